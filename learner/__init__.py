"""The learner: Levanter/Equinox policy training on packed RlExamples (design section 5, docs/learner.md)."""

import marin_rl._compat  # noqa: F401  (before any haliax call)
from marin_rl.learner._config import (
    Aggregation,
    ConstantSchedule,
    CosineSchedule,
    LearnerConfig,
    LossConfig,
    LrSchedule,
    ModelConfig,
    OptimizerConfig,
    SequenceMean,
    TokenMean,
    TokenSum,
)
from marin_rl.learner._learner import Learner
from marin_rl.learner._logprobs import per_token_logprobs, sequence_logprobs, token_logprobs_and_entropy
from marin_rl.learner._loss import LossInputs, aggregation_weights, kl_estimate, policy_loss, scored_tokens
from marin_rl.learner._model import build_model, cast_floating, compute_dtype, load_hf_model, save_hf_model
from marin_rl.learner._optim import build_optimizer
from marin_rl.learner._step import loss_and_gradients

__all__ = [
    "Aggregation",
    "ConstantSchedule",
    "CosineSchedule",
    "Learner",
    "LearnerConfig",
    "LossConfig",
    "LossInputs",
    "LrSchedule",
    "ModelConfig",
    "OptimizerConfig",
    "SequenceMean",
    "TokenMean",
    "TokenSum",
    "aggregation_weights",
    "build_model",
    "build_optimizer",
    "cast_floating",
    "compute_dtype",
    "kl_estimate",
    "load_hf_model",
    "loss_and_gradients",
    "per_token_logprobs",
    "policy_loss",
    "save_hf_model",
    "scored_tokens",
    "sequence_logprobs",
    "token_logprobs_and_entropy",
]
