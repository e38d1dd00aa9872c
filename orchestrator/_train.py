"""`train(config)`: the RL loop of `marin-rl train`.

env workers -> replay buffers -> batcher -> learner -> broadcaster -> server -> env workers.
Local runtime: the learner, the embedded servers and the env workers share one process: workers
sample on a background event loop while the learner trains (or, in a deterministic run, generate each
step's batch with that step's policy); each new policy is swapped into the servers in place (device to
device when `placement` gives an engine its own device). Ray runtime: servers and env workers are Ray
actors (`marin_rl.distributed`), the rest stays here. Set up (`_setup.start`), loop (`_loop`: the
step, then its hooks: broadcast, metrics, evaluation, the metrics line, checkpoints), shut down.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from marin_rl.compiles import CompileCounter, set_default_xla_flags
from marin_rl.config import TrainConfig, dump_config
from marin_rl.orchestrator._lifecycle import LEARNED, LOGGED, MEASURED, PERSISTED, Shutdown, StepInfo
from marin_rl.orchestrator._preflight import RUN_CONFIG, CheckedRun, check_run, check_run_dir, holds_run
from marin_rl.orchestrator._setup import Run, start


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    final_step: int
    stopped_early: bool
    """True when a stop was requested (Ctrl-C / SIGTERM) before max_steps."""


def prepare_run_dir(config: TrainConfig, resume: bool) -> tuple[Path, bool]:
    """Create RUN/ and write the resolved config; never write over a previous run unless resuming.

    Returns the directory and whether this call created it (then a failed start removes it)."""
    run_dir = Path(config.run_dir)
    check_run_dir(run_dir, resume)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_CONFIG).write_text(dump_config(config))
    return run_dir, created


def train(
    config: TrainConfig, *, resume: bool = False, stop: threading.Event | None = None, checked: CheckedRun | None = None
) -> TrainResult:
    """Train until `config.max_steps` or until `stop` is set; always flushes rollouts, and checkpoints
    whatever ended the run (but a NaN loss or a second Ctrl-C). A permanent failure (docs/reliability.md)
    is raised after that checkpoint.

    `checked` is `check_run(config)`'s result when the caller already ran the checks."""
    set_default_xla_flags()  # in effect unless JAX has started its backend already
    stop = stop or threading.Event()
    checked = checked or check_run(config, resume=resume)
    run_dir, created = prepare_run_dir(config, resume)
    try:
        return _train(config, run_dir, resume, stop, checked)
    except BaseException:
        if created and not holds_run(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)  # a start that failed leaves nothing to delete by hand
        raise


def _train(config: TrainConfig, run_dir: Path, resume: bool, stop: threading.Event, checked: CheckedRun) -> TrainResult:
    # Set up, loop, shut down: the shut-down closes what start-up opened, also when start-up fails.
    with CompileCounter() as compiles:  # every thread's compilations, start-up's included
        with Shutdown() as shutdown:
            run = start(config, run_dir, resume, stop, checked, compiles, shutdown)
            stopped_early = _loop(run)
            if run.failures:
                raise run.failures[0]
        if shutdown.errors:
            raise shutdown.errors[0]
    run.learner.export()
    return TrainResult(run_dir, run.learner.policy_version, stopped_early)


def _loop(run: Run) -> bool:
    """Steps until max_steps, or until a stop is asked (then returns True if before max_steps)."""
    step, hooks = run.start_step, run.hooks
    while step < run.config.max_steps:
        # --- data: wait for a full batch of fresh-enough rollouts
        t0 = time.perf_counter()
        batch = run.next_batch()
        if batch is None:
            return True
        if step == run.start_step:
            run.clock.mark("first batch")
        with run.device_lock:
            t1 = time.perf_counter()  # the engine's device call in flight ends first
            # --- learn: one optimizer step makes policy version step + 1
            learner_metrics = run.learner.step(batch.to_example())
            step = run.learner.policy_version
            t2 = time.perf_counter()
            # --- broadcast: the servers sample from the new policy from their next batch on
            info = StepInfo(step, batch, learner_metrics, {"wait_data": t1 - t0, "learner": t2 - t1})
            hooks.run(LEARNED, info)
        t3 = time.perf_counter()
        info.seconds.update(broadcast=t3 - t2, step=t3 - t0)
        # --- measure, log, persist
        hooks.run(MEASURED, info)
        hooks.run(LOGGED, info)
        with run.device_lock:
            hooks.run(PERSISTED, info)
        if run.stop.is_set():
            return step < run.config.max_steps
    return False


