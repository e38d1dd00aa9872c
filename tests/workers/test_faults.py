"""Which failures are retried (transient), which stop the run (permanent), and the gated sampler."""

import asyncio
import logging
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest

from marin_rl.envs import Completion, Sampler, SamplerError, SamplingParams
from marin_rl.config import EnvConfig
from marin_rl.errors import ConfigError, PermanentError, ProblemSourceError, PromptTooLong
from marin_rl.workers._endpoints import Endpoint, GatedSampler, SeededSampler, derive_seed
from marin_rl.workers._faults import RewardFailureWatch, ServerNotReady, classify
from marin_rl.testing import make_group
from marin_rl.types import InferenceMetadata


def status_error(status):
    request = httpx.Request("POST", "http://server/v1/completions")
    return openai.APIStatusError(f"Error code: {status}", response=httpx.Response(status, request=request), body=None)


@pytest.mark.parametrize(
    "error, fault",
    [
        (status_error(400), "permanent"),  # the request itself is wrong: never retried
        (status_error(404), "permanent"),
        (status_error(500), "transient"),
        (status_error(503), "transient"),
        (status_error(504), "transient"),
        (status_error(429), "transient"),
        (openai.APIConnectionError(request=httpx.Request("POST", "http://server")), "transient"),
        (httpx.ConnectError("refused"), "transient"),
        (ServerNotReady("restarting"), "transient"),
        (ProblemSourceError("env 'a': no file"), "permanent"),
        (PromptTooLong("env 'a': 70 tokens"), "permanent"),
        (ConfigError("bad weight"), "permanent"),
        (SamplerError("no policy_version"), "permanent"),
        (FileNotFoundError("data.jsonl"), "permanent"),
        (KeyError("answer"), "unknown"),  # an env's own bug, maybe one problem's
    ],
)
def test_failures_are_classified(error, fault):
    assert classify(error) == fault


class Versions(Sampler):
    def __init__(self, version):
        self.version = version
        self.params = []

    async def sample(self, prompt_ids, n, params):
        self.params.append(params)
        meta = InferenceMetadata(server_id="s", model="m", policy_version=self.version, finish_reason="stop")
        return [Completion(np.array([1]), np.array([-0.1]), meta) for _ in range(n)]


class Gate:
    def __init__(self, window):
        self.window = window
        self.stale = []

    def sampling_window(self):
        return self.window

    def report_stale(self, reported):
        self.stale.append(reported)
        self.window = None


def test_a_remote_server_is_sampled_only_with_this_runs_weights():
    def sample(version, gate):
        return asyncio.run(GatedSampler(Versions(version), Endpoint("http://r/v1", "m", "remote0", gate=gate)).sample([1, 2], 2, SamplingParams()))

    assert len(sample(4, Gate((3, 4)))) == 2
    with pytest.raises(ServerNotReady, match="not serving this run's weights"):
        sample(4, Gate(None))
    restarted = Gate((3, 4))
    for version in (0, 999):  # restarted from its own checkpoint: older, or a version this run never had
        restarted.window = (3, 4)
        with pytest.raises(ServerNotReady, match=f"policy version {version}, not one this run pushed"):
            sample(version, restarted)
    assert restarted.stale == [0, 999]


def test_seeds_depend_on_the_group_the_rollout_and_the_turn_never_on_the_prompt():
    def seeds(first_prompt, order):
        """A group's first request, then each rollout in `order` asks for its next turn with one prompt."""
        inner = Versions(0)
        group = SeededSampler(inner, derive_seed(0, "math", 3, 7))
        asyncio.run(group.sample(first_prompt, 4, SamplingParams()))
        rollouts = {i: group.fork("rollout", i) for i in sorted(set(order))}
        for i in order:
            asyncio.run(rollouts[i].sample([1, 2, 3], 1, SamplingParams()))
        return [p.seed for p in inner.params]

    first, r0_turn2, r1_turn2, r0_turn3 = seeds([1, 2], [0, 1, 0])
    # Coinciding conversations (one prompt) of two rollouts, and two turns of one rollout: all apart.
    assert len({first, r0_turn2, r1_turn2, r0_turn3}) == 4 and all(0 <= s < 2**63 for s in (first, r0_turn2, r0_turn3))
    # Reproducible whatever order the rollouts reach their turns in, and whatever the prompts say.
    assert seeds([9], [1, 0, 0]) == [first, r1_turn2, r0_turn2, r0_turn3]
    assert derive_seed(0, "math", 3, 7) != derive_seed(0, "math", 3, 8) != derive_seed(0, "math", 4, 7)


def _group(size: int, failed: int) -> list:
    group = make_group([0.0] * size)
    return [replace(r, metadata={"reward_errors": {"judge": "timed out after 30s"}}) if i < failed else r for i, r in enumerate(group)]


def test_failed_rewards_past_the_limit_stop_the_run_naming_the_env_and_the_key():
    watch = RewardFailureWatch("math", max_share=0.5, window=64)
    for _ in range(3):
        watch.observe(_group(16, 8))  # 50%: at the limit, not past it
    with pytest.raises(PermanentError) as stopped:
        watch.observe(_group(16, 16))  # the window closes at 64: 32 failed of 64, then 40 of 64 here
    message = str(stopped.value)
    assert "env 'math': rewards failed for 40 of the last 64 rollouts (62.5%; judge: timed out after 30s)" in message
    assert "envs[math].max_reward_failures = 0.5" in message


def test_failed_rewards_are_judged_over_a_whole_window_not_one_group():
    watch = RewardFailureWatch("math", max_share=0.5, window=64)
    watch.observe(_group(16, 16))  # a whole group failed, but 16 rollouts are no window
    for _ in range(3):
        watch.observe(_group(16, 0))
    watch.observe(_group(16, 16))  # the next window starts afresh


def test_a_warning_past_one_percent_and_again_when_the_share_doubles(caplog):
    watch = RewardFailureWatch("math", max_share=0.5, window=64)
    shares = []
    with caplog.at_level(logging.WARNING, logger="marin_rl.workers._faults"):
        for failed in [0, 1, 1, 2, 1, 4, 16]:  # a window of 64 each: 0%, 1.6%, 1.6%, 3.1%, 1.6%, 6.2%, 25%
            before = len(caplog.records)
            watch.observe(_group(64, failed))
            shares.append(len(caplog.records) - before)
    assert shares == [0, 1, 0, 1, 0, 1, 1]
    assert caplog.records[0].getMessage() == (
        "env 'math': rewards failed for 1 of the last 64 rollouts (1.6%; judge: timed out after 30s); they score 0"
    )


def test_max_reward_failures_must_be_a_share():
    with pytest.raises(ValueError, match=r"envs\[math\]\.max_reward_failures must be in \[0, 1\], got 1.5"):
        EnvConfig(name="math", type="toy_addition", max_reward_failures=1.5)
