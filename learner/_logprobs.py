"""Per-token log-probs of packed rows, with the causal shift, scored blockwise over the vocabulary.

`logits[t]` (from the hidden state at position t) predicts token t + 1. We score targets `input_ids[t + 1]`
at every position and then shift the result right by one, so `logprobs[t]` is the log-prob of token t:
index t describes token t, like every other per-token array of an RlExample. The first token of each
segment has no prediction inside its rollout and gets 0 (as do padding tokens); `scored_tokens` says which.

The log-softmax over a large vocabulary is never materialised as `[tokens, vocab]`: a custom VJP runs over
blocks of vocabulary columns with a running max / sum-exp (like Levanter's blockwise cross-entropy), in the
forward pass and again in the backward pass.

`exact_sequence_logprobs` gives the values of the engine's exact passes instead (the bits the engine sampled
with), differentiated as `sequence_logprobs` is.
"""

from __future__ import annotations

import functools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jaxtyping import Array, Float, Int
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel

from marin_rl.engine import ExactLayout, attention_scale, exact_hidden_states, exact_token_logprobs, fresh_keys_and_values, row_windows, unrolled_weights
from marin_rl.learner._loss import scored_tokens
from marin_rl.rl_example import BATCH_AXIS, POS_AXIS, RlExample


def per_token_logprobs(
    model: LmHeadModel,
    example: RlExample,
    *,
    vocab_block_size: int = 16384,
    key=None,
) -> tuple[NamedArray, NamedArray]:
    """Log-prob of each token of `example` given the earlier tokens of its own segment, and the entropy of
    the distribution that predicted it; see `sequence_logprobs` (this reads only the example's
    `input_ids`, `position_ids` and `segment_ids`)."""
    return sequence_logprobs(
        model,
        example.input_ids,
        example.position_ids,
        example.segment_ids,
        vocab_block_size=vocab_block_size,
        key=key,
    )


def sequence_logprobs(
    model: LmHeadModel,
    input_ids: NamedArray,
    position_ids: NamedArray,
    segment_ids: NamedArray,
    *,
    vocab_block_size: int = 16384,
    key=None,
) -> tuple[NamedArray, NamedArray]:
    """Per-token log-probs and predictive entropies of packed rows, both `[batch, position]` float32 and 0
    where `scored_tokens` is False (first token of a segment, padding).

    Segment ids restrict attention to the token's own rollout and position ids restart at 0 per rollout,
    so a rollout packed with others gets the log-probs it would get alone. The model runs in whatever
    dtype its parameters have (cast them first for mixed precision); the softmax is always float32.
    """
    Batch, Pos = input_ids.resolve_axis(BATCH_AXIS), input_ids.resolve_axis(POS_AXIS)
    attn_mask = AttentionMask.causal().with_segment_ids(segment_ids)
    hidden = model.activations(input_ids, attn_mask, key=key, pos_ids=position_ids)
    if isinstance(hidden, tuple):  # models with an auxiliary loss return (activations, aux)
        hidden = hidden[0]
    hidden = hidden.rearrange((Batch, Pos, model.Embed)).array
    lm_head = model.get_lm_head().rearrange((model.Vocab, model.Embed)).array

    # The causal shift: position t predicts token t + 1 ...
    next_ids = jnp.roll(input_ids.rearrange((Batch, Pos)).array, -1, axis=1)
    rows, positions, embed = hidden.shape
    next_logp, next_entropy = token_logprobs_and_entropy(
        hidden.reshape(rows * positions, embed), lm_head, next_ids.reshape(-1), vocab_block_size
    )
    # ... so token t is scored by position t - 1 (what rolls into t = 0 is masked below).
    logp = jnp.roll(next_logp.reshape(rows, positions), 1, axis=1)
    entropy = jnp.roll(next_entropy.reshape(rows, positions), 1, axis=1)
    scored = scored_tokens(segment_ids.rearrange((Batch, Pos)).array)
    return (
        hax.named(jnp.where(scored, logp, 0.0), (Batch, Pos)),
        hax.named(jnp.where(scored, entropy, 0.0), (Batch, Pos)),
    )


