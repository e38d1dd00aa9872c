# Copyright 2023 The JAX Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Copied from jax 0.10.2, jax/experimental/pallas/ops/gpu/paged_attention.py (Pallas on Triton; the
# upstream Triton backend is deprecated, so marin-rl keeps its own copy). Modified by marin-rl: the
# quantization scales and the logits soft cap are removed (unused), the query scale is an argument,
# `lengths` is required, a single query head per KV head is not padded to 16 rows (multiply-and-sum
# instead of a tensor-core dot), one partition is normalised in the kernel, and the code is formatted
# to the project's style.
"""Paged decode attention on GPU: one query token per sequence against its KV pages (Pallas/Triton)."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)


def _kernel(
    q_ref,  # [block_h, head_dim]
    k_pages_ref,  # [total_num_pages, page_size, head_dim]
    v_pages_ref,  # [total_num_pages, page_size, head_dim]
    block_tables_ref,  # [pages_per_partition]
    lengths_ref,  # [1]
    o_ref: Any,  # [block_h, head_dim]
    l_ref: Any,  # [block_h]
    m_ref: Any,  # [block_h]
    *,
    pages_per_compute_block: int,
    mask_value: float,
    normalize: bool,
):
    partition_idx = pl.program_id(2)
    block_h, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[-2]
    pages_per_partition = block_tables_ref.shape[0]
    block_k = pages_per_compute_block * page_size

    def _compute(start_page_idx, end_page_idx, o, m_i, l_i):
        q = q_ref[pl.ds(0, block_h), :]

        # Loop over blocks of pages of this partition of the sequence.
        def body(start_k, carry):
            o_prev, m_prev, l_prev = carry
            block_tables = block_tables_ref[pl.ds(start_k * pages_per_compute_block, pages_per_compute_block)]
            k = k_pages_ref[block_tables].reshape(block_k, head_dim)
            v = v_pages_ref[block_tables].reshape(block_k, head_dim)
            if block_h >= 16:
                logits = plgpu.dot(q, k.T)  # [block_h, block_k]
            else:  # a tensor-core dot needs 16 rows: multiply and sum rather than pad q with zero rows
                logits = jnp.sum(q[:, None, :].astype(jnp.float32) * k[None, :, :].astype(jnp.float32), axis=-1)

            curr_start_token_idx = (partition_idx * pages_per_partition + start_k * pages_per_compute_block) * page_size
            mask = jnp.arange(block_k) + curr_start_token_idx < lengths_ref[0]
            mask = lax.broadcast_in_dim(mask, (block_h, block_k), (1,))
            logits = jnp.where(mask, logits, mask_value)

            log2e = math.log2(math.e)
            m_curr = logits.max(axis=-1)
            m_next = jnp.maximum(m_prev, m_curr)
            correction = jnp.exp2((m_prev - m_next) * log2e)
            l_prev_corr = correction * l_prev
            s_curr = jnp.exp2((logits - m_next[:, None]) * log2e)
            l_next = l_prev_corr + s_curr.sum(axis=-1)
            if block_h >= 16:
                values = plgpu.dot(s_curr.astype(v.dtype), v)
            else:
                values = jnp.sum(s_curr[:, :, None] * v[None, :, :].astype(jnp.float32), axis=1)
            o_next = correction[:, None] * o_prev + values
            return o_next, m_next, l_next

        max_it = pl.cdiv(end_page_idx - start_page_idx, pages_per_compute_block)
        return lax.fori_loop(0, max_it, body, (o, m_i, l_i))

    m_i = jnp.zeros(block_h, dtype=jnp.float32) + jnp.finfo(jnp.float32).min
    l_i = jnp.zeros(block_h, dtype=jnp.float32)
    o = jnp.zeros((block_h, head_dim), dtype=jnp.float32)

    start_page_idx = partition_idx * pages_per_partition
    end_page_idx = jnp.minimum(pl.cdiv(lengths_ref[0], page_size), start_page_idx + pages_per_partition)
    # Partitions past the sequence's end do no work.
    o, m_i, l_i = jax.lax.cond(
        start_page_idx >= end_page_idx,
        lambda: (o, m_i, l_i),
        lambda: _compute(start_page_idx, end_page_idx, o, m_i, l_i),
    )
    if normalize:  # the only partition: the output as it is, no combining round after the kernel
        o = o / (l_i[:, None] + jnp.finfo(jnp.float32).eps)
    o_ref[...] = o.astype(o_ref.dtype)
    l_ref[...] = l_i
    m_ref[...] = m_i


def _unbatched(
    q: jax.Array,  # [num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, total_num_pages, page_size, head_dim]
    v_pages: jax.Array,
    block_tables: jax.Array,  # [pages_per_sequence]
    lengths: jax.Array,  # [1]
    *,
    block_h: int,
    pages_per_compute_block: int,
    k_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    mask_value: float,
) -> jax.Array:
    num_q_heads, head_dim = q.shape
    num_kv_heads, total_num_pages, page_size, _ = k_pages.shape
    pages_per_sequence = block_tables.shape[0]
    assert pages_per_sequence % k_splits == 0, f"{pages_per_sequence=} must be divisible by {k_splits=}."
    pages_per_partition = pages_per_sequence // k_splits
    pages_per_compute_block = min(pages_per_partition, pages_per_compute_block)
    assert pages_per_partition % pages_per_compute_block == 0, (
        f"{pages_per_partition=} must be divisible by {pages_per_compute_block=}."
    )
    block_tables = block_tables.reshape(k_splits, pages_per_partition)

    q_heads_per_kv_head = num_q_heads // num_kv_heads
    q_reshaped = q.reshape(num_kv_heads, q_heads_per_kv_head, head_dim)
    if q_heads_per_kv_head % block_h:
        q_reshaped = jnp.pad(q_reshaped, ((0, 0), (0, -q_heads_per_kv_head % block_h), (0, 0)))
    head_splits = pl.cdiv(q_heads_per_kv_head, block_h)

    kernel = functools.partial(
        _kernel, pages_per_compute_block=pages_per_compute_block, mask_value=mask_value, normalize=k_splits == 1
    )
    o, l, m = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, head_splits, k_splits),
        in_specs=[
            pl.BlockSpec((None, block_h, head_dim), lambda h, i, k: (h, i, 0)),  # q
            pl.BlockSpec((None, total_num_pages, page_size, head_dim), lambda h, i, k: (h, 0, 0, 0)),  # k_pages
            pl.BlockSpec((None, total_num_pages, page_size, head_dim), lambda h, i, k: (h, 0, 0, 0)),  # v_pages
            pl.BlockSpec((None, pages_per_partition), lambda h, i, k: (k, 0)),  # block_tables
            pl.BlockSpec((1,), lambda h, i, k: (0,)),  # lengths
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, head_dim), lambda h, i, k: (k, h, i, 0)),  # o
            pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),  # l
            pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),  # m
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, *q_reshaped.shape), dtype=q.dtype),
            jax.ShapeDtypeStruct((k_splits, *q_reshaped.shape[:-1]), dtype=jnp.float32),
            jax.ShapeDtypeStruct((k_splits, *q_reshaped.shape[:-1]), dtype=jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_attention_{block_h=}_{pages_per_compute_block=}",
    )(q_reshaped, k_pages, v_pages, block_tables, lengths)

    if q_heads_per_kv_head % block_h:
        o = o[..., :q_heads_per_kv_head, :]
        l = l[..., :q_heads_per_kv_head]
        m = m[..., :q_heads_per_kv_head]
    if k_splits == 1:
        return o[0].reshape(q.shape).astype(q.dtype)

    # The final round of flash attention: combine the k_splits partitions.
    m_next = m.max(axis=0)
    correction = jnp.exp(m - m_next[None])
    o = o * correction[..., None].astype(o.dtype)
    l_next = (l * correction).sum(axis=0)
    eps = jnp.finfo(l_next.dtype).eps
    o = o.sum(axis=0) / ((l_next[..., None] + eps).astype(o.dtype))
    return o.reshape(q.shape).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=["block_h", "pages_per_compute_block", "k_splits", "num_warps", "num_stages", "interpret", "mask_value"],
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    block_h: int | None = None,
    pages_per_compute_block: int = 8,
    k_splits: int = 16,
    num_warps: int = 8,
    num_stages: int = 2,
    interpret: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> jax.Array:
    """Paged grouped-query attention of one query token per sequence (q already scaled).

    Args:
      q: [batch_size, num_heads, head_dim].
      k_pages, v_pages: [num_kv_heads, total_num_pages, page_size, head_dim].
      block_tables: i32[batch_size, pages_per_sequence], entries in [0, total_num_pages).
      lengths: i32[batch_size], tokens of each sequence to attend to.

      block_h: query heads per program (fewer than 16 are multiplied and summed, 16 go through a
        tensor-core dot, padded with zero rows); None: 1 when each KV head has one query head, else 16.

    Returns: [batch_size, num_heads, head_dim].
    """
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads, _, _, head_dim_k = k_pages.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape. Got {k_pages.shape} and {v_pages.shape}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"Number of Q heads must be divisible by number of KV heads. Got {num_heads} and {num_kv_heads}.")
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim of Q must be the same as that of K/V. Got {head_dim} and {head_dim_k}.")
    if block_tables.shape[0] != batch_size or lengths.shape != (batch_size,):
        raise ValueError("`block_tables`, `lengths` and `q` must have the same batch size")
    if lengths.dtype != jnp.int32:
        raise ValueError(f"The dtype of `lengths` must be int32. Got {lengths.dtype}")
    if block_h is None:  # one query head per KV head: no padding (measured faster); else a tensor-core dot
        block_h = 1 if num_heads == num_kv_heads else 16
    if block_h & (block_h - 1) or block_h > max(16, num_heads // num_kv_heads):
        raise ValueError(f"block_h must be a power of two, at most max(16, query heads per KV head); got {block_h}")

    impl = functools.partial(
        _unbatched,
        block_h=block_h,
        pages_per_compute_block=pages_per_compute_block,
        k_splits=k_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
    )
    return jax.vmap(impl, (0, None, None, 0, 0), 0)(q, k_pages, v_pages, block_tables, lengths[..., None])
