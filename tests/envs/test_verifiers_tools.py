"""verifiers tool tasks: a local Python tool server (started by verifiers), Qwen and Llama 3 formats.

"verifiers' own" trace: the same task run by verifiers against a plain OpenAI server that returns the
calls already parsed (as vLLM's tool parser would); our reward must equal its.
"""

import asyncio
import json

import pytest

vf = pytest.importorskip("verifiers.v1")

from marin_rl.envs import ScriptedSampler, sample_group  # noqa: E402
from marin_rl.envs._verifiers import VerifiersEnv  # noqa: E402

# Each rollout starts verifiers' tool server as a process.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_envs")]


def _hermes(*calls):
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def _add(a, b):
    return {"name": "calc_add", "arguments": {"a": a, "b": b}}


def _run(env, texts):
    problem = next(iter(env.problems()))
    [rollout] = asyncio.run(sample_group(env, problem, ScriptedSampler(env.tokenizer, texts), 1))
    rollout.validate()
    return rollout


def _rendering(tokenizer, rollout, tools, **kwargs):
    messages = [{"role": t.role, "content": t.content} for t in rollout.turns]
    return tokenizer.apply_chat_template(messages, tools=tools, **kwargs)


def test_hermes_tool_calls_run_on_the_tool_server_and_stay_token_exact(qwen_tokenizer, verifiers_own_trace):
    env = VerifiersEnv("marin_vf_calc").bind(qwen_tokenizer, name="vf-calc")
    # Two parallel calls, then the answer: Qwen's template puts both results in one user block.
    calls = _hermes(_add(2, 3), _add(1, 1))
    rollout = _run(env, [calls, "5"])
    own = verifiers_own_trace(env, [[_add(2, 3), _add(1, 1)], "5"])
    assert [(t.role, t.content) for t in rollout.turns] == [
        ("system", "Use the tools."),
        ("user", "What is 2+3?"),
        ("assistant", calls),
        ("tool", "5"),
        ("tool", "2"),
        ("assistant", "5"),
    ]
    tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})} for t in own.tools]
    ids, rendering = rollout.token_ids().tolist(), _rendering(qwen_tokenizer, rollout, tools)
    # The template's newline after the last `<|im_end|>` is never seen by the model: not part of the rollout.
    assert rendering == [*ids, *qwen_tokenizer.encode("\n", add_special_tokens=False)]
    first_result, second_result = rollout.turns[3:5]
    # The first result holds only what closes the assistant turn; the block's ids go to its last message.
    assert qwen_tokenizer.decode(first_result.token_ids) == "\n"
    assert qwen_tokenizer.decode(second_result.token_ids) == (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    sampled = qwen_tokenizer.decode(rollout.token_ids()[rollout.sampled_mask()])
    assert sampled == f"{calls}<|im_end|>5<|im_end|>"
    assert rollout.rewards == {"correct": 1.0, "used_tool": 1.0} and rollout.reward == 1.5
    assert rollout.reward == own.reward
    assert rollout.metadata["num_turns"] == 2


def test_llama3_tool_calls_run_on_the_tool_server_and_stay_token_exact(llama3_tokenizer, verifiers_own_trace):
    env = VerifiersEnv("marin_vf_calc").bind(llama3_tokenizer)
    call = json.dumps({"name": "calc_add", "parameters": {"a": 2, "b": 3}})
    rollout = _run(env, [call, "5"])
    own = verifiers_own_trace(env, [[_add(2, 3)], "5"])
    assert [(t.role, t.content) for t in rollout.turns][2:] == [("assistant", call), ("tool", "5"), ("assistant", "5")]
    tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})} for t in own.tools]
    assert rollout.token_ids().tolist() == _rendering(llama3_tokenizer, rollout, tools)
    assert llama3_tokenizer.decode(rollout.turns[3].token_ids) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    )
    assert rollout.reward == own.reward == 1.5


def test_a_malformed_tool_call_ends_the_rollout_and_is_counted(qwen_tokenizer):
    env = VerifiersEnv("marin_vf_calc").bind(qwen_tokenizer, name="vf-calc")
    rollout = _run(env, ["<tool_call>\n{not json}\n</tool_call>"])
    assert [t.role for t in rollout.turns] == ["system", "user", "assistant"]
    assert rollout.rewards == {"correct": 0.0, "used_tool": 0.0}
    assert env.metrics.as_dict()["envs/vf-calc/malformed_tool_calls"] == 1


def test_tool_tasks_need_a_known_tool_call_format(tokenizer):
    env = VerifiersEnv("marin_vf_calc").bind(tokenizer)
    with pytest.raises(RuntimeError, match="tool_call_format"):
        _run(env, ["5"])
    with pytest.raises(ValueError, match="no token"):
        VerifiersEnv("marin_vf_calc", tool_call_format="hermes").bind(tokenizer)._tool_call_format


def test_qwen3_thinks_calls_and_answers_in_one_tool_loop(qwen3_tokenizer, verifiers_own_trace):
    env = VerifiersEnv("marin_vf_calc").bind(qwen3_tokenizer)
    think_and_call = f"<think>\nI add.\n</think>\n\n{_hermes(_add(2, 3))}"
    rollout = _run(env, [think_and_call, "<think>\nIt is 5.\n</think>\n\n5"])
    assert [t.role for t in rollout.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert rollout.turns[2].content == think_and_call  # the sampled turn, reasoning and markup included
    # verifiers sees the reply without its reasoning: the same reward as a server that split it off.
    assert rollout.reward == verifiers_own_trace(env, [[_add(2, 3)], "5"]).reward == 1.5
