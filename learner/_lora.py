"""LoRA on a Levanter model (`levanter.lora`): which parameters a step trains, and the plain model the
engines and exports get.

With adapters, only their arrays are trained (gradients, optimizer state); everywhere a model leaves
the learner (an engine's swap, a remote server, an HF export) it goes merged: W + (alpha / r) B A, a
plain model of the base's architecture.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
from levanter.lora import LoraConfig as LevanterLoraConfig
from levanter.lora import LoraLinear, is_lora_param, loraize

from marin_rl.learner._config import LoraConfig


def add_adapters(model, config: LoraConfig, *, key):
    """`model` with adapters on the linear layers of its transformer blocks (never the LM head).
    Levanter starts B at zero, so the adapted model computes what `model` does."""
    alpha = config.rank if config.alpha is None else config.alpha
    levanter_config = LevanterLoraConfig(target_modules=config.target_modules, r=config.rank, alpha=alpha, dropout=config.dropout)
    return dataclasses.replace(model, transformer=loraize(model.transformer, levanter_config, key))


def has_adapters(model) -> bool:
    return any(isinstance(node, LoraLinear) for node in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoraLinear)))


def trainable_spec(model):
    """The filter of the parameters a step trains: the adapters' where there are any, else every
    floating-point array."""
    if not has_adapters(model):
        return eqx.is_inexact_array
    return jax.tree.map(is_lora_param, model, is_leaf=is_lora_param)


def trainable_params(model):
    """The trained arrays of `model` (None elsewhere): what gradients and optimizer state are shaped like."""
    return eqx.filter(eqx.filter(model, trainable_spec(model)), eqx.is_inexact_array)


@hax.named_jit  # as Levanter's `merge_lora_modules`: sharded parameters merge where they live
def merged_model(model):
    """`model` with each adapter merged into its layer's weight (W + scale * B A), in W's axis order: a
    plain model with the base's arrays, shape for shape."""

    def merge(module):
        if not isinstance(module, LoraLinear):
            return module
        weight = module.wrapped.weight
        return dataclasses.replace(module.wrapped, weight=(weight + module.lora.merge()).rearrange(weight.axes))

    return jax.tree.map(merge, model, is_leaf=lambda node: isinstance(node, LoraLinear))
