"""`Placement`: a run's placement config resolved to this host's JAX devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from marin_rl.errors import ConfigError
from marin_rl.learner import LearnerMesh

if TYPE_CHECKING:  # the config imports this package's configs
    from marin_rl.config import TrainConfig


@dataclass(frozen=True)
class Placement:
    learner_devices: list
    engine_devices: list
    """One per embedded engine."""
    learner_mesh: LearnerMesh | None
    """None: the learner stays on JAX's default device (the single-device run)."""

    @staticmethod
    def of(config: TrainConfig) -> Placement:
        """ConfigError naming the key when a device index is not one of `jax.devices()`."""
        devices = jax.devices()

        def pick(indices: list[int], key: str) -> list:
            missing = [i for i in indices if i >= len(devices)]
            if missing:
                raise ConfigError(f"placement.{key}: no device {missing} on this host, which has {len(devices)} ({devices[0].platform})")
            return [devices[i] for i in indices]

        placement = config.placement
        learner = pick(placement.learner_devices, "learner_devices")
        engines = pick(config.embedded_devices, "server_devices")
        mesh = None if learner == devices[:1] else LearnerMesh.over(learner, fsdp=placement.fsdp)
        return Placement(learner, engines, mesh)

    def shares_learner_device(self, device) -> bool:
        """An engine on one of the learner's devices takes turns with it (the device lock)."""
        return device in self.learner_devices
