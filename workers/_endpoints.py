"""The servers env workers sample from, and the samplers that keep their answers trustworthy.

- `GatedSampler`: a remote server is sampled from only while it serves this run's weights (its
  transport confirmed them), and an answer reporting a version this run never pushed there (the
  server restarted from its own checkpoint) is refused and reported.
- `SeededSampler`: every request carries a seed derived from the group's seed, the rollout's index and
  the turn, so a deterministic run's samples depend on the run's config alone.
- `RetryingSampler`: a request that fails transiently is sent again (evaluation).
- `LeastLoadedSampler`: each request goes to the ready server with the fewest sequences in flight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from marin_rl.envs import Completion, Sampler, SamplingParams
from marin_rl.workers._faults import ServerNotReady, retry_transient


class VersionGate(Protocol):
    """What a remote server's weight transport tells the workers (`RemoteTransport`)."""

    def sampling_window(self) -> tuple[int, int] | None:
        """(oldest, newest) version an answer may report; None: do not sample from it now."""

    def report_stale(self, reported: int) -> None:
        """An answer reported a version outside the window."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server the workers sample from."""

    base_url: str
    model: str
    server_id: str
    request_timeout_s: float = 600.0
    gate: VersionGate | None = None
    """None: always serves this run's weights (the embedded server)."""
    local: Sampler | None = None
    """Samples from this server in-process, without HTTP (the embedded server's `LocalSampler`)."""

    @property
    def ready(self) -> bool:
        return self.gate is None or self.gate.sampling_window() is not None


class GatedSampler(Sampler):
    """`inner`'s completions, refused unless the server serves weights this run pushed to it."""

    def __init__(self, inner: Sampler, endpoint: Endpoint):
        self.inner = inner
        self.endpoint = endpoint

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        gate = self.endpoint.gate
        before = None if gate is None else gate.sampling_window()
        if gate is not None and before is None:
            raise ServerNotReady(f"{self.endpoint.server_id} ({self.endpoint.base_url}) is not serving this run's weights")
        completions = await self.inner.sample(prompt_ids, n, params)
        if gate is not None:
            after = gate.sampling_window() or before
            for version in {c.metadata.policy_version for c in completions}:
                if not before[0] <= version <= after[1]:
                    gate.report_stale(version)
                    raise ServerNotReady(
                        f"{self.endpoint.server_id} answered with policy version {version}, not one this run pushed "
                        f"to it ({before[0]}..{after[1]}): it restarted; its answer is dropped"
                    )
        return completions


def derive_seed(*parts: int | str | Sequence[int]) -> int:
    """A 63-bit seed from `parts` (ints, strings, token-id sequences), the same in every process."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = np.asarray(part, dtype=np.int64).tobytes() if not isinstance(part, str) else part.encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return int.from_bytes(digest.digest(), "little") >> 1


class SeededSampler(Sampler):
    """Sends its k-th request with the seed `derive_seed(seed, k)`; `fork(*key)` is a `SeededSampler` of
    its own, seeded from (`seed`, key).

    The runner forks one per rollout for the turns after the first, and one per problem to evaluate,
    so a request's seed is a function of (run seed, env, the problem's draw, the rollout's index in its
    group, the turn): of the run's config alone, whatever order conversations reach their next turn in,
    and never of a prompt's content. Conversations of one group that coincide so far (every one of them,
    once the first turn is learned) still sample apart.
    """

    def __init__(self, inner: Sampler, seed: int):
        self.inner = inner
        self.seed = seed
        self._requests = 0

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        request, self._requests = self._requests, self._requests + 1
        return await self.inner.sample(prompt_ids, n, replace(params, seed=derive_seed(self.seed, request)))

    def fork(self, *key: int | str) -> SeededSampler:
        return SeededSampler(self.inner, derive_seed(self.seed, *key))


class RetryingSampler(Sampler):
    """`inner`'s completions, a request that fails transiently sent again (at most `attempts` times)."""

    def __init__(self, inner: Sampler, *, max_backoff_s: float, attempts: int):
        self.inner = inner
        self.max_backoff_s = max_backoff_s
        self.attempts = attempts

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        async for attempt in retry_transient(max_backoff_s=self.max_backoff_s, attempts=self.attempts):
            with attempt:
                return await self.inner.sample(prompt_ids, n, params)


class LeastLoadedSampler(Sampler):
    """Each request to the server, among those that serve this run's weights now, with the fewest
    sequences in flight from this process (ties: the first). Several processes routing this way each
    spread their own load, so the total is spread too."""

    def __init__(self, samplers: Sequence[GatedSampler]):
        self.samplers = list(samplers)
        self.in_flight = [0] * len(self.samplers)

    def choose(self) -> int:
        ready = [i for i, s in enumerate(self.samplers) if s.endpoint.ready]
        if not ready:
            raise ServerNotReady("no server serves this run's weights now")
        return min(ready, key=lambda i: self.in_flight[i])

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        index = self.choose()
        self.in_flight[index] += n
        try:
            return await self.samplers[index].sample(prompt_ids, n, params)
        finally:
            self.in_flight[index] -= n
