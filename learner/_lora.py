"""LoRA in the learner (`levanter.lora`): which parameters a step trains, and how its adapters are saved.

With adapters, only their arrays are trained (gradients, optimizer state) and checkpointed (with a
fingerprint of the base they belong to). Servers get the adapted model: the colocated engine merges it
into its own copy of the weights, servers elsewhere get the adapters alone (`marin_rl.adapters`). An HF
export is merged (W + (alpha / r) B A); `save_peft_adapter` writes the adapters as a PEFT directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
from levanter.lora import LoraConfig as LevanterLoraConfig
from levanter.lora import is_lora_param, loraize, save_peft_pretrained

from marin_rl.adapters import adapter_module_names, has_adapters
from marin_rl.learner._config import LoraConfig
from marin_rl.learner._files import directory_written_atomically
from marin_rl.learner._model import cast_floating


def _levanter_config(config: LoraConfig) -> LevanterLoraConfig:
    alpha = config.rank if config.alpha is None else config.alpha
    return LevanterLoraConfig(target_modules=config.target_modules, r=config.rank, alpha=alpha, dropout=config.dropout)


def add_adapters(model, config: LoraConfig, *, key):
    """`model` with adapters on the linear layers of its transformer blocks (never the LM head).
    Levanter starts B at zero, so the adapted model computes what `model` does."""
    return dataclasses.replace(model, transformer=loraize(model.transformer, _levanter_config(config), key))


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
