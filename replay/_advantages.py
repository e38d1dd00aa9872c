"""Group-relative advantage estimators: one scalar per rollout from its group's rewards.

Every sampled token of a rollout gets its rollout's advantage (design.md section 3).

- RLOO (Ahmadian et al. 2024, "Back to Basics"): `A_i = r_i - mean_{j != i} r_j`, the
  leave-one-out baseline; unbiased. Equals `n / (n - 1) * (r_i - mean r)`.
- GRPO (Shao et al. 2024, DeepSeekMath): `A_i = (r_i - mean r) / (std r + eps)`, std with
  Bessel's correction as in TRL and verl.
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): `A_i = r_i - mean r`; drops
  the std normalisation that biases towards easy/hard prompts.

A group of one has no baseline: its advantage is 0 under every estimator. `positive_only`
clamps negative advantages to 0 (learn only from better-than-baseline samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import draccus
import numpy as np

AdvantageFunction = Callable[[np.ndarray], np.ndarray]
"""Rewards of one group, shape [n] -> advantages, shape [n]."""


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    n = len(rewards)
    if n < 2:
        return np.zeros(n)
    leave_one_out_mean = (rewards.sum() - rewards) / (n - 1)
    return rewards - leave_one_out_mean


def grpo_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    if len(rewards) < 2:
        return np.zeros(len(rewards))
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + eps)


def dr_grpo_advantages(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    if len(rewards) < 2:
        return np.zeros(len(rewards))
    return rewards - rewards.mean()


@dataclass(frozen=True)
class AdvantageConfig(draccus.ChoiceRegistry):
    """Which estimator a replay buffer uses (`type: rloo | grpo | dr_grpo`)."""

    positive_only: bool = False
    """Clamp negative advantages to 0."""

    @classmethod
    def default_choice_name(cls) -> str:
        return "rloo"

    def build(self) -> AdvantageFunction:
        def advantages(rewards: np.ndarray) -> np.ndarray:
            values = self.compute(rewards)
            return np.maximum(values, 0.0) if self.positive_only else values

        return advantages

    def compute(self, rewards: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@AdvantageConfig.register_subclass("rloo")
@dataclass(frozen=True)
class RlooConfig(AdvantageConfig):
    def compute(self, rewards: np.ndarray) -> np.ndarray:
        return rloo_advantages(rewards)


@AdvantageConfig.register_subclass("grpo")
@dataclass(frozen=True)
class GrpoConfig(AdvantageConfig):
    eps: float = 1e-6
    """Added to the group's std before dividing."""

    def compute(self, rewards: np.ndarray) -> np.ndarray:
        return grpo_advantages(rewards, self.eps)


@AdvantageConfig.register_subclass("dr_grpo")
@dataclass(frozen=True)
class DrGrpoConfig(AdvantageConfig):
    def compute(self, rewards: np.ndarray) -> np.ndarray:
        return dr_grpo_advantages(rewards)
