"""`train(config)`: the RL loop of `marin-rl train`.

env workers -> replay buffers -> batcher -> learner -> broadcaster -> server -> env workers.
The learner, the embedded server and the env workers share one process: workers sample on a
background event loop while the learner trains; each new policy is swapped into the server in
place. Read top to bottom: set up, loop, shut down.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from marin_rl.config import TrainConfig, dump_config
from marin_rl.orchestrator._metrics import MetricsLog, ProgressLine
from marin_rl.orchestrator._preflight import RUN_CONFIG, CheckedRun, check_run, check_run_dir, holds_run
from marin_rl.orchestrator._workers import Endpoint, EnvWorkers, WorkerSpec

logger = logging.getLogger(__name__)


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
    """Train until `config.max_steps` or until `stop` is set; always flushes rollouts and checkpoints.

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
    # Heavy imports after the config is known to be good.
    import jax

    from marin_rl.learner import Learner
    from marin_rl.orchestrator._inference_server import PolicyServer
    from marin_rl.replay import BatchCancelled, Batcher, ReplayBuffer, effective_shares

    # --- set up
    tokenizer = checked.tokenizer
    learner = Learner(config.learner, config.model, run_dir, tokenizer, key=jax.random.key(config.seed))
    if resume:
        learner.restore_latest()
        logger.info("resuming at policy version %d", learner.policy_version)
    server = PolicyServer(config.server, learner.model, tokenizer, policy_version=learner.policy_version).start()
    broadcaster = config.broadcaster.build(colocated=server, tokenizer=tokenizer, run_dir=str(run_dir))
    if resume and len(broadcaster.transports) > 1:
        broadcaster.maybe_broadcast(learner.model, learner.policy_version)  # remote servers start from the checkpoint
    buffers = {
        env.name: ReplayBuffer(
            env.name,
            env.buffer,
            algorithm=env.algorithm,
            run_dir=run_dir,
            max_seq_len=config.batcher.max_seq_len,
            overlong=config.batcher.overlong,
        )
        for env in config.envs
    }
    batcher = Batcher(buffers, config.fractions, config.batcher)
    envs = checked.envs
    budget = config.batcher.num_rows * config.batcher.max_seq_len
    # Each env buffers up to max_buffered_batches of its share (an env with fraction 0 lives on the
    # remainder, so it gets an even share for this purpose).
    shares = effective_shares(config.fractions, list(config.fractions))
    buffered_share = {name: max(share, 1 / len(shares)) for name, share in shares.items()}
    specs = {
        e.name: WorkerSpec.for_algorithm(
            e.algorithm,
            replicas=e.replicas,
            group_size=e.group_size,
            sampling=e.sampling,
            reward_weights=e.reward_weights,
            max_turns=e.max_turns,
            verifier_timeout_s=e.verifier_timeout_s,
            max_buffered_tokens=int(config.max_buffered_batches * buffered_share[e.name] * budget),
            max_total_tokens=config.batcher.max_seq_len,
            eval=e.eval,
        )
        for e in config.envs
    }
    endpoints = [Endpoint(server.base_url, config.server.model_name, "embedded", config.server.request_timeout_s)]
    endpoints += [
        Endpoint(url, config.server.model_name, f"remote{i}", config.server.request_timeout_s)
        for i, url in enumerate(config.broadcaster.remote_servers)
    ]
    workers = EnvWorkers(envs, specs, buffers, endpoints, seed=config.seed, max_backoff_s=config.worker_max_backoff_s)
    metrics_log = MetricsLog(run_dir, config.wandb, config_dict={"run_dir": str(run_dir)})

    start_step = learner.policy_version
    totals: dict[str, float] = defaultdict(float)
    step = start_step
    stopped_early = False
    workers.start()
    try:
        with ProgressLine(config.max_steps, start_step, [e.name for e in config.envs]) as progress:
            if config.eval_every and start_step == 0:
                metrics_log.log(0, _timed_eval(workers))  # the baseline, before any update
            while step < config.max_steps:
                # --- data: wait for a full batch of fresh-enough rollouts
                t0 = time.perf_counter()
                try:
                    batch = batcher.next_batch(learner.policy_version, cancel=stop)
                except BatchCancelled:
                    stopped_early = True
                    break
                t1 = time.perf_counter()

                # --- learn: one optimizer step makes policy version step + 1
                learner_metrics = learner.step(batch.to_example())
                step = learner.policy_version
                t2 = time.perf_counter()

                # --- broadcast: the servers sample from the new policy from their next batch on
                broadcast_metrics = broadcaster.maybe_broadcast(learner.model, step)
                t3 = time.perf_counter()

                # --- log
                metrics = {f"learner/{k}": v for k, v in learner_metrics.items()}
                metrics.update(batch.metrics)
                metrics.update(broadcast_metrics)
                for buffer in buffers.values():
                    metrics.update(buffer.metrics())
                    buffer.flush_if_due()
                metrics.update(workers.metrics())
                if server.last_swap is not None:  # copy: the weights; wait: the server's batch in flight
                    metrics["broadcast/swap_seconds"] = server.last_swap.total_seconds
                    metrics["broadcast/swap_copy_seconds"] = server.last_swap.copy_seconds
                    metrics["broadcast/swap_wait_seconds"] = server.last_swap.wait_seconds
                totals["wall"] += t3 - t0
                totals["wait"] += t1 - t0
                generated = sum(metrics.get(f"replays/{e.name}/new_generated_tokens", 0.0) for e in config.envs)
                if config.eval_every and step % config.eval_every == 0:
                    metrics.update(_timed_eval(workers))
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
                metrics_log.log(step, metrics)
                progress.update(step, metrics)

                # --- persist
                if step % config.checkpoint_every == 0:
                    learner.save_checkpoint()
                if config.export_hf_every and step % config.export_hf_every == 0:
                    learner.export_hf()
                if stop.is_set():
                    stopped_early = step < config.max_steps
                    break
    finally:
        # Whatever ended the loop, keep what was produced: rollouts on disk, the latest weights.
        workers.stop()
        for buffer in buffers.values():
            buffer.close()
        metrics_log.close()
        server.shutdown()
    if learner.policy_version > start_step or not any((run_dir / "checkpoints").glob("step-*")):
        learner.save_checkpoint()
    learner.export_hf()
    return TrainResult(run_dir, learner.policy_version, stopped_early)


def _timed_eval(workers: EnvWorkers) -> dict[str, float]:
    start = time.perf_counter()
    metrics = workers.evaluate()
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics
