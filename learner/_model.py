"""Building, loading and exporting the policy: a Levanter `LmHeadModel` of the Llama or Qwen families."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax.state_dict import save_state_dict, to_torch_compatible_state_dict
from jax.sharding import Mesh
from levanter.layers.attention import AttentionBackend
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
from levanter.models.llama import LlamaConfig
from levanter.models.lm_model import LmHeadModel
from levanter.models.qwen import Qwen3Config, QwenConfig

from marin_rl.learner._attention import use_jax_nn_attention
from marin_rl.learner._config import ModelConfig
from marin_rl.learner._files import directory_written_atomically

_LEVANTER_CONFIGS: dict[str, type[LlamaConfig]] = {"llama": LlamaConfig, "qwen2": QwenConfig, "qwen3": Qwen3Config}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LEVANTER_BACKENDS = {
    "default": AttentionBackend.DEFAULT,
    "jax_flash": AttentionBackend.JAX_FLASH,
    "vanilla": AttentionBackend.VANILLA,
    "nvte": AttentionBackend.NVTE,
    "splash": AttentionBackend.SPLASH,
    "cudnn": None,  # ours: the attention layers are swapped after building (see _attention.py)
}
_CHECKPOINTING = {"layer": True, "none": False, "offload": "offload", "nested": "nested"}
SAFETENSORS_FILE = "model.safetensors"


def compute_dtype(model_config: ModelConfig) -> jnp.dtype:
    """The dtype of the forward/backward pass (`auto`: bfloat16 on accelerators, float32 on CPU)."""
    if model_config.compute_dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(model_config.compute_dtype)


def levanter_config(model_config: ModelConfig, hf_config=None) -> LlamaConfig:
    """The Levanter config: from `hf_config` (a transformers config) if given, else from the size fields."""
    cls = _LEVANTER_CONFIGS[model_config.family]
    if hf_config is None:
        base = cls(
            seq_len=model_config.seq_len,
            hidden_dim=model_config.hidden_dim,
            intermediate_dim=model_config.intermediate_dim,
            num_layers=model_config.num_layers,
            num_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            tie_word_embeddings=model_config.tie_word_embeddings,
            rope=DefaultRotaryEmbeddingsConfig(theta=model_config.rope_theta),
        )
    else:
        if hf_config.model_type != model_config.family:
            raise ValueError(
                f"ModelConfig.family is {model_config.family!r} but the checkpoint's config.json has "
                f"model_type {hf_config.model_type!r}"
            )
        if model_config.family == "qwen2":
            # Levanter's QwenConfig.from_hf_config reads `no_bias`, which transformers' Qwen2Config lacks.
            # Qwen2 has biases on q/k/v only (always on in Levanter's Qwen attention), none in MLP or norms.
            hf_config.no_bias = True
        base = cls.from_hf_config(hf_config)
    return dataclasses.replace(
        base,
        attn_backend=_LEVANTER_BACKENDS[model_config.attn_backend],
        flash_attention_block_size=model_config.flash_block_size,
        gradient_checkpointing=_CHECKPOINTING[model_config.gradient_checkpointing],
    )


def _with_attention_backend(model: LmHeadModel, model_config: ModelConfig) -> LmHeadModel:
    if model_config.attn_backend == "cudnn":
        return use_jax_nn_attention(model, "cudnn", model_config.cudnn_max_segments)
    return model


def cast_floating(tree, dtype):
    """Cast every floating-point array of a pytree (e.g. a model) to `dtype`; differentiable."""
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


def build_model(model_config: ModelConfig, vocab_size: int, *, key, hf_config=None) -> LmHeadModel:
    """A freshly initialised model (float32 parameters) with the sizes of `model_config` (of `hf_config`, a
    transformers config, where given): Levanter's initialisation, but token embeddings drawn from
    N(0, `initializer_range`^2) as transformers does."""
    config = levanter_config(model_config, hf_config)

    # One compiled program: eagerly, each parameter's initialiser compiled on its own (70 programs, 3.7 s
    # of the quickstart's start-up on 2 CPU cores).
    @eqx.filter_jit
    def init(key):
        model = config.build(hax.Axis("vocab", vocab_size), key=key)
        # Levanter 1.2.dev1644 ignores its configs' `initializer_range` (0.02) for embeddings: haliax draws
        # them with std 1 / hidden (0.0005 at hidden 2048). From those, a 1B model needed 35 steps to a mean
        # reward of 0.3 where the same loop from transformers' weights needed 11 (docs/performance.md).
        embeddings = model.embeddings.token_embeddings
        weight = config.initializer_range * jax.random.normal(jax.random.fold_in(key, 1), embeddings.weight.array.shape)
        return eqx.tree_at(lambda m: m.embeddings.token_embeddings.weight, model, hax.named(weight, embeddings.weight.axes))

    # It runs once: on CPU, LLVM's optimisations were 3/4 of its compilation (4.9 -> 1.4 s for the
    # quickstart's model) and change only last bits of the draws.
    if isinstance(key, jax.core.Tracer) or jax.default_backend() != "cpu":  # traced: a shape-only template
        return _with_attention_backend(init(key), model_config)
    return _with_attention_backend(init.lower(key).compile({"xla_backend_optimization_level": 0})(key), model_config)


def _single_device_mesh() -> Mesh:
    # Levanter's HF loader shards by named axes and needs a mesh with a `data` axis in scope.
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "replica", "model"))


def read_hf_config(path: str | os.PathLike):
    """The transformers config of the Hugging Face checkpoint directory `path`."""
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"ModelConfig.hf_checkpoint: no config.json in {str(path)!r}")
    return AutoConfig.from_pretrained(str(path))


def load_hf_model(path: str | os.PathLike, model_config: ModelConfig, *, tokenizer=None) -> LmHeadModel:
    """Load a local Hugging Face checkpoint directory through Levanter's converter, float32 parameters.

    `model_config.family` must match the checkpoint's `model_type`; its size fields are ignored. The
    converter needs a tokenizer: pass one, or the directory must hold one. The vocabulary keeps the
    checkpoint's size (it is not resized to the tokenizer's).
    """
    from levanter.compat.hf_checkpoints import HFCheckpointConverter

    # Absolute: Levanter's converter takes a relative path (`models/x`) for a hub repo id and goes online.
    path = Path(path).resolve()
    hf_config = read_hf_config(path)
    config = levanter_config(model_config, hf_config)
    converter = HFCheckpointConverter(
        type(config),
        reference_checkpoint=str(path),
        HfConfigClass=type(hf_config),
        tokenizer=tokenizer if tokenizer is not None else str(path),
    )
    with hax.partitioning.set_mesh(_single_device_mesh()):
        model = converter.load_pretrained(
            config.model_type,
            ref=str(path),
            config=config,
            dtype=jnp.float32,
            resize_vocab_to_match_tokenizer=False,
        )
    return _with_attention_backend(model, model_config)


def save_hf_model(model: LmHeadModel, tokenizer, path: str | os.PathLike, *, dtype=None) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config.json, model.safetensors, and the
    tokenizer when given), atomically: into a temporary sibling directory, then renamed into place.

    `dtype` casts floating-point weights (e.g. `jnp.bfloat16`); None keeps float32. Returns `path`.
    """
    with directory_written_atomically(Path(path)) as tmp:
        hf_config = model.config.to_hf_config(vocab_size=model.Vocab.size)
        hf_config.architectures = [_HF_ARCHITECTURES[hf_config.model_type]]
        hf_config.dtype = str(jnp.dtype(dtype or jnp.float32))
        hf_config.save_pretrained(str(tmp))
        state_dict = to_torch_compatible_state_dict(model)
        if dtype is not None:
            state_dict = {
                k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in state_dict.items()
            }
        save_state_dict(state_dict, str(tmp / SAFETENSORS_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(path)
