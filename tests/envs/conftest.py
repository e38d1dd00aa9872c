from pathlib import Path

import pytest

from marin_rl.tokenizer import build_char_tokenizer, load_tokenizer

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("char")


@pytest.fixture(scope="session")
def render_ids(tokenizer):
    """The chat template's rendering of a list of (role, content) pairs."""

    def render(pairs, add_generation_prompt=False):
        messages = [{"role": role, "content": content} for role, content in pairs]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    return render


def _family_tokenizer(name, template, special, plain, eos, bos=None):
    """The char tokenizer with a model family's chat template and its special tokens (no hub access here)."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [*tok.additional_special_tokens, *special]})
    tok.add_tokens(plain)  # added, but not special: decoding keeps them (as Qwen's `<tool_call>`)
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    tok.chat_template = (HERE / "templates" / template).read_text()
    tok.name_or_path = name
    return tok


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen2.5's chat template and tool tokens (Hermes tool calls, shared with Qwen3)."""
    return _family_tokenizer(
        "qwen2.5-chars",
        "qwen2_5.jinja",
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        eos="<|im_end|>",
    )


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's chat template (thinking: `<think>` blocks kept only for turns after the last user query)."""
    return _family_tokenizer(
        "qwen3-chars",
        "qwen3.jinja",
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        eos="<|im_end|>",
    )


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """Llama 3.2's chat template and special tokens (JSON tool calls, `ipython` tool turns)."""
    return _family_tokenizer(
        "llama3.2-chars",
        "llama3_2.jinja",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
        [],
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
    )


async def _serve_replies(replies):
    """A plain OpenAI chat-completions server answering with `replies` in turn: a text, or a list of
    tool calls `{"name", "arguments"}` (as a vLLM server with a tool parser returns them)."""
    import json

    from aiohttp import web

    queue = list(replies)

    async def complete(request):
        reply = queue.pop(0)
        if isinstance(reply, str):
            message, finish = {"role": "assistant", "content": reply}, "stop"
        else:
            calls = [
                {"id": f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for i, c in enumerate(reply)
            ]
            message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/v1"


@pytest.fixture
def verifiers_own_trace():
    """`(env, replies, problem=0) -> trace`: a `VerifiersEnv`'s task run by verifiers itself against a
    plain OpenAI server replaying `replies` (no token ids): verifiers' own scoring of those completions."""
    import asyncio

    import verifiers.v1 as vf

    def run(env, replies, problem=0):
        task = list(env.problems())[problem].extras["task"]

        async def episode():
            runner, url = await _serve_replies(replies)
            try:
                async with env.vf_env.serving():
                    client = vf.EvalClientConfig(base_url=url, api_key_var="MARIN_RL_UNUSED")
                    return await env.vf_env.run_episode(task, vf.ModelContext(model="m", client=client))
            finally:
                await runner.cleanup()

        [trace] = [t for t in asyncio.run(episode()).traces if t.agent.trainable]
        assert trace.ok, trace.errors
        return trace

    return run
