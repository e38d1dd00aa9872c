"""`RayRuntime`: a run's Ray cluster and actors, seen from the driver (where the learner, the replay
buffers and the batcher stay).

- Server actors: their `RayServerTransport`s join the broadcaster, which pushes every version to all
  of them and waits for each to confirm it; one that died is restarted by Ray and brought the newest
  version by its transport's watcher before env workers sample from it again.
- Env-worker actors: `RayEnvWorkers` has `EnvWorkers`' interface for the train loop; a thread collects
  the actors' finished rollouts into the replay buffers and sends them the buffers' sizes and each
  server's sampling window. An actor Ray restarted starts again from its shard's last positions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from marin_rl.broadcaster import BytesExports, CheckpointExports
from marin_rl.distributed._actors import EnvWorkerActor, ServerActor
from marin_rl.distributed._transport import RayServerTransport
from marin_rl.distributed._wire import rollouts_from_bytes
from marin_rl.errors import PermanentError

if TYPE_CHECKING:  # the config imports this package's configs
    from marin_rl.config import TrainConfig

logger = logging.getLogger(__name__)

COLLECT_WAIT_S = 0.2
"""How long an env-worker actor holds a collection open waiting for rollouts."""


class RayRuntime:
    def __init__(self, config: TrainConfig, model, tokenizer, run_dir: Path):
        """Start a local cluster (or join `config.ray.address`) and the server actors."""
        self.config = config
        settings = config.ray
        self._own_cluster = not ray.is_initialized()
        if self._own_cluster:
            _init_cluster(settings)
        self.namespace = actor_namespace(run_dir)
        gpu = settings.server_num_gpus > 0
        server = ray.remote(ServerActor)
        resources = dict(num_gpus=settings.server_num_gpus, num_cpus=settings.server_num_cpus, max_restarts=settings.max_restarts)
        self.servers = [
            server.options(name=f"server{i}", namespace=self.namespace, **resources).remote(
                config.server,
                model.config,
                model.Vocab.size,
                config.tokenizer,
                port=settings.server_port + i,
                gpu=gpu,
                compilation_cache=config.compilation_cache,
            )
            for i in range(settings.num_servers)
        ]
        urls = ray.get([actor.base_url.remote() for actor in self.servers])
        broadcast = config.broadcaster
        if settings.weight_transfer == "object_store":
            exports = BytesExports(broadcast.export_dtype, keep=broadcast.keep_exports, put=ray.put)
        else:
            directory = broadcast.export_dir or str(run_dir / "hf")
            exports = CheckpointExports(directory, tokenizer, export_dtype=broadcast.export_dtype, keep=broadcast.keep_exports)
        self.transports = [
            RayServerTransport(
                actor,
                url,
                exports,
                server_id=f"ray{i}",
                timeout_s=broadcast.confirm_timeout_s,
                max_backoff_s=broadcast.reconnect_max_backoff_s,
            )
            for i, (actor, url) in enumerate(zip(self.servers, urls))
        ]
        self.workers: RayEnvWorkers | None = None

    def env_workers(self, buffers, endpoints, *, positions: Mapping[str, int] | None, on_failure) -> RayEnvWorkers:
        """`ray.num_env_workers` actors sampling from `endpoints` into `buffers` (started by `start`)."""
        settings = self.config.ray
        worker = ray.remote(EnvWorkerActor)
        resources = dict(num_cpus=settings.env_worker_num_cpus, max_restarts=settings.max_restarts)
        specs = [(e.base_url, e.server_id, None if e.gate is None else "actor" if isinstance(e.gate, RayServerTransport) else "remote") for e in endpoints]
        count = settings.num_env_workers
        actors = [
            worker.options(name=f"env_worker{i}", namespace=self.namespace, **resources).remote(self.config, i, count, specs)
            for i in range(count)
        ]
        self.workers = RayEnvWorkers(actors, buffers, [e.gate for e in endpoints], positions=positions or {}, on_failure=on_failure)
        return self.workers

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        for actor in self.servers:
            ray.kill(actor)
        if self._own_cluster:
            ray.shutdown()


def actor_namespace(run_dir: Path) -> str:
    """The Ray namespace of a run's actors (`server{i}`, `env_worker{i}`): `ray list actors` shows them."""
    return f"marin-rl:{Path(run_dir).resolve()}"


