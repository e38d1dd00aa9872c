"""The loss against a NumPy reference of the formulas in docs/learner.md."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner import (
    LossConfig,
    LossInputs,
    SequenceMean,
    TokenMean,
    TokenSum,
    aggregation_weights,
    policy_loss,
    scored_tokens,
)


def reference_loss(logp, packed, mask, config: LossConfig, reference_logprobs=None):
    """Token by token, then grouped by (row, segment id)."""
    per_token = {}
    for row, pos in zip(*np.nonzero(mask), strict=True):
        lp, b, a = float(logp[row, pos]), float(packed.policy_logprobs[row, pos]), float(packed.advantages[row, pos])
        if config.tis_cap is None:
            rho, weight = np.exp(lp - b), 1.0
        else:
            rho, weight = 1.0, min(np.exp(lp - b), config.tis_cap)
        if config.mis_cap is not None and not 1 / config.mis_cap <= np.exp(lp - b) <= config.mis_cap:
            weight = 0.0
        pg = -min(rho * a, np.clip(rho, 1 - config.eps_low, 1 + config.eps_high) * a) * weight
        loss = packed.rl_weights[row, pos] * pg + packed.ce_weights[row, pos] * -lp
        if config.beta > 0:
            log_r = float(reference_logprobs[row, pos]) - lp
            kl = -log_r if config.kl_estimator == "k1" else np.exp(log_r) - 1 - log_r
            loss += config.beta * packed.kl_weights[row, pos] * kl
        per_token[(row, pos)] = loss
    match config.aggregation:
        case TokenMean():
            return sum(per_token.values()) / len(per_token)
        case TokenSum(constant=constant):
            return sum(per_token.values()) / constant
        case SequenceMean():
            sequences = {}
            for (row, pos), loss in per_token.items():
                sequences.setdefault((row, packed.segment_ids[row, pos]), []).append(loss)
            return np.mean([np.mean(losses) for losses in sequences.values()])


def loss_inputs(packed, aggregation, reference_logprobs=None):
    segment_ids = jnp.asarray(packed.segment_ids)
    mask = jnp.asarray(packed.loss_mask) & scored_tokens(segment_ids)
    return LossInputs(
        mask=mask,
        advantages=jnp.asarray(packed.advantages),
        policy_logprobs=jnp.asarray(packed.policy_logprobs),
        rl_weights=jnp.asarray(packed.rl_weights),
        ce_weights=jnp.asarray(packed.ce_weights),
        kl_weights=jnp.asarray(packed.kl_weights),
        reference_logprobs=None if reference_logprobs is None else jnp.asarray(reference_logprobs),
        aggregation_weights=aggregation_weights(aggregation, mask, segment_ids),
        metric_weights=mask / jnp.maximum(mask.sum(), 1),
    )


def near_behaviour_logprobs(packed, seed, spread=0.5):
    """Learner log-probs within `spread` of the behaviour's, so ratios land on both sides of the clip range."""
    rng = np.random.default_rng(seed)
    return (packed.policy_logprobs + rng.uniform(-spread, spread, packed.input_ids.shape)).astype(np.float32)


def pg_only(inputs):
    return dataclasses.replace(inputs, ce_weights=jnp.zeros_like(inputs.ce_weights))


AGGREGATIONS = [TokenMean(), SequenceMean(), TokenSum(constant=37.0)]


