"""Attention of the engine: decode over the paged KV cache, and prefill of fresh prompts.

Decode (one new token per sequence): the Pallas/Triton paged-attention kernel on GPU
(`kernels/paged_attention.py`), or a pure-JAX path that gathers each sequence's pages (any device;
the reference the kernel is tested against). Prefill (whole prompts, padded into a batch): causal
attention within each prompt through `jax.nn.dot_product_attention` (cuDNN flash attention on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from marin_rl.engine._config import ExactLayout

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class AttentionKernels:
    """Which implementation runs each kind of attention; see `choose_kernels`."""

    decode: str
    """"pallas" or "jax"."""
    prefill: str
    """`jax.nn.dot_product_attention`'s implementation: "cudnn" or "xla"."""
    k_splits: int = 16
    """Pallas: at most this many partitions of a sequence's pages processed in parallel (flash-decoding);
    `splits_for` uses fewer when the batch alone gives the GPU enough programs."""
    min_programs: int = 2048
    """Pallas: split sequences until batch x kv heads x splits reaches this many programs (an H100 has 132
    SMs). Each split of a short sequence is a program with (almost) nothing to do."""
    # Pallas launch settings from `benchmarks/bench_decode_attention.py` (H100): one page per inner step,
    # one stage, and two warps take 85 us per layer where upstream's 8 pages, 8 warps, 2 stages took 129 us
    # (1B shape, 256 sequences). With one query head per KV head (the 0.5B loop shape) one warp and no
    # padding of the query to 16 rows: 40-44 us (two runs) against 51.5 us padded, 113 us upstream.
    pages_per_compute_block: int = 1
    """Pallas: pages loaded per inner step."""
    num_warps: int = 2
    """Pallas: warps per program (several query heads per KV head: a tensor-core dot)."""
    num_warps_one_head: int = 1
    """Pallas: warps per program when each KV head has one query head (multiply-and-sum)."""
    num_stages: int = 1
    """Pallas: software-pipelining stages of the inner loop."""
    interpret: bool = False
    """Pallas: run the kernel through the interpreter (to test it on CPU)."""
    exact: ExactLayout | None = None
    """Set: every pass is the exact one of `_exact.py` (batch-invariant, the learner's bits), whatever
    `decode` and `prefill` say."""

    def table_width(self, pages_per_seq: int) -> int:
        """Width of the block tables: the Pallas kernel splits them into `k_splits` equal partitions,
        each a whole number of compute blocks of a power-of-two number of pages (Triton's block shapes
        are powers of two). Extra entries point at the scratch page, past every length."""
        if self.decode != "pallas":
            return pages_per_seq
        per_split = -(-pages_per_seq // self.k_splits)
        block = self.pages_per_compute_block
        per_split = 1 << (per_split - 1).bit_length() if per_split <= block else -(-per_split // block) * block
        return per_split * self.k_splits

    def splits_for(self, batch: int, kv_heads: int) -> int:
        """Partitions per sequence: the fewest (a power of two, at most `k_splits`) that make
        `min_programs` programs. The table width (`table_width`) divides evenly by any of them."""
        splits = 1
        while splits < self.k_splits and batch * kv_heads * splits < self.min_programs:
            splits *= 2
        return splits


def choose_kernels(choice: str, dtype, platform: str | None = None, exact: ExactLayout | None = None) -> AttentionKernels:
    """`choice` is EngineConfig.attention: "auto" picks the GPU kernels on a GPU with a 16-bit cache.
    With `exact`, the exact passes replace them (the block tables keep the gathered layout)."""
    if exact is not None:
        return AttentionKernels(decode="jax", prefill="xla", exact=exact)
    platform = platform or jax.default_backend()
    half = jnp.dtype(dtype).itemsize == 2
    if choice == "pallas" and platform != "gpu":
        raise ValueError(f"attention='pallas' needs a GPU (this is {platform}); use 'jax' or 'auto'")
    gpu_fast = platform == "gpu" and half
    decode = "pallas" if choice == "pallas" or (choice == "auto" and gpu_fast) else "jax"
    return AttentionKernels(decode=decode, prefill="cudnn" if gpu_fast and choice != "jax" else "xla")


def decode_attention(
    kernels: AttentionKernels,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
) -> jax.Array:
    """q `[batch, heads, head_dim]` against the first `lengths[b]` tokens of each sequence's pages.

    `k_pages`/`v_pages`: `[kv_heads, pages, page_size, head_dim]`; `block_tables`: `[batch, width]`.
    Query heads are grouped kv-head-major (head h uses kv head h // (heads / kv_heads))."""
    if kernels.decode == "pallas":
        from marin_rl.engine.kernels.paged_attention import paged_attention

        return paged_attention(
            (q * scale).astype(k_pages.dtype),
            k_pages,
            v_pages,
            block_tables,
            lengths,
            k_splits=kernels.splits_for(q.shape[0], k_pages.shape[0]),
            pages_per_compute_block=kernels.pages_per_compute_block,
            num_warps=kernels.num_warps_one_head if q.shape[1] == k_pages.shape[0] else kernels.num_warps,
            num_stages=kernels.num_stages,
            interpret=kernels.interpret,
        ).astype(q.dtype)
    return gathered_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale)


def gathered_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale):
    """Pure JAX: gather each sequence's pages into `[batch, tokens]` and attend (softmax in float32)."""
    batch, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    tokens = block_tables.shape[1] * page_size
    k = k_pages[:, block_tables].reshape(kv_heads, batch, tokens, head_dim)
    v = v_pages[:, block_tables].reshape(kv_heads, batch, tokens, head_dim)
    q = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("bkgd,kbtd->bkgt", q, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(tokens)[None, :] < lengths[:, None]
    logits = jnp.where(visible[:, None, None, :], logits, _MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgt,kbtd->bkgd", weights, v.astype(jnp.float32))
    return out.reshape(batch, heads, head_dim).astype(q.dtype)


def prefill_attention(kernels: AttentionKernels, q, k, v, lengths, scale: float) -> jax.Array:
    """Causal attention within each padded prompt: q `[batch, time, heads, head_dim]`, k/v
    `[batch, time, kv_heads, head_dim]`, `lengths[b]` real tokens in row b (rows past it are ignored)."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=kernels.prefill,
    )
