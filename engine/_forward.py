"""The transformer forward passes of the engine, on `ServingWeights` (Levanter's own layer modules).

Each layer is Levanter's decoder layer written out with the attention call replaced: the projections,
q/k norms (Qwen3), rotary embeddings, MLP and norms are the learner's code, so the engine's log-probs
are the learner's up to float rounding. Layers are unrolled (each has its own weights and KV arrays)
in the compiled program, and traced once (`hidden_states`).

With `kernels.exact` the passes are the exact ones of `_exact.py` instead, and return log-probs: the
learner's bits, whatever is batched together.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

from marin_rl._upstream import attention_qkv, post_norms
from marin_rl.engine._attention import AttentionKernels, decode_attention, prefill_attention
from marin_rl.engine._exact import exact_hidden_states, exact_log_softmax, fresh_keys_and_values, page_windows, row_windows
from marin_rl.engine._kv_cache import KvCache, write_tokens
from marin_rl.engine._weights import ServingWeights

# attend(q [b, t, heads, d], k [b, t, kv_heads, d], v, layer_cache, shared) -> (out [b, t, heads, d], new layer_cache):
# one layer's attention; `layer_cache` is that layer's arrays (its KV pages, or None), `shared` the arrays
# every layer reads (block tables, lengths).
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any, Any], tuple[jax.Array, Any]]


def attention_scale(weights: ServingWeights) -> float:
    config = weights.attention_config
    return config.scaling_factor if config.scaling_factor is not None else 1.0 / math.sqrt(config.head_size)


def hidden_states(
    weights: ServingWeights, token_ids: jax.Array, positions: jax.Array, attend: Attend, layer_caches: Sequence[Any], shared: Any
) -> tuple[jax.Array, tuple]:
    """Final-norm hidden states `[b, t, embed]` of tokens `[b, t]` at `positions` `[b, t]`, and each
    layer's cache as `attend` returns it.

    Each layer is one call of a jitted function: traced and lowered once, not once per layer (a
    Levanter layer traces about a thousand small ops; 24 of them took seconds per compiled shape).
    XLA inlines the calls, so the program is the unrolled one."""
    names = ("batch", "position")
    x = weights.embeddings.embed(hax.named(token_ids, names))
    layer = eqx.filter_jit(functools.partial(_layer, attend))
    pos_ids = hax.named(positions, names)
    new_caches = []
    for module, cache in zip(weights.layers, layer_caches, strict=True):
        x, cache = layer(module, x, pos_ids, cache, shared)
        new_caches.append(cache)
    return weights.norm(x).rearrange((*names, "embed")).array, tuple(new_caches)


def _layer(attend: Attend, layer, x, pos_ids, cache, shared):
    """Levanter's decoder layer with `attend` as its attention."""
    names = ("batch", "position")
    residual = x
    h = layer.input_layernorm(x)
    q, k, v = attention_qkv(layer.self_attn, h, pos_ids=pos_ids)
    b, t = pos_ids.array.shape
    q = q.rearrange((*names, "kv_head", "q_heads_per_group", "head_size")).array
    q = q.reshape(b, t, -1, q.shape[-1])  # heads kv-head-major, as Levanter flattens them
    k = k.rearrange((*names, "kv_head", "head_size")).array
    v = v.rearrange((*names, "kv_head", "head_size")).array
    out, cache = attend(q, k, v, cache, shared)
    out = layer.self_attn.o_proj(hax.named(out.astype(x.dtype), (*names, "heads", "head_size")), key=None)
    post_attn, post_mlp = post_norms(layer)
    if post_attn is not None:
        out = post_attn(out)
    x = residual + out
    residual = x
    out = layer.mlp(layer.post_attention_layernorm(x), key=None)
    if post_mlp is not None:
        out = post_mlp(out)
    return residual + out, cache


def logits_of(weights: ServingWeights, hidden: jax.Array) -> jax.Array:
    """float32 logits `[..., vocab]` of hidden states `[..., embed]` (as the learner computes them)."""
    return jnp.einsum("...e,ve->...v", hidden, weights.lm_head.array, preferred_element_type=jnp.float32)


def decode_forward(
    weights: ServingWeights,
    kernels: AttentionKernels,
    cache: KvCache,
    tokens: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    write_pages: jax.Array,
) -> tuple[jax.Array, KvCache]:
    """One token per sequence: write its keys/values at `positions` into page `write_pages[b]`
    (out of range for idle slots: dropped), attend to the sequence so far; float32 logits `[b, vocab]`
    (log-probs with `kernels.exact`)."""
    page_size = cache.keys[0].shape[2]
    scale = attention_scale(weights)
    offsets = positions % page_size
    lengths = (positions + 1).astype(jnp.int32)
    layer_caches = list(zip(cache.keys, cache.values))
    if kernels.exact is not None:

        def stored(k, v, layer_cache, shared):
            (keys, values), (write_pages, offsets) = layer_cache, shared
            keys = write_tokens(keys, k, write_pages, offsets)
            values = write_tokens(values, v, write_pages, offsets)
            return (_flat(keys), _flat(values)), (keys, values)

        windows = page_windows(block_tables, page_size, kernels.exact.context)
        hidden, caches = exact_hidden_states(
            weights, kernels.exact, tokens, positions, windows, lengths, stored, scale, layer_caches, (write_pages, offsets)
        )
        return exact_log_softmax(weights, kernels.exact, hidden), _kv_cache(caches)

    def attend(q, k, v, layer_cache, shared):
        (keys, values), (write_pages, offsets, block_tables, lengths) = layer_cache, shared
        keys = write_tokens(keys, k[:, 0], write_pages, offsets)
        values = write_tokens(values, v[:, 0], write_pages, offsets)
        return decode_attention(kernels, q[:, 0], keys, values, block_tables, lengths, scale)[:, None], (keys, values)

    shared = (write_pages, offsets, block_tables, lengths)
    hidden, caches = hidden_states(weights, tokens[:, None], positions[:, None], attend, layer_caches, shared)
    return logits_of(weights, hidden[:, 0]), _kv_cache(caches)


