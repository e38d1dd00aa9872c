import asyncio
import math
import sys
import threading

import numpy as np
import pytest

from marin_rl.envs import (
    CalculatorEnv,
    Env,
    Problem,
    SamplingParams,
    ScriptedSampler,
    build_env,
    evaluate,
    pass_at_k,
    resolve_settings,
    reward,
    sample_group,
    xml_tag,
)
from marin_rl.errors import ConfigError, PromptTooLong


class Echo(Env):
    """Rewards an `<answer>` equal to the problem's answer."""

    sampling = SamplingParams(max_tokens=64, stop=("</answer>",))
    system_prompt = "Answer in tags."

    def problems(self):
        return [Problem(id=f"p{i}", prompt=f"say {i}", answer=str(i)) for i in range(3)]

    @reward
    def correct(self, completion, answer):
        return float(xml_tag("answer")(completion).value == answer)

    @reward(weight=0.5)
    def short(self, messages):
        return float(len(messages[-1]["content"]) < 20)


class Tool(Env):
    """Each assistant turn gets a tool reply until the model answers; counts calls in `state`."""

    max_turns = 4

    def problems(self):
        return [Problem(id="t", prompt="go", answer="done")]

    async def interact(self, messages, problem, state):
        if "<answer>" in messages[-1]["content"]:
            return None
        state["calls"] = state.get("calls", 0) + 1
        return [{"role": "tool", "content": f"result {state['calls']}"}]

    @reward
    def calls(self, state):
        return float(state.get("calls", 0))


def _rollouts(env, sampler, n=2, **kwargs):
    problem = next(iter(env.problems()))
    return asyncio.run(sample_group(env, problem, sampler, n, resolve_settings(env, **kwargs)))


def test_single_turn_group_is_scored_and_valid(tokenizer):
    env = Echo().bind(tokenizer, name="echo-train")
    sampler = ScriptedSampler(tokenizer, ["<answer>0</answer>", "<answer>1</answer> and a long tail"])
    rollouts = _rollouts(env, sampler, n=2)
    for r in rollouts:
        r.validate()
    good, bad = rollouts
    assert good.rewards == {"correct": 1.0, "short": 1.0} and good.reward == 1.5
    assert bad.rewards == {"correct": 0.0, "short": 1.0} and bad.reward == 0.5  # stop string cut the tail
    assert good.group_id == bad.group_id and good.rollout_uid != bad.rollout_uid
    assert good.problem_id == "p0" and good.environment == "echo-train"
    assert good.metadata["answer"] == "0" and "reward_errors" not in good.metadata
    assert [t.role for t in good.turns] == ["system", "user", "assistant"]
    assert len(sampler.prompts) == 1  # one request with n choices
    meta = good.turns[-1].inference_metadata
    assert meta.sampling_params["stop"] == ["</answer>"] and meta.sampling_params["max_tokens"] == 64


def test_multi_turn_ids_equal_template_rendering_and_only_assistant_tokens_are_sampled(tokenizer, render_ids):
    env = Tool().bind(tokenizer)
    script = lambda prompt: "<answer>x</answer>" if "result 2" in prompt else "call"  # noqa: E731
    [rollout] = _rollouts(env, ScriptedSampler(tokenizer, script), n=1)
    rollout.validate()
    pairs = [(t.role, t.content) for t in rollout.turns]
    assert pairs == [
        ("user", "go"),
        ("assistant", "call"),
        ("tool", "result 1"),
        ("assistant", "call"),
        ("tool", "result 2"),
        ("assistant", "<answer>x</answer>"),
    ]
    ids = rollout.token_ids()
    assert ids.tolist() == render_ids(pairs)
    mask = rollout.sampled_mask()
    expected = np.concatenate([np.full(len(t.token_ids), t.role == "assistant") for t in rollout.turns])
    np.testing.assert_array_equal(mask, expected)
    assert tokenizer.decode(ids[mask]) == "call<|end|>call<|end|><answer>x</answer><|end|>"
    assert rollout.rewards == {"calls": 2.0} and rollout.metadata["stop_reason"] == "env"


def test_max_turns_and_length_end_a_rollout(tokenizer):
    env = Tool().bind(tokenizer)
    [capped] = _rollouts(env, ScriptedSampler(tokenizer, ["call"]), n=1, max_turns=2)
    assert capped.metadata["stop_reason"] == "max_turns" and capped.metadata["num_turns"] == 2
    assert not capped.is_truncated
    [cut] = _rollouts(env, ScriptedSampler(tokenizer, ["a long ramble"]), n=1, sampling=SamplingParams(max_tokens=3))
    assert cut.is_truncated and cut.metadata["stop_reason"] == "length" and cut.metadata["num_turns"] == 1
    cut.validate()


