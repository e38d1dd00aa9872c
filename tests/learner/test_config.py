"""Configs: YAML-style decoding with draccus, validation, the learning-rate schedule, weight decay."""

import draccus
import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import numpy as np
import pytest

from marin_rl.learner import (
    CosineSchedule,
    LinearSchedule,
    LearnerConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    SequenceMean,
    TokenSum,
    build_optimizer,
)
from marin_rl.learner._optim import weight_decay_mask


def test_configs_decode_from_yaml_style_dicts_with_type_choices():
    config = draccus.decode(
        LearnerConfig,
        {
            "loss": {"aggregation": {"type": "token_sum", "constant": 512}, "tis_cap": 2.0},
            "optimizer": {"schedule": {"type": "cosine", "decay_steps": 10}},
            "microbatch_rows": 4,
        },
    )
    assert config.loss.aggregation == TokenSum(constant=512.0)
    assert config.optimizer.schedule == CosineSchedule(decay_steps=10)
    assert draccus.decode(LearnerConfig, draccus.encode(config)) == config
    assert draccus.decode(LossConfig, {"aggregation": {"type": "sequence_mean"}}).aggregation == SequenceMean()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(family="gpt2"), "ModelConfig.family"),
        (lambda: ModelConfig(attn_backend="flash3"), "ModelConfig.attn_backend"),
        (lambda: LossConfig(kl_estimator="k2"), "LossConfig.kl_estimator"),
        (lambda: LossConfig(eps_low=1.0), "LossConfig.eps_low"),
        (lambda: TokenSum(constant=0.0), "TokenSum.constant"),
        (lambda: LearnerConfig(microbatch_rows=0), "LearnerConfig.microbatch_rows"),
        (lambda: OptimizerConfig(learning_rate=-1e-3), "OptimizerConfig.learning_rate"),
        (lambda: OptimizerConfig(learning_rate=float("nan")), "OptimizerConfig.learning_rate"),
        (lambda: OptimizerConfig(warmup_steps=-1), "OptimizerConfig.warmup_steps"),
        (lambda: OptimizerConfig(max_grad_norm=0.0), "OptimizerConfig.max_grad_norm"),
    ],
)
def test_invalid_config_values_name_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_warmup_then_cosine_schedule():
    _, schedule = build_optimizer(
        OptimizerConfig(learning_rate=1.0, warmup_steps=3, schedule=CosineSchedule(decay_steps=10, min_lr_ratio=0.1))
    )
    lrs = [float(schedule(step)) for step in (0, 1, 2, 3, 8, 13, 50)]
    np.testing.assert_allclose(lrs, [0.25, 0.5, 0.75, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1], rtol=1e-6)


def test_linear_schedule_decays_as_transformers_linear_does():
    # transformers' `linear` without warmup over T steps: lr * (T - t) / T at step t (TRL's default).
    _, schedule = build_optimizer(OptimizerConfig(learning_rate=2.0, schedule=LinearSchedule(decay_steps=4)))
    np.testing.assert_allclose([float(schedule(t)) for t in range(6)], [2.0, 1.5, 1.0, 0.5, 0.0, 0.0], rtol=1e-6)


class _Block(eqx.Module):
    proj: hnn.Linear
    input_layernorm: hnn.RmsNorm


def test_weight_decay_skips_biases_and_norms():
    In, Out = hax.Axis("embed", 4), hax.Axis("mlp", 8)
    block = _Block(hnn.Linear.init(In=In, Out=Out, key=jax.random.PRNGKey(0), use_bias=True), hnn.RmsNorm.init(In))
    mask = weight_decay_mask(block)
    assert mask.proj.weight is True
    assert mask.proj.bias is False
    assert mask.input_layernorm.weight is False
