"""Past one device: placement on one host's devices, and the Ray runtime (docs/distributed.md).

The configs import eagerly; the runtime (JAX, Ray) loads on first use.
"""

import importlib

from marin_rl.distributed._config import PlacementConfig, RayConfig

_LAZY = {
    "Placement": "_placement",
    "RayRuntime": "_runtime",
    "ServerActor": "_actors",
    "EnvWorkerActor": "_actors",
    "RayServerTransport": "_transport",
    "rollouts_from_bytes": "_wire",
    "rollouts_to_bytes": "_wire",
    "weights_from_bytes": "_wire",
    "weights_to_bytes": "_wire",
}

__all__ = ["PlacementConfig", "RayConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"marin_rl.distributed.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'marin_rl.distributed' has no attribute {name!r}")
