"""The transformer forward passes of the engine, on `ServingWeights` (Levanter's own layer modules).

Each layer is Levanter's decoder layer written out with the attention call replaced: the projections,
q/k norms (Qwen3), rotary embeddings, MLP and norms are the learner's code, so the engine's log-probs
are the learner's up to float rounding. Layers are unrolled (each has its own weights and KV arrays).

With `kernels.exact` the passes are the exact ones of `_exact.py` instead, and return log-probs: the
learner's bits, whatever is batched together.
"""

from __future__ import annotations

import math
from typing import Callable

import haliax as hax
import jax
import jax.numpy as jnp

from marin_rl._upstream import attention_qkv, post_norms
from marin_rl.engine._attention import AttentionKernels, decode_attention, prefill_attention
from marin_rl.engine._exact import exact_hidden_states, exact_log_softmax, page_windows, row_windows
from marin_rl.engine._kv_cache import KvCache, write_tokens
from marin_rl.engine._weights import ServingWeights

# attend(layer_index, q [b, t, heads, d], k [b, t, kv_heads, d], v) -> [b, t, heads, d]
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def attention_scale(weights: ServingWeights) -> float:
    config = weights.attention_config
    return config.scaling_factor if config.scaling_factor is not None else 1.0 / math.sqrt(config.head_size)


def hidden_states(weights: ServingWeights, token_ids: jax.Array, positions: jax.Array, attend: Attend) -> jax.Array:
    """Final-norm hidden states `[b, t, embed]` of tokens `[b, t]` at `positions` `[b, t]`."""
    names = ("batch", "position")
    x = weights.embeddings.embed(hax.named(token_ids, names))
    pos_ids = hax.named(positions, names)
    for i, layer in enumerate(weights.layers):
        residual = x
        h = layer.input_layernorm(x)
        q, k, v = attention_qkv(layer.self_attn, h, pos_ids=pos_ids)
        b, t = token_ids.shape
        q = q.rearrange((*names, "kv_head", "q_heads_per_group", "head_size")).array
        q = q.reshape(b, t, -1, q.shape[-1])  # heads kv-head-major, as Levanter flattens them
        k = k.rearrange((*names, "kv_head", "head_size")).array
        v = v.rearrange((*names, "kv_head", "head_size")).array
        out = hax.named(attend(i, q, k, v).astype(x.dtype), (*names, "heads", "head_size"))
        out = layer.self_attn.o_proj(out, key=None)
        post_attn, post_mlp = post_norms(layer)
        if post_attn is not None:
            out = post_attn(out)
        x = residual + out
        residual = x
        out = layer.mlp(layer.post_attention_layernorm(x), key=None)
        if post_mlp is not None:
            out = post_mlp(out)
        x = residual + out
    return weights.norm(x).rearrange((*names, "embed")).array


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
    keys, values = [], []
    if kernels.exact is not None:

        def stored(i, k, v):
            keys.append(write_tokens(cache.keys[i], k, write_pages, offsets))
            values.append(write_tokens(cache.values[i], v, write_pages, offsets))
            return _flat(keys[i]), _flat(values[i])

        windows = page_windows(block_tables, page_size, kernels.exact.context)
        hidden = exact_hidden_states(weights, kernels.exact, tokens, positions, windows, lengths, stored, scale)
        return exact_log_softmax(weights, kernels.exact, hidden), KvCache(tuple(keys), tuple(values))

    def attend(i, q, k, v):
        keys.append(write_tokens(cache.keys[i], k[:, 0], write_pages, offsets))
        values.append(write_tokens(cache.values[i], v[:, 0], write_pages, offsets))
        return decode_attention(kernels, q[:, 0], keys[i], values[i], block_tables, lengths, scale)[:, None]

    hidden = hidden_states(weights, tokens[:, None], positions[:, None], attend)
    return logits_of(weights, hidden[:, 0]), KvCache(tuple(keys), tuple(values))


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
    keys, values = [], []

    def tokens_and_copies(x):
        flat = x.reshape(p * t, *x.shape[2:])
        return jnp.concatenate([flat, flat[copy_tokens]])

    if kernels.exact is not None:

        def stored(i, k, v):  # k `[p * t, kv_heads, head]`; the windows read the fresh ones
            keys.append(write_tokens(cache.keys[i], jnp.concatenate([k, k[copy_tokens]]), pages, offsets))
            values.append(write_tokens(cache.values[i], jnp.concatenate([v, v[copy_tokens]]), pages, offsets))
            return jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)

        # Positions made opaque: XLA would fold a constant's rotary sines at compile time, in other last
        # bits than the same sines of the positions the learner and a decode step compute at run time.
        flat_positions = jax.lax.optimization_barrier(positions.reshape(-1))
        starts = jnp.repeat(jnp.arange(p, dtype=jnp.int32) * t, t)
        windows = row_windows(starts, flat_positions, kernels.exact.context)
        hidden = exact_hidden_states(
            weights, kernels.exact, token_ids.reshape(-1), flat_positions, windows, flat_positions + 1, stored, scale
        )
        last = hidden.reshape(p, t, -1)[jnp.arange(p), jnp.maximum(lengths - 1, 0)]
        return exact_log_softmax(weights, kernels.exact, last), KvCache(tuple(keys), tuple(values))

    def attend(i, q, k, v):
        keys.append(write_tokens(cache.keys[i], tokens_and_copies(k), pages, offsets))
        values.append(write_tokens(cache.values[i], tokens_and_copies(v), pages, offsets))
        return prefill_attention(kernels, q, k, v, lengths, scale)

    hidden = hidden_states(weights, token_ids, positions, attend)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return logits_of(weights, last), KvCache(tuple(keys), tuple(values))


def prompt_logprobs(weights: ServingWeights, kernels: AttentionKernels, token_ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """float32 log-probs `[p, t, vocab]` of the next token at every position of padded prompts, without a KV cache."""
    p, t = token_ids.shape
    scale = attention_scale(weights)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    if kernels.exact is not None:
        flat_positions = jax.lax.optimization_barrier(positions.reshape(-1))  # see `prefill_forward`
        windows = row_windows(jnp.repeat(jnp.arange(p, dtype=jnp.int32) * t, t), flat_positions, kernels.exact.context)

        def fresh(i, k, v):
            return jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)

        hidden = exact_hidden_states(weights, kernels.exact, token_ids.reshape(-1), flat_positions, windows, flat_positions + 1, fresh, scale)
        return exact_log_softmax(weights, kernels.exact, hidden).reshape(p, t, -1)
    hidden = hidden_states(weights, token_ids, positions, lambda i, q, k, v: prefill_attention(kernels, q, k, v, lengths, scale))
    return jax.nn.log_softmax(logits_of(weights, hidden), axis=-1)


def _flat(pages: jax.Array) -> jax.Array:
    """`[kv_heads, pages, page_size, head]` as `[kv_heads, pages * page_size, head]` (what windows index)."""
    kv_heads, num_pages, page_size, head = pages.shape
    return pages.reshape(kv_heads, num_pages * page_size, head)
