"""Records that cross component boundaries: `Turn`, `Rollout`, `InferenceMetadata`.

The token-level truth lives here (design.md section 1): an assistant turn carries the exact ids the
server sampled and their logprobs; every other turn carries the ids the chat template rendered for
it, so concatenating all turns' ids gives the exact sequence the model saw. The learner never
re-tokenizes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import numpy as np

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
FINISH_REASONS: tuple[str, ...] = ("stop", "length")


class RolloutValidationError(ValueError):
    """A rollout broke the record contract. Names the offending field and the rollout uid."""

    def __init__(self, rollout_uid: str, field_name: str, message: str):
        super().__init__(f"rollout {rollout_uid!r}: {field_name}: {message}")
        self.rollout_uid = rollout_uid
        self.field_name = field_name
        self.reason = message


@dataclass(frozen=True, slots=True)
class InferenceMetadata:
    """How an assistant turn was generated."""

    server_id: str
    model: str
    policy_version: int
    """The learner step whose weights sampled this turn."""
    finish_reason: str
    """`stop` (EOS or a stop string) or `length` (hit max_tokens)."""
    latency_s: float = 0.0
    sampling_params: dict[str, Any] = field(default_factory=dict)
    """temperature, top_p, max_tokens, ... as sent to the server."""


@dataclass(frozen=True, slots=True, eq=False)
class Turn:
    """One message of a conversation with the token ids the model saw or sampled for it."""

    role: str
    content: str
    token_ids: np.ndarray
    """int32. Assistant: the sampled ids. Other roles: the chat template's rendering of this turn."""
    logprobs: np.ndarray | None = None
    """float32, same length as `token_ids`; behaviour-policy logprobs of the sampled ids (assistant)."""
    inference_metadata: InferenceMetadata | None = None
    """Assistant turns only."""
    timestamp: float | None = None
    teacher_logprobs: np.ndarray | None = None
    """float32, same length as `token_ids`: a frozen teacher's logprob of each sampled id (assistant turns
    of on-policy distillation envs; None elsewhere)."""

    def __post_init__(self):
        # Normalise list inputs so equality, packing and storage see one dtype.
        object.__setattr__(self, "token_ids", np.asarray(self.token_ids, dtype=np.int32))
        for name in ("logprobs", "teacher_logprobs"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, np.asarray(value, dtype=np.float32))

    @property
    def is_sampled(self) -> bool:
        return self.role == "assistant"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Turn):
            return NotImplemented
        return (
            self.role == other.role
            and self.content == other.content
            and np.array_equal(self.token_ids, other.token_ids)
            and _optional_arrays_equal(self.logprobs, other.logprobs)
            and self.inference_metadata == other.inference_metadata
            and self.timestamp == other.timestamp
            and _optional_arrays_equal(self.teacher_logprobs, other.teacher_logprobs)
        )

    __hash__ = None  # mutable arrays inside