def exact_sequence_logprobs(
    model: LmHeadModel,
    input_ids: NamedArray,
    position_ids: NamedArray,
    segment_ids: NamedArray,
    layout: ExactLayout,
    *,
    vocab_block_size: int = 16384,
) -> tuple[NamedArray, NamedArray]:
    """`sequence_logprobs`, with the values of the engine's exact passes (`marin_rl.engine._exact`): a
    rollout's log-probs are the bits the engine computed when it sampled it with these weights, at any
    place in any row. The gradient is `sequence_logprobs`'s (the exact passes run in the forward only)."""
    Batch, Pos = input_ids.resolve_axis(BATCH_AXIS), input_ids.resolve_axis(POS_AXIS)
    ids, positions, segments = (x.rearrange((Batch, Pos)).array for x in (input_ids, position_ids, segment_ids))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def standard(params):
        named = [hax.named(x, (Batch, Pos)) for x in (ids, positions, segments)]
        logp, entropy = sequence_logprobs(eqx.combine(params, static), *named, vocab_block_size=vocab_block_size)
        return logp.array, entropy.array

    @jax.custom_vjp
    def logprobs(params):
        weights = unrolled_weights(eqx.combine(params, static))
        rows, length = ids.shape
        flat_positions = positions.reshape(-1)
        starts = jnp.arange(rows * length, dtype=jnp.int32) - flat_positions  # each token's segment starts here
        windows = row_windows(starts, flat_positions, layout.context)
        hidden, _ = exact_hidden_states(
            weights, layout, ids.reshape(-1), flat_positions, windows, flat_positions + 1, fresh_keys_and_values, attention_scale(weights),
            [None] * len(weights.layers),
        )
        # The causal shift as in `sequence_logprobs`: position t scores token t + 1.
        next_ids = jnp.roll(ids, -1, axis=1).reshape(-1)
        next_logp, next_entropy = exact_token_logprobs(weights, layout, hidden, next_ids)
        scored = scored_tokens(segments)
        logp = jnp.where(scored, jnp.roll(next_logp.reshape(rows, length), 1, axis=1), 0.0)
        entropy = jnp.where(scored, jnp.roll(next_entropy.reshape(rows, length), 1, axis=1), 0.0)
        return logp, entropy

    def forward(params):
        return logprobs(params), params

    def backward(params, cotangents):
        return jax.vjp(standard, params)[1](cotangents)

    logprobs.defvjp(forward, backward)
    logp, entropy = logprobs(params)
    return hax.named(logp, (Batch, Pos)), hax.named(entropy, (Batch, Pos))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def token_logprobs_and_entropy(
    hidden: Float[Array, "tokens embed"],
    lm_head: Float[Array, "vocab embed"],
    targets: Int[Array, " tokens"],
    block_size: int,
) -> tuple[Float[Array, " tokens"], Float[Array, " tokens"]]:
    """`log softmax(hidden @ lm_head.T)[target]` and the entropy of that softmax, per token, float32,
    computed over vocabulary blocks of `block_size` columns. Both outputs are differentiable."""
    logp, entropy, _ = _forward(hidden, lm_head, targets, block_size)
    return logp, entropy


def _blocks(vocab: int, block_size: int) -> tuple[int, int]:
    block = min(block_size, vocab)
    return block, -(-vocab // block)


def _block_logits(hidden, lm_head, targets, i, block):
    """Logits of block i (float32), which columns are new to this block, and the one-hot of the targets.

    The last block is clamped to end at the vocabulary's end, so it may overlap the previous one; the
    overlapping columns were counted already and are masked out (`fresh`)."""
    vocab = lm_head.shape[0]
    start = jnp.minimum(i * block, vocab - block)
    weights = jax.lax.dynamic_slice_in_dim(lm_head, start, block, axis=0)
    logits = jnp.dot(hidden, weights.T, preferred_element_type=jnp.float32)
    columns = start + jnp.arange(block)
    fresh = columns >= i * block
    is_target = (columns[None, :] == targets[:, None]) & fresh[None, :]
    return start, weights, logits, fresh, is_target


def _forward(hidden, lm_head, targets, block_size):
    block, num_blocks = _blocks(lm_head.shape[0], block_size)
    tokens = hidden.shape[0]

    def body(i, carry):
        running_max, sum_exp, sum_exp_logit, target_logit = carry
        _, _, logits, fresh, is_target = _block_logits(hidden, lm_head, targets, i, block)
        logits = jnp.where(fresh[None, :], logits, -jnp.inf)
        new_max = jnp.maximum(running_max, logits.max(axis=1))
        rescale = jnp.exp(running_max - new_max)
        exp = jnp.exp(logits - new_max[:, None])  # 0 on masked columns
        sum_exp = sum_exp * rescale + exp.sum(axis=1)
        sum_exp_logit = sum_exp_logit * rescale + jnp.sum(exp * jnp.where(fresh[None, :], logits, 0.0), axis=1)
        target_logit = target_logit + jnp.sum(jnp.where(is_target, logits, 0.0), axis=1)
        return new_max, sum_exp, sum_exp_logit, target_logit

    zeros = jnp.zeros((tokens,), jnp.float32)
    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    running_max, sum_exp, sum_exp_logit, target_logit = jax.lax.fori_loop(0, num_blocks, body, init)
    log_z = running_max + jnp.log(sum_exp)
    mean_logit = sum_exp_logit / sum_exp  # E_p[logit]
    # H = -sum p log p = log Z - E_p[logit]
    return target_logit - log_z, log_z - mean_logit, (log_z, mean_logit)


def _fwd(hidden, lm_head, targets, block_size):
    logp, entropy, (log_z, mean_logit) = _forward(hidden, lm_head, targets, block_size)
    return (logp, entropy), (hidden, lm_head, targets, log_z, mean_logit)


def _bwd(block_size, residuals, cotangents):
    hidden, lm_head, targets, log_z, mean_logit = residuals
    d_logp, d_entropy = cotangents
    block, num_blocks = _blocks(lm_head.shape[0], block_size)

    def body(i, carry):
        d_hidden, d_lm_head = carry
        start, weights, logits, fresh, is_target = _block_logits(hidden, lm_head, targets, i, block)
        p = jnp.where(fresh[None, :], jnp.exp(logits - log_z[:, None]), 0.0)
        # d logp / d logit_j = [j = target] - p_j;  d H / d logit_j = p_j (E_p[logit] - logit_j)
        d_logits = d_logp[:, None] * (is_target - p) + d_entropy[:, None] * p * (mean_logit[:, None] - logits)
        d_logits = d_logits.astype(hidden.dtype)
        d_hidden = d_hidden + jnp.dot(d_logits, weights, preferred_element_type=jnp.float32)
        d_weights = jnp.dot(d_logits.T, hidden, preferred_element_type=jnp.float32)
        # Add, not set: an overlapping last block must not overwrite the previous block's columns.
        previous = jax.lax.dynamic_slice_in_dim(d_lm_head, start, block, axis=0)
        d_lm_head = jax.lax.dynamic_update_slice_in_dim(d_lm_head, previous + d_weights, start, axis=0)
        return d_hidden, d_lm_head

    init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(lm_head.shape, jnp.float32))
    d_hidden, d_lm_head = jax.lax.fori_loop(0, num_blocks, body, init)
    return d_hidden.astype(hidden.dtype), d_lm_head.astype(lm_head.dtype), None


token_logprobs_and_entropy.defvjp(_fwd, _bwd)