def prefill_forward(
    weights: ServingWeights,
    kernels: AttentionKernels,
    cache: KvCache,
    token_ids: jax.Array,
    lengths: jax.Array,
    write_pages: jax.Array,
    copy_tokens: jax.Array,
    copy_pages: jax.Array,
) -> tuple[jax.Array, KvCache]:
    """Whole prompts `[p, t]` (row r holds `lengths[r]` tokens, then padding): write every token's
    keys/values into page `write_pages[r, t]` (out of range for padding: dropped), and token
    `copy_tokens[i]` of the flattened prompts again into page `copy_pages[i]` (the other samples'
    copies of partial pages); float32 logits `[p, vocab]` of each prompt's last token (log-probs with
    `kernels.exact`)."""
    p, t = token_ids.shape
    page_size = cache.keys[0].shape[2]
    scale = attention_scale(weights)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    offsets = (positions % page_size).reshape(-1)
    # Written from the fresh keys/values, not copied page to page inside the cache: a scatter whose
    # source is the cache it updates made XLA copy the whole cache on the GPU (17 ms per prefill).
    offsets = jnp.concatenate([offsets, offsets[copy_tokens]])
    pages = jnp.concatenate([write_pages.reshape(-1), copy_pages])
    layer_caches = list(zip(cache.keys, cache.values))
    if kernels.exact is not None:

        def stored(k, v, layer_cache, shared):  # k `[p * t, kv_heads, head]`; the windows read the fresh ones
            (keys, values), (pages, offsets, copy_tokens) = layer_cache, shared
            keys = write_tokens(keys, jnp.concatenate([k, k[copy_tokens]]), pages, offsets)
            values = write_tokens(values, jnp.concatenate([v, v[copy_tokens]]), pages, offsets)
            return (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)), (keys, values)

        # Positions made opaque: XLA would fold a constant's rotary sines at compile time, in other last
        # bits than the same sines of the positions the learner and a decode step compute at run time.
        flat_positions = jax.lax.optimization_barrier(positions.reshape(-1))
        starts = jnp.repeat(jnp.arange(p, dtype=jnp.int32) * t, t)
        windows = row_windows(starts, flat_positions, kernels.exact.context)
        hidden, caches = exact_hidden_states(
            weights, kernels.exact, token_ids.reshape(-1), flat_positions, windows, flat_positions + 1, stored, scale,
            layer_caches, (pages, offsets, copy_tokens),
        )
        last = hidden.reshape(p, t, -1)[jnp.arange(p), jnp.maximum(lengths - 1, 0)]
        return exact_log_softmax(weights, kernels.exact, last), _kv_cache(caches)

    def attend(q, k, v, layer_cache, shared):
        (keys, values), (pages, offsets, copy_tokens, lengths) = layer_cache, shared

        def tokens_and_copies(x):
            flat = x.reshape(p * t, *x.shape[2:])
            return jnp.concatenate([flat, flat[copy_tokens]])

        keys = write_tokens(keys, tokens_and_copies(k), pages, offsets)
        values = write_tokens(values, tokens_and_copies(v), pages, offsets)
        return prefill_attention(kernels, q, k, v, lengths, scale), (keys, values)

    shared = (pages, offsets, copy_tokens, lengths)
    hidden, caches = hidden_states(weights, token_ids, positions, attend, layer_caches, shared)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return logits_of(weights, last), _kv_cache(caches)


def prompt_logprobs(weights: ServingWeights, kernels: AttentionKernels, token_ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """float32 log-probs `[p, t, vocab]` of the next token at every position of padded prompts, without a KV cache."""
    p, t = token_ids.shape
    scale = attention_scale(weights)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    if kernels.exact is not None:
        flat_positions = jax.lax.optimization_barrier(positions.reshape(-1))  # see `prefill_forward`
        windows = row_windows(jnp.repeat(jnp.arange(p, dtype=jnp.int32) * t, t), flat_positions, kernels.exact.context)

        hidden, _ = exact_hidden_states(
            weights, kernels.exact, token_ids.reshape(-1), flat_positions, windows, flat_positions + 1, fresh_keys_and_values, scale,
            [None] * len(weights.layers),
        )
        return exact_log_softmax(weights, kernels.exact, hidden).reshape(p, t, -1)

    def attend(q, k, v, _, lengths):
        return prefill_attention(kernels, q, k, v, lengths, scale), None

    hidden, _ = hidden_states(weights, token_ids, positions, attend, [None] * len(weights.layers), lengths)
    return jax.nn.log_softmax(logits_of(weights, hidden), axis=-1)


def _kv_cache(layer_caches) -> KvCache:
    keys, values = zip(*layer_caches)
    return KvCache(tuple(keys), tuple(values))


def _flat(pages: jax.Array) -> jax.Array:
    """`[kv_heads, pages, page_size, head]` as `[kv_heads, pages * page_size, head]` (what windows index)."""
    kv_heads, num_pages, page_size, head = pages.shape
    return pages.reshape(kv_heads, num_pages * page_size, head)
