"""Workarounds for upstream behaviour, one place each; drop one when a pinned release fixes it."""

import warnings

import jax

# haliax 1.4.dev453 calls `jax.core.is_constant_dim`, which JAX 0.11 removed from the public `jax.core`
# (it still lives in `jax._src.core`). The GPU image runs JAX 0.11; the CPU pin (0.10.2) still has it,
# behind a DeprecationWarning that looking it up would raise.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    _has_is_constant_dim = hasattr(jax.core, "is_constant_dim")
if not _has_is_constant_dim:
    import jax._src.core

    jax.core.is_constant_dim = jax._src.core.is_constant_dim
