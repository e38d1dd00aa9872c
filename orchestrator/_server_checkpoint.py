"""Hugging Face checkpoint I/O for the `serve` process and the broadcaster.

Temporary: the learner will export `load_hf_model(path, model_config)` / `save_hf_model(model,
tokenizer, path)`; these two functions then become calls to it.
"""

from __future__ import annotations

import json
import os

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np


def _config_class(model_type: str):
    from levanter.models.llama import LlamaConfig
    from levanter.models.qwen import Qwen3Config

    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    if model_type not in classes:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of {sorted(classes)}")
    return classes[model_type]


def load_hf_checkpoint(path: str, tokenizer, dtype: str | None = None):
    """A Levanter model from the HF checkpoint directory `path` (floating params in `dtype`, default fp32)."""
    from jax.sharding import Mesh
    from levanter.compat.hf_checkpoints import HFCheckpointConverter
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    config_class = _config_class(hf_config.model_type)
    # Upstream: the converter insists on a tokenizer (else it asks the hub for one), and load_pretrained
    # needs a mesh with a `data` axis in scope.
    converter = HFCheckpointConverter(
        config_class, reference_checkpoint=path, HfConfigClass=type(hf_config), tokenizer=tokenizer
    )
    config = config_class.from_hf_config(hf_config)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "replica", "model"))
    with hax.partitioning.set_mesh(mesh):
        return converter.load_pretrained(
            config.model_type, ref=path, config=config, dtype=jnp.dtype(dtype or "float32"), resize_vocab_to_match_tokenizer=False
        )


def save_hf_checkpoint(model, tokenizer, path: str) -> None:
    """Write `model` (+ tokenizer) to `path` as config.json + model.safetensors."""
    from haliax.state_dict import to_torch_compatible_state_dict
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: np.asarray(v) for k, v in to_torch_compatible_state_dict(model).items()}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf_config = model.config.to_hf_config(model.Vocab.size)
    hf_config.architectures = [f"{type(hf_config).__name__.removesuffix('Config')}ForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config.to_dict(), f, indent=2)
    tokenizer.save_pretrained(path)
