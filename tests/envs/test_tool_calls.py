"""Tool calls parsed from sampled ids in each model family's format, and the test templates' fidelity."""

import json

import pytest

from marin_rl.envs._tool_calls import detect_tool_call_format, parse_tool_calls, resolve_tool_call_format

ADD = {"name": "calc_add", "arguments": {"a": 2, "b": 3}}


def _ids(tokenizer, text):
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def _hermes(call):
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_formats_are_detected_from_the_tokenizers_special_tokens(tokenizer, qwen_tokenizer, qwen3_tokenizer, llama3_tokenizer):
    assert detect_tool_call_format(qwen_tokenizer) == detect_tool_call_format(qwen3_tokenizer) == "hermes"
    assert detect_tool_call_format(llama3_tokenizer) == "llama3"
    assert detect_tool_call_format(tokenizer) is None
    assert resolve_tool_call_format(qwen_tokenizer, "auto") == "hermes"
    with pytest.raises(ValueError, match=r"tool_call_format 'hermes': tokenizer 'llama3.2-chars' has no token"):
        resolve_tool_call_format(llama3_tokenizer, "hermes")
    with pytest.raises(ValueError, match="must be 'auto' or one of"):
        resolve_tool_call_format(qwen_tokenizer, "xml")


def test_hermes_calls_are_split_from_the_content(qwen_tokenizer):
    second = {"name": "calc_add", "arguments": {"a": 1, "b": 1}}
    parsed = parse_tool_calls(qwen_tokenizer, _ids(qwen_tokenizer, f"Adding.\n{_hermes(ADD)}\n{_hermes(second)}"), "hermes")
    assert parsed.content == "Adding."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("calc_add", ADD["arguments"]), ("calc_add", second["arguments"])]
    assert parsed.malformed_calls == 0


def test_malformed_hermes_calls_are_counted_and_not_made(qwen_tokenizer):
    text = f"{_hermes(ADD)}\n<tool_call>\n{{not json}}\n</tool_call>\n<tool_call>\n" + '{"arguments": {}}'
    parsed = parse_tool_calls(qwen_tokenizer, _ids(qwen_tokenizer, text), "hermes")
    assert [c.name for c in parsed.tool_calls] == ["calc_add"] and parsed.malformed_calls == 2


def test_qwen3_reasoning_is_split_off(qwen3_tokenizer):
    parsed = parse_tool_calls(qwen3_tokenizer, _ids(qwen3_tokenizer, f"<think>\nI add.\n</think>\n\n{_hermes(ADD)}"), "hermes")
    assert parsed.reasoning == "I add." and parsed.content == "" and [c.name for c in parsed.tool_calls] == ["calc_add"]


def test_a_llama3_call_is_the_whole_reply(llama3_tokenizer):
    call = json.dumps({"name": "calc_add", "parameters": {"a": 2, "b": 3}})
    parsed = parse_tool_calls(llama3_tokenizer, _ids(llama3_tokenizer, call), "llama3")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("calc_add", {"a": 2, "b": 3})]
    plain = parse_tool_calls(llama3_tokenizer, _ids(llama3_tokenizer, "It is 5."), "llama3")
    assert plain.content == "It is 5." and plain.tool_calls == () and plain.malformed_calls == 0


def test_test_templates_render_like_renderers_copies_of_the_real_ones(qwen3_tokenizer, llama3_tokenizer):
    """The hub's tokenizers are out of reach here; the `renderers` package hand-codes Qwen3's and
    Llama 3.2's templates, so the test templates standing in for them must agree token for token."""
    from renderers import Llama3Renderer, Qwen3Renderer

    tools = [{"type": "function", "function": {"name": "calc_add", "description": "Add.", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": ADD}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    llama = llama3_tokenizer.apply_chat_template(messages, tools=tools, date_string="26 Jul 2024")
    assert llama == Llama3Renderer(llama3_tokenizer).render_ids(messages, tools=tools)
    thinking = [*messages[:2], {"role": "assistant", "content": f"<think>\nI add.\n</think>\n\n{_hermes(ADD)}"}, messages[3]]
    qwen3 = qwen3_tokenizer.apply_chat_template(thinking, tools=tools, add_generation_prompt=True)
    assert qwen3 == Qwen3Renderer(qwen3_tokenizer).render_ids(thinking, tools=tools, add_generation_prompt=True)