def _init_cluster(settings) -> None:
    """Join `settings.address`, or start a local cluster with room for every actor on this machine."""
    common = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    needed = settings.num_servers * settings.server_num_cpus + settings.num_env_workers * settings.env_worker_num_cpus
    memory = None if settings.object_store_mb is None else settings.object_store_mb * 2**20
    with warnings.catch_warnings():
        # JAX warns at every fork of a process that loaded it; Ray's fork is followed by an exec at once.
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        if settings.address is not None:
            ray.init(address=settings.address, **common)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 1)), object_store_memory=memory, **common)


class RayEnvWorkers:
    """The env-worker actors with `EnvWorkers`' interface (start, stop, positions, metrics, evaluate)."""

    def __init__(self, actors, buffers, gates, *, positions: Mapping[str, int], on_failure: Callable[[PermanentError], None]):
        self.actors, self.buffers, self.gates = actors, dict(buffers), gates
        self._actor_positions = [dict(positions) for _ in actors]  # each actor's next positions, as last reported
        self._actor_metrics: list[dict[str, float]] = [{} for _ in actors]
        self._counts: Counter[str] = Counter()
        self._on_failure = on_failure
        self.failure: PermanentError | None = None
        self.restarts = 0
        """Env-worker actors restarted by Ray (and started again) during the run."""
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, free_running: bool = True) -> RayEnvWorkers:
        if not free_running:
            raise ValueError("the Ray runtime's env workers only run free (deterministic runs need runtime local)")
        ray.get([actor.start.remote(positions, self._windows()) for actor, positions in zip(self.actors, self._actor_positions)])
        self._thread = threading.Thread(target=self._collect_loop, name="marin-rl-ray-collector", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout)
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=timeout)
            except ray.exceptions.RayError:
                pass  # dead already: nothing to stop
            ray.kill(actor)
        self._thread = None

    def positions(self) -> dict[str, int]:
        """Per env, the first position not drawn yet by every actor: all positions below it were drawn."""
        with self._lock:
            return {name: min(p.get(name, 0) for p in self._actor_positions) for name in self.buffers}

    def metrics(self) -> dict[str, float]:
        """The actors' counters summed, with the rollouts the driver's buffers rejected."""
        with self._lock:
            total: Counter[str] = Counter()
            for metrics in self._actor_metrics:
                total.update(metrics)
            total.update(self._counts)
            total["workers/actor_restarts"] = self.restarts
            return {key: float(value) for key, value in total.items()}

    def evaluate(self, step: int = 0) -> dict[str, float]:
        return ray.get(self.actors[0].evaluate.remote(step))

    # ---- the collector ----

    def _collect(self, index: int):
        ahead = {name: buffer.tokens_ahead() for name, buffer in self.buffers.items()}
        return self.actors[index].collect.remote(ahead, self._windows(), COLLECT_WAIT_S)

    def _windows(self) -> list:
        return [None if gate is None else gate.sampling_window() for gate in self.gates]

    def _collect_loop(self) -> None:
        pending = {self._collect(i): i for i in range(len(self.actors))}
        while not self._stopping.is_set():
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                index = pending.pop(ref)
                try:
                    self._absorb(index, ray.get(ref))
                except ray.exceptions.RayError as e:  # died: Ray restarts it; its next answer says so
                    logger.warning("env-worker actor %d: %s", index, type(e).__name__)
                    time.sleep(0.5)
                pending[self._collect(index)] = index

    def _absorb(self, index: int, reply: dict) -> None:
        if not reply["started"]:  # restarted by Ray: continue its shard where it was
            self.restarts += 1
            logger.warning("env-worker actor %d was restarted; it continues from %s", index, self._actor_positions[index])
            ray.get(self.actors[index].start.remote(self._actor_positions[index], self._windows()))
            return
        for name, data in reply["rollouts"].items():
            rollouts = rollouts_from_bytes(data)
            accepted = self.buffers[name].add(rollouts)
            with self._lock:
                self._counts[f"workers/{name}/rollouts_rejected"] += len(rollouts) - accepted
        for server, version, above in reply["stale"]:
            window = self.gates[server].sampling_window()
            if above and window is not None and version <= window[1]:
                continue  # pushed after the actor's window was shipped: not a restart
            self.gates[server].report_stale(version)
        with self._lock:
            self._actor_positions[index] = reply["positions"]
            self._actor_metrics[index] = reply["metrics"]
        if reply["failure"] and self.failure is None:
            self.failure = PermanentError(reply["failure"])
            self._on_failure(self.failure)
