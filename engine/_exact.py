"""The exact forward pass: a token's log-probs are the same bits whatever is computed beside it.

XLA's matmuls and reductions pick their tiling from the shapes they see, so a sequence's logits change
in the last bits with the batch around it: with the number of prompts in a prefill, the slots in a
decode step, a rollout's offset in a learner row. Here every per-token computation runs on tiles of
`tile` tokens (`lax.map`), so each matmul and reduction sees one shape whatever the batch, and a
token's row of a tile is computed alike at any place in it; attention reads a window of `context` keys
that starts at the sequence's first token, so the softmax sums the same lanes in the same order for a
prompt in a prefill, a slot in a decode step and a rollout anywhere in a packed row. The engine samples
from these log-probs and the learner scores with the same functions, so at the same weights the
behaviour log-probs equal the learner's bit for bit (`Learner` with `exact`; docs/algorithms.md).

Levanter's own layer modules do the work (norms, projections, rotary embeddings, MLP), as in
`_forward.py`; what changes is the shapes they see and the attention.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

from marin_rl._upstream import attention_qkv, post_norms
from marin_rl.engine._config import ExactLayout

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_TILE_AXES = ("position", "embed")


def tiled(fn: Callable, tile: int, *xs: jax.Array, gather: Callable | None = None):
    """`fn` over consecutive tiles of `tile` rows of `xs` (padded at the end), outputs unpadded.
    `gather(*tile_of_xs)`, if given, makes `fn`'s inputs from each tile (e.g. reads other arrays).

    XLA:CPU contracts a multiply and an add into one FMA where they land in one fused loop, so `fn`'s
    arithmetic must be compiled alike in every program: a loop (trip count hidden, so that one trip is
    not inlined), and buffers one tile longer than the work (an update of a whole buffer is simplified
    away, which changed the fusions of the last tile's ops: 1 ulp on a prompt prefilled alone)."""
    n = xs[0].shape[0]
    count = -(-n // tile)
    size = (count + 1) * tile
    xs = tuple(jnp.pad(x, [(0, size - n)] + [(0, 0)] * (x.ndim - 1)) for x in xs)
    gather = gather or (lambda *parts: parts)
    inputs = jax.eval_shape(gather, *(jax.ShapeDtypeStruct((tile, *x.shape[1:]), x.dtype) for x in xs))
    shapes = jax.eval_shape(fn, *inputs)
    outs = jax.tree.map(lambda s: jnp.zeros((size, *s.shape[1:]), s.dtype), shapes)

    def body(i, outs):
        results = fn(*gather(*(jax.lax.dynamic_slice_in_dim(x, i * tile, tile) for x in xs)))
        return jax.tree.map(lambda out, r: jax.lax.dynamic_update_slice_in_dim(out, r, i * tile, 0), outs, results)

    outs = jax.lax.fori_loop(0, jax.lax.optimization_barrier(count), body, outs)
    return jax.tree.map(lambda o: o[:n], outs)


def _queries_keys_values(layer, x, positions):
    """q `[t, kv_heads, group, head]`, k and v `[t, kv_heads, head]` of hidden states `[t, embed]`."""
    h = layer.input_layernorm(hax.named(x, _TILE_AXES))
    q, k, v = attention_qkv(layer.self_attn, h, pos_ids=hax.named(positions, ("position",)))
    q = q.rearrange(("position", "kv_head", "q_heads_per_group", "head_size")).array
    k = k.rearrange(("position", "kv_head", "head_size")).array
    v = v.rearrange(("position", "kv_head", "head_size")).array
    return q, k, v


def _window_attention(q, k, v, lengths, scale):
    """Each query `[t, kv_heads, group, head]` against the `lengths[i]` first keys of its window
    (`k`, `v` `[kv_heads, t, context, head]`); lanes past the length weigh exactly 0."""
    group = q.shape[2]
    # One query head per KV head makes each product a matrix-vector one, which XLA:GPU turns into
    # reductions fused by context (0.5 ulp-scale differences between two programs, H100): a second,
    # zero query row keeps them matrix products of one shape.
    if group == 1:
        q = jnp.concatenate([q, jnp.zeros_like(q)], axis=2)
    visible = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [t, context]
    v = jnp.where(visible[None, :, :, None], v, 0).astype(jnp.float32)
    logits = jnp.einsum("tkgd,ktld->tkgl", q, k, preferred_element_type=jnp.float32) * scale
    weights = jax.nn.softmax(jnp.where(visible[:, None, None, :], logits, _MASK_VALUE), axis=-1)
    return jnp.einsum("tkgl,ktld->tkgd", weights, v)[:, :, :group].astype(q.dtype)


def _finish_layer(layer, x, attention):
    """The residual stream after the attention output `[t, kv_heads, group, head]` and the MLP."""
    x = hax.named(x, _TILE_AXES)
    t, kv_heads, group, head = attention.shape
    out = layer.self_attn.o_proj(hax.named(attention.reshape(t, kv_heads * group, head), ("position", "heads", "head_size")), key=None)
    post_attn, post_mlp = post_norms(layer)
    if post_attn is not None:
        out = post_attn(out)
    x = x + out
    out = layer.mlp(layer.post_attention_layernorm(x), key=None)
    if post_mlp is not None:
        out = post_mlp(out)
    return (x + out).rearrange(_TILE_AXES).array


# (k [n, kv_heads, head], v, layer_cache, shared) -> ((keys, values) `[kv_heads, tokens, head]` the windows
# index, the layer's new cache): one layer's keys and values stored; `layer_cache` is that layer's arrays
# (its KV pages, or None), `shared` the arrays every layer reads.
KeysAndValues = Callable[[jax.Array, jax.Array, Any, Any], tuple[tuple[jax.Array, jax.Array], Any]]


def fresh_keys_and_values(k, v, layer_cache, shared):
    """`KeysAndValues` of a pass without a KV cache: the windows index the fresh keys and values."""
    return (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)), None


def exact_hidden_states(
    weights,
    layout: ExactLayout,
    token_ids,
    positions,
    windows,
    lengths,
    keys_and_values: KeysAndValues,
    scale: float,
    layer_caches: Sequence[Any],
    shared: Any = None,
):
    """Hidden states `[n, embed]` (before the final norm) of tokens `[n]` at `positions` `[n]`, and each
    layer's cache as `keys_and_values` returns it.

    `windows` `[n, context]`: where each token's sequence keeps its keys, from its first token on;
    `lengths` `[n]`: how many of them it sees (its position + 1). `keys_and_values` takes each layer's
    fresh keys and values of the `n` tokens (to store them) and returns the arrays the windows index.
    Each layer is one call of a jitted function, traced once (as `_forward.hidden_states`)."""
    x = tiled(lambda ids: weights.embeddings.embed(hax.named(ids, ("position",))).rearrange(_TILE_AXES).array, layout.tile, token_ids)
    layer = eqx.filter_jit(functools.partial(_exact_layer, keys_and_values, layout.tile, scale))
    new_caches = []
    for module, cache in zip(weights.layers, layer_caches, strict=True):
        x, cache = layer(module, x, positions, windows, lengths, cache, shared)
        new_caches.append(cache)
    return x, tuple(new_caches)


def _exact_layer(keys_and_values: KeysAndValues, tile: int, scale: float, layer, x, positions, windows, lengths, cache, shared):
    q, k, v = tiled(lambda x, p: _queries_keys_values(layer, x, p), tile, x, positions)
    (keys, values), cache = keys_and_values(k, v, cache, shared)
    attention = tiled(
        lambda q, k, v, n: _window_attention(q, k, v, n, scale),
        tile,
        q,
        windows,
        lengths,
        gather=lambda q, w, n: (q, keys[:, w], values[:, w], n),
    )
    return tiled(lambda x, a: _finish_layer(layer, x, a), tile, x, attention), cache


def _log_softmax_parts(weights, x):
    """(logits - their max, log of the sum of their exps), float32, of hidden states `[t, embed]`."""
    h = weights.norm(hax.named(x, _TILE_AXES)).rearrange(_TILE_AXES).array
    logits = jnp.einsum("te,ve->tv", h, weights.lm_head.array, preferred_element_type=jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    return shifted, jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))


def exact_log_softmax(weights, layout: ExactLayout, hidden):
    """float32 log-probs `[n, vocab]` of the next token after hidden states `[n, embed]`."""
    shifted, log_sum = tiled(lambda x: _log_softmax_parts(weights, x), layout.tile, hidden)
    return shifted - log_sum[:, None]


def exact_token_logprobs(weights, layout: ExactLayout, hidden, targets):
    """float32 log-prob of `targets` `[n]` after hidden states `[n, embed]`, and the entropy of each
    distribution: the values `exact_log_softmax` gives, read at the targets."""

    def body(x, target):
        shifted, log_sum = _log_softmax_parts(weights, x)
        logp = shifted - log_sum[:, None]
        return jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0], -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    return tiled(body, layout.tile, hidden, targets)


def page_windows(block_tables, page_size: int, context: int):
    """Each sequence's window `[batch, context]` into the flat `[pages * page_size]` KV cache."""
    lanes = jnp.arange(context)
    return block_tables[:, lanes // page_size] * page_size + lanes % page_size


def row_windows(starts, positions, context: int):
    """Windows `[n, context]` into flat token arrays for tokens whose sequence starts at flat index
    `starts[i]` and who sit at `positions[i]` in it; lanes past a token stay on it (they are masked)."""
    lanes = jnp.arange(context)
    return starts[:, None] + jnp.minimum(lanes[None, :], positions[:, None])
