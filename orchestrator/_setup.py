"""Start-up of `train`: every part of the run built from its config, each handed to the `Shutdown` that
closes it, and the loop's periodic work registered as hooks."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from marin_rl._upstream import device_memory_stats
from marin_rl.compiles import CompileCounter, enable_compilation_cache
from marin_rl.config import TrainConfig
from marin_rl.errors import ConfigError, DiskFull, PermanentError
from marin_rl.interpreter import tune_interpreter
from marin_rl.orchestrator._lifecycle import LEARNED, LOGGED, MEASURED, PERSISTED, Hooks, Shutdown, StepInfo
from marin_rl.orchestrator._memory import reserve_device_memory, used_devices
from marin_rl.orchestrator._metrics import MetricsLog, ProgressLine
from marin_rl.orchestrator._preflight import CheckedRun, engine_shapes, prefill_rows
from marin_rl.orchestrator._resume import set_aside_abandoned
from marin_rl.orchestrator._startup import StartupClock
from marin_rl.workers import Endpoint, EnvWorkers, worker_specs

if TYPE_CHECKING:
    from marin_rl.broadcaster import Broadcaster
    from marin_rl.engine import DeviceLock
    from marin_rl.learner import Learner
    from marin_rl.replay import Batcher, ReplayBuffer
    from marin_rl.server import PolicyServer

logger = logging.getLogger(__name__)

@dataclass
class Run:
    """The parts of a run, built by `start`."""

    config: TrainConfig
    stop: threading.Event
    clock: StartupClock
    compiles: CompileCounter
    learner: Learner
    servers: list[PolicyServer]
    broadcaster: Broadcaster
    buffers: dict[str, ReplayBuffer]
    batcher: Batcher
    workers: EnvWorkers | None
    """Set once built (the final checkpoint is registered to close after them)."""
    device_lock: DeviceLock
    hooks: Hooks
    failures: list[PermanentError]
    start_step: int
    saved: list[int]
    """Policy versions checkpointed by this run (and the one it resumed from)."""
    drawn: dict[str, int] = field(default_factory=dict)
    """Where each env's next group starts in its problem stream (a deterministic run's checkpoint holds
    these: a fill interrupted by a failure must not move them)."""
    started: bool = False
    """Past start-up: a checkpoint is kept of whatever ends the run."""
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds since the start, for the share spent waiting for data."""
    compiled: int = 0
    """Compilations counted by the last step."""

    def next_batch(self):
        """A full batch of fresh-enough rollouts, or None when the run is stopped while waiting."""
        from marin_rl.replay import BatchCancelled

        try:
            if self.config.deterministic:  # sampled now by this policy alone, in a fixed order
                self.workers.fill(self.batcher.short_envs, cancel=self.stop)
            batch = self.batcher.next_batch(self.learner.policy_version, cancel=self.stop)
        except BatchCancelled:
            return None
        if self.config.deterministic:
            self.drawn = self.workers.positions()
            for buffer in self.buffers.values():
                buffer.drop_all()  # the next step starts from nothing, as a resumed one would
        return batch

    def save_checkpoint(self) -> None:
        positions = self.drawn if self.config.deterministic else self.workers.positions()
        self.learner.save_checkpoint({"problem_positions": positions, "batcher_credit": dict(self.batcher.credit)})
        self.saved.append(self.learner.policy_version)


