"""Which failures are retried (transient), which stop the run (permanent), and the gated sampler."""

import asyncio

import httpx
import numpy as np
import openai
import pytest

from marin_rl.envs import Completion, Sampler, SamplerError, SamplingParams
from marin_rl.errors import ConfigError, ProblemSourceError, PromptTooLong
from marin_rl.orchestrator._endpoints import Endpoint, GatedSampler, SeededSampler, derive_seed
from marin_rl.orchestrator._faults import ServerNotReady, classify
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