class Fragile(Env):
    verifier_timeout_s = 0.2
    release = threading.Event()

    def problems(self):
        return [Problem(id="f", prompt="q", answer="a")]

    @reward
    def fine(self, completion):
        return 1.0

    @reward
    def raises(self, completion):
        raise ZeroDivisionError("boom")

    @reward
    def hangs(self, completion):
        self.release.wait(60)  # a stuck sympy call, say
        return 1.0

    @reward
    async def hangs_async(self):
        await asyncio.sleep(60)
        return 1.0

    @reward
    def nan(self):
        return math.nan

    @reward
    def not_a_number(self):
        return "1.0"

    @reward
    def exits(self):
        sys.exit(3)

    @reward
    async def exits_async(self):
        sys.exit(4)  # asyncio would re-raise it out of the workers' event loop


def test_failing_verifiers_score_zero_with_recorded_errors(tokenizer):
    env = Fragile().bind(tokenizer)
    try:
        rollouts = _rollouts(env, ScriptedSampler(tokenizer, ["x"]), n=2)
        counters = env.metrics.as_dict()
    finally:
        Fragile.release.set()
    for r in rollouts:
        r.validate()
        assert r.rewards == {
            "fine": 1.0, "raises": 0.0, "hangs": 0.0, "hangs_async": 0.0, "nan": 0.0, "not_a_number": 0.0,
            "exits": 0.0, "exits_async": 0.0,
        }  # fmt: skip
        assert r.reward == 1.0
        errors = r.metadata["reward_errors"]
        assert set(errors) == {"raises", "hangs", "hangs_async", "nan", "not_a_number", "exits", "exits_async"}
        assert errors["raises"] == "ZeroDivisionError: boom"
        assert errors["exits"] == "SystemExit: 3" and errors["exits_async"] == "SystemExit: 4"
        assert errors["hangs"] == errors["hangs_async"] == "timed out after 0.2s"
        assert "nan" in errors["nan"] and "'1.0'" in errors["not_a_number"]
    assert counters["envs/Fragile/reward_errors"] == 10  # raises, nan, not_a_number, exits, exits_async, twice
    assert counters["envs/Fragile/reward_timeouts"] == 4
    assert counters["envs/Fragile/hung_verifier_threads"] == 2
    assert counters["envs/Fragile/rollouts"] == 2


def test_a_failing_tool_ends_the_rollout_and_is_recorded(tokenizer):
    class Broken(Tool):
        async def interact(self, messages, problem, state):
            raise ConnectionError("tool server down")

    env = Broken().bind(tokenizer)
    [r] = _rollouts(env, ScriptedSampler(tokenizer, ["call"]), n=1)
    r.validate()
    assert r.metadata["interact_error"] == "ConnectionError: tool server down"
    assert r.metadata["stop_reason"] == "interact_error"
    assert env.metrics.as_dict()["envs/Broken/interact_errors"] == 1


def test_run_config_overrides_weights_timeout_and_turns(tokenizer):
    env = Echo().bind(tokenizer)
    settings = resolve_settings(env, reward_weights={"short": 0.0}, verifier_timeout_s=3, max_turns=2)
    assert settings.reward_weights == {"correct": 1.0, "short": 0.0}
    assert settings.verifier_timeout_s == 3.0 and settings.max_turns == 2
    with pytest.raises(ValueError, match=r"unknown rewards \['typo'\]"):
        resolve_settings(env, reward_weights={"typo": 1.0})
    [r] = _rollouts(env, ScriptedSampler(tokenizer, ["<answer>0</answer>"]), n=1, reward_weights={"short": 0.0})
    assert r.reward == 1.0 and r.rewards["short"] == 1.0


def test_reward_functions_are_checked_when_the_class_is_defined():
    with pytest.raises(TypeError, match="unknown arguments \\['response'\\]"):

        class Bad(Env):
            @reward
            def score(self, response):
                return 0.0

    with pytest.raises(TypeError, match="unknown rewards"):

        class BadWeights(Echo):
            reward_weights = {"corect": 2.0}

    class Heavier(Echo):
        reward_weights = {"short": 2.0}

    assert {k: w for k, (_, w) in Heavier().reward_functions().items()} == {"correct": 1.0, "short": 2.0}


