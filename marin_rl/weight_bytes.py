"""Whole weights as safetensors bytes with Hugging Face parameter names (what an HF checkpoint's file
holds): what the broadcaster sends to Ray's server actors and to `POST /v1/weights/upload`, with no
checkpoint written. Floating parameters may be cast on the way (`bfloat16` halves them)."""

from __future__ import annotations


def weights_to_bytes(model, dtype: str | None = None) -> bytes:
    """`model`'s parameters as safetensors bytes, floating ones cast to `dtype` (None keeps them)."""
    import jax.numpy as jnp
    import safetensors.flax  # JAX arrays, bfloat16 included (safetensors' numpy loader has no bfloat16)
    from haliax.state_dict import to_torch_compatible_state_dict

    state = to_torch_compatible_state_dict(model)
    if dtype is not None:
        state = {k: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in state.items()}
    return safetensors.flax.save(state)


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
