"""The verifiers (v1) adapter, against scripted sampling. The embedded-server run is in test_server_e2e.py."""

import asyncio
import math

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from marin_rl.envs import ScriptedSampler, build_env, sample_group  # noqa: E402
from marin_rl.envs._verifiers import VerifiersEnv  # noqa: E402

SEEN: dict[str, dict] = {}
"""What the verifiers trace held at scoring time, by trace id."""


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.25)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) < 10)

    @vf.metric
    async def record(self, trace) -> float:
        branch = trace.branches[-1]
        SEEN[trace.id] = {"ids": branch.token_ids, "mask": branch.sampled_mask, "logprobs": branch.logprobs}
        return float(len(branch.token_ids))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i in range(3):
            yield SumTask(SumData(idx=i, prompt=f"{i}+{i}=", system_prompt="Digits only.", answer=str(2 * i)), self.config.task)


class FlakyTask(SumTask):
    @vf.reward
    async def raises(self, trace) -> float:
        raise KeyError("missing field")


class NanTask(SumTask):
    @vf.reward
    async def nan(self, trace) -> float:
        return math.nan


class SlowTask(SumTask):
    @vf.reward
    async def slow(self, trace) -> float:
        await asyncio.sleep(60)
        return 1.0


def _taskset(task_cls):
    class Taskset(vf.Taskset[task_cls, vf.TasksetConfig]):
        def load(self):
            yield task_cls(SumData(idx=0, prompt="1+1=", answer="2"), self.config.task)

    return Taskset(vf.TasksetConfig())


def _group(env, texts, n=2, **kwargs):
    problem = next(iter(env.problems()))
    return asyncio.run(sample_group(env, problem, ScriptedSampler(env.tokenizer, texts), n, **kwargs))


def test_verifiers_taskset_yields_token_exact_rollouts(tokenizer, render_ids):
    env = VerifiersEnv(SumTaskset(vf.TasksetConfig())).bind(tokenizer, name="vf-sum")
    problems = list(env.problems())
    assert len(problems) == 3 and len({p.id for p in problems}) == 3
    assert env.default_reward_weights() == {"brief": 0.25, "correct": 1.0}
    right, wrong = _group(env, ["0", "zero, I think"])
    for r in (right, wrong):
        r.validate()
        pairs = [(t.role, t.content) for t in r.turns]
        assert r.token_ids().tolist() == render_ids(pairs)
        seen = SEEN[r.metadata["verifiers"]["trace_id"]]  # verifiers' own trace agrees, token for token
        assert seen["ids"] == r.token_ids().tolist()
        assert seen["mask"] == r.sampled_mask().tolist()
        np.testing.assert_allclose(seen["logprobs"], r.behaviour_logprobs())
        assert r.environment == "vf-sum" and r.problem_id == problems[0].id
        assert r.metadata["verifiers"]["stop_condition"] == "agent_completed"
    assert [(t.role, t.content) for t in right.turns] == [("system", "Digits only."), ("user", "0+0="), ("assistant", "0")]
    assert right.rewards == {"brief": 1.0, "correct": 1.0} and right.reward == 1.25
    assert wrong.rewards == {"brief": 0.0, "correct": 0.0} and wrong.reward == 0.0
    assert right.group_id == wrong.group_id and right.rollout_uid != wrong.rollout_uid


def test_run_config_weights_override_verifiers_weights(tokenizer):
    env = VerifiersEnv(SumTaskset(vf.TasksetConfig())).bind(tokenizer)
    [r] = _group(env, ["0"], n=1, reward_weights={"brief": 0.0})
    assert r.reward == 1.0
    with pytest.raises(ValueError, match="unknown rewards"):
        _group(env, ["0"], n=1, reward_weights={"typo": 1.0})


def test_length_cut_marks_the_rollout_truncated(tokenizer):
    from marin_rl.envs import SamplingParams

    env = VerifiersEnv(SumTaskset(vf.TasksetConfig())).bind(tokenizer)
    [r] = _group(env, ["a very long reply"], n=1, sampling=SamplingParams(max_tokens=4))
    r.validate()
    assert r.is_truncated and r.turns[-1].inference_metadata.finish_reason == "length"


def test_max_total_tokens_caps_verifiers_rollouts(tokenizer, render_ids):
    env = VerifiersEnv(SumTaskset(vf.TasksetConfig())).bind(tokenizer)
    prompt_len = len(render_ids([("system", "Digits only."), ("user", "0+0=")], add_generation_prompt=True))
    [r] = _group(env, ["a long reply"], n=1, max_total_tokens=prompt_len + 3)
    r.validate()
    assert r.num_tokens == prompt_len + 3 and r.is_truncated
    with pytest.raises(RuntimeError, match="context_length"):
        _group(env, ["0"], n=1, max_total_tokens=prompt_len)


@pytest.mark.parametrize(
    ("task_cls", "counter", "message"),
    [(FlakyTask, "reward_errors", "KeyError: 'missing field'"), (SlowTask, "reward_timeouts", "scoring timed out")],
)
def test_failed_verifiers_scoring_gives_zero_with_the_error_recorded(tokenizer, task_cls, counter, message):
    env = VerifiersEnv(_taskset(task_cls)).bind(tokenizer, name="vf")
    rollouts = _group(env, ["2"], n=2, verifier_timeout_s=0.5)
    for r in rollouts:
        r.validate()
        # verifiers scores a task's rewards together: one failure leaves all of them unscored.
        assert r.reward == 0.0 and set(r.rewards.values()) == {0.0}
        errors = r.metadata["reward_errors"]
        assert set(errors) == set(r.rewards) and all(message in e for e in errors.values())
    assert env.metrics.as_dict()[f"envs/vf/{counter}"] == 2 * len(rollouts[0].rewards)


def test_nan_verifiers_reward_scores_zero_alone(tokenizer):
    env = VerifiersEnv(_taskset(NanTask)).bind(tokenizer, name="vf")
    [r] = _group(env, ["2"], n=1)
    r.validate()
    assert r.rewards == {"brief": 1.0, "correct": 1.0, "nan": 0.0} and r.reward == 1.25
    assert r.metadata["reward_errors"] == {"nan": "returned nan, expected a finite number"}
    assert env.metrics.as_dict()["envs/vf/reward_errors"] == 1


def test_taskset_resolution_errors_are_clear(tokenizer):
    with pytest.raises(ValueError, match="not a verifiers Taskset"):
        VerifiersEnv("marin_rl.envs:Env")
    with pytest.raises(ModuleNotFoundError, match="no-such-taskset"):
        build_env("verifiers", {"taskset": "no-such-taskset"})
