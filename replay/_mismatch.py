"""Train/inference mismatch: how far the learner's log-probs of sampled tokens are from the server's.

For a token sampled by the behaviour policy mu (the server) and scored by the learner's pi before its
update, with log-ratio d = log pi - log mu:
- `kl`: mean of the k3 estimate `exp(d) - 1 - d` of KL(mu || pi) (Schulman 2020; >= 0, unbiased);
- `max_abs_diff`: the largest |d|;
- `frac_capped`: the share of tokens whose ratio exp(d) exceeds `cap`, the tokens a truncated
  importance weight (TIS, `learner.loss.tis_cap`) would cut.

Tokens sampled with the weights the learner holds (same policy version) measure numerics alone: 0 with
exact numerics. Tokens from older versions add the drift of the updates since, reported apart
(`stale_kl`, `stale_tokens`).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from marin_rl.replay._batcher import Batch

DEFAULT_MISMATCH_CAP = 2.0
"""`frac_capped`'s cap when the loss uses no TIS cap of its own (2: a common TIS setting)."""


def mismatch_metrics(batch: Batch, learner_logprobs: np.ndarray, envs: Collection[str], cap: float) -> dict[str, float]:
    """`mismatch/{env}/...` for each of `envs` (those sampled by the policy) with tokens in `batch`;
    `learner_logprobs` `[rows, positions]` are the learner's of the batch's tokens at `batch.policy_version`."""
    fresh: dict[str, list[np.ndarray]] = {env: [] for env in envs}
    stale: dict[str, list[np.ndarray]] = {env: [] for env in envs}
    for group in batch.groups:
        if group.env not in fresh:
            continue
        for member, (row, offset) in zip(group.members, batch.plan.placements[group.env][group.group_id]):
            log_ratio = learner_logprobs[row, offset : offset + member.num_tokens] - member.behaviour_logprobs
            versions = member.token_versions
            fresh[group.env].append(log_ratio[versions == batch.policy_version])
            stale[group.env].append(log_ratio[(versions >= 0) & (versions != batch.policy_version)])
    out: dict[str, float] = {}
    for env in envs:
        same = np.concatenate(fresh[env]) if fresh[env] else np.zeros(0, np.float32)
        older = np.concatenate(stale[env]) if stale[env] else np.zeros(0, np.float32)
        prefix = f"mismatch/{env}/"
        out[prefix + "tokens"] = float(len(same))
        out[prefix + "stale_tokens"] = float(len(older))
        if len(same):
            out[prefix + "kl"] = _k3(same)
            out[prefix + "max_abs_diff"] = float(np.abs(same).max())
            out[prefix + "frac_capped"] = float(np.mean(same > np.log(cap)))
        if len(older):
            out[prefix + "stale_kl"] = _k3(older)
    return out


def _k3(log_ratio: np.ndarray) -> float:
    d = log_ratio.astype(np.float64)
    return float(np.mean(np.expm1(d) - d))
