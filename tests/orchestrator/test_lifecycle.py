"""The run's lifecycle: hooks run at their period and phase, the shut-down closes last opened first,
past failures, and a start that fails after the servers are up leaves no thread behind."""

import logging
import threading

import pytest

from marin_rl.config import load_config
from marin_rl.errors import DiskFull
from marin_rl.orchestrator import train
from marin_rl.orchestrator._lifecycle import LEARNED, LOGGED, MEASURED, PERSISTED, Hooks, Shutdown, StepInfo
from marin_rl.testing import QUICK_RUN


def info(step: int) -> StepInfo:
    return StepInfo(step, batch=None, learner_metrics={}, seconds={})


def test_hooks_run_at_their_period_in_phase_order_and_never_at_0():
    hooks, ran = Hooks(), []
    hooks.add(lambda i: ran.append(("checkpoint", i.step)), every=3, phase=PERSISTED)
    hooks.add(lambda i: ran.append(("metrics", i.step)), every=1, phase=MEASURED)
    hooks.add(lambda i: ran.append(("eval", i.step)), every=2, phase=MEASURED)
    hooks.add(lambda i: ran.append(("never", i.step)), every=0, phase=MEASURED)
    hooks.add(lambda i: ran.append(("never", i.step)), every=None, phase=LOGGED)
    for step in range(1, 7):
        for phase in (LEARNED, MEASURED, LOGGED, PERSISTED):
            hooks.run(phase, info(step))
    assert ran == [
        ("metrics", 1), ("metrics", 2), ("eval", 2), ("metrics", 3), ("checkpoint", 3),
        ("metrics", 4), ("eval", 4), ("metrics", 5), ("metrics", 6), ("eval", 6), ("checkpoint", 6),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="phase must be one of"):
        hooks.add(print, every=1, phase="later")
    with pytest.raises(ValueError, match="every must be >= 0"):
        hooks.add(print, every=-1, phase=LOGGED)


def test_shutdown_closes_last_opened_first_and_past_a_failure():
    closed = []

    def failing():
        closed.append("broadcaster")
        raise OSError("socket closed")

    with Shutdown() as shutdown:
        shutdown.close_later(lambda: closed.append("server"))
        shutdown.close_later(failing)
        shutdown.close_later(lambda: closed.append("workers"))
    assert closed == ["workers", "broadcaster", "server"]
    assert [str(e) for e in shutdown.errors] == ["socket closed"] and shutdown.ended_by is None


def test_the_runs_own_error_is_raised_and_closing_errors_are_one_line_each(caplog):
    with pytest.raises(DiskFull, match="disk full"), caplog.at_level(logging.INFO, logger="marin_rl.orchestrator._lifecycle"):
        with Shutdown() as shutdown:
            shutdown.close_later(lambda: (_ for _ in ()).throw(DiskFull("disk full\nwriting a segment")))
            shutdown.close_later(lambda: (_ for _ in ()).throw(OSError("gone")))
            raise DiskFull("disk full")
    assert isinstance(shutdown.ended_by, DiskFull)
    levels = {r.getMessage().split(": ", 1)[1]: r.levelno for r in caplog.records}
    assert levels == {"gone": logging.WARNING, "disk full writing a segment": logging.INFO}  # a full disk is said once, by the run


def test_a_second_ctrl_c_while_closing_closes_the_rest_then_stops():
    closed = []

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with Shutdown() as shutdown:
            shutdown.close_later(lambda: closed.append("server"))
            shutdown.close_later(interrupted)
    assert closed == ["server"] and isinstance(shutdown.ended_by, KeyboardInterrupt)


def engine_and_server_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("marin-rl-engine", "marin-rl-http"))}


def test_a_start_that_fails_after_the_servers_are_up_stops_them(tmp_path, monkeypatch):
    import marin_rl.replay

    before = engine_and_server_threads()

    def no_buffer(*args, **kwargs):
        raise OSError("no space for the replay buffer")

    monkeypatch.setattr(marin_rl.replay, "ReplayBuffer", no_buffer)
    config = load_config("configs/quickstart.yaml", [f"--run_dir={tmp_path / 'run'}", "--max_steps=2", *QUICK_RUN])
    with pytest.raises(OSError, match="no space for the replay buffer"):
        train(config)
    assert not engine_and_server_threads() - before
    assert not (tmp_path / "run").exists()  # a start that failed leaves nothing to delete by hand
