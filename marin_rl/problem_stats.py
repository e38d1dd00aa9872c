"""Per-problem statistics of a run's rollouts: which problems fail now, since when, and with what signal.

Computed from the viewer's index columns (`environment`, `problem_id`, `group_id`, `policy_version`,
`reward`), so `marin-rl rollouts summary --by problem` and the viewer's problem page show the same.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

RECENT_VERSIONS = 10
"""A problem's recent reward covers the env's last this many policy versions."""


@dataclass(frozen=True)
class ProblemStats:
    env: str
    problem_id: str
    rollouts: int
    recent_rollouts: int
    recent_reward: float | None
    """Mean reward over the env's last RECENT_VERSIONS versions (None: not sampled then)."""
    first_solved: int | None
    """The first policy version that sampled a rollout with reward >= `solved` (None: never)."""
    zero_variance: float | None
    """The share of its recent groups whose rewards were all equal (no learning signal)."""
    latest_group: str
    """Its newest group (the highest policy version)."""
    example_uid: str
    """A rollout of that group."""


def problem_stats(columns: dict[str, list], *, solved: float = 1.0, recent_versions: int = RECENT_VERSIONS) -> list[ProblemStats]:
    """One row per (env, problem), failing problems first: lowest recent reward, then the longest unsolved."""
    env_latest: dict[str, int] = {}
    for env, version in zip(columns["environment"], columns["policy_version"]):
        env_latest[env] = max(env_latest.get(env, version), version)
    rows: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, key in enumerate(zip(columns["environment"], columns["problem_id"])):
        rows[key].append(i)
    out = []
    for (env, problem), members in rows.items():
        versions = np.array([columns["policy_version"][i] for i in members])
        rewards = np.array([columns["reward"][i] for i in members], np.float64)
        recent = versions > env_latest[env] - recent_versions
        groups: dict[str, list[float]] = defaultdict(list)
        for i, is_recent in zip(members, recent):
            if is_recent:
                groups[columns["group_id"][i]].append(columns["reward"][i])
        solved_versions = versions[rewards >= solved]
        newest = members[int(np.argmax(versions))]
        out.append(
            ProblemStats(
                env=env,
                problem_id=problem,
                rollouts=len(members),
                recent_rollouts=int(recent.sum()),
                recent_reward=float(rewards[recent].mean()) if recent.any() else None,
                first_solved=int(solved_versions.min()) if len(solved_versions) else None,
                zero_variance=float(np.mean([len(set(g)) == 1 for g in groups.values()])) if groups else None,
                latest_group=columns["group_id"][newest],
                example_uid=columns["rollout_uid"][newest],
            )
        )
    never = float("inf")
    out.sort(key=lambda s: (s.recent_reward if s.recent_reward is not None else never, -(s.first_solved is None), s.env, s.problem_id))
    return out
