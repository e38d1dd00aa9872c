"""Sampling on device: temperature, top-p, top-k, per-sample keys, and stop-sequence matching.

Every draw uses a key derived from (request seed, sample index, position) alone, so a seeded
request gets the same tokens whatever else is batched with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NO_TOKEN = -2
"""Fills the history of recent tokens before a sequence has produced them (no stop sequence holds it)."""
STOP_PAD = -1
"""Left padding of the right-aligned stop sequences."""


def seed_key_data(seed: int) -> np.ndarray:
    """The raw threefry key `[hi, lo]` of a 63-bit seed (`jax.random.PRNGKey` would keep only 32 bits
    without x64, so seeds 0 and 2**62 would sample alike)."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def sample_key_data(seed_keys: jax.Array, sample_index: jax.Array) -> jax.Array:
    """Per-sample base keys `[batch, 2]` from request keys `[batch, 2]` and sample indices `[batch]`."""
    fold = lambda k, i: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), i))  # noqa: E731
    return jax.vmap(fold)(seed_keys, sample_index)


def sample(logits, base_keys, positions, temperature, top_p, top_k, *, truncate: bool, normalized: bool = False):
    """Draw one token per row of `logits` `[batch, vocab]` (float32) at `positions` `[batch]`.

    Returns `(tokens, logprobs)`: the log-prob of each token under the distribution it was drawn from
    (temperature-scaled, top-p/top-k truncated and renormalised); greedy rows (temperature 0) take the
    argmax and report its log-prob under the model's own distribution.

    `truncate` (static) is whether any row may ask for top-p/top-k (`truncates`): the host knows, and
    False compiles the sort out, where a `lax.cond` on the rows had XLA read its predicate back to the
    host every step. `normalized` (static): `logits` are already the model's log-probs (the exact
    passes'), reported as they are at temperature 1 and greedy (a second log-softmax would move their
    last bits off the learner's)."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(scaled, axis=-1)
    if normalized:
        logp = jnp.where(((temperature == 1) | greedy)[:, None], logits, logp)
    if truncate:
        truncating = ~greedy & ((top_p < 1) | (top_k > 0))
        logp = jnp.where(truncating[:, None], _truncate(logp, top_p, top_k), logp)

    def draw(key_data, position, row):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), position)
        return jnp.argmax(row + jax.random.gumbel(key, row.shape, row.dtype))

    drawn = jax.vmap(draw)(base_keys, positions, logp)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def truncates(temperature: float, top_p: float, top_k: int) -> bool:
    """Whether a request's sampling cuts the distribution (host side; see `sample`'s `truncate`)."""
    return temperature > 0 and (top_p < 1 or top_k > 0)


def _truncate(logp, top_p, top_k):
    """Keep each row's smallest set of most likely tokens holding `top_p` of the mass, at most `top_k`
    of them (0: no limit); renormalise. Ties at the threshold are kept."""
    vocab = logp.shape[-1]
    ordered = -jnp.sort(-logp, axis=-1)
    mass_before = jnp.cumsum(jnp.exp(ordered), axis=-1) - jnp.exp(ordered)
    kept = jnp.sum(mass_before < top_p[:, None], axis=-1)
    kept = jnp.where(top_k > 0, jnp.minimum(kept, top_k), kept)
    threshold = jnp.take_along_axis(ordered, jnp.clip(kept - 1, 0, vocab - 1)[:, None], axis=-1)
    cut = jnp.where(logp >= threshold, logp, -jnp.inf)
    return cut - jax.scipy.special.logsumexp(cut, axis=-1, keepdims=True)


def push_history(history, tokens, active):
    """Shift each active row's recent tokens left by one and append its new token."""
    shifted = jnp.concatenate([history[:, 1:], tokens[:, None]], axis=1)
    return jnp.where(active[:, None], shifted, history)


def hits_stop(history, stops):
    """Whether each row's recent tokens `[batch, L]` end with one of its stop sequences `[batch, S, L]`
    (right-aligned, left-padded with STOP_PAD)."""
    used = stops != STOP_PAD
    match = jnp.all(~used | (stops == history[:, None, :]), axis=-1) & jnp.any(used, axis=-1)
    return jnp.any(match, axis=-1)
