"""Per-token log-probs: blockwise scoring, the causal shift, and packing invariance."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner import build_model, per_token_logprobs, scored_tokens, token_logprobs_and_entropy
from marin_rl.learner._attention import use_jax_nn_attention
from marin_rl.rl_example import RlExample

logprobs = eqx.filter_jit(per_token_logprobs)


def naive_logprobs_and_entropy(hidden, lm_head, targets):
    log_probs = jax.nn.log_softmax(hidden @ lm_head.T, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, entropy


@pytest.mark.parametrize("block_size", [37, 8, 10, 64])  # one block, 5 with an overlapping last one, ...
def test_blockwise_logprobs_match_full_softmax_values_and_gradients(block_size):
    k_h, k_w, k_t, k_g1, k_g2 = jax.random.split(jax.random.PRNGKey(0), 5)
    hidden = jax.random.normal(k_h, (11, 8))
    lm_head = 2.0 * jax.random.normal(k_w, (37, 8))
    targets = jax.random.randint(k_t, (11,), 0, 37)
    cotangents = (jax.random.normal(k_g1, (11,)), jax.random.normal(k_g2, (11,)))

    def blockwise(h, w):
        return token_logprobs_and_entropy(h, w, targets, block_size)

    def naive(h, w):
        return naive_logprobs_and_entropy(h, w, targets)

    out, vjp = jax.vjp(blockwise, hidden, lm_head)
    expected, expected_vjp = jax.vjp(naive, hidden, lm_head)
    for actual, wanted in zip(out, expected, strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-5)
    for actual, wanted in zip(vjp(cotangents), expected_vjp(cotangents), strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=1e-4, atol=1e-5)


def rollouts_alone(packed, *, pad_to=None):
    """Each rollout of `packed` as its own row starting at position 0: one example padded to `pad_to`
    positions, or (pad_to None) a list of one-row examples of exactly the rollout's length."""
    rollouts = []
    for row in range(packed.num_rows):
        for segment in np.unique(packed.segment_ids[row]):
            if segment >= 0:
                rollouts.append((row, packed.segment_ids[row] == segment))
    fields = [f.name for f in dataclasses.fields(packed) if getattr(packed, f.name) is not None]

    def take(row, where, width):
        out = {}
        for name in fields:
            value = getattr(packed, name)[row, where]
            fill = -1 if name == "segment_ids" else 0
            out[name] = np.pad(value, (0, width - len(value)), constant_values=fill)[None]
        out["segment_ids"] = np.where(out["segment_ids"] >= 0, 0, -1).astype(np.int32)
        return out

    if pad_to is None:
        return rollouts, [
            RlExample.from_packed(type(packed)(**take(row, where, where.sum()))) for row, where in rollouts
        ]
    rows = [take(row, where, pad_to) for row, where in rollouts]
    stacked = {name: np.concatenate([r[name] for r in rows]) for name in fields}
    return rollouts, RlExample.from_packed(type(packed)(**stacked))


@pytest.fixture(scope="module")
def tiny_model(tiny_model_config):
    return build_model(tiny_model_config, 104, key=jax.random.PRNGKey(0))


BACKENDS = {  # the same parameters (same key), attention computed by different kernels
    "vanilla": {"attn_backend": "vanilla"},
    "jax_flash": {"attn_backend": "jax_flash", "flash_block_size": 16},  # blocks small enough to be used
    "cudnn_path_on_xla": {},  # the `cudnn` backend's code, with jax.nn's XLA implementation (CPU)
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_give_each_rollout_its_solo_logprobs(tiny_model, tiny_model_config, packed_batch, example, backend):
    model = build_model(dataclasses.replace(tiny_model_config, **BACKENDS[backend]), 104, key=jax.random.PRNGKey(0))
    if backend == "cudnn_path_on_xla":
        model = use_jax_nn_attention(model, "xla")
    packed_logp, packed_entropy = (np.asarray(x.array) for x in logprobs(model, example))
    # Reference: every rollout in a row of its own, Levanter's default attention.
    rollouts, solo = rollouts_alone(packed_batch, pad_to=packed_batch.max_seq_len)
    solo_logp, solo_entropy = (np.asarray(x.array) for x in logprobs(tiny_model, solo))
    assert len(rollouts) == 8
    for i, (row, where) in enumerate(rollouts):
        np.testing.assert_allclose(packed_logp[row, where], solo_logp[i, : where.sum()], atol=1e-5)
        np.testing.assert_allclose(packed_entropy[row, where], solo_entropy[i, : where.sum()], atol=1e-5)


def test_a_rollout_alone_without_padding_matches_its_packed_logprobs(tiny_model, packed_batch, example):
    packed_logp = np.asarray(logprobs(tiny_model, example)[0].array)
    rollouts, solos = rollouts_alone(packed_batch)
    (row, where), solo = rollouts[1], solos[1]  # the middle rollout of row 0: 12 tokens at positions 7-18
    np.testing.assert_allclose(packed_logp[row, where], logprobs(tiny_model, solo)[0].array[0], atol=1e-5)


def test_padding_and_other_segments_do_not_change_a_rollouts_logprobs(tiny_model, packed_batch, example):
    logp = np.asarray(logprobs(tiny_model, example)[0].array)
    # Row 0 holds segments 0, 1, 2 and padding; rewrite every token outside segment 1.
    outside = packed_batch.segment_ids[0] != 1
    input_ids = packed_batch.input_ids.copy()
    input_ids[0, outside] = (input_ids[0, outside] + 17) % 104
    changed = RlExample.from_packed(dataclasses.replace(packed_batch, input_ids=input_ids))
    changed_logp = np.asarray(logprobs(tiny_model, changed)[0].array)
    np.testing.assert_allclose(changed_logp[0, ~outside], logp[0, ~outside], atol=1e-6)
    assert not np.allclose(changed_logp[0, outside], logp[0, outside])


def test_unscored_tokens_get_zero_and_scored_tokens_are_log_probabilities(tiny_model, packed_batch, example):
    logp = np.asarray(logprobs(tiny_model, example)[0].array)
    scored = np.asarray(scored_tokens(jnp.asarray(packed_batch.segment_ids)))
    assert (logp[~scored] == 0).all()
    assert (logp[scored] < 0).all()
