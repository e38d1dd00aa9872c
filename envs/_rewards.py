"""Running reward functions safely, and the counters an env reports.

A reward function that raises, runs past its timeout, or returns something that is not a finite
number scores 0; the error is recorded by name and counted, and nothing else is affected. Sync
reward functions run in a thread of their own (not a shared pool): Python cannot kill a thread,
so a hung verifier is abandoned, and with a pool a few of those would starve every later call.
Abandoned threads that are still running are reported as `hung_verifier_threads`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
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
        self._abandoned: list[threading.Thread] = []

    def increment(self, counter: str, by: int = 1) -> None:
        self.counts[counter] += by

    def abandon(self, thread: threading.Thread) -> None:
        self._abandoned.append(thread)

    def as_dict(self) -> dict[str, float]:
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
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
) -> Scores:
    """Run every reward function concurrently; `functions` maps name -> (function, weight)."""
    names = list(functions)
    outcomes = await asyncio.gather(
        *(_run_one(name, fn, available, timeout_s, metrics) for name, (fn, _) in functions.items())
    )
    rewards, errors = {}, {}
    for name, (value, error) in zip(names, outcomes):
        rewards[name] = value
        if error is not None:
            errors[name] = error
    total = sum(functions[name][1] * rewards[name] for name in names)
    return Scores(rewards, float(total), errors)


async def _run_one(
    name: str, fn: Callable[..., Any], available: Mapping[str, Any], timeout_s: float, metrics: EnvMetrics
) -> tuple[float, str | None]:
    kwargs = {p: available[p] for p in inspect.signature(fn).parameters if p in available}
    thread = None
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(**kwargs), timeout_s)
        else:
            future, thread = _in_thread(fn, kwargs, name)
            value = await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        metrics.increment("reward_timeouts")
        if thread is not None:
            metrics.abandon(thread)
        return 0.0, f"timed out after {timeout_s:g}s"
    except Exception as e:  # noqa: BLE001 - any verifier failure scores 0 and is recorded
        metrics.increment("reward_errors")
        return 0.0, f"{type(e).__name__}: {e}"
    checked = _as_reward(value)
    if checked is None:
        metrics.increment("reward_errors")
        return 0.0, f"returned {value!r}, expected a finite number"
    return checked, None


def _as_reward(value: Any) -> float | None:
    if not isinstance(value, (bool, int, float, np.number)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> tuple[asyncio.Future, threading.Thread]:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            value, error = fn(**kwargs), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the event loop closed while this verifier ran: nobody is waiting

    thread = threading.Thread(target=run, name=f"verifier:{name}", daemon=True)
    thread.start()
    return future, thread
