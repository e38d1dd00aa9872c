"""LoRA on a Levanter model (`levanter.lora`): which parameters a step trains, and the plain model the
engines and exports get.

With adapters, only their arrays are trained (gradients, optimizer state) and checkpointed (with a
fingerprint of the base they belong to); everywhere a model leaves the learner (an engine's swap, a
remote server, an HF export) it goes merged: W + (alpha / r) B A, a plain model of the base's
architecture. `save_peft_adapter` writes the adapters alone, as a PEFT adapter directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.lora import LoraConfig as LevanterLoraConfig
from levanter.lora import LoraLinear, is_lora_param, loraize, save_peft_pretrained

from marin_rl.learner._files import directory_written_atomically
from marin_rl.learner._model import cast_floating

from marin_rl.learner._config import LoraConfig


def _levanter_config(config: LoraConfig) -> LevanterLoraConfig:
    alpha = config.rank if config.alpha is None else config.alpha
    return LevanterLoraConfig(target_modules=config.target_modules, r=config.rank, alpha=alpha, dropout=config.dropout)


def add_adapters(model, config: LoraConfig, *, key):
    """`model` with adapters on the linear layers of its transformer blocks (never the LM head).
    Levanter starts B at zero, so the adapted model computes what `model` does."""
    return dataclasses.replace(model, transformer=loraize(model.transformer, _levanter_config(config), key))


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


def with_frozen_base_in(model, dtype):
    """`model` with its frozen floating-point arrays (all but the adapters) stored in `dtype`. The step
    only ever uses them cast to its compute dtype, so storing them cast changes no result, and a bf16
    run holds its base in half the memory, with no cast of it at every step."""
    trained, frozen = eqx.partition(model, trainable_spec(model))
    return eqx.combine(trained, cast_floating(frozen, dtype))


@jax.jit
def _sums_of_magnitudes(leaves):
    return jnp.stack([jnp.sum(jnp.abs(leaf.astype(jnp.float32))) for leaf in leaves])


def base_fingerprint(model) -> list[float]:
    """The sum of |w| of each frozen floating-point array of `model`: which base its adapters were
    trained on (a checkpoint of adapters alone resumes only onto it). One reduction per array."""
    _, frozen = eqx.partition(model, trainable_spec(model))
    return [float(x) for x in _sums_of_magnitudes(jax.tree.leaves(eqx.filter(frozen, eqx.is_inexact_array)))]


def adapter_module_names(model) -> list[str]:
    """Names of the linear layers that carry adapters (`q_proj`, ...), as PEFT's `target_modules`."""
    paths = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda node: isinstance(node, LoraLinear))[0]
    return sorted({path[-1].name for path, node in paths if isinstance(node, LoraLinear)})


def save_peft_adapter(model, config: LoraConfig, base_model_name_or_path: str | None, path: str | Path, tokenizer=None) -> Path:
    """Write the adapters of `model` as a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the Hugging Face base,
    atomically (a temporary sibling renamed into place). Returns `path`."""
    # PEFT reads a null target_modules as its per-architecture default (q_proj and v_proj only).
    levanter_config = dataclasses.replace(_levanter_config(config), target_modules=adapter_module_names(model))
    with directory_written_atomically(Path(path)) as tmp:
        # Levanter's own prefix is for a bare transformer; this is the whole LM-head model.
        save_peft_pretrained(model, levanter_config, base_model_name_or_path, str(tmp), tokenizer, prefix="base_model.model")
    return Path(path)


@hax.named_jit  # as Levanter's `merge_lora_modules`: sharded parameters merge where they live
def merged_model(model):
    """`model` with each adapter merged into its layer's weight (W + scale * B A), in W's axis order and
    dtype: a plain model with the base's arrays, shape for shape."""

    def merge(module):
        if not isinstance(module, LoraLinear):
            return module
        weight = module.wrapped.weight
        merged = (weight + module.lora.merge()).rearrange(weight.axes)
        return dataclasses.replace(module.wrapped, weight=merged.astype(weight.dtype))

    return jax.tree.map(merge, model, is_leaf=lambda node: isinstance(node, LoraLinear))
