"""marin-rl: reinforcement learning of language models with JAX, Equinox and Levanter."""

from marin_rl.types import InferenceMetadata, Rollout, RolloutValidationError, Turn

__all__ = ["InferenceMetadata", "PackedArrays", "RlExample", "Rollout", "RolloutValidationError", "Turn"]


def __getattr__(name: str):
    # RlExample pulls in jax/haliax (seconds); the CLI's offline commands never need it.
    if name == "RlExample":
        from marin_rl.rl_example import RlExample

        return RlExample
    if name == "PackedArrays":
        from marin_rl.packed import PackedArrays

        return PackedArrays
    raise AttributeError(f"module 'marin_rl' has no attribute {name!r}")
