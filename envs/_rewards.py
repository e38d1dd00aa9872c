"""Running reward functions safely, and the counters an env reports.

A reward function that raises (anything, `SystemExit` included), runs past its timeout, or returns
something that is not a finite number scores 0; the error is recorded by name and counted, and
nothing else is affected. Sync reward functions run on the env's `VerifierThreads`, daemon threads
of which at most `verifier_threads` serve at once: Python cannot kill a thread, so a call that times
out is abandoned: its thread is interrupted if it runs Python code and replaced (see the class; a stuck
thread never keeps the process from exiting). Threads still running a timed-out call are reported as
`hung_verifier_threads`. Async reward functions run on the caller's event loop and are cancelled at
the timeout; they must not block it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
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

    def __init__(self, env_name: str, threads: VerifierThreads | None = None):
        """`threads`: the env's verifier threads, whose hung ones are reported."""
        self.env_name = env_name
        self.counts: Counter[str] = Counter()
        self.threads = threads

    def increment(self, counter: str, by: int = 1) -> None:
        self.counts[counter] += by

    def as_dict(self) -> dict[str, float]:
        out = {f"envs/{self.env_name}/{k}": float(v) for k, v in sorted(self.counts.items())}
        if self.threads is not None:
            out[f"envs/{self.env_name}/hung_verifier_threads"] = float(self.threads.hung)
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
    except asyncio.CancelledError:  # the run is stopping: a call under way must not run on after it
        if call is not None:
            threads.abandon(call)
        raise
    except TimeoutError:
        metrics.increment("reward_timeouts")
        if call is not None and call.cancelled():  # never started: every thread was busy
            return 0.0, (
                f"timed out after {timeout_s:g}s waiting for a verifier thread ({threads.hung} stuck in calls "
                f"that timed out, {threads.max_hung} more than verifier_threads at most)"
            )
        if call is not None:
            threads.abandon(call)
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
    """Threads running sync reward functions: at most `size` serving at once, started as needed.

    Python cannot stop a thread. A call that times out is abandoned (`abandon`): its thread leaves the
    pool, gets an exception raised in it (which ends a call stuck in Python code: a loop, a slow parser)
    and exits once its call ends; a fresh thread serves in its place. A call blocked in C (a regex, a
    socket read) keeps its thread until it returns, so threads are capped at `size + max_hung`: past
    that, calls wait in the queue and time out (one still queued is dropped, never run), and the run's
    limit on failed rewards stops it.
    """

    def __init__(self, size: int = 8, name: str = "verifier", max_hung: int = 256):
        if size < 1:
            raise ValueError(f"VerifierThreads: size must be >= 1, got {size}")
        if max_hung < 0:
            raise ValueError(f"VerifierThreads: max_hung must be >= 0, got {max_hung}")
        self.size = size
        self.max_hung = max_hung
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._serving: set[threading.Thread] = set()
        self._abandoned: set[threading.Thread] = set()  # still running a timed-out call
        self._running: dict[concurrent.futures.Future, threading.Thread] = {}
        self._started = 0
        self._idle = 0  # serving threads waiting for a call
        self._queued = 0  # calls not yet taken by a thread
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        call: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the verifier threads are shut down")
            self._queued += 1
            self._start_if_needed()
        self._calls.put((call, fn))
        return call

    def shutdown(self) -> None:
        """Serving threads end once the calls queued before are done (a hung one when its call returns):
        a process that runs many envs, one run after another, keeps no threads of the finished ones."""
        with self._lock:
            self._closed = True
            serving = len(self._serving)
        for _ in range(serving):
            self._calls.put(None)

    def abandon(self, call: concurrent.futures.Future) -> None:
        """`call` timed out: interrupt its thread and let a fresh one take the calls waiting."""
        with self._lock:
            thread = self._running.pop(call, None)
            if thread is None:
                return  # finished meanwhile, or never started
            self._serving.discard(thread)
            self._abandoned.add(thread)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
            self._start_if_needed()

    def _start_if_needed(self) -> None:
        # Under the lock: a call waits with no idle thread, and both caps leave room for one more.
        if self._queued > self._idle and len(self._serving) < self.size and len(self._serving) + self._hung() < self.size + self.max_hung:
            self._started += 1
            thread = threading.Thread(target=self._serve, name=f"{self.name}-{self._started}", daemon=True)
            self._serving.add(thread)
            thread.start()

    @property
    def threads(self) -> int:
        """Threads alive (never more than `size + max_hung`)."""
        with self._lock:
            return len(self._serving) + self._hung()

    @property
    def hung(self) -> int:
        """Threads still running a call that timed out."""
        with self._lock:  # the metrics read it while the event loop's thread abandons calls
            return self._hung()

    def _hung(self) -> int:
        # Under the lock.
        self._abandoned = {t for t in self._abandoned if t.is_alive()}
        return len(self._abandoned)

    def _serve(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    self._idle += 1
                taken = self._calls.get()
                with self._lock:
                    self._idle -= 1
                    if taken is None:  # shut down
                        self._serving.discard(me)
                        return
                    call, fn = taken
                    self._queued -= 1
                    if not call.set_running_or_notify_cancel():
                        continue  # timed out while queued
                    self._running[call] = me
                try:
                    result, error = fn(), None
                except BaseException as e:  # noqa: BLE001 - SystemExit too: handed to the awaiting coroutine
                    result, error = None, _contain(e)
                with self._lock:
                    abandoned = me not in self._serving  # then a fresh thread took this one's place
                    self._running.pop(call, None)
                if error is None:
                    call.set_result(result)
                else:
                    call.set_exception(error)
                if abandoned:
                    return
        except _Abandoned:  # raised late, once the call had ended: this thread was leaving anyway
            pass


class _Abandoned(BaseException):
    """Raised in a thread whose reward call timed out, to end a call stuck in Python code."""