def start(config: TrainConfig, run_dir: Path, resume: bool, stop: threading.Event, checked: CheckedRun, compiles: CompileCounter, shutdown: Shutdown) -> Run:
    """Build the run's parts; `shutdown` closes each (what was built, should a later part fail)."""
    # Heavy imports after the config is known to be good; the accelerators' memory is reserved beside them.
    import jax

    reserve_device_memory(config)
    from marin_rl.distributed import Placement
    from marin_rl.engine import DeviceLock, ModelToCome
    from marin_rl.learner import Learner
    from marin_rl.replay import Batcher, ReplayBuffer
    from marin_rl.rl_example import RlExample
    from marin_rl.server import PolicyServer

    clock = StartupClock(checked.seconds)
    enable_compilation_cache(config.compilation_cache)
    tokenizer = checked.tokenizer
    placement = Placement.of(config)
    server_config = embedded_server_config(config, checked)
    # One device: the engines' programs compile from the model's shapes while it is built (a learner
    # mesh places it over several devices, which the engines' copies must follow: built first there).
    overlap = placement.learner_mesh is None and placement.engine_devices
    shapes = Learner.model_shapes(config.learner, config.model, tokenizer, exact=server_config.exact_layout) if overlap else None
    built: concurrent.futures.Future[Learner] = concurrent.futures.Future()

    def build_learner() -> tuple[dict, float]:
        """The learner (into `built`, for the engines), then its step compiled: (run state, compile seconds)."""
        try:
            started = time.perf_counter()
            learner = Learner(
                config.learner, config.model, run_dir, tokenizer, key=jax.random.key(config.seed), mesh=placement.learner_mesh, exact=server_config.exact_layout
            )
            run_state = learner.restore_latest() if resume else {}
            if resume:
                if run_state is None:  # stopped before its first checkpoint: start again, from the same seed
                    run_state = {"problem_positions": {e.name: 0 for e in config.envs}}
                set_aside_abandoned(run_dir, learner.policy_version, run_state.get("problem_positions", {}))
                logger.info("resuming at policy version %d", learner.policy_version)
            logger.info("learner: model built in %.1fs", time.perf_counter() - started)
        except BaseException as error:
            built.set_exception(error)
            raise
        built.set_result(learner)
        # Every batch has this shape: the step compiles now, beside the engines' start-up (XLA compiles
        # without the GIL), so that neither start-up nor the first step waits on it alone.
        return run_state, learner.compile_step(RlExample.from_packed(config.batcher.padding_arrays()))

    building = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="marin-rl-build")
    learner_ready = building.submit(build_learner)
    building.shutdown(wait=False)  # its thread ends with the compilation
    if shapes is not None:
        model, policy_version = ModelToCome(shapes, built), 0  # the engines take its version when it arrives
    else:  # a mesh: built first
        first = built.result()
        model, policy_version = first.model, first.policy_version
    clock.mark("model")
    # The learner and an embedded engine on its device take turns on it: the engine holds this lock while
    # its calls are in flight (letting go when the loop asks), the loop around each learn/broadcast/save
    # phase. cuDNN attention's CUDA-graph capture fails if another thread launches work meanwhile (seen on
    # an H200, jax 0.11.2), and overlapping gains nothing measurable on one GPU or on a 2-core CPU (0.26 vs
    # 0.30 s per quickstart step). An engine on a device of its own needs no lock: the swap copies the
    # weights device to device. Re-entrant: the broadcast's swap takes it inside the loop's phase.
    device_lock = DeviceLock()
    servers = []
    for device in placement.engine_devices:
        shared = placement.shares_learner_device(device)
        servers.append(PolicyServer(server_config, model, tokenizer, policy_version=policy_version, device_lock=device_lock if shared else None, device=device).start())
        shutdown.close_later(servers[-1].shutdown)
    learner = built.result()
    runtime = None
    if config.runtime == "ray":
        from marin_rl.distributed import RayRuntime

        runtime = RayRuntime(config, learner.model, tokenizer, run_dir)
        shutdown.close_later(runtime.shutdown)
    broadcaster = config.broadcaster.build(colocated=servers, tokenizer=tokenizer, run_dir=str(run_dir), extra=runtime.transports if runtime else ())
    shutdown.close_later(broadcaster.close)
    buffers = {}
    for env in config.envs:
        buffers[env.name] = ReplayBuffer(
            env.name, env.buffer, algorithm=env.algorithm, run_dir=run_dir, max_seq_len=config.batcher.max_seq_len, overlong=config.batcher.overlong, vocab_size=learner.model.Vocab.size
        )
        shutdown.close_later(buffers[env.name].close)
    batcher = Batcher(buffers, config.fractions, config.batcher)
    run_state, step_seconds = learner_ready.result()
    batcher.credit.update(run_state.get("batcher_credit", {}))
    logger.info("learner: step compiled in %.1fs", step_seconds)
    clock.mark("compile")
    failures: list[PermanentError] = []

    def fail(error: PermanentError) -> None:  # from the workers' thread: stop waiting for data
        failures.append(error)
        stop.set()

    saved = [learner.policy_version] if any((run_dir / "checkpoints").glob("step-*")) else []
    run = Run(config, stop, clock, compiles, learner, servers, broadcaster, buffers, batcher, None, device_lock, Hooks(), failures, learner.policy_version, saved)
    shutdown.close_later(lambda: _final_checkpoint(run, shutdown.ended_by))
    endpoints = _endpoints(config, servers, broadcaster)
    positions = run_state.get("problem_positions")
    if runtime is None:
        run.workers = EnvWorkers(
            checked.envs, worker_specs(config, checked.envs), buffers, endpoints, seed=config.seed, max_backoff_s=config.worker_max_backoff_s, positions=positions, on_failure=fail
        )
    else:
        run.workers = runtime.env_workers(buffers, endpoints, positions=positions, on_failure=fail)
    shutdown.close_later(run.workers.stop)  # first: they push into the buffers
    run.drawn = run.workers.positions()
    metrics_log = MetricsLog(run_dir, config.wandb, config_dict={"run_dir": str(run_dir)})
    shutdown.close_later(metrics_log.close)
    progress = shutdown.enter_context(ProgressLine(config.max_steps, run.start_step, [e.name for e in config.envs]))
    _add_hooks(run, metrics_log, progress)
    shutdown.close_later(tune_interpreter(jax.default_backend()))
    run.started = True  # from here on, whatever ends the run is checkpointed
    broadcaster.start(learner.model, learner.policy_version)  # remote servers: this run's weights, before any sampling
    run.workers.start(free_running=not config.deterministic)
    if config.eval_every and run.start_step == 0:
        metrics_log.log(0, _timed_eval(run.workers, 0))  # the baseline, before any update
    return run