def test_build_env_by_name_and_import_path(tokenizer):
    env = build_env("calculator", {"num_problems": 3}, tokenizer=tokenizer, name="calc-a")
    assert isinstance(env, CalculatorEnv) and env.name == "calc-a" and len(env.problems()) == 3
    env.tokenizer  # bound
    by_path = build_env("marin_rl.envs._calculator:CalculatorEnv", {"seed": 1}, tokenizer="char")
    assert isinstance(by_path, CalculatorEnv) and by_path.name == "calculator"
    with pytest.raises(ConfigError, match="unknown env type 'nope'.*calculator"):  # one line from the CLI
        build_env("nope")
    with pytest.raises(ConfigError, match="did you mean 'calculator'"):
        build_env("calculater")
    with pytest.raises(ConfigError, match=r"has no Env subclass 'calculate'; its Env subclasses: \['CalculatorEnv'\]"):
        build_env("marin_rl.envs._calculator:calculate")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'dat' \(arguments of CalculatorEnv: \['data'"):
        build_env("calculator", {"dat": "x"})
    with pytest.raises(RuntimeError, match="no tokenizer"):
        CalculatorEnv().tokenizer


OWN_ENV = """
from marin_rl.envs import Env, Problem, reward


class {name}(Env):
    def problems(self):
        return [Problem(id="p", prompt="hi", answer="x")]

    @reward
    def correct(self, completion, answer):
        return float(completion == answer)
"""


def test_own_envs_import_from_the_current_directory_by_module_or_file(tmp_path, monkeypatch):
    (tmp_path / "own_env_module.py").write_text(OWN_ENV.format(name="ByModule"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "own_env_file.py").write_text(OWN_ENV.format(name="ByFile"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert build_env("own_env_module:ByModule").problems()[0].id == "p"
    assert type(build_env("sub/own_env_file.py:ByFile")).__module__ == "own_env_file"
    with pytest.raises(ValueError, match="no module 'own_env_nope' in the current directory"):
        build_env("own_env_nope:X")
    with pytest.raises(ValueError, match="no file 'sub/nope.py'"):
        build_env("sub/nope.py:X")


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong samples
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_evaluate_reports_pass_at_k_greedily(tokenizer):
    env = Echo().bind(tokenizer)
    env.success_reward = "correct"
    # Problem p1 is solved once in 4 samples, p0 and p2 never.
    script = lambda prompt: "<answer>1</answer>" if "say 1" in prompt else "<answer>?</answer>"  # noqa: E731
    sampler = ScriptedSampler(tokenizer, script)
    result = asyncio.run(evaluate(env, sampler, env.problems(), n=2, ks=(1, 2)))
    assert result.num_problems == 3 and len(result.rollouts) == 6
    assert result.pass_at_k == {1: pytest.approx(1 / 3), 2: pytest.approx(1 / 3)}
    assert result.reward_means == {"correct": pytest.approx(1 / 3), "short": 1.0}
    assert result.rollouts[0].turns[-1].inference_metadata.sampling_params["temperature"] == 0.0
    metrics = result.metrics()
    assert metrics["eval/Echo/pass@1"] == pytest.approx(1 / 3) and "eval/Echo/reward/mean" in metrics
    assert "envs/Echo/rollouts" not in env.metrics.as_dict()  # eval counters stay apart
    with pytest.raises(ValueError, match="no eval_problems"):
        asyncio.run(evaluate(env, sampler))


def test_a_failed_rollout_cancels_the_rest_of_its_group(tokenizer):
    from marin_rl.envs import Sampler

    class FailsLater(Sampler):
        def __init__(self):
            self.scripted = ScriptedSampler(tokenizer, ["call"])
            self.calls = 0
            self.cancelled = False

        async def sample(self, prompt_ids, n, params):
            self.calls += 1
            if self.calls == 1:
                return await self.scripted.sample(prompt_ids, n, params)
            if self.calls == 2:
                raise ConnectionError("server gone")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise

    sampler = FailsLater()
    with pytest.raises(ConnectionError, match="server gone"):
        _rollouts(Tool().bind(tokenizer), sampler, n=2)
    assert sampler.cancelled


def test_max_total_tokens_caps_every_rollout(tokenizer, render_ids):
    env = Tool().bind(tokenizer)
    problem = env.problems()[0]
    sampler = ScriptedSampler(tokenizer, ["call"])
    first_turn = len(render_ids([("user", "go"), ("assistant", "call")]))
    after_tool = len(render_ids([("user", "go"), ("assistant", "call"), ("tool", "result 1")], add_generation_prompt=True))
    # Room for a first turn and a tool message, but the second turn's max_tokens is cut to 3.
    [cut] = asyncio.run(sample_group(env, problem, sampler, 1, resolve_settings(env, max_total_tokens=after_tool + 3)))
    cut.validate()
    assert cut.num_tokens == after_tool + 3 and cut.is_truncated and cut.metadata["stop_reason"] == "length"
    assert cut.turns[-1].inference_metadata.sampling_params["max_tokens"] == 3
    # No room after the tool message: the rollout ends on its last assistant turn.
    [ended] = asyncio.run(sample_group(env, problem, sampler, 1, resolve_settings(env, max_total_tokens=after_tool)))
    assert [t.role for t in ended.turns] == ["user", "assistant"] and ended.num_tokens == first_turn
    assert ended.is_truncated and ended.metadata["stop_reason"] == "max_total_tokens"
    prompt_len = len(render_ids([("user", "go")], add_generation_prompt=True))
    with pytest.raises(PromptTooLong, match="no room left under max_total_tokens"):
        asyncio.run(sample_group(env, problem, sampler, 1, resolve_settings(env, max_total_tokens=prompt_len)))
