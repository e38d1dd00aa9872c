"""Group-relative advantage estimators: one scalar per rollout from its group's rewards.

Every sampled token of a rollout gets its rollout's advantage (design.md section 3).

- RLOO (Ahmadian et al. 2024, "Back to Basics"): `A_i = r_i - mean_{j != i} r_j`, the
  leave-one-out baseline; unbiased. Equals `n / (n - 1) * (r_i - mean r)`.
- GRPO (Shao et al. 2024, DeepSeekMath): `A_i = (r_i - mean r) / (std r + eps)`, std with
  Bessel's correction as in TRL and verl.
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): `A_i = r_i - mean r`; drops
  the std normalisation that biases towards easy/hard prompts.

A group of one has no baseline: its advantage is 0 under every estimator. The algorithms that use
these (and their options, e.g. `positive_only`) are in `_algorithms.py`.
"""

from __future__ import annotations

import numpy as np


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
