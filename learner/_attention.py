"""The `cudnn` attention backend: Levanter's `Attention` with its kernel swapped for
`jax.nn.dot_product_attention` (cuDNN flash attention on NVIDIA GPUs).

Levanter's own GPU fast path needs Transformer Engine (`nvte`), which the GPU image lacks; without it Levanter
falls back to its pure-JAX blockwise flash attention. cuDNN flash attention ships with jaxlib.

Packed rows: on Hopper and later, cuDNN's packed layout takes each row's segments as (start, length) lists
and computes attention within each segment only, so a row of four rollouts costs a quarter of a full causal
row and reads no mask. A row with more segments than `max_segments` (or an older GPU, or the `xla`
implementation) takes a boolean same-segment mask instead, which cuDNN applies as an additive bias over
the whole row.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.layers.attention import Attention, AttentionMask
from levanter.models.lm_model import LmHeadModel

from marin_rl._upstream import attention_qkv, compute_capability, cudnn_packed_attention
from marin_rl.learner._config import ModelConfig

DEFAULT_MAX_SEGMENTS = ModelConfig.cudnn_max_segments


class JaxNnAttention(Attention):
    """Levanter's `Attention` (same parameters, same q/k/v/rope/output code) computing the attention itself
    with `jax.nn.dot_product_attention(implementation=...)`: `cudnn` on GPU, `xla` to check it on CPU."""

    implementation: str = eqx.field(static=True, default="cudnn")
    max_segments: int = eqx.field(static=True, default=DEFAULT_MAX_SEGMENTS)
    """Segments per row (rollouts, plus the padding run) that cuDNN's packed layout takes; rows with more
    use the dense mask."""

    def __call__(
        self,
        x: NamedArray,
        mask: NamedArray | AttentionMask | None,
        *,
        key=None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        config = self.config
        if config.logits_soft_cap is not None:
            raise NotImplementedError("attn_backend 'cudnn' does not support logits_soft_cap")
        Batch, Pos = x.resolve_axis("batch"), x.resolve_axis("position")
        q, k, v = attention_qkv(self, x, key=key, pos_ids=pos_ids)
        q = q.rearrange((Batch, Pos, "kv_head", "q_heads_per_group", "head_size")).array
        # jax.nn groups query head n with kv head n // group, matching Levanter's (kv_head, per_group) order.
        q = q.reshape(Batch.size, Pos.size, config.num_heads, config.head_size)
        k = k.rearrange((Batch, Pos, "kv_head", "head_size")).array
        v = v.rearrange((Batch, Pos, "kv_head", "head_size")).array

        is_causal, segment_ids = _mask_parts(mask, Batch, Pos)
        scale = config.scaling_factor if config.scaling_factor is not None else 1.0 / math.sqrt(config.head_size)

        def dense(q, k, v, segment_ids):
            segment_mask = None if segment_ids is None else same_segment_mask(segment_ids)
            return jax.nn.dot_product_attention(
                q, k, v, mask=segment_mask, scale=scale, is_causal=is_causal, implementation=self.implementation
            )

        if segment_ids is not None and is_causal and self.implementation == "cudnn" and _packed_layout_supported():
            lengths, starts, fits = segment_layout(segment_ids, self.max_segments)
            out = jax.lax.cond(
                fits,
                lambda q, k, v, segment_ids: cudnn_packed_attention(q, k, v, lengths, starts, scale),
                dense,
                q, k, v, segment_ids,
            )
        else:
            out = dense(q, k, v, segment_ids)
        out = hax.named(out, (Batch, Pos, config.Heads, config.HeadSize)).astype(x.dtype)
        return self.o_proj(out, key=None)


def _mask_parts(mask, Batch, Pos):
    """(is_causal, [batch, position] segment ids or None) from a Levanter mask (self-attention: the query's
    and the key's segment ids are the same array)."""
    if mask is None:
        return False, None
    if not isinstance(mask, AttentionMask) or mask.explicit_mask is not None or mask.sliding_window is not None:
        raise NotImplementedError("attn_backend 'cudnn' supports causal masks with segment ids only")
    if mask.segment_ids is None:
        return mask.is_causal, None
    q_segments, _ = mask.segment_ids  # self-attention: the keys' segment ids are the queries'
    return mask.is_causal, q_segments.rearrange((Batch, Pos)).array


def same_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """Boolean [batch, 1, query, key]: the query and key positions hold the same segment id."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def segment_layout(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed layout of rows of segments (runs of equal id; the padding run counts as one).

    Returns (lengths [batch, max_segments], starts [batch, max_segments + 1], fits): per row the length
    and first position of each run, -1 past the row's last run, and whether every row has at most
    `max_segments` runs (if not, the layout is incomplete and must not be used).
    """
    rows, positions = segment_ids.shape
    is_start = jnp.concatenate([jnp.ones((rows, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    fits = jnp.all(is_start.sum(axis=1) <= max_segments)
    first = jax.vmap(lambda row: jnp.nonzero(row, size=max_segments, fill_value=-1)[0])(is_start).astype(jnp.int32)
    following = jnp.concatenate([first[:, 1:], jnp.full((rows, 1), -1, jnp.int32)], axis=1)
    lengths = jnp.where(first < 0, -1, jnp.where(following < 0, positions, following) - first)
    starts = jnp.concatenate([first, jnp.full((rows, 1), -1, jnp.int32)], axis=1)
    return lengths, starts, fits


def _packed_layout_supported() -> bool:
    """cuDNN's packed layout needs a Hopper or later GPU (compute capability 9.0)."""
    device = jax.devices()[0]
    capability = compute_capability(device)
    return device.platform == "gpu" and capability is not None and float(capability) >= 9.0


def use_jax_nn_attention(model: LmHeadModel, implementation: str, max_segments: int = DEFAULT_MAX_SEGMENTS) -> LmHeadModel:
    """The model with every (scanned) attention layer computed by `JaxNnAttention`; parameters unchanged."""

    def swap(attention: Attention) -> JaxNnAttention:
        fields = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)}
        return JaxNnAttention(**fields, implementation=implementation, max_segments=max_segments)

    return eqx.tree_at(lambda m: m.transformer.layers.stacked.self_attn, model, replace_fn=swap)
