"""The learner: Levanter/Equinox policy training on packed RlExamples (design section 5, docs/learner.md).

Configs import eagerly (only draccus); the rest loads on first use, so parsing a config does not import
Levanter (10-20 s).
"""

from marin_rl._lazy import lazy_attributes
from marin_rl._upstream import restore_jax_core_is_constant_dim
from marin_rl.learner._config import (
    Aggregation,
    ConstantSchedule,
    CosineSchedule,
    LearnerConfig,
    LinearSchedule,
    LoraConfig,
    LossConfig,
    LrSchedule,
    ModelConfig,
    OptimizerConfig,
    SequenceMean,
    TokenMean,
    TokenSum,
)

_LAZY = {
    "Learner": "_learner",
    "per_token_logprobs": "_logprobs",
    "sequence_logprobs": "_logprobs",
    "token_logprobs_and_entropy": "_logprobs",
    "LossInputs": "_loss",
    "aggregation_weights": "_loss",
    "kl_estimate": "_loss",
    "policy_loss": "_loss",
    "scored_tokens": "_loss",
    "LearnerMesh": "_mesh",
    "complete_checkpoints": "_checkpoint",
    "directory_written_atomically": "_files",
    "add_adapters": "_lora",
    "build_model": "_model",
    "cast_floating": "_model",
    "compute_dtype": "_model",
    "load_hf_model": "_model",
    "save_hf_model": "_model",
    "build_optimizer": "_optim",
    "loss_and_gradients": "_step",
}

__all__ = [
    "Aggregation",
    "ConstantSchedule",
    "CosineSchedule",
    "LearnerConfig",
    "LinearSchedule",
    "LoraConfig",
    "LossConfig",
    "LrSchedule",
    "ModelConfig",
    "OptimizerConfig",
    "SequenceMean",
    "TokenMean",
    "TokenSum",
    *sorted(_LAZY),
]


__getattr__ = lazy_attributes(__name__, _LAZY, prepare=restore_jax_core_is_constant_dim)  # before any haliax call
