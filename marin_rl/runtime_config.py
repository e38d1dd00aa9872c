"""Configs of placement on one host's devices and of the Ray runtime (`marin_rl.distributed` runs them).

Here, not in that package: the run's config holds them, and that package's runtime reads the run's
config."""

from __future__ import annotations

from dataclasses import dataclass, field

RUNTIMES = ("local", "ray")
WEIGHT_TRANSFERS = ("object_store", "checkpoint")


@dataclass(frozen=True)
class PlacementConfig:
    """Which devices of this host the learner and the embedded inference engines use (local runtime)."""

    learner_devices: list[int] = field(default_factory=lambda: [0])
    """Indices into `jax.devices()` that the learner's mesh spans. More than one: data-parallel (each
    device takes an equal share of the batch rows), parameters sharded or not as `fsdp` says."""
    fsdp: bool = True
    """Shard parameters and optimizer state along `embed` over the learner's devices (FSDP); false
    replicates them (plain data parallelism: more memory, no gathers)."""
    server_devices: list[int] | None = None
    """One embedded inference engine per entry, on that device. None: one, on the learner's first
    device (colocated: they take turns on it). []: none (only `broadcaster.remote_servers`)."""
    device_memory_gib: float | None = None
    """Memory of each device the run may use, in GiB: a run whose resident memory (estimated from the
    config: orchestrator/_memory.py) exceeds it is refused at start, with the numbers. None: what the
    device reports (a GPU's allocator limit; a CPU reports none, so nothing is checked there)."""

    def __post_init__(self):
        for name in ("learner_devices", "server_devices"):
            devices = getattr(self, name) or []
            if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
                raise ValueError(f"placement.{name} must be distinct device indices >= 0, got {devices}")
        if not self.learner_devices:
            raise ValueError("placement.learner_devices must name at least one device")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ValueError(f"placement.device_memory_gib must be > 0, got {self.device_memory_gib}")

    @property
    def engines(self) -> list[int]:
        """The device index of each embedded engine."""
        return [self.learner_devices[0]] if self.server_devices is None else list(self.server_devices)

    @property
    def data_parallel(self) -> int:
        return len(self.learner_devices)


@dataclass(frozen=True)
class RayConfig:
    """The Ray runtime (`runtime: ray`): inference servers and env workers as Ray actors, the learner,
    replay buffers and batcher in the driver (docs/distributed.md)."""

    address: str | None = None
    """Cluster to join (`auto`, or `HOST:PORT` of its head); None starts a local cluster for this run."""
    num_servers: int = 1
    """Inference server actors, each an engine behind the OpenAI API on its own node port."""
    server_num_gpus: float = 0.0
    """GPUs each server actor asks Ray for (1 on a GPU cluster: one engine per GPU); 0: CPU actors."""
    server_num_cpus: float = 1.0
    """CPUs each server actor asks Ray for."""
    server_port: int = 8100
    """Server actor i listens on port `server_port + i` of its node, also after Ray restarts it, so env
    workers reach it at the same address."""
    num_env_workers: int = 1
    """Env-worker actors. Each runs every env with ceil(`replicas` / num_env_workers) workers and draws
    its own share of every env's problem stream (positions i, i + num_env_workers, ...)."""
    env_worker_num_cpus: float = 1.0
    """CPUs each env-worker actor asks Ray for."""
    weight_transfer: str = "object_store"
    """How new weights reach the server actors: `object_store` (safetensors bytes put once into Ray's
    object store, fetched by every server) or `checkpoint` (an HF checkpoint written to
    `broadcaster.export_dir`, which every node must see at the same path)."""
    max_restarts: int = 10
    """Times Ray restarts a server or env-worker actor that died; a restarted server gets the current
    weights before it serves again."""
    object_store_mb: int | None = None
    """Object-store size of a local cluster started for this run (None: Ray's default, 30% of memory)."""

    def __post_init__(self):
        for name in ("num_servers", "num_env_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"ray.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("server_num_gpus", "server_num_cpus", "env_worker_num_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"ray.{name} must be >= 0, got {getattr(self, name)}")
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"ray.weight_transfer must be one of {WEIGHT_TRANSFERS}, got {self.weight_transfer!r}")
        if not (0 < self.server_port and self.server_port + self.num_servers <= 65536):
            raise ValueError(f"ray.server_port must leave room for {self.num_servers} ports below 65536, got {self.server_port}")
        if self.max_restarts < 0:
            raise ValueError(f"ray.max_restarts must be >= 0, got {self.max_restarts}")
