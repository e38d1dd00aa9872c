"""Past one device: placement on one host's devices, and the Ray runtime (docs/distributed.md).

Its configs are `marin_rl.runtime_config`'s; the runtime (JAX, Ray) loads on first use.
"""

from marin_rl._lazy import lazy_attributes

_LAZY = {
    "Placement": "_placement",
    "RayRuntime": "_runtime",
    "ServerActor": "_actors",
    "EnvWorkerActor": "_actors",
    "RayServerTransport": "_transport",
    "rollouts_from_bytes": "_wire",
    "rollouts_to_bytes": "_wire",
}

__all__ = [*_LAZY]


__getattr__ = lazy_attributes(__name__, _LAZY)
