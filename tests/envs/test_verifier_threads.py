"""Verifier threads: a hung reward call is cut at its timeout and its thread replaced (at most a cap of
them hung), a call stuck in Python is interrupted, and the threads end with their run."""

import asyncio
import threading
import time

import pytest

from marin_rl.envs import Env, Problem, ScriptedSampler, reward, sample_group


def _rollouts(env, sampler, n=2):
    return asyncio.run(sample_group(env, next(iter(env.problems())), sampler, n))


def _stuck_env(release: threading.Event, started: list, *, hung_cap: int) -> type[Env]:
    class Stuck(Env):
        verifier_timeout_s = 0.1
        verifier_threads = 2
        max_hung_verifier_threads = hung_cap

        def problems(self):
            return [Problem(id="s", prompt="q")]

        @reward
        def hangs(self):
            started.append(1)
            release.wait(60)
            return 1.0

    return Stuck


def test_hung_verifier_threads_are_replaced_so_capacity_never_falls_to_zero(tokenizer):
    release, started = threading.Event(), []
    env = _stuck_env(release, started, hung_cap=256)().bind(tokenizer)
    try:
        for _ in range(5):  # 10 rollouts, each hanging past the timeout
            for r in _rollouts(env, ScriptedSampler(tokenizer, ["x"]), n=2):
                assert r.rewards == {"hangs": 0.0} and r.metadata["reward_errors"]["hangs"] == "timed out after 0.1s"
        assert len(started) == 10  # every call ran: a fresh thread replaced each hung one
        assert env.verifier_pool.hung == 10 and env.verifier_pool.threads == 10
        assert env.metrics.as_dict()["envs/Stuck/hung_verifier_threads"] == 10
    finally:
        release.set()
    _wait_until(lambda: _threads_named("verifier:Stuck") == env.verifier_pool.threads == 0)  # a thread leaving the pool ends a moment later
    # Released, the abandoned threads end (every thread ran a call that timed out).
    assert env.verifier_pool.hung == 0 and _threads_named("verifier:Stuck") == 0
    assert env.metrics.as_dict()["envs/Stuck/hung_verifier_threads"] == 0


def _threads_named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_reward_stuck_in_python_code_is_interrupted_at_its_timeout(tokenizer):
    finished = []

    class Looping(Env):
        verifier_timeout_s = 0.1

        def problems(self):
            return [Problem(id="s", prompt="q")]

        @reward
        def loops(self):
            deadline = time.monotonic() + 60  # a pathological input: this would run for a minute
            try:
                while time.monotonic() < deadline:
                    sum(range(1000))
            finally:
                finished.append(time.monotonic())
            return 1.0

    env = Looping().bind(tokenizer)
    started = time.monotonic()
    rollouts = _rollouts(env, ScriptedSampler(tokenizer, ["x"]), n=4)
    assert [r.metadata["reward_errors"]["loops"] for r in rollouts] == ["timed out after 0.1s"] * 4
    _wait_until(lambda: _threads_named("verifier:Looping") == env.verifier_pool.threads == 0)  # a thread leaving the pool ends a moment later
    assert len(finished) == 4 and max(finished) - started < 30  # ended by the interruption, not by the loop
    assert env.verifier_pool.hung == 0 and _threads_named("verifier:Looping") == 0
    assert env.metrics.as_dict()["envs/Looping/hung_verifier_threads"] == 0


def test_a_reward_under_way_when_the_run_stops_is_interrupted_too(tokenizer):
    running, finished = threading.Event(), []

    class Spinning(Env):
        verifier_timeout_s = 60  # longer than the test: only the stop can end it

        def problems(self):
            return [Problem(id="s", prompt="q")]

        @reward
        def spins(self):
            running.set()
            try:
                while True:
                    sum(range(1000))
            finally:
                finished.append(1)

    env = Spinning().bind(tokenizer)

    async def stopped_while_scoring():
        group = asyncio.ensure_future(sample_group(env, next(iter(env.problems())), ScriptedSampler(tokenizer, ["x"]), 1))
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 30)
        group.cancel()  # as the workers' tasks are when a run stops
        with pytest.raises(asyncio.CancelledError):
            await group

    asyncio.run(stopped_while_scoring())
    _wait_until(lambda: _threads_named("verifier:Spinning") == env.verifier_pool.threads == 0)
    assert finished == [1] and env.verifier_pool.threads == 0 and _threads_named("verifier:Spinning") == 0


def test_hung_verifier_threads_stop_at_their_cap(tokenizer):
    release, started = threading.Event(), []
    env = _stuck_env(release, started, hung_cap=3)().bind(tokenizer)
    try:
        for _ in range(5):
            for r in _rollouts(env, ScriptedSampler(tokenizer, ["x"]), n=2):
                assert r.rewards == {"hangs": 0.0}
        # 2 serving + 3 replacements ran; the rest waited for a thread and never ran.
        assert len(started) == 5 and env.verifier_pool.threads == 5
        assert _threads_named("verifier:Stuck") == 5
        assert "waiting for a verifier thread (5 stuck in calls that timed out, 3 more than verifier_threads at most)" in r.metadata["reward_errors"]["hangs"]
        assert env.metrics.as_dict()["envs/Stuck/reward_timeouts"] == 10
    finally:
        release.set()


def test_closed_verifier_threads_end_after_their_calls_and_take_no_more(tokenizer):
    release, started = threading.Event(), []
    env = _stuck_env(release, started, hung_cap=256)().bind(tokenizer)
    env.verifier_timeout_s = 30  # nothing times out: the calls are running when the threads are closed
    pool = env.verifier_pool
    calls = [pool.submit(lambda i=i: (release.wait(60), i)[1]) for i in range(pool.size + 1)]  # one queued
    _wait_until(lambda: pool.threads == pool.size)
    env.close_verifier_threads()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: 0)
    assert _threads_named("verifier:Stuck") == pool.size  # the calls under way, and the one queued, finish first
    release.set()
    assert sorted(call.result(timeout=10) for call in calls) == list(range(pool.size + 1))
    _wait_until(lambda: _threads_named("verifier:Stuck") == 0)
    assert _threads_named("verifier:Stuck") == 0 and pool.threads == 0
