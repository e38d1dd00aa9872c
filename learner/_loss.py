"""The policy loss: per-token terms and their aggregation, pure functions over `[batch, position]` arrays.

For each token t with mask m_t (the policy sampled it and it is scored: not the first token of its segment),
log-prob logp_t under the learner, behaviour log-prob b_t (from the server), advantage A_t:

    pg_t = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t) * w_t
    ce_t = -logp_t
    kl_t = log(pi/ref) (k1)  or  ref/pi - 1 - log(ref/pi) (k3),  with log(ref/pi) = ref_t - logp_t
    l_t  = rl_weights_t * pg_t + ce_weights_t * ce_t + beta * kl_weights_t * kl_t
    loss = sum_t a_t * m_t * l_t

Ratio and weight: without truncated importance sampling (`tis_cap` None), rho_t = exp(logp_t - b_t) and
w_t = 1 (PPO with the server's policy as the old policy; Schulman et al. 2017). With `tis_cap` C,
rho_t = exp(logp_t - sg(logp_t)), the ratio against the learner's own pre-update policy (1 in value: each
batch gets one optimizer step, so the clip never binds), and w_t = sg(min(exp(logp_t - b_t), C)) corrects for
the gap between the learner and the server (staleness and numerics): truncated importance sampling as in
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training". sg = stop-gradient.
With `mis_cap` C', w_t is also 0 where exp(logp_t - b_t) lies outside [1/C', C'] (masked importance
sampling, IcePop: such tokens are dropped rather than down-weighted).

The aggregation weight a_t comes from the whole batch (see `aggregation_weights`), so summing the loss of
microbatches gives exactly the loss, and the gradient, of the whole batch.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from marin_rl.learner._config import Aggregation, LossConfig, SequenceMean, TokenMean, TokenSum
from marin_rl.rl_example import PADDING_SEGMENT_ID


def scored_tokens(segment_ids: Int[Array, "batch position"]) -> Bool[Array, "batch position"]:
    """Tokens that get a log-prob: not padding and not the first token of their segment (the causal shift
    scores token t with the logits at t - 1, which must belong to the same rollout)."""
    same_as_previous = segment_ids[:, 1:] == segment_ids[:, :-1]
    has_previous = jnp.concatenate([jnp.zeros_like(same_as_previous[:, :1]), same_as_previous], axis=1)
    return has_previous & (segment_ids != PADDING_SEGMENT_ID)


def aggregation_weights(
    aggregation: Aggregation, mask: Bool[Array, "batch position"], segment_ids: Int[Array, "batch position"]
) -> Float[Array, "batch position"]:
    """Per-token weights a_t (0 off the mask) such that the loss is `sum_t a_t * l_t`.

    - token_mean: a_t = 1 / N, N the loss tokens of the batch.
    - sequence_mean (GRPO): a_t = 1 / (G * n_s), n_s the loss tokens of t's sequence s = (row, segment id),
      G the sequences of the batch with at least one loss token. A segment is one contiguous run of its row
      (how the batcher packs).
    - token_sum (Dr.GRPO): a_t = 1 / constant.
    """
    m = mask.astype(jnp.float32)
    match aggregation:
        case TokenMean():
            return m / jnp.maximum(m.sum(), 1.0)
        case TokenSum(constant=constant):
            return m / constant
        case SequenceMean():
            rows, positions = segment_ids.shape
            run_starts = jnp.concatenate([jnp.ones((rows, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
            run_index = jnp.cumsum(run_starts, axis=1) - 1
            sequence = (jnp.arange(rows)[:, None] * positions + run_index).reshape(-1)
            per_sequence = jax.ops.segment_sum(m.reshape(-1), sequence, num_segments=rows * positions)
            tokens_in_sequence = per_sequence[sequence].reshape(rows, positions)
            num_sequences = jnp.sum(run_starts & (tokens_in_sequence > 0))
            return m / jnp.maximum(tokens_in_sequence * num_sequences, 1.0)
        case _:
            raise ValueError(f"unknown aggregation {type(aggregation).__name__}")


LOSS_METRICS = ("pg_loss", "ce_loss", "kl_loss", "kl_ref", "clip_frac", "approx_kl", "entropy", "tis_weight", "mis_masked")


class LossInputs(eqx.Module):
    """Per-token inputs of the loss, all `[batch, position]` and aligned with input_ids."""

    mask: Bool[Array, "batch position"]
    advantages: Float[Array, "batch position"]
    policy_logprobs: Float[Array, "batch position"]
    rl_weights: Float[Array, "batch position"]
    ce_weights: Float[Array, "batch position"]
    kl_weights: Float[Array, "batch position"]
    reference_logprobs: Float[Array, "batch position"] | None
    aggregation_weights: Float[Array, "batch position"]  # a_t, from the whole batch
    metric_weights: Float[Array, "batch position"]  # m_t / N, from the whole batch: metrics are token means


def policy_loss(
    logp: Float[Array, "batch position"],
    entropy: Float[Array, "batch position"],
    inputs: LossInputs,
    config: LossConfig,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The loss `sum_t a_t m_t l_t` (see the module docstring) and metric sums over these tokens.

    The metrics (`LOSS_METRICS`) are sums of batch-normalised terms, so they add up over microbatches:
    `pg_loss`, `ce_loss`, `kl_loss` (the three parts of the loss), and token means over loss tokens of
    `kl_ref` (the KL estimate to the reference; 0 when beta = 0), `clip_frac` (the clipped branch is the
    minimum), `approx_kl` (k3 estimate of KL(behaviour || learner)), `entropy`, `tis_weight` (the IS
    weight, masked tokens counted as 0; 1 without TIS or MIS) and `mis_masked` (the share MIS masks).
    """
    mask, advantages = inputs.mask, inputs.advantages
    # Off the mask the inputs are arbitrary (0 log-probs); zero the exponent there so exp stays finite and
    # its (masked-out) gradient is not 0 * inf.
    behaviour_log_ratio = jnp.where(mask, logp - inputs.policy_logprobs, 0.0)
    if config.tis_cap is None:
        log_ratio = behaviour_log_ratio
        is_weight = jnp.ones_like(logp)
    else:
        log_ratio = logp - jax.lax.stop_gradient(logp)
        is_weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(behaviour_log_ratio), config.tis_cap))
    masked = jnp.zeros_like(mask)
    if config.mis_cap is not None:
        masked = jax.lax.stop_gradient(jnp.abs(behaviour_log_ratio) > jnp.log(config.mis_cap))
        is_weight = jnp.where(masked, 0.0, is_weight)
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high) * advantages
    pg = -jnp.minimum(unclipped, clipped) * is_weight
    ce = -logp
    per_token = inputs.rl_weights * pg + inputs.ce_weights * ce

    a = inputs.aggregation_weights
    w = inputs.metric_weights
    metrics = {"pg_loss": jnp.sum(a * inputs.rl_weights * pg), "ce_loss": jnp.sum(a * inputs.ce_weights * ce)}
    if config.beta > 0:
        if inputs.reference_logprobs is None:
            raise ValueError("LossConfig.beta > 0 needs reference_logprobs")
        kl = kl_estimate(logp, inputs.reference_logprobs, mask, config.kl_estimator)
        per_token = per_token + config.beta * inputs.kl_weights * kl
        metrics["kl_loss"] = jnp.sum(a * config.beta * inputs.kl_weights * kl)
        metrics["kl_ref"] = jnp.sum(w * kl)
    else:
        metrics["kl_loss"] = metrics["kl_ref"] = jnp.zeros((), jnp.float32)
    loss = jnp.sum(a * per_token)

    metrics["clip_frac"] = jnp.sum(w * (clipped < unclipped))
    metrics["approx_kl"] = jnp.sum(w * (jnp.exp(behaviour_log_ratio) - 1.0 - behaviour_log_ratio))
    metrics["entropy"] = jnp.sum(w * entropy)
    metrics["tis_weight"] = jnp.sum(w * is_weight)
    metrics["mis_masked"] = jnp.sum(w * masked)
    return loss, jax.lax.stop_gradient(metrics)


def kl_estimate(
    logp: Float[Array, "batch position"],
    reference_logprobs: Float[Array, "batch position"],
    mask: Bool[Array, "batch position"],
    estimator: str,
) -> Float[Array, "batch position"]:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL
    Divergence", 2020): k1 = log(pi/ref); k3 = r - 1 - log r with r = ref/pi (unbiased, always >= 0)."""
    log_r = jnp.where(mask, reference_logprobs - logp, 0.0)
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"LossConfig.kl_estimator must be 'k1' or 'k3', got {estimator!r}")
