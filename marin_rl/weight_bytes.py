"""Whole weights as safetensors bytes with Hugging Face parameter names (what an HF checkpoint's file
holds): what the broadcaster sends to Ray's server actors and to `POST /v1/weights/upload`, with no
checkpoint written. Floating parameters may be cast on the way (`bfloat16` halves them)."""

from __future__ import annotations

import functools


def weights_to_bytes(model, dtype: str | None = None) -> bytes:
    """`model`'s parameters as safetensors bytes, floating ones cast to `dtype` (None keeps them)."""
    import equinox as eqx
    import jax
    import safetensors.flax  # bfloat16 included (safetensors' numpy loader has no bfloat16)
    from haliax.state_dict import flatten_modules_for_export, to_state_dict

    if dtype is not None:  # on the device, in one program: half the bytes come to the host, none cast there
        model = _cast_program(dtype)(model)
    # haliax's to_torch_compatible_state_dict copies each array to the host in turn (8.6 s for a 1B
    # model's 2.1 GB of bfloat16 on an H200); one device_get overlaps the copies.
    state = to_state_dict(flatten_modules_for_export(eqx.filter(model, eqx.is_array)))
    return safetensors.flax.save(jax.device_get(state))


@functools.cache
def _cast_program(dtype: str):
    """`cast_floating` jitted, one program per dtype, kept: a new function at every push would trace and
    compile again."""
    import equinox as eqx
    import jax.numpy as jnp

    from marin_rl.learner import cast_floating

    target = jnp.dtype(dtype)
    return eqx.filter_jit(lambda model: cast_floating(model, target))


def weights_from_bytes(data: bytes, template):
    """A model shaped like `template` (a model, or `eqx.filter_eval_shape` of one) holding the weights
    in `data`; ValueError naming the parameter when a name or shape does not match."""
    import jax.numpy as jnp
    from haliax.state_dict import from_torch_compatible_state_dict

    from marin_rl.adapters import safetensors_arrays

    # As JAX arrays (on the default device): given numpy arrays, haliax shards them by a mesh in scope.
    state = {name: jnp.asarray(array) for name, array in safetensors_arrays(data)}
    try:
        return from_torch_compatible_state_dict(template, state)
    except (KeyError, ValueError) as e:
        raise ValueError(f"the weights do not fit the served model: {type(e).__name__}: {e}") from e
