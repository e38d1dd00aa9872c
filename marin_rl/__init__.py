"""marin-rl: reinforcement learning of language models with JAX, Equinox and Levanter."""

from marin_rl._lazy import lazy_attributes
from marin_rl.types import InferenceMetadata, Rollout, RolloutValidationError, Turn

# RlExample and PackedArrays pull in jax/haliax (seconds); the CLI's offline commands never need them.
_LAZY = {"RlExample": "rl_example", "PackedArrays": "packed"}

__all__ = ["InferenceMetadata", "Rollout", "RolloutValidationError", "Turn", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)
