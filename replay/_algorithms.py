"""Per-env algorithms: how a group of rollouts becomes per-token training signal.

The learner is algorithm-blind (design.md section 5): it applies, per token, an advantage and the
weights of three loss components: `rl` (the clipped policy gradient), `ce` (cross-entropy on the
token, SFT) and `kl` (KL to the learner's reference, times its beta). Each env names its algorithm,
which decides those four numbers for every token of its rollouts. Envs with different algorithms
pack into the same batch. Formulas and configs: docs/algorithms.md.

| type      | advantage of a sampled token              | rl | ce | kl | ages |
|-----------|-------------------------------------------|----|----|----|------|
| `rloo`    | r_i - mean_{j != i} r_j                   | 1  | 0  | 1  | yes  |
| `grpo`    | (r_i - mean r) / (std r + eps)            | 1  | 0  | 1  | yes  |
| `dr_grpo` | r_i - mean r                              | 1  | 0  | 1  | yes  |
| `sft`     | 0                                         | 0  | 1  | 0  | no   |
| `opd`     | coef * (log p_teacher - log p_behaviour)  | 1  | 0  | 0  | yes  |

Tokens that were not sampled (prompt, tool output) get all zeros. SFT rollouts come from a frozen
source (demonstrations or a teacher server), so they never grow stale.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import draccus
import numpy as np

from marin_rl.replay._advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages

if TYPE_CHECKING:
    from marin_rl.replay._buffer import FlatRollout


@dataclass(frozen=True)
class TokenSignal:
    """Per-token training signal of one rollout; every array is aligned with its token ids."""

    advantages: np.ndarray  # float32
    rl_weights: np.ndarray  # float32
    ce_weights: np.ndarray  # float32
    kl_weights: np.ndarray  # float32
    # Arrays may be shared, read-only views (e.g. one run of zeros): copy before changing them.


@dataclass(frozen=True)
class TeacherConfig:
    """A frozen model behind an OpenAI-compatible server (a `marin-rl serve` process, or vLLM)."""

    base_url: str
    """`http://host:port/v1`."""
    model: str = "policy"
    """Model name the server serves."""
    api_key: str = "EMPTY"
    """Sent as the bearer token of requests."""


@dataclass(frozen=True)
class AlgorithmConfig(draccus.ChoiceRegistry, abc.ABC):
    """`type: rloo | grpo | dr_grpo | sft | opd` (default rloo)."""

    @classmethod
    def default_choice_name(cls) -> str:
        return "rloo"

    @property
    def frozen_source(self) -> bool:
        """Rollouts come from a frozen source and never grow stale."""
        return False

    @property
    def group_relative(self) -> bool:
        """Advantages compare rollouts of a group (a group of one has no signal)."""
        return False

    @property
    def uses_rewards(self) -> bool:
        return True

    @property
    def teacher(self) -> TeacherConfig | None:
        """The frozen teacher server this algorithm samples from or scores with, if any."""
        return None

    @property
    def completion_source(self) -> str:
        """Who writes the completions: `policy`, `teacher` (frozen server) or `dataset` (demonstrations)."""
        return "policy"

    @property
    def needs_teacher_logprobs(self) -> bool:
        """Every sampled token must carry the teacher's logprob (the env worker asks the teacher)."""
        return False

    @abc.abstractmethod
    def score_group(self, members: Sequence[FlatRollout]) -> list[TokenSignal]:
        """Per-token signal of each member of one group."""

    def check(self, env: str, group_size: int, temperature: float, drop_zero_variance_groups: bool) -> None:
        """Raise ValueError naming the env if this algorithm cannot work with these settings."""
        if self.group_relative and group_size < 2:
            raise ValueError(
                f"envs[{env}]: algorithm {self.name!r} compares rollouts within a group, so group_size must be "
                f">= 2 (got {group_size}); a group of one always has advantage 0"
            )
        if not self.uses_rewards and drop_zero_variance_groups:
            raise ValueError(
                f"envs[{env}]: buffer.drop_zero_variance_groups filters on rewards, which algorithm {self.name!r} "
                "does not use: it would drop every group"
            )
        if not self.frozen_source and temperature != 1.0:
            raise ValueError(
                f"envs[{env}]: algorithm {self.name!r} trains on the sampled tokens' logprobs, which the server "
                f"reports at the sampling temperature ({temperature}); the learner scores at temperature 1, so "
                "importance ratios would be wrong. Sample at temperature 1.0"
            )

    @property
    def name(self) -> str:
        return self.get_choice_name(type(self))


_ZEROS = np.zeros(1 << 16, np.float32)
_ZEROS.flags.writeable = False


def _zeros(n: int) -> np.ndarray:
    """A read-only run of n zeros (a shared view, not a new array: scoring happens per batch)."""
    return _ZEROS[:n] if n <= len(_ZEROS) else np.zeros(n, np.float32)


