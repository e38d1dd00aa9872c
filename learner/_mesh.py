"""The learner's mesh: data-parallel over several devices, parameters sharded (FSDP) or replicated.

Levanter's convention: a mesh with axes (`data`, `replica`, `model`); Haliax axis mappings say which
named axis goes to which mesh axis. Batch rows are split over `data`; with FSDP the parameters and the
optimizer state are split along `embed` over the same devices (gathered layer by layer in the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from marin_rl.rl_example import BATCH_AXIS

MESH_AXES = ("data", "replica", "model")
FSDP_MAPPING = {"embed": "data"}
BATCH_MAPPING = {BATCH_AXIS: "data"}


@dataclass(frozen=True)
class LearnerMesh:
    """Where the learner's arrays live: `mesh` over its devices, parameters mapped by `param_mapping`."""

    mesh: Mesh
    param_mapping: dict[str, str]
    """Named axis -> mesh axis for parameters and optimizer state ({} replicates them)."""

    @staticmethod
    def over(devices: Sequence[jax.Device], *, fsdp: bool = True) -> LearnerMesh:
        mesh = Mesh(np.array(list(devices)).reshape(len(devices), 1, 1), MESH_AXES)
        return LearnerMesh(mesh, dict(FSDP_MAPPING) if fsdp else {})

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    def place_params(self, tree):
        """Parameters, optimizer state, a reference model: sharded by `param_mapping`, the rest replicated."""
        return place(tree, self.param_mapping, self.mesh)

    def place_batch(self, tree):
        """A batch: rows split over the data axis."""
        return place(tree, BATCH_MAPPING, self.mesh)

    def __hash__(self) -> int:  # a static argument of the jitted step
        return hash((self.mesh, tuple(sorted(self.param_mapping.items()))))


def place(tree, mapping: dict[str, str], mesh: Mesh):
    """Named arrays by `mapping` (a device put outside jit, a sharding constraint inside), other arrays
    replicated over `mesh` (plain arrays left on one device would not mix with the mesh's in a step)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def leaf(x):
        if isinstance(x, hax.NamedArray):
            return hax.shard(x, mapping, mesh=mesh)
        if eqx.is_array(x):
            inside_jit = isinstance(x, jax.core.Tracer)
            return jax.lax.with_sharding_constraint(x, replicated) if inside_jit else jax.device_put(x, replicated)
        return x

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, hax.NamedArray))
