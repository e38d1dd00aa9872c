"""`train(config)`: the RL loop of `marin-rl train`.

env workers -> replay buffers -> batcher -> learner -> broadcaster -> server -> env workers.
Local runtime: the learner, the embedded servers and the env workers share one process: workers
sample on a background event loop while the learner trains (or, in a deterministic run, generate each
step's batch with that step's policy); each new policy is swapped into the servers in place (device to
device when `placement` gives an engine its own device). Ray runtime: servers and env workers are Ray
actors (`marin_rl.distributed`), the rest stays here. Read top to bottom: set up, loop, shut down.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import shutil
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from marin_rl.compiles import CompileCounter, enable_compilation_cache
from marin_rl.config import TrainConfig, dump_config
from marin_rl.errors import ConfigError, DiskFull, PermanentError
from marin_rl.orchestrator._endpoints import Endpoint
from marin_rl.orchestrator._metrics import MetricsLog, ProgressLine
from marin_rl.orchestrator._preflight import RUN_CONFIG, CheckedRun, check_run, check_run_dir, engine_shapes, holds_run
from marin_rl.orchestrator._resume import set_aside_abandoned
from marin_rl.orchestrator._startup import StartupClock
from marin_rl.orchestrator._workers import EnvWorkers, worker_specs

logger = logging.getLogger(__name__)

# The interpreter's switch interval during a run, by platform. On a GPU the engine thread must feed the
# device: 0.5 -> 0.1 ms took the 0.5B loop's prefill calls from 39.8 to 23.7 ms and the learner's wait
# from 0.60 to 0.55 (H100). On a CPU the threads share the cores: 0.1 ms made the quickstart's step 8%
# slower than 0.5 ms.
SWITCH_INTERVAL_S = {"gpu": 0.0001}
DEFAULT_SWITCH_INTERVAL_S = 0.0005


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
    with CompileCounter() as compiles:  # every thread's compilations, start-up's included
        return _run(config, run_dir, resume, stop, checked, compiles)


def _run(
    config: TrainConfig, run_dir: Path, resume: bool, stop: threading.Event, checked: CheckedRun, compiles: CompileCounter
) -> TrainResult:
    # Heavy imports after the config is known to be good.
    import jax

    from marin_rl.distributed import Placement
    from marin_rl.engine import DeviceLock
    from marin_rl.learner import Learner
    from marin_rl.orchestrator._inference_server import PolicyServer
    from marin_rl.replay import DEFAULT_MISMATCH_CAP, BatchCancelled, Batcher, ReplayBuffer, mismatch_metrics
    from marin_rl.rl_example import RlExample

    # --- set up
    clock = StartupClock(checked.seconds)
    enable_compilation_cache(config.compilation_cache)
    tokenizer = checked.tokenizer
    placement = Placement.of(config)
    server_config = embedded_server_config(config, checked)
    learner = Learner(
        config.learner,
        config.model,
        run_dir,
        tokenizer,
        key=jax.random.key(config.seed),
        mesh=placement.learner_mesh,
        exact=server_config.exact_layout,
    )
    run_state = learner.restore_latest() if resume else {}
    if resume:
        if run_state is None:  # stopped before its first checkpoint: start again, from the same seed
            run_state = {"problem_positions": {e.name: 0 for e in config.envs}}
        set_aside_abandoned(run_dir, learner.policy_version, run_state.get("problem_positions", {}))
        logger.info("resuming at policy version %d", learner.policy_version)
    clock.mark("model")
    # Every batch has this shape: the learner's step compiles now, beside the engines' start-up (XLA
    # compiles without the GIL), so that neither start-up nor the first step waits on it alone.
    compiling = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="marin-rl-compile")
    step_compiled = compiling.submit(learner.compile_step, RlExample.from_packed(config.batcher.padding_arrays()))
    compiling.shutdown(wait=False)  # its thread ends with the compilation
    # The learner and an embedded engine on its device take turns on it: the engine holds this lock while
    # its calls are in flight (letting go when the loop asks), the loop around each learn/broadcast/save
    # phase. cuDNN attention's CUDA-graph capture fails if another thread launches work meanwhile (seen on
    # an H200, jax 0.11.2), and overlapping gains nothing measurable on one GPU or on a 2-core CPU (0.26 vs
    # 0.30 s per quickstart step). An engine on a device of its own needs no lock: the swap copies the
    # weights device to device. Re-entrant: the broadcast's swap takes it inside the loop's phase.
    device_lock = DeviceLock()
    servers = [
        PolicyServer(
            server_config,
            learner.model,
            tokenizer,
            policy_version=learner.policy_version,
            device_lock=device_lock if placement.shares_learner_device(device) else None,
            device=device,
        ).start()
        for device in placement.engine_devices
    ]
    runtime = None
    if config.runtime == "ray":
        from marin_rl.distributed import RayRuntime

        runtime = RayRuntime(config, learner.model, tokenizer, run_dir)
    broadcaster = config.broadcaster.build(
        colocated=servers, tokenizer=tokenizer, run_dir=str(run_dir), extra=runtime.transports if runtime else ()
    )
    buffers = {
        env.name: ReplayBuffer(
            env.name,
            env.buffer,
            algorithm=env.algorithm,
            run_dir=run_dir,
            max_seq_len=config.batcher.max_seq_len,
            overlong=config.batcher.overlong,
            vocab_size=learner.model.Vocab.size,
        )
        for env in config.envs
    }
    batcher = Batcher(buffers, config.fractions, config.batcher)
    batcher.credit.update(run_state.get("batcher_credit", {}))
    logger.info("learner: step compiled in %.1fs", step_compiled.result())
    clock.mark("compile")
    # Servers in other processes are sampled from only while they serve this run's weights (their
    # transport says).
    timeout = config.server.request_timeout_s
    # Workers in this process reach the embedded engines directly (no HTTP, no JSON); other servers over HTTP.
    names = ["embedded"] if len(servers) == 1 else [f"embedded{i}" for i in range(len(servers))]
    endpoints = [
        Endpoint(server.base_url, config.server.model_name, name, timeout, local=server.local_sampler(name))
        for name, server in zip(names, servers)
    ]
    endpoints += [
        Endpoint(transport.base_url, config.server.model_name, transport.server_id, timeout, gate=transport)
        for transport in broadcaster.transports[len(servers) :]
    ]
    failures: list[PermanentError] = []

    def fail(error: PermanentError) -> None:  # from the workers' thread: stop waiting for data
        failures.append(error)
        stop.set()

    if runtime is None:
        workers = EnvWorkers(
            checked.envs,
            worker_specs(config, checked.envs),
            buffers,
            endpoints,
            seed=config.seed,
            max_backoff_s=config.worker_max_backoff_s,
            positions=run_state.get("problem_positions"),
            on_failure=fail,
        )
    else:
        workers = runtime.env_workers(buffers, endpoints, positions=run_state.get("problem_positions"), on_failure=fail)
    metrics_log = MetricsLog(run_dir, config.wandb, config_dict={"run_dir": str(run_dir)})

    policy_envs = [e.name for e in config.envs if e.algorithm.completion_source == "policy"]
    mismatch_cap = config.learner.loss.tis_cap or DEFAULT_MISMATCH_CAP

    # A deterministic run's checkpoint holds the positions its next step's groups start from (a fill
    # interrupted by a failure must not move them); a free-running run's, the live ones.
    drawn = workers.positions()

    def save_checkpoint() -> None:
        positions = drawn if config.deterministic else workers.positions()
        learner.save_checkpoint({"problem_positions": positions, "batcher_credit": dict(batcher.credit)})
        saved.append(learner.policy_version)

    start_step = learner.policy_version
    saved = [start_step] if any((run_dir / "checkpoints").glob("step-*")) else []
    totals: dict[str, float] = defaultdict(float)
    step = start_step
    stopped_early = False
    ended_by: BaseException | None = None
    compiled = 0  # compilations counted by the last step
    # What start-up made (modules, compiled functions, the model) lives as long as the run: frozen out of
    # the collector's sight, full collections stop pausing every thread for 0.3-0.4 s every ~20 quickstart
    # steps. Unfrozen at the end, so that runs in one process leave nothing behind.
    gc.freeze()
    # The engine thread, the env workers and the learner share one interpreter lock: a thread that wants it
    # waits up to the switch interval (5 ms by default) for the holder to let go, several times per engine
    # call. Shorter turns keep the device fed.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S.get(jax.default_backend(), DEFAULT_SWITCH_INTERVAL_S))
    try:
        broadcaster.start(learner.model, learner.policy_version)  # remote servers: this run's weights, before any sampling
        workers.start(free_running=not config.deterministic)
        with ProgressLine(config.max_steps, start_step, [e.name for e in config.envs]) as progress:
            if config.eval_every and start_step == 0:
                metrics_log.log(0, _timed_eval(workers, 0))  # the baseline, before any update
            while step < config.max_steps:
                # --- data: wait for a full batch of fresh-enough rollouts
                t0 = time.perf_counter()
                try:
                    if config.deterministic:  # sampled now by policy `step` alone, in a fixed order
                        workers.fill(batcher.short_envs, cancel=stop)
                    batch = batcher.next_batch(learner.policy_version, cancel=stop)
                except BatchCancelled:
                    stopped_early = True
                    break
                if step == start_step:
                    clock.mark("first batch")
                if config.deterministic:
                    drawn = workers.positions()
                    for buffer in buffers.values():
                        buffer.drop_all()  # the next step starts from nothing, as a resumed one would

                with device_lock:
                    t1 = time.perf_counter()  # the engine's device call in flight ends first

                    # --- learn: one optimizer step makes policy version step + 1
                    learner_metrics = learner.step(batch.to_example())
                    step = learner.policy_version
                    t2 = time.perf_counter()

                    # --- broadcast: the servers sample from the new policy from their next batch on
                    broadcast_metrics = broadcaster.maybe_broadcast(learner.model, step)
                t3 = time.perf_counter()

                # --- log
                metrics = {f"learner/{k}": v for k, v in learner_metrics.items()}
                metrics.update(mismatch_metrics(batch, learner.last_logprobs, policy_envs, mismatch_cap))
                metrics.update(batch.metrics)
                metrics.update(broadcast_metrics)
                for buffer in buffers.values():
                    metrics.update(buffer.metrics())
                    buffer.flush_if_due()
                metrics.update(workers.metrics())
                for server in servers:  # engine counters, summed over the embedded engines
                    for key, value in server.metrics().items():
                        metrics[key] = metrics.get(key, 0.0) + value
                swaps = [server.last_swap for server in servers if server.last_swap is not None]
                if swaps:  # copy: the weights (device to device); wait: the server's batch in flight; the slowest
                    metrics["broadcast/swap_seconds"] = max(swap.total_seconds for swap in swaps)
                    metrics["broadcast/swap_copy_seconds"] = max(swap.copy_seconds for swap in swaps)
                    metrics["broadcast/swap_wait_seconds"] = max(swap.wait_seconds for swap in swaps)
                totals["wall"] += t3 - t0
                totals["wait"] += t1 - t0
                generated = sum(metrics.get(f"replays/{e.name}/new_generated_tokens", 0.0) for e in config.envs)
                if config.eval_every and step % config.eval_every == 0:
                    metrics.update(_timed_eval(workers, step))
                metrics.update(
                    {
                        "time/step_s": t3 - t0,
                        "time/wait_data_s": t1 - t0,
                        "time/learner_s": t2 - t1,
                        "time/broadcast_s": t3 - t2,
                        "time/frac_waiting_for_data": totals["wait"] / totals["wall"],
                        "throughput/generated_tokens_per_s": generated / (t3 - t0),
                    }
                )
                counted = compiles.metrics()
                metrics.update(counted)
                if step > start_step + 1 and counted["compile/count"] > compiled:
                    names = ", ".join(f"{name} ({seconds:.1f} s)" for name, seconds in compiles.compiled[compiled : counted["compile/count"]])
                    logger.warning("step %d compiled %s: a shape not compiled at start", step, names)
                compiled = counted["compile/count"]
                if step == start_step + 1:
                    clock.mark("first step")
                    metrics.update(clock.metrics())
                metrics_log.log(step, metrics)
                progress.update(step, metrics)
                if step == start_step + 1:
                    progress.console.print(clock.line(step), highlight=False)

                # --- persist
                with device_lock:
                    if step % config.checkpoint_every == 0:
                        save_checkpoint()
                    if config.export_hf_every and step % config.export_hf_every == 0:
                        learner.export_hf()
                if stop.is_set():
                    stopped_early = step < config.max_steps
                    break
    except BaseException as e:
        ended_by = e
        raise
    finally:
        gc.unfreeze()
        sys.setswitchinterval(switch_interval)
        # Whatever ended the loop, keep what was produced: rollouts on disk, the latest weights. Each part
        # is stopped even if another fails (a full disk fails every write).
        try:
            workers.stop()
        except KeyboardInterrupt as e:  # a second Ctrl-C while the workers stop: keep the rollouts anyway
            ended_by = e
        closing = [buffer.close for buffer in buffers.values()]
        closing += [metrics_log.close, broadcaster.close, *(server.shutdown for server in servers)]
        closing += [runtime.shutdown] if runtime is not None else []
        failed = ended_by or (failures[0] if failures else None)
        # Not after a NaN (the weights are NaN), a second Ctrl-C (stop now) or a full disk.
        if not isinstance(failed, (FloatingPointError, KeyboardInterrupt, DiskFull)) and saved[-1:] != [learner.policy_version]:
            closing.append(save_checkpoint)
        stop_errors = _run_all(closing, failed)
        if isinstance(ended_by, KeyboardInterrupt):
            raise ended_by
    if failures:
        raise failures[0]
    if stop_errors:
        raise stop_errors[0]
    learner.export_hf()
    return TrainResult(run_dir, learner.policy_version, stopped_early)


def embedded_server_config(config: TrainConfig, checked: CheckedRun):
    """The embedded engines' settings: the shapes its envs need compiled at start (unless
    `server.precompile_prompt_lens` names them), and with exact numerics, the exact passes in the
    learner's compute dtype (the bits of both are equal only then)."""
    server = config.server
    if not server.precompile_prompt_lens:
        server = dataclasses.replace(server, **engine_shapes(checked.prompts, server.max_seq_len))
    if not config.exact:
        return server
    from marin_rl.learner import compute_dtype

    dtype = str(compute_dtype(config.model))
    if config.server.compute_dtype not in (None, dtype):
        raise ConfigError(
            f"exact numerics: server.compute_dtype is {config.server.compute_dtype!r} but the learner computes in "
            f"{dtype} (model.compute_dtype); the exact passes need one dtype: set server.compute_dtype to {dtype!r} "
            "or leave it unset"
        )
    return dataclasses.replace(server, exact_numerics=True, compute_dtype=dtype)


def _run_all(actions, ended_by: BaseException | None) -> list[Exception]:
    """Run every action, whichever fail; returns their errors. When the run already failed (`ended_by`),
    its error is the one reported: these are logged in one line each."""
    errors = []
    for action in actions:
        try:
            action()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            if ended_by is not None:  # a full disk fails every write: said once, by the run's error
                level = logging.INFO if isinstance(e, DiskFull) and isinstance(ended_by, DiskFull) else logging.WARNING
                logger.log(level, "while stopping, %s failed too: %s", getattr(action, "__qualname__", action), " ".join(str(e).split()))
    return errors


def _timed_eval(workers: EnvWorkers, step: int) -> dict[str, float]:
    start = time.perf_counter()
    metrics = workers.evaluate(step)
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics
