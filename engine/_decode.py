"""The engine's compiled device calls: prefill-and-insert, a chunk of decode steps, prompt scoring.

Everything here has static shapes: `max_seqs` decode slots, block tables of a fixed width, prompts
padded into `[rows, time]` buckets. Which slot holds which request lives on the host (`_scheduler.py`).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from marin_rl.engine._attention import AttentionKernels
from marin_rl.engine._forward import decode_forward, prefill_forward, prompt_logprobs
from marin_rl.engine._kv_cache import KvCache
from marin_rl.engine._pages import SCRATCH_PAGE
from marin_rl.engine._sampling import NO_TOKEN, hits_stop, push_history, sample, sample_key_data
from marin_rl.engine._weights import ServingWeights


class SlotState(eqx.Module):
    """What the device knows of each decode slot."""

    tokens: Int[Array, " slots"]
    """The last sampled token: the next step's input."""
    positions: Int[Array, " slots"]
    """Its position in the sequence (its keys/values are not in the cache yet)."""
    active: Bool[Array, " slots"]
    block_tables: Int[Array, "slots width"]
    """KV pages of the sequence in order; unused entries hold the scratch page."""
    keys: UInt32[Array, "slots 2"]
    """Per-sample base key; the token at position p is drawn with fold_in(key, p)."""
    temperature: Float[Array, " slots"]
    top_p: Float[Array, " slots"]
    top_k: Int[Array, " slots"]
    end_position: Int[Array, " slots"]
    """A sequence ends once it samples a token at this position (prompt length + max_tokens - 1)."""
    stops: Int[Array, "slots stops stop_len"]
    """Stop sequences, right-aligned, left-padded with STOP_PAD."""
    history: Int[Array, "slots stop_len"]
    """The last `stop_len` sampled tokens (NO_TOKEN before there are that many)."""

    @staticmethod
    def empty(slots: int, table_width: int, max_stops: int, stop_len: int) -> SlotState:
        # Copied from the host, each its own buffer (the state is donated): a constant made on the device
        # compiles a program per shape and dtype (10 of the quickstart's 42 at a cold start).
        def full(shape, value, dtype):
            return jax.device_put(np.full(shape, value, dtype))

        return SlotState(
            tokens=full(slots, 0, np.int32),
            positions=full(slots, 0, np.int32),
            active=full(slots, False, bool),
            block_tables=full((slots, table_width), SCRATCH_PAGE, np.int32),
            keys=full((slots, 2), 0, np.uint32),
            temperature=full(slots, 1, np.float32),
            top_p=full(slots, 1, np.float32),
            top_k=full(slots, 0, np.int32),
            end_position=full(slots, 0, np.int32),
            stops=full((slots, max_stops, stop_len), -1, np.int32),
            history=full((slots, stop_len), NO_TOKEN, np.int32),
        )


class PrefillBatch(eqx.Module):
    """New prompts to prefill and the slots their samples take (host-built numpy arrays)."""

    token_ids: Int[Array, "rows time"]
    lengths: Int[Array, " rows"]
    """Prompt length of each row (0 for padding rows)."""
    write_pages: Int[Array, "rows time"]
    """Page each prompt token's keys/values go to; out of range (dropped) for padding."""
    copy_tokens: Int[Array, " copies"]
    """The prompt tokens of a partial last page are written again into the own page of each other
    sample of the prompt: token `copy_tokens[i]` (an index into the flattened `[rows * time]`
    prompts) also goes to page `copy_pages[i]` (out of range: unused entry)."""
    copy_pages: Int[Array, " copies"]
    is_new: Bool[Array, " slots"]
    prompt_row: Int[Array, " slots"]
    """Row of `token_ids` a new slot samples from."""
    block_tables: Int[Array, "slots width"]
    seed_keys: UInt32[Array, "slots 2"]
    sample_index: Int[Array, " slots"]
    temperature: Float[Array, " slots"]
    top_p: Float[Array, " slots"]
    top_k: Int[Array, " slots"]
    end_position: Int[Array, " slots"]
    stops: Int[Array, "slots stops stop_len"]


def prefill_insert(weights: ServingWeights, cache: KvCache, state: SlotState, batch: PrefillBatch, kernels: AttentionKernels, truncate: bool):
    """Prefill the prompts, draw each new sample's first token, and install the new slots (`truncate`:
    whether any new sample uses top-p/top-k, see `sample`).

    Returns `(cache, state, first_tokens, first_logprobs, finished)`, the last three per slot (only the
    new slots' entries mean anything); a sample whose first token ends it is never active."""
    scores, cache = prefill_forward(
        weights, kernels, cache, batch.token_ids, batch.lengths, batch.write_pages, batch.copy_tokens, batch.copy_pages
    )
    positions = batch.lengths[batch.prompt_row]  # the first sampled token follows the prompt
    keys = sample_key_data(batch.seed_keys, batch.sample_index)
    tokens, logprobs = sample(
        scores[batch.prompt_row], keys, positions, batch.temperature, batch.top_p, batch.top_k,
        truncate=truncate, normalized=kernels.exact is not None,
    )
    history = push_history(jnp.full_like(state.history, NO_TOKEN), tokens, batch.is_new)
    finished = hits_stop(history, batch.stops) | (positions >= batch.end_position)
    new = SlotState(
        tokens=tokens,
        positions=positions,
        active=~finished,
        block_tables=batch.block_tables,
        keys=keys,
        temperature=batch.temperature,
        top_p=batch.top_p,
        top_k=batch.top_k,
        end_position=batch.end_position,
        stops=batch.stops,
        history=history,
    )

    def merge(fresh, old):
        mask = batch.is_new.reshape(batch.is_new.shape + (1,) * (fresh.ndim - 1))
        return jnp.where(mask, fresh, old)

    return cache, jax.tree.map(merge, new, state), tokens, logprobs, finished


def decode_chunk(
    weights: ServingWeights, cache: KvCache, state: SlotState, kernels: AttentionKernels, steps: int, slots_used: int, truncate: bool
):
    """`steps` decode steps for the first `slots_used` slots (idle ones among them compute but write
    nothing; the host fills slots from the lowest index, so few requests cost little).
    `truncate`: whether any of them uses top-p/top-k (see `sample`).

    Returns `(cache, state, tokens [slots_used, steps], logprobs [slots_used, steps], active [slots_used])`;
    a slot's token is -1 at the steps it was not active; `active`: whether it still is (an output of its
    own: the returned state is donated to the next call before the host reads this one back)."""
    full_state = state
    state = jax.tree.map(lambda x: x[:slots_used], full_state)
    page_size = cache.keys[0].shape[2]
    slots = jnp.arange(slots_used)

    def step(carry, _):
        cache, s = carry
        # Idle slots write nowhere (out of range): the active ones' targets are distinct, as
        # `write_tokens` needs.
        write_pages = jnp.where(s.active, s.block_tables[slots, s.positions // page_size], cache.keys[0].shape[1])
        scores, cache = decode_forward(weights, kernels, cache, s.tokens, s.positions, s.block_tables, write_pages)
        next_positions = s.positions + 1
        tokens, logprobs = sample(
            scores, s.keys, next_positions, s.temperature, s.top_p, s.top_k, truncate=truncate, normalized=kernels.exact is not None
        )
        history = push_history(s.history, tokens, s.active)
        finished = s.active & (hits_stop(history, s.stops) | (next_positions >= s.end_position))
        emitted = jnp.where(s.active, tokens, -1)
        s = dataclasses.replace(
            s,
            tokens=jnp.where(s.active, tokens, s.tokens),
            positions=jnp.where(s.active, next_positions, s.positions),
            history=history,
            active=s.active & ~finished,
        )
        return (cache, s), (emitted, logprobs)

    (cache, used), (tokens, logprobs) = jax.lax.scan(step, (cache, state), None, length=steps)
    state = jax.tree.map(lambda full, part: full.at[:slots_used].set(part), full_state, used)
    return cache, state, tokens.T, logprobs.T, used.active


def deactivate(state: SlotState, slots_mask: Bool[Array, " slots"]) -> SlotState:
    """Stop the masked slots (their requests were cancelled)."""
    return dataclasses.replace(state, active=state.active & ~slots_mask)


def score_prompt(weights: ServingWeights, kernels: AttentionKernels, token_ids, length, top_k: int):
    """Log-prob, rank and top-k alternatives of each prompt token after the first (`token_ids` `[1, t]`
    padded at the end; causal attention makes the padding irrelevant)."""
    logp = prompt_logprobs(weights, kernels, token_ids, length)[0, :-1]
    token_logp = jnp.take_along_axis(logp, token_ids[0, 1:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logp > token_logp[:, None], axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, top_k)
    return token_logp, ranks, top_ids, top_logp
