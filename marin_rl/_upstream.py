"""Every use of a dependency's private or version-dependent interface, one place each.

Each entry names the release it was checked against (pyproject.toml pins them);
tests/marin_rl/test_upstream.py fails when one of them changes. Dependencies are imported inside the
functions: importing this module loads nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

# --- jax 0.10.2 (CPU pin), 0.11 (GPU image) ---------------------------------------------------------


def restore_jax_core_is_constant_dim() -> None:
    """haliax 1.4.dev453 calls `jax.core.is_constant_dim`, which JAX 0.11 removed from the public
    `jax.core` (it still lives in `jax._src.core`); 0.10.2 still has it, behind a DeprecationWarning
    that looking it up would raise. Call before any haliax call."""
    import jax

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        present = hasattr(jax.core, "is_constant_dim")
    if not present:
        import jax._src.core

        jax.core.is_constant_dim = jax._src.core.is_constant_dim


# --- transformers 4.57.6 -------------------------------------------------------------------------------


def transformers_without_torch() -> None:
    """Keep torch out of this process's transformers (nothing here uses it): `USE_TORCH=0` unless the user
    set it, and, with it off, torchvision marked absent. transformers' `image_utils` (reached from
    levanter's HF checkpoint module) imports torchvision wherever it is installed, USE_TORCH or not, and
    torchvision imports torch: 10 s of a GPU run's start-up where the image ships both. Call before
    transformers is imported."""
    import importlib.util
    import os

    if os.environ.setdefault("USE_TORCH", "0").upper() not in ("0", "OFF", "NO", "FALSE"):
        return
    if importlib.util.find_spec("torchvision") is not None:
        import transformers.utils.import_utils as import_utils

        import_utils._torchvision_available = False


CUDNN_ATTENTION_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
"""jax 0.10.2: cuDNN attention with per-row segment lists, which `jax.nn.dot_product_attention` (one
length per row) does not expose. Ships in the CPU jaxlib too (it only fails when called)."""


def cudnn_packed_attention(q, k, v, lengths, starts, scale: float):
    """cuDNN flash attention `[batch, position, heads, head]` within each row's segments, given as
    (lengths, starts) lists (`learner._attention.segment_layout`); Hopper or later."""
    import importlib

    cudnn = importlib.import_module(CUDNN_ATTENTION_MODULE)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts,
        scale=scale, mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
    )


def compute_capability(device) -> str | None:
    """jax 0.10.2: only GPU devices have `compute_capability` (such as "9.0")."""
    return getattr(device, "compute_capability", None)


def device_memory_stats(device) -> dict[str, int] | None:
    """jax 0.10.2: `Device.memory_stats()`, None on CPU (and here for a device object without it)."""
    return device.memory_stats() if hasattr(device, "memory_stats") else None


def jit_cache_size(jitted) -> int:
    """jax 0.10.2: how many shapes a `jax.jit` function holds compiled (its private `_cache_size()`); the
    engine counts them to tell a call that compiled while serving."""
    return jitted._cache_size()


# --- levanter 1.2.dev1644, haliax 1.4.dev453 ----------------------------------------------------------


def attention_qkv(attention, x, *, pos_ids, key=None):
    """Levanter's private `Attention._compute_qkv`: q `[..., kv_head, q_heads_per_group, head_size]`,
    k and v `[..., kv_head, head_size]` after the projections, q/k norms and rotary embeddings. The
    engine and the cudnn backend reuse it so that their q/k/v are the learner's."""
    return attention._compute_qkv(x, key=key, pos_ids=pos_ids)


def post_norms(layer) -> tuple[Any, Any]:
    """(post-attention, post-MLP) extra norms of a decoder layer, None where it has none:
    `LlamaDecoderLayer` has the fields (None unless configured), `QwenDecoderLayer` lacks them."""
    return getattr(layer, "post_attn_layernorm", None), getattr(layer, "post_mlp_layernorm", None)


def uses_sliding_window(config) -> bool:
    """Whether a Levanter model config turns sliding-window attention on (`QwenConfig`'s fields;
    Llama's config has neither)."""
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", False)


def layer_modules(layers) -> tuple:
    """Each layer's module of haliax's `Stacked` (slices of its arrays) or `BlockSeq`."""
    return tuple(layers.unstacked())


def layer_template(layers):
    """One layer's module without slicing a `Stacked`'s arrays: for static fields (configs)."""
    return layers.stacked if hasattr(layers, "stacked") else layers.blocks[0]