def _add_hooks(run: Run, metrics_log: MetricsLog, progress: ProgressLine) -> None:
    """The loop's periodic work, in the order it runs within a phase."""
    config, learner, hooks = run.config, run.learner, run.hooks
    # With LoRA the model goes with its adapters: engines merge them into their copy, servers elsewhere get them alone.
    hooks.add(lambda info: info.metrics.update(run.broadcaster.maybe_broadcast(learner.model, info.step)), every=config.broadcaster.every_k_steps, phase=LEARNED)
    hooks.add(lambda info: _measure(run, info), every=1, phase=MEASURED)
    hooks.add(lambda info: info.metrics.update(_timed_eval(run.workers, info.step)), every=config.eval_every, phase=MEASURED)

    def log(info: StepInfo) -> None:
        first = info.step == run.start_step + 1
        if first:
            run.clock.mark("first step")
            info.metrics.update(run.clock.metrics())
        metrics_log.log(info.step, info.metrics)
        progress.update(info.step, info.metrics)
        if first:
            progress.console.print(run.clock.line(info.step), highlight=False)

    hooks.add(log, every=1, phase=LOGGED)
    hooks.add(lambda info: run.save_checkpoint(), every=config.checkpoint_every, phase=PERSISTED)
    hooks.add(lambda info: learner.export(), every=config.export_hf_every, phase=PERSISTED)