@dataclass(frozen=True, slots=True)
class Rollout:
    """A conversation sampled for one problem, scored by the env's verifier."""

    environment: str
    problem_id: str
    rollout_uid: str
    group_id: str
    """Rollouts sampled together for one prompt share it; advantages are computed per group."""
    turns: tuple[Turn, ...]
    rewards: dict[str, float]
    """Named rewards from the env's reward functions."""
    reward: float
    """Weighted sum of `rewards` (weights from the env config)."""
    is_truncated: bool = False
    """True when generation stopped at max_tokens (or the row length) rather than at a stop."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras (answer, verifier errors, ...)."""

    def __post_init__(self):
        object.__setattr__(self, "turns", tuple(self.turns))

    def __iter__(self) -> Iterator[Turn]:
        return iter(self.turns)

    @property
    def policy_version(self) -> int:
        """The oldest policy version that sampled any of its assistant turns (its age)."""
        versions = [t.inference_metadata.policy_version for t in self.turns if t.inference_metadata is not None]
        if not versions:
            raise RolloutValidationError(self.rollout_uid, "turns", "no assistant turn with inference_metadata")
        return min(versions)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns if t.is_sampled)

    def token_ids(self) -> np.ndarray:
        """All ids of the conversation in order: what the model saw."""
        return np.concatenate([t.token_ids for t in self.turns]).astype(np.int32, copy=False)

    def sampled_mask(self) -> np.ndarray:
        """True on tokens the policy sampled (aligned with `token_ids()`)."""
        return np.concatenate([np.full(len(t.token_ids), t.is_sampled) for t in self.turns])

    def behaviour_logprobs(self) -> np.ndarray:
        """Sampling logprob of each sampled token, 0 elsewhere (aligned with `token_ids()`)."""
        parts = [
            t.logprobs if t.is_sampled else np.zeros(len(t.token_ids), np.float32) for t in self.turns
        ]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def teacher_logprobs(self) -> np.ndarray | None:
        """The teacher's logprob of each sampled token, 0 elsewhere; None if no turn carries them."""
        if all(t.teacher_logprobs is None for t in self.turns):
            return None
        parts = [
            t.teacher_logprobs if t.is_sampled and t.teacher_logprobs is not None else np.zeros(len(t.token_ids), np.float32)
            for t in self.turns
        ]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def validate(self, vocab_size: int | None = None) -> Rollout:
        """Raise `RolloutValidationError` naming the field if the record breaks the contract (with
        `vocab_size`, token ids must also be below it)."""
        uid = self.rollout_uid
        for name in ("environment", "problem_id", "rollout_uid", "group_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise RolloutValidationError(uid, name, f"must be a non-empty string, got {value!r}")
        if not self.turns:
            raise RolloutValidationError(uid, "turns", "a rollout needs at least one turn")
        if not _is_finite_number(self.reward):
            raise RolloutValidationError(uid, "reward", f"must be a finite number, got {self.reward!r}")
        for name, value in self.rewards.items():
            if not _is_finite_number(value):
                raise RolloutValidationError(uid, f"rewards[{name!r}]", f"must be a finite number, got {value!r}")
        has_assistant = False
        for i, turn in enumerate(self.turns):
            where = f"turns[{i}]"
            if turn.role not in ROLES:
                raise RolloutValidationError(uid, f"{where}.role", f"must be one of {ROLES}, got {turn.role!r}")
            if turn.token_ids.ndim != 1:
                raise RolloutValidationError(uid, f"{where}.token_ids", "must be one-dimensional")
            if (turn.token_ids < 0).any():
                raise RolloutValidationError(uid, f"{where}.token_ids", "token ids must be >= 0")
            if vocab_size is not None and len(turn.token_ids) and turn.token_ids.max() >= vocab_size:
                raise RolloutValidationError(
                    uid, f"{where}.token_ids", f"token id {int(turn.token_ids.max())} is not below the vocabulary size {vocab_size}"
                )
            if not turn.is_sampled:
                if turn.logprobs is not None and len(turn.logprobs) != len(turn.token_ids):
                    raise RolloutValidationError(
                        uid,
                        f"{where}.logprobs",
                        f"must have length {len(turn.token_ids)} like token_ids, got {len(turn.logprobs)}",
                    )
                continue
            has_assistant = True
            if len(turn.token_ids) == 0:
                raise RolloutValidationError(uid, f"{where}.token_ids", "assistant turn is empty")
            if turn.logprobs is None:
                raise RolloutValidationError(uid, f"{where}.logprobs", "assistant turn needs sampled logprobs")
            for name in ("logprobs", "teacher_logprobs"):
                values = getattr(turn, name)
                if values is None:
                    continue
                if len(values) != len(turn.token_ids):
                    raise RolloutValidationError(
                        uid, f"{where}.{name}", f"must have length {len(turn.token_ids)} like token_ids, got {len(values)}"
                    )
                if not np.isfinite(values).all():
                    raise RolloutValidationError(uid, f"{where}.{name}", "contains NaN or inf")
                if (values > 1e-4).any():
                    raise RolloutValidationError(uid, f"{where}.{name}", "log-probabilities must be <= 0")
            meta = turn.inference_metadata
            if meta is None:
                raise RolloutValidationError(uid, f"{where}.inference_metadata", "assistant turn needs it")
            if not isinstance(meta.policy_version, int) or meta.policy_version < 0:
                raise RolloutValidationError(
                    uid, f"{where}.inference_metadata.policy_version", f"must be an int >= 0, got {meta.policy_version!r}"
                )
            if meta.finish_reason not in FINISH_REASONS:
                raise RolloutValidationError(
                    uid,
                    f"{where}.inference_metadata.finish_reason",
                    f"must be one of {FINISH_REASONS}, got {meta.finish_reason!r}",
                )
        if not has_assistant:
            raise RolloutValidationError(uid, "turns", "needs at least one assistant turn")
        return self


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) and math.isfinite(value)


def _optional_arrays_equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a, b)
