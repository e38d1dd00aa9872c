"""Running reward functions safely, and the counters an env reports.

A reward function that raises (anything, `SystemExit` included), runs past its timeout, or returns
something that is not a finite number scores 0; the error is recorded by name and counted, and
nothing else is affected. Sync reward functions run on the env's `VerifierThreads`, a bounded pool
of daemon threads: Python cannot kill a thread, so a hung call keeps its thread, but there are never
more than the pool's size (calls that find every thread stuck wait, then time out and score 0), and
a stuck thread never keeps the process from exiting. Threads still running a timed-out call are
reported as `hung_verifier_threads`. Async reward functions run on the caller's event loop and are
cancelled at the timeout; they must not block it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import queue
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


class EnvMetrics:
    """Monotonic counters of one env, logged as `envs/{name}/{counter}`."""

    def __init__(self, env_name: str):
        self.env_name = env_name
        self.counts: Counter[str] = Counter()
        self._abandoned: list[concurrent.futures.Future] = []

    def increment(self, counter: str, by: int = 1) -> None:
        self.counts[counter] += by

    def abandon(self, call: concurrent.futures.Future) -> None:
        """A timed-out sync call whose thread may still be running it."""
        self._abandoned.append(call)

    def as_dict(self) -> dict[str, float]:
        self._abandoned = [f for f in self._abandoned if f.running()]
        out = {f"envs/{self.env_name}/{k}": float(v) for k, v in sorted(self.counts.items())}
        out[f"envs/{self.env_name}/hung_verifier_threads"] = float(len(self._abandoned))
        return out


@dataclass(frozen=True)
class Scores:
    rewards: dict[str, float]
    """Each named reward (0 where the reward function failed)."""
    reward: float
    """Sum of weight * named reward."""
    errors: dict[str, str]
    """Reward name -> what went wrong, for the failed ones."""


async def score(
    functions: Mapping[str, tuple[Callable[..., Any], float]],
    available: Mapping[str, Any],
    *,
    timeout_s: float,
    metrics: EnvMetrics,
    threads: VerifierThreads,
) -> Scores:
    """Run every reward function concurrently (sync ones on `threads`); `functions` maps name -> (function, weight)."""
    names = list(functions)
    runs = [_run_one(fn, available, timeout_s, metrics, threads) for fn, _ in functions.values()]
    # One function (the common case) needs no task of its own: this runs once per rollout.
    outcomes = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
    rewards, errors = {}, {}
    for name, (value, error) in zip(names, outcomes):
        rewards[name] = value
        if error is not None:
            errors[name] = error
    total = sum(functions[name][1] * rewards[name] for name in names)
    return Scores(rewards, float(total), errors)


async def _run_one(
    fn: Callable[..., Any], available: Mapping[str, Any], timeout_s: float, metrics: EnvMetrics, threads: VerifierThreads
) -> tuple[float, str | None]:
    kwargs = {p: available[p] for p in _parameters(fn) if p in available}
    call = None
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(_contained(fn(**kwargs)), timeout_s)
        else:
            call = threads.submit(lambda: fn(**kwargs))
            value = await asyncio.wait_for(asyncio.wrap_future(call), timeout_s)
    except TimeoutError:
        metrics.increment("reward_timeouts")
        if call is not None and call.cancelled():  # never started: every thread was busy
            return 0.0, f"timed out after {timeout_s:g}s waiting for one of the {threads.size} verifier threads (hung calls hold them)"
        if call is not None:
            metrics.abandon(call)
        return 0.0, f"timed out after {timeout_s:g}s"
    except Exception as e:  # noqa: BLE001 - any verifier failure scores 0 and is recorded
        metrics.increment("reward_errors")
        return 0.0, f"{type(e).__name__}: {e}" if not isinstance(e, RewardRaised) else str(e)
    checked = _as_reward(value)
    if checked is None:
        metrics.increment("reward_errors")
        return 0.0, f"returned {value!r}, expected a finite number"
    return checked, None


@functools.lru_cache(maxsize=1024)
def _parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    # inspect.signature is slow, and this runs for every rollout; bound methods hash by (self, function).
    return tuple(inspect.signature(fn).parameters)


class RewardRaised(Exception):
    """A reward function raised a BaseException that is not an Exception (SystemExit, KeyboardInterrupt)."""


def _contain(error: BaseException) -> Exception:
    # SystemExit & co. must not reach the event loop: asyncio re-raises them out of it, ending every worker.
    return error if isinstance(error, Exception) else RewardRaised(f"{type(error).__name__}: {error}")


async def _contained(coroutine):
    try:
        return await coroutine
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001
        raise _contain(e) from None


def _as_reward(value: Any) -> float | None:
    if not isinstance(value, (bool, int, float, np.number)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class VerifierThreads:
    """At most `size` daemon threads running sync reward functions, started as needed.

    A call that times out cannot be stopped: its thread stays busy until the function returns. The
    bound keeps hung calls from piling up threads; once every thread is stuck, later calls wait in
    the queue and time out (a timed-out call still queued is dropped, never run).
    """

    def __init__(self, size: int = 8, name: str = "verifier"):
        if size < 1:
            raise ValueError(f"VerifierThreads: size must be >= 1, got {size}")
        self.size = size
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a call
        self._queued = 0  # calls not yet taken by a thread

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        call: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._queued += 1
            start = self._queued > self._idle and self._threads < self.size
            self._threads += start
        self._calls.put((call, fn))
        if start:
            threading.Thread(target=self._serve, name=f"{self.name}-{self._threads}", daemon=True).start()
        return call

    @property
    def threads(self) -> int:
        """Threads started so far (never more than `size`)."""
        return self._threads

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            call, fn = self._calls.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            if not call.set_running_or_notify_cancel():
                continue  # timed out while queued
            try:
                call.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - SystemExit too: handed to the awaiting coroutine
                call.set_exception(_contain(e))
