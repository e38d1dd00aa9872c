"""The paged KV cache: per layer, keys and values of every page, `[kv_heads, pages, page_size, head_dim]`.

Separate key and value arrays per layer (the layout the paged-attention kernel reads), so a layer's
decode step reads and updates its own buffers in place: no per-step slice or copy of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp

from marin_rl._upstream import device_memory_stats
from marin_rl.engine._config import EngineConfig


@dataclass(frozen=True)
class KvCacheSpec:
    num_layers: int
    kv_heads: int
    head_dim: int
    num_pages: int
    """Including the scratch page."""
    page_size: int
    dtype: jnp.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def tokens(self) -> int:
        """Tokens the cache can hold (the scratch page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def gib(self) -> float:
        return self.num_pages * self.page_size * self.bytes_per_token / 2**30


def plan_kv_cache(config: EngineConfig, *, num_layers: int, kv_heads: int, head_dim: int, dtype, device=None) -> KvCacheSpec:
    """The cache size that `config` asks for; ValueError (with the numbers) when it cannot hold one
    `max_seq_len` sequence."""
    spec = KvCacheSpec(num_layers, kv_heads, head_dim, 2, config.page_size, jnp.dtype(dtype))
    if config.kv_cache_tokens is not None:
        tokens, source = config.kv_cache_tokens, f"kv_cache_tokens={config.kv_cache_tokens}"
    elif config.kv_cache_memory_fraction is not None:
        device = device or jax.devices()[0]
        stats = device_memory_stats(device)
        if not stats or "bytes_limit" not in stats:
            raise ValueError(
                f"kv_cache_memory_fraction: {device.platform} device {device.id} does not report its memory; "
                "set kv_cache_tokens instead"
            )
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        tokens = int(config.kv_cache_memory_fraction * free // spec.bytes_per_token)
        source = (
            f"kv_cache_memory_fraction={config.kv_cache_memory_fraction} of {free / 2**30:.2f} GiB free "
            f"at {spec.bytes_per_token} bytes per token"
        )
    else:
        tokens = config.every_slot_tokens
        source = f"max_seqs * max_seq_len in pages = {config.max_seqs} * {config.pages_per_seq} * {config.page_size}"
    needed = config.pages_per_seq * config.page_size
    if tokens < needed:
        raise ValueError(
            f"the KV cache ({source}) holds {tokens} tokens, less than one max_seq_len={config.max_seq_len} "
            f"sequence ({needed} tokens in pages of {config.page_size}); give it more memory or lower max_seq_len"
        )
    num_pages = -(-tokens // config.page_size) + 1  # + the scratch page
    return KvCacheSpec(num_layers, kv_heads, head_dim, num_pages, config.page_size, jnp.dtype(dtype))


class KvCache(eqx.Module):
    keys: tuple[jax.Array, ...]
    """Per layer `[kv_heads, num_pages, page_size, head_dim]`."""
    values: tuple[jax.Array, ...]

    @staticmethod
    def zeros(spec: KvCacheSpec) -> KvCache:
        # Zeros, not uninitialised memory: attention weights masked to 0 still multiply the values.
        shape = (spec.kv_heads, spec.num_pages, spec.page_size, spec.head_dim)
        make = lambda: jnp.zeros(shape, spec.dtype)  # noqa: E731
        return KvCache(tuple(make() for _ in range(spec.num_layers)), tuple(make() for _ in range(spec.num_layers)))


def write_tokens(pages: jax.Array, new: jax.Array, page_ids: jax.Array, offsets: jax.Array) -> jax.Array:
    """One scatter: `new[i]` (`[kv_heads, head_dim]`) into page `page_ids[i]` at `offsets[i]`.

    Index `num_pages` (out of range) drops the write. The in-range targets must be distinct (each
    token has its own place): the scatter is told so, which makes it cheaper on a GPU."""
    kv_heads, num_pages, page_size, head_dim = pages.shape
    # One index into the (page, offset) rows rather than two, and distinct targets: a simpler scatter.
    rows = jnp.where(page_ids < num_pages, page_ids * page_size + offsets, num_pages * page_size)
    flat = pages.reshape(kv_heads, num_pages * page_size, head_dim)
    flat = flat.at[:, rows].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop", unique_indices=True)
    return flat.reshape(pages.shape)