def _measure(run: Run, info: StepInfo) -> None:
    """The step's metrics from every part; warns of a compilation after the first step."""
    import jax

    from marin_rl.replay import DEFAULT_MISMATCH_CAP, mismatch_metrics

    config, metrics, seconds = run.config, info.metrics, info.seconds
    policy_envs = [e.name for e in config.envs if e.algorithm.completion_source == "policy"]
    metrics.update({f"learner/{k}": v for k, v in info.learner_metrics.items()})
    metrics.update(mismatch_metrics(info.batch, run.learner.last_logprobs, policy_envs, config.learner.loss.tis_cap or DEFAULT_MISMATCH_CAP))
    metrics.update(info.batch.metrics)
    for buffer in run.buffers.values():
        metrics.update(buffer.metrics())
        buffer.flush_if_due()
    metrics.update(run.workers.metrics())
    for server in run.servers:  # engine counters, summed over the embedded engines
        for key, value in server.metrics().items():
            metrics[key] = metrics.get(key, 0.0) + value
    swaps = [server.last_swap for server in run.servers if server.last_swap is not None]
    if swaps:  # copy: the weights (device to device); wait: the server's batch in flight; the slowest
        metrics["broadcast/swap_seconds"] = max(swap.total_seconds for swap in swaps)
        metrics["broadcast/swap_copy_seconds"] = max(swap.copy_seconds for swap in swaps)
        metrics["broadcast/swap_wait_seconds"] = max(swap.wait_seconds for swap in swaps)
    run.totals["wall"] += seconds["step"]
    run.totals["wait"] += seconds["wait_data"]
    generated = sum(metrics.get(f"replays/{e.name}/new_generated_tokens", 0.0) for e in config.envs)
    metrics.update({f"time/{name}_s": value for name, value in seconds.items()})
    metrics["time/frac_waiting_for_data"] = run.totals["wait"] / run.totals["wall"]
    metrics["throughput/generated_tokens_per_s"] = generated / seconds["step"]
    counted = run.compiles.metrics()
    metrics.update(counted)
    if info.step > run.start_step + 1 and counted["compile/count"] > run.compiled:
        names = ", ".join(f"{name} ({s:.1f} s)" for name, s in run.compiles.compiled[run.compiled : counted["compile/count"]])
        logger.warning("step %d compiled %s: a shape not compiled at start", info.step, names)
    run.compiled = counted["compile/count"]
    for device in used_devices(config):  # none report memory on a CPU
        stats = device_memory_stats(jax.devices()[device]) or {}
        if "peak_bytes_in_use" in stats:
            metrics[f"memory/device{device}_peak_gib"] = stats["peak_bytes_in_use"] / 2**30


def _final_checkpoint(run: Run, ended_by: BaseException | None) -> None:
    """Whatever ended a started run, keep its latest weights; not after a NaN (the weights are NaN), a
    second Ctrl-C (stop now) or a full disk."""
    ended_by = ended_by or (run.failures[0] if run.failures else None)
    if run.started and not isinstance(ended_by, (FloatingPointError, KeyboardInterrupt, DiskFull)) and run.saved[-1:] != [run.learner.policy_version]:
        run.save_checkpoint()


def _endpoints(config: TrainConfig, servers: list, broadcaster) -> list[Endpoint]:
    """Workers in this process reach the embedded engines directly (no HTTP, no JSON); other servers over
    HTTP, and only while they serve this run's weights (their transport says)."""
    timeout = config.server.request_timeout_s
    names = ["embedded"] if len(servers) == 1 else [f"embedded{i}" for i in range(len(servers))]
    endpoints = [Endpoint(server.base_url, config.server.model_name, name, timeout, local=server.local_sampler(name)) for name, server in zip(names, servers)]
    endpoints += [
        Endpoint(transport.base_url, config.server.model_name, transport.server_id, timeout, gate=transport)
        for transport in broadcaster.transports[len(servers) :]
    ]
    return endpoints


def _timed_eval(workers: EnvWorkers, step: int) -> dict[str, float]:
    start = time.perf_counter()
    metrics = workers.evaluate(step)
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics


def embedded_server_config(config: TrainConfig, checked: CheckedRun):
    """The embedded engines' settings: the shapes its envs need compiled at start (unless
    `server.precompile_prompt_lens` names them), and with exact numerics, the exact passes in the
    learner's compute dtype (the bits of both are equal only then)."""
    server = config.server
    if not server.precompile_prompt_lens:
        import jax

        rows = server.max_prefill_rows if server.max_prefill_rows is not None else prefill_rows(config, checked.envs, checked.prompts, jax.default_backend())
        server = dataclasses.replace(server, **engine_shapes(checked.prompts, server.max_seq_len, rows))
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
