"""`ServingWeights`: the engine's own copy of a Levanter LM's weights, one module per layer.

The learner keeps its layers stacked (one array per parameter with a leading layer axis, run under a
scan). The engine unrolls its decode step over layers instead, so each layer's weights are separate
arrays: no slice of a stacked array is copied per step. The modules are Levanter's own (embedding,
decoder layers, norms), so the engine computes exactly what the learner does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from haliax import NamedArray

from marin_rl.adapters import merged
from marin_rl._upstream import layer_modules, layer_template, restore_jax_core_is_constant_dim, uses_sliding_window

restore_jax_core_is_constant_dim()


class ServingWeights(eqx.Module):
    embeddings: Any
    """Levanter's embedding module (`embed(ids)`: token embedding, plus its norm where the family has one)."""
    layers: tuple
    """One Levanter decoder layer per transformer layer, in order."""
    norm: Any
    """The final norm."""
    lm_head: NamedArray
    """[vocab, embed]; the token embedding itself when the model ties them."""
    config: Any = eqx.field(static=True)
    """The Levanter model config (attention sizes, rope)."""

    @property
    def Vocab(self):
        return self.lm_head.resolve_axis("vocab")

    @property
    def attention_config(self):
        return self.layers[0].self_attn.config

    @property
    def dtype(self):
        return self.lm_head.dtype


@dataclasses.dataclass(frozen=True)
class ModelToCome:
    """A model still being built, for an engine to start with: its `shapes` (`eqx.filter_eval_shape` of it)
    now, the model later. The engine compiles its programs from the shapes while the model is built and
    waits for it before its first device call. `arrival` resolves to whatever holds the model as `model`
    and its `policy_version` (the learner)."""

    shapes: Any
    arrival: concurrent.futures.Future

    @property
    def Pos(self):
        return self.shapes.Pos

    @property
    def Vocab(self):
        return self.shapes.Vocab


def is_weight(x) -> bool:
    """An array of the weights, or its shape and dtype where only those are known (`ModelToCome`)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def shapes_only(tree) -> bool:
    """Whether `tree` holds shapes (`jax.ShapeDtypeStruct`) where its arrays would be."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def check_supported(model) -> None:
    """Raise ValueError for models the engine's forward pass does not reproduce exactly."""
    # One layer's config, not the unstacked layers: this runs every swap.
    config = layer_template(model.transformer.layers).self_attn.config
    if config.logits_soft_cap is not None:
        raise ValueError("the generation engine does not support attention logits_soft_cap")
    if uses_sliding_window(model.config):
        raise ValueError("the generation engine does not support sliding-window attention")


def unrolled_weights(model) -> ServingWeights:
    """`model`'s weights as `ServingWeights`, without a copy (layers sliced out of the stacked arrays):
    how the learner runs the exact passes on its own model inside its step."""
    return ServingWeights(
        embeddings=model.embeddings,
        layers=layer_modules(model.transformer.layers),
        norm=model.transformer.norm,
        lm_head=model.get_lm_head().rearrange(("vocab", model.Embed)),
        config=model.config,
    )


@eqx.filter_jit
def _serving_weights(model, dtype) -> ServingWeights:
    def cast(x):
        if eqx.is_inexact_array(x) and dtype is not None:
            return x.astype(dtype)
        return x

    # Adapters merge in the same pass as the copy (no merged model in between: 8B of bf16 is 16 GB).
    weights = unrolled_weights(merged(model))
    # `+ 0` makes every leaf a fresh buffer even where no cast happens: the learner may donate or
    # overwrite its arrays after handing the model over.
    return jax.tree.map(lambda x: cast(x) + 0 if eqx.is_array(x) else x, weights)


def serving_weights(model, compute_dtype: str | None) -> ServingWeights:
    """The engine's copy of `model`'s weights, floating ones cast to `compute_dtype` (None keeps them);
    LoRA adapters on `model` are merged into it. Of a model of shapes only, their shapes."""
    check_supported(model)
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else None
    if shapes_only(model):
        return eqx.filter_eval_shape(_serving_weights, model, dtype)
    return jax.block_until_ready(_serving_weights(model, dtype))


def check_same_architecture(served: ServingWeights, new: ServingWeights) -> None:
    """Raise ValueError unless `new` has the served weights' structure, shapes and dtypes (anything else
    would recompile the engine's kernels or fail inside them)."""
    served_leaves, served_def = jax.tree.flatten(served)
    new_leaves, new_def = jax.tree.flatten(new)
    if served_def != new_def:
        raise ValueError(
            "new weights have a different model structure or config than the served model "
            f"(served config {served.config}, new config {new.config})"
        )
    for i, (a, b) in enumerate(zip(served_leaves, new_leaves)):
        if is_weight(a) != is_weight(b) or (not is_weight(a) and a != b):
            raise ValueError(f"new weights: leaf {i} is {b!r}, the served model has {a!r}")
        if is_weight(a) and (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(f"new weights: leaf {i} is {b.dtype}{list(b.shape)}, the served model has {a.dtype}{list(a.shape)}")


def jit_on_leaves(fn: Callable, template: ServingWeights, *, static_argnums: tuple[int, ...] = (), donate_argnums: tuple[int, ...] = ()):
    """`jax.jit(fn)` where `fn(weights, *args)` takes `ServingWeights`, called with `weight_leaves(weights)`
    in their place.

    A flat list of arrays is flattened by the jit's C++ dispatch; `eqx.filter_jit` re-partitions the
    whole module in Python at every call (about 1-2 ms for a 24-layer model, per prefill and per
    decode call). The non-array parts (configs, axes) come from `template`: `check_same_architecture`
    keeps every installed model's equal to them."""
    dynamic, static = eqx.partition(template, is_weight)
    treedef = jax.tree.structure(dynamic)

    def call(leaves, *args):
        return fn(eqx.combine(jax.tree.unflatten(treedef, leaves), static), *args)

    return jax.jit(call, static_argnums=static_argnums, donate_argnums=donate_argnums)


def weight_leaves(weights: ServingWeights) -> list[jax.Array]:
    """The arrays of `weights`, in the order `jit_on_leaves` takes them."""
    return jax.tree.leaves(eqx.filter(weights, is_weight))
