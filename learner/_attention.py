"""The `cudnn` attention backend: Levanter's `Attention` with its kernel swapped for
`jax.nn.dot_product_attention` (cuDNN flash attention on NVIDIA GPUs).

Levanter's own GPU fast path needs Transformer Engine (`nvte`), which the GPU image lacks; without it Levanter
falls back to its pure-JAX blockwise flash attention. cuDNN flash attention ships with jaxlib. Packed rows
are handled by a boolean mask (same segment id), which cuDNN applies as an additive bias, plus its causal mask.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import haliax as hax
import jax
from haliax import NamedArray
from levanter.layers.attention import Attention, AttentionMask
from levanter.models.lm_model import LmHeadModel


class JaxNnAttention(Attention):
    """Levanter's `Attention` (same parameters, same q/k/v/rope/output code) computing the attention itself
    with `jax.nn.dot_product_attention(implementation=...)`: `cudnn` on GPU, `xla` to check it on CPU."""

    implementation: str = eqx.field(static=True, default="cudnn")

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
        q, k, v = self._compute_qkv(x, key=key, pos_ids=pos_ids)
        q = q.rearrange((Batch, Pos, "kv_head", "q_heads_per_group", "head_size")).array
        # jax.nn groups query head n with kv head n // group, matching Levanter's (kv_head, per_group) order.
        q = q.reshape(Batch.size, Pos.size, config.num_heads, config.head_size)
        k = k.rearrange((Batch, Pos, "kv_head", "head_size")).array
        v = v.rearrange((Batch, Pos, "kv_head", "head_size")).array

        is_causal, segment_mask = _mask_parts(mask, Batch, Pos)
        scale = config.scaling_factor if config.scaling_factor is not None else 1.0 / math.sqrt(config.head_size)
        out = jax.nn.dot_product_attention(
            q, k, v, mask=segment_mask, scale=scale, is_causal=is_causal, implementation=self.implementation
        )
        out = hax.named(out, (Batch, Pos, config.Heads, config.HeadSize)).astype(x.dtype)
        return self.o_proj(out, key=None)


def _mask_parts(mask, Batch, Pos):
    """(is_causal, boolean [batch, 1, query, key] same-segment mask or None) from a Levanter mask."""
    if mask is None:
        return False, None
    if not isinstance(mask, AttentionMask) or mask.explicit_mask is not None or mask.sliding_window is not None:
        raise NotImplementedError("attn_backend 'cudnn' supports causal masks with segment ids only")
    if mask.segment_ids is None:
        return mask.is_causal, None
    q_segments, kv_segments = (s.rearrange((Batch, Pos)).array for s in mask.segment_ids)
    return mask.is_causal, q_segments[:, None, :, None] == kv_segments[:, None, None, :]


def use_jax_nn_attention(model: LmHeadModel, implementation: str) -> LmHeadModel:
    """The model with every (scanned) attention layer computed by `JaxNnAttention`; parameters unchanged."""

    def swap(attention: Attention) -> JaxNnAttention:
        fields = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)}
        return JaxNnAttention(**fields, implementation=implementation)

    return eqx.tree_at(lambda m: m.transformer.layers.stacked.self_attn, model, replace_fn=swap)
