"""What crosses process boundaries in the Ray runtime, as bytes of documented formats (not pickles):
rollouts as Arrow IPC streams of the rollout table (`marin_rl.storage`, the Parquet segments' schema),
weights as safetensors with Hugging Face parameter names (what an HF checkpoint's file holds)."""

from __future__ import annotations

import pyarrow as pa

from marin_rl.storage import rollouts_to_table, table_to_rollouts
from marin_rl.types import Rollout


def rollouts_to_bytes(rollouts: list[Rollout]) -> bytes:
    table = rollouts_to_table(rollouts)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def rollouts_from_bytes(data: bytes) -> list[Rollout]:
    return table_to_rollouts(pa.ipc.open_stream(data).read_all())


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