@dataclass(frozen=True)
class GroupAdvantageConfig(AlgorithmConfig):
    """Shared by the group-relative estimators: one advantage per rollout, on every sampled token."""

    positive_only: bool = False
    """Clamp negative advantages to 0 (learn only from better-than-baseline samples)."""
    filter_truncated: bool = False
    """Overlong filtering (DAPO): truncated rollouts keep their place in the group's baseline but get
    no RL signal."""

    @property
    def group_relative(self) -> bool:
        return True

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def score_group(self, members: Sequence[FlatRollout]) -> list[TokenSignal]:
        rewards = np.array([m.rollout.reward for m in members], dtype=np.float64)
        values = self.advantages(rewards)
        if self.positive_only:
            values = np.maximum(values, 0.0)
        signals = []
        for member, advantage in zip(members, values):
            sampled, zeros = member.sampled_weights, _zeros(member.num_tokens)
            rl = zeros if (self.filter_truncated and member.rollout.is_truncated) else sampled
            signals.append(TokenSignal(np.float32(advantage) * sampled, rl, zeros, sampled))
        return signals


@AlgorithmConfig.register_subclass("rloo")
@dataclass(frozen=True)
class RlooConfig(GroupAdvantageConfig):
    """REINFORCE leave-one-out (Ahmadian et al. 2024)."""

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rloo_advantages(rewards)


@AlgorithmConfig.register_subclass("grpo")
@dataclass(frozen=True)
class GrpoConfig(GroupAdvantageConfig):
    """GRPO (Shao et al. 2024): group-normalised advantages."""

    eps: float = 1e-6
    """Added to the group's std before dividing."""

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        return grpo_advantages(rewards, self.eps)


@AlgorithmConfig.register_subclass("dr_grpo")
@dataclass(frozen=True)
class DrGrpoConfig(GroupAdvantageConfig):
    """Dr.GRPO (Liu et al. 2025): mean-centred, not std-normalised."""

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        return dr_grpo_advantages(rewards)


@AlgorithmConfig.register_subclass("sft")
@dataclass(frozen=True)
class SftConfig(AlgorithmConfig):
    """Cross-entropy on completions from a frozen source: the env's demonstrations (`source: dataset`,
    each problem's `answer`, or `extras["completion"]`, is the assistant turn) or a frozen teacher
    server (`source: teacher`) that samples the completions."""

    source: str = "dataset"
    """`dataset` or `teacher`."""
    teacher_server: TeacherConfig | None = None
    """The teacher server, for `source: teacher`."""

    def __post_init__(self):
        if self.source not in ("dataset", "teacher"):
            raise ValueError(f"sft.source must be 'dataset' or 'teacher', got {self.source!r}")
        if self.source == "teacher" and self.teacher_server is None:
            raise ValueError("sft with source: teacher needs teacher_server: {base_url: ..., model: ...}")
        if self.source == "dataset" and self.teacher_server is not None:
            raise ValueError("sft with source: dataset takes no teacher_server (set source: teacher to sample from it)")

    @property
    def frozen_source(self) -> bool:
        return True

    @property
    def uses_rewards(self) -> bool:
        return False

    @property
    def teacher(self) -> TeacherConfig | None:
        return self.teacher_server

    @property
    def completion_source(self) -> str:
        return self.source

    def score_group(self, members: Sequence[FlatRollout]) -> list[TokenSignal]:
        signals = []
        for member in members:
            zeros = _zeros(member.num_tokens)
            signals.append(TokenSignal(zeros, zeros, member.sampled_weights, zeros))
        return signals


@AlgorithmConfig.register_subclass("opd")
@dataclass(frozen=True)
class OpdConfig(AlgorithmConfig):
    """On-policy distillation (Agarwal et al. 2024; Lu et al. 2025): the policy samples, a frozen teacher
    scores every sampled token, and the per-token advantage is minus the per-token reverse KL estimate,
    `coef * (log p_teacher - log p_behaviour)`."""

    teacher_server: TeacherConfig | None = None
    """The teacher server that scores the sampled tokens (through a prompt-logprobs request)."""
    coef: float = 1.0
    """Scale of the per-token advantage."""

    def __post_init__(self):
        if self.teacher_server is None:
            raise ValueError("opd needs teacher_server: {base_url: ..., model: ...}")

    @property
    def uses_rewards(self) -> bool:
        return False

    @property
    def teacher(self) -> TeacherConfig | None:
        return self.teacher_server

    @property
    def needs_teacher_logprobs(self) -> bool:
        return True

    def score_group(self, members: Sequence[FlatRollout]) -> list[TokenSignal]:
        signals = []
        for member in members:
            if member.teacher_logprobs is None:
                raise ValueError(f"opd: rollout {member.rollout.rollout_uid!r} has no teacher_logprobs")
            sampled, zeros = member.sampled_weights, _zeros(member.num_tokens)
            reverse_kl = (member.behaviour_logprobs - member.teacher_logprobs) * sampled
            signals.append(TokenSignal((-self.coef * reverse_kl).astype(np.float32), sampled, zeros, zeros))
        return signals