@pytest.mark.parametrize("aggregation", AGGREGATIONS, ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("tis_cap", [None, 1.1])
@pytest.mark.parametrize("kl", [None, "k1", "k3"])
@pytest.mark.parametrize("mis_cap", [None, 1.3])
def test_loss_matches_numpy_reference(packed_batch, aggregation, tis_cap, kl, mis_cap):
    packed = packed_batch
    logp = near_behaviour_logprobs(packed, seed=2)
    reference = near_behaviour_logprobs(packed, seed=3) if kl else None
    config = LossConfig(
        eps_low=0.1,
        eps_high=0.25,
        tis_cap=tis_cap,
        mis_cap=mis_cap,
        beta=0.3 if kl else 0.0,
        kl_estimator=kl or "k3",
        aggregation=aggregation,
    )
    inputs = loss_inputs(packed, aggregation, reference)
    loss, metrics = policy_loss(jnp.asarray(logp), jnp.zeros_like(logp), inputs, config)

    expected = reference_loss(logp, packed, np.asarray(inputs.mask), config, reference)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    parts = metrics["pg_loss"] + metrics["ce_loss"] + metrics["kl_loss"]
    np.testing.assert_allclose(float(parts), float(loss), rtol=1e-5)
    ratio = np.exp(logp - packed.policy_logprobs)[np.asarray(inputs.mask)]
    outside = np.mean((ratio > mis_cap) | (ratio < 1 / mis_cap)) if mis_cap else 0.0
    np.testing.assert_allclose(float(metrics["mis_masked"]), outside, rtol=1e-5)
    assert mis_cap is None or 0 < outside < 1  # the spread puts tokens on both sides of the cap


def test_clipping_on_both_sides_stops_the_gradient():
    # Four loss tokens after a segment's first token: ratios 1.5 / 0.5 with advantages +1 / -1.
    logp = jnp.log(jnp.array([[1.0, 1.5, 0.5, 1.5, 0.5]])) - 3.0
    behaviour = jnp.full((1, 5), -3.0)
    advantages = jnp.array([[0.0, 1.0, -1.0, -1.0, 1.0]])
    mask = jnp.array([[False, True, True, True, True]])
    ones = jnp.ones((1, 5))
    inputs = LossInputs(mask, advantages, behaviour, ones, 0 * ones, 0 * ones, None, mask / 4.0, mask / 4.0)
    config = LossConfig(eps_low=0.2, eps_high=0.2)

    def loss(logp):
        return policy_loss(logp, 0 * logp, inputs, config)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
    # Token 1 (rho 1.5 > 1.2, A > 0) and token 2 (rho 0.5 < 0.8, A < 0) are clipped: constant, no gradient.
    # Token 3 (rho 1.5, A < 0) and token 4 (rho 0.5, A > 0) keep the unclipped term: gradient -A rho / 4.
    np.testing.assert_allclose(grad[0], [0.0, 0.0, 0.0, 1.5 / 4, -0.5 / 4], atol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_frac"]), 0.5)
    np.testing.assert_allclose(float(value), (-1.2 + 0.8 + 1.5 - 0.5) / 4, rtol=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS, ids=lambda a: type(a).__name__)
def test_ppo_gradient_at_ratio_one_is_reinforce(packed_batch, aggregation):
    packed = packed_batch
    inputs = pg_only(loss_inputs(packed, aggregation))
    behaviour = jnp.asarray(packed.policy_logprobs)

    def pg_loss(logp):
        return policy_loss(logp, 0 * logp, inputs, LossConfig(aggregation=aggregation))[0]

    grad = jax.grad(pg_loss)(behaviour)  # at logp = behaviour every ratio is 1
    reinforce = -inputs.advantages * inputs.rl_weights * inputs.aggregation_weights
    np.testing.assert_allclose(grad, reinforce, atol=1e-7)
    assert np.abs(np.asarray(reinforce)).max() > 0


def test_tis_gradient_is_truncated_importance_weighted_reinforce(packed_batch):
    packed = packed_batch
    logp = jnp.asarray(near_behaviour_logprobs(packed, seed=4, spread=1.0))
    inputs = pg_only(loss_inputs(packed, TokenMean()))
    config = LossConfig(tis_cap=1.5)
    grad = jax.grad(lambda lp: policy_loss(lp, 0 * lp, inputs, config)[0])(logp)
    weight = jnp.minimum(jnp.exp(logp - inputs.policy_logprobs), 1.5)
    expected = jnp.where(inputs.mask, -inputs.advantages * weight * inputs.aggregation_weights, 0.0)
    np.testing.assert_allclose(grad, expected, atol=1e-7)


def test_sequence_mean_weights_each_sequence_equally():
    # Row 0: segment 0 has 1 loss token, segment 1 has 3; row 1: segment 0 has 2. Padding has none.
    segment_ids = jnp.array([[0, 0, 1, 1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1]])
    mask = jnp.array([[False, True, False, True, True, True, False], [False, True, True, False, False, False, False]])
    weights = aggregation_weights(SequenceMean(), mask, segment_ids)
    expected = np.array([[0, 1 / 3, 0, 1 / 9, 1 / 9, 1 / 9, 0], [0, 1 / 6, 1 / 6, 0, 0, 0, 0]])
    np.testing.assert_allclose(weights, expected, rtol=1e-6)


def test_scored_tokens_skip_segment_starts_and_padding():
    segment_ids = jnp.array([[0, 0, 0, 1, 1, -1, -1]])
    np.testing.assert_array_equal(scored_tokens(segment_ids), [[False, True, True, False, True, False, False]])


def test_masked_tokens_with_extreme_log_probs_do_not_poison_the_loss(packed_batch):
    inputs = loss_inputs(packed_batch, TokenMean())
    logp = jnp.where(inputs.mask, jnp.asarray(packed_batch.policy_logprobs), 1e4)  # exp would overflow off-mask
    config = LossConfig(tis_cap=2.0, beta=0.1)
    inputs = dataclasses.replace(inputs, reference_logprobs=jnp.full_like(logp, -1e4))
    loss, grad = jax.value_and_grad(lambda lp: policy_loss(lp, 0 * lp, inputs, config)[0])(logp)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
