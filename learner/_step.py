"""Loss and gradients of one batch, accumulated over microbatches: a pure function the learner jits.

Normalisers (token counts, sequence counts) come from the whole batch before it is split, and every
microbatch contributes `sum_t a_t l_t` over its own tokens, so the summed gradients equal the gradient of
the whole batch computed at once (up to float summation order).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.models.lm_model import LmHeadModel

from marin_rl.engine import ExactLayout
from marin_rl.learner._config import LearnerConfig
from marin_rl.learner._logprobs import exact_sequence_logprobs, sequence_logprobs
from marin_rl.learner._lora import trainable_params, trainable_spec
from marin_rl.learner._loss import LOSS_METRICS, LossInputs, aggregation_weights, policy_loss, scored_tokens
from marin_rl.learner._model import cast_floating
from marin_rl.rl_example import BATCH_AXIS, PADDING_SEGMENT_ID, POS_AXIS, RlExample


def loss_and_gradients(
    model: LmHeadModel,
    example: RlExample,
    *,
    config: LearnerConfig,
    compute_dtype,
    reference: LmHeadModel | None = None,
    key=None,
    exact: ExactLayout | None = None,
):
    """(loss, gradients with the structure of `trainable_params(model)`, metrics, log-probs).

    The model runs in `compute_dtype` (its float32 parameters get float32 gradients). With
    `config.loss.beta > 0`, reference log-probs are the example's, or else computed with `reference`.
    Metrics: those of `policy_loss`, plus `num_tokens` (non-padding) and `num_loss_tokens`. The log-probs
    `[batch, position]` are the learner's of every token (0 where not scored): with `exact`, the values of
    the engine's exact passes (`exact_sequence_logprobs`).
    """
    Batch = example.input_ids.resolve_axis(BATCH_AXIS)
    microbatch = config.microbatch_rows or Batch.size
    if Batch.size % microbatch != 0:
        raise ValueError(f"LearnerConfig.microbatch_rows = {microbatch} must divide the batch's {Batch.size} rows")
    num_microbatches = Batch.size // microbatch

    def rows_first(named):
        return named.rearrange((BATCH_AXIS, POS_AXIS)).array

    segment_ids = rows_first(example.segment_ids)
    mask = rows_first(example.loss_mask).astype(bool) & scored_tokens(segment_ids)
    num_loss_tokens = mask.sum()
    loss_inputs = LossInputs(
        mask=mask,
        advantages=rows_first(example.advantages),
        policy_logprobs=rows_first(example.policy_logprobs),
        rl_weights=rows_first(example.rl_weights),
        ce_weights=rows_first(example.ce_weights),
        kl_weights=rows_first(example.kl_weights),
        reference_logprobs=None if example.reference_logprobs is None else rows_first(example.reference_logprobs),
        aggregation_weights=aggregation_weights(config.loss.aggregation, mask, segment_ids),
        metric_weights=mask / jnp.maximum(num_loss_tokens, 1),
    )
    if config.loss.beta > 0 and loss_inputs.reference_logprobs is None and reference is None:
        raise ValueError("LossConfig.beta > 0 needs the example's reference_logprobs or a reference model")
    tokens = (rows_first(example.input_ids), rows_first(example.position_ids), segment_ids)
    microbatches = jax.tree.map(lambda x: x.reshape(num_microbatches, microbatch, *x.shape[1:]), (tokens, loss_inputs))
    keys = jax.random.split(key if key is not None else jax.random.PRNGKey(0), num_microbatches)

    def logprobs(model, tokens, key, exact=None):
        Mb = hax.Axis(BATCH_AXIS, tokens[0].shape[0])
        Pos = hax.Axis(POS_AXIS, tokens[0].shape[1])
        named = [hax.named(x, (Mb, Pos)) for x in tokens]
        if exact is not None:
            logp, entropy = exact_sequence_logprobs(model, *named, exact, vocab_block_size=config.vocab_block_size)
        else:
            logp, entropy = sequence_logprobs(model, *named, vocab_block_size=config.vocab_block_size, key=key)
        return logp.array, entropy.array

    trained, frozen = eqx.partition(model, trainable_spec(model))

    def loss_fn(trained, tokens, inputs, key):
        model = eqx.combine(trained, frozen)
        logp, entropy = logprobs(cast_floating(model, compute_dtype), tokens, key, exact)
        loss, metrics = policy_loss(logp, entropy, inputs, config.loss)
        return loss, (metrics, jax.lax.stop_gradient(logp))

    def accumulate(carry, xs):
        grads_sum, loss_sum, metrics_sum = carry
        (mb_tokens, mb_inputs), mb_key = xs
        if config.loss.beta > 0 and mb_inputs.reference_logprobs is None:
            ref_logp, _ = logprobs(reference, mb_tokens, None)
            mb_inputs = dataclasses.replace(mb_inputs, reference_logprobs=jax.lax.stop_gradient(ref_logp))
        (loss, (metrics, logp)), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(trained, mb_tokens, mb_inputs, mb_key)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return (add(grads_sum, grads), loss_sum + loss, add(metrics_sum, metrics)), logp

    zero_grads = jax.tree.map(jnp.zeros_like, trainable_params(model))
    zero_metrics = {name: jnp.zeros((), jnp.float32) for name in LOSS_METRICS}
    init = (zero_grads, jnp.zeros((), jnp.float32), zero_metrics)
    (grads, loss, metrics), logp = jax.lax.scan(accumulate, init, (microbatches, keys))
    metrics = {
        **metrics,
        "num_tokens": jnp.sum(segment_ids != PADDING_SEGMENT_ID),
        "num_loss_tokens": num_loss_tokens,
    }
    return loss, grads, metrics, logp.reshape(segment_ids.shape)
