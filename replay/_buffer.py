"""ReplayBuffer: one per env. Validates, stores and ages rollouts; scores groups for the batcher."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal, Mapping

import numpy as np

from marin_rl.storage import RolloutWriter, append_reject, env_rejects_path, env_rollout_dir
from marin_rl.types import Rollout, RolloutValidationError, Turn
from marin_rl.replay._algorithms import AlgorithmConfig, RlooConfig, TokenSignal
from marin_rl.replay._packing import GroupSpec

logger = logging.getLogger(__name__)

OverlongPolicy = Literal["reject", "truncate"]


@dataclass(frozen=True)
class ReplayBufferConfig:
    max_age: int = 1
    """Drop rollouts whose policy version is below `current - max_age` (1: up to one step stale): the
    per-env cap on staleness. Rollouts of a frozen source (sft) never age."""
    min_group_size: int = 2
    """A group with fewer surviving rollouts is not trained on (it may still grow)."""
    drop_zero_variance_groups: bool = False
    """Dynamic filtering: drop groups whose rewards are all equal (zero advantage, no learning signal),
    counted in `replays/{env}/frac_filtered`."""
    flush_every_rollouts: int = 512
    """Write a Parquet segment once this many rollouts are pending."""
    flush_every_s: float = 30.0
    """... or once the oldest pending rollout is this old."""

    def __post_init__(self):
        if self.max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {self.max_age}")
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be >= 1, got {self.min_group_size}")


@dataclass(frozen=True)
class FlatRollout:
    """A stored rollout with its flat per-token arrays, computed once when it arrives."""

    rollout: Rollout
    token_ids: np.ndarray  # int32, every turn's ids in order
    sampled_mask: np.ndarray  # bool, True on assistant (sampled) tokens
    sampled_weights: np.ndarray  # float32 copy of sampled_mask: the default weight of a loss component
    behaviour_logprobs: np.ndarray  # float32, sampling logprobs on sampled tokens, 0 elsewhere
    teacher_logprobs: np.ndarray | None  # float32, a teacher's logprobs on sampled tokens (opd), else None
    policy_version: int
    token_versions: np.ndarray  # int64, the policy version that sampled each token, -1 on tokens not sampled

    @staticmethod
    def of(rollout: Rollout) -> FlatRollout:
        sampled = rollout.sampled_mask()
        versions = [
            np.full(len(t.token_ids), t.inference_metadata.policy_version if t.is_sampled and t.inference_metadata else -1)
            for t in rollout.turns
        ]
        return FlatRollout(
            rollout,
            rollout.token_ids(),
            sampled,
            sampled.astype(np.float32),
            rollout.behaviour_logprobs(),
            rollout.teacher_logprobs(),
            rollout.policy_version,
            np.concatenate(versions).astype(np.int64),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ScoredGroup:
    """A group taken for training, with its algorithm's per-token signal for each member."""

    env: str
    group_id: str
    members: tuple[FlatRollout, ...]
    signals: tuple[TokenSignal, ...]

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.members)


@dataclass
class _Counters:
    """What arrived since the last metrics report."""

    rollouts: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    truncated: int = 0
    reward_failed: int = 0  # a reward function raised, timed out or returned no number
    rewards: list[float] = field(default_factory=list)
    named_rewards: dict[str, list[float]] = field(default_factory=dict)
    teacher_kl: list[float] = field(default_factory=list)  # per rollout: sum over sampled tokens
    teacher_kl_tokens: int = 0
    neg_logprob: float = 0.0  # sum of -log p over the sampled tokens


class ReplayBuffer:
    """Holds one env's rollouts by group until the batcher takes them.

    `add` is thread-safe and never blocks on anything but a short lock (safe to call from an
    asyncio worker). Bad rollouts are rejected one by one: counted, written to
    `RUN/rejects/{env}.jsonl`, and the rest of the call and of the buffer are unaffected.
    """

    def __init__(
        self,
        env: str,
        config: ReplayBufferConfig = ReplayBufferConfig(),
        *,
        algorithm: AlgorithmConfig = RlooConfig(),
        run_dir: str | Path | None = None,
        max_seq_len: int | None = None,
        overlong: OverlongPolicy = "reject",
        vocab_size: int | None = None,
    ):
        """`vocab_size`: token ids must be below it (the policy's embedding rows); None: not checked."""
        self.env = env
        self.vocab_size = vocab_size
        self.config = config
        self.algorithm = algorithm
        self.max_seq_len = max_seq_len
        self.overlong = overlong
        self._dir = env_rollout_dir(run_dir, env) if run_dir is not None else None
        self._rejects = env_rejects_path(run_dir, env) if run_dir is not None else None
        self._writer = (
            RolloutWriter(self._dir, config.flush_every_rollouts, config.flush_every_s) if self._dir else None
        )
        self._groups: dict[str, list[FlatRollout]] = {}  # insertion order = arrival order
        self._num_rollouts = 0  # kept in step with _groups, so size() is O(1) (workers poll it)
        self._num_tokens = 0
        self._tokens_by_version: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._data_arrived = threading.Condition(self._lock)
        self._policy_version = 0
        self._oldest_version = 2**62  # lower bound on the versions held; lets ageing skip its scan
        self._new = _Counters()
        self._totals = dict(
            rejected=0, dropped_stale=0, dropped_unused=0, filtered_groups=0, overlong_truncated=0, overlong_rejected=0
        )
        self._groups_seen = 0
        self._frac_used_in_batch: float | None = None

    # ---- producers ----

    def add(self, rollouts: Iterable[Rollout]) -> int:
        """Validate and store rollouts; returns how many were accepted."""
        accepted: list[Rollout] = []
        rejects: list[dict] = []
        for rollout in rollouts:
            try:
                rollout = self._check(rollout)
            except RolloutValidationError as e:
                logger.warning("%s: rejected %s", self.env, e)
                rejects.append(
                    dict(env=self.env, rollout_uid=e.rollout_uid, field=e.field_name, reason=e.reason, time=time.time())
                )
                continue
            accepted.append(rollout)
        flat = {r.rollout_uid: FlatRollout.of(r) for r in accepted}  # outside the lock: O(tokens)
        with self._lock:
            self._totals["rejected"] += len(rejects)
            for rollout in accepted:
                entry = flat[rollout.rollout_uid]
                if rollout.group_id not in self._groups:
                    self._groups_seen += 1
                self._groups.setdefault(rollout.group_id, []).append(entry)
                self._num_rollouts += 1
                self._num_tokens += entry.num_tokens
                self._tokens_by_version[entry.policy_version] += entry.num_tokens
                self._oldest_version = min(self._oldest_version, entry.policy_version)
                self._count_new(entry)
            if accepted:
                self._data_arrived.notify_all()
        if self._rejects is not None:
            for record in rejects:
                append_reject(self._rejects, record)
        if self._writer is not None and accepted:
            self._writer.append(accepted)
        return len(accepted)

    def _check(self, rollout: Rollout) -> Rollout:
        if not isinstance(rollout, Rollout):
            raise RolloutValidationError("?", "rollout", f"expected a Rollout, got {type(rollout).__name__}")
        rollout.validate(self.vocab_size)
        if rollout.environment != self.env:
            raise RolloutValidationError(
                rollout.rollout_uid, "environment", f"this buffer holds {self.env!r}, got {rollout.environment!r}"
            )
        if self.algorithm.needs_teacher_logprobs:
            for i, turn in enumerate(rollout.turns):
                if turn.is_sampled and turn.teacher_logprobs is None:
                    raise RolloutValidationError(
                        rollout.rollout_uid,
                        f"turns[{i}].teacher_logprobs",
                        f"algorithm {self.algorithm.name!r} needs the teacher's logprob of every sampled token",
                    )
        if self.max_seq_len is not None and rollout.num_tokens > self.max_seq_len:
            if self.overlong == "reject":
                with self._lock:
                    self._totals["overlong_rejected"] += 1
                raise RolloutValidationError(
                    rollout.rollout_uid,
                    "turns",
                    f"{rollout.num_tokens} tokens is longer than max_seq_len {self.max_seq_len} (overlong: reject)",
                )
            rollout = truncate_rollout(rollout, self.max_seq_len)
            with self._lock:
                self._totals["overlong_truncated"] += 1
        return rollout

    def _count_new(self, entry: FlatRollout) -> None:
        new, rollout = self._new, entry.rollout
        new.rollouts += 1
        new.tokens += entry.num_tokens
        new.generated_tokens += rollout.num_generated_tokens
        new.truncated += int(rollout.is_truncated)
        new.reward_failed += bool(rollout.metadata.get("reward_errors"))
        new.neg_logprob -= float(np.sum(entry.behaviour_logprobs))  # 0 off the sampled tokens
        if entry.teacher_logprobs is not None:
            sampled = entry.sampled_mask
            new.teacher_kl.append(float(np.sum(entry.behaviour_logprobs[sampled] - entry.teacher_logprobs[sampled])))
            new.teacher_kl_tokens += int(sampled.sum())
        new.rewards.append(float(rollout.reward))
        for name, value in rollout.rewards.items():
            new.named_rewards.setdefault(name, []).append(float(value))

    # ---- ageing ----

    def set_policy_version(self, version: int) -> int:
        """Advance the current version and drop what became too old; returns how many were dropped."""
        with self._lock:
            self._policy_version = version
            oldest_allowed = version - self.config.max_age
            dropped = 0
            if self.algorithm.frozen_source or self._oldest_version >= oldest_allowed:
                return 0  # nothing can be stale: skip the scan
            self._oldest_version = version
            for group_id in list(self._groups):
                entries = self._groups[group_id]
                kept = [e for e in entries if e.policy_version >= oldest_allowed]
                dropped += len(entries) - len(kept)
                self._forget([e for e in entries if e.policy_version < oldest_allowed])
                self._oldest_version = min([self._oldest_version, *(e.policy_version for e in kept)])
                if kept:
                    self._groups[group_id] = kept
                else:
                    del self._groups[group_id]
            self._totals["dropped_stale"] += dropped
            return dropped

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def _forget(self, entries: list[FlatRollout]) -> None:
        """Update the counters for entries leaving the buffer (caller holds the lock)."""
        self._num_rollouts -= len(entries)
        self._num_tokens -= sum(e.num_tokens for e in entries)
        for entry in entries:
            self._tokens_by_version[entry.policy_version] -= entry.num_tokens
            if not self._tokens_by_version[entry.policy_version]:
                del self._tokens_by_version[entry.policy_version]

    # ---- the batcher's side ----

    def candidates(self) -> Iterator[GroupSpec]:
        """Usable groups, newest first, lazily. Zero-variance groups are dropped here when configured."""
        with self._lock:
            snapshot = list(reversed(self._groups.items()))
        for group_id, entries in snapshot:
            lengths = tuple(e.num_tokens for e in entries)
            if len(lengths) < self.config.min_group_size:
                continue
            if self.config.drop_zero_variance_groups and _rewards_all_equal(entries[: len(lengths)]):
                with self._lock:
                    filtered = self._groups.pop(group_id, None)
                    if filtered is not None:
                        self._forget(filtered)
                        self._totals["filtered_groups"] += 1
                continue
            yield GroupSpec(group_id, lengths)

    def take(self, sizes: Mapping[str, int]) -> list[ScoredGroup]:
        """Remove and score the first `sizes[group_id]` rollouts of each group (as many as were
        planned; members that arrived after `candidates` stay in the buffer)."""
        taken: list[ScoredGroup] = []
        with self._lock:
            available = self._num_rollouts
            for group_id, size in sizes.items():
                entries = self._groups.pop(group_id)
                members, rest = entries[:size], entries[size:]
                self._forget(members)
                if rest:
                    self._groups[group_id] = rest
                taken.append(ScoredGroup(self.env, group_id, tuple(members), tuple(self.algorithm.score_group(members))))
            used = sum(len(g.members) for g in taken)
            self._frac_used_in_batch = used / available if available else 0.0
        return taken

    def drop_all(self) -> int:
        """Forget every rollout held (a deterministic run carries nothing from one batch to the next,
        so that a resumed run sees what an uninterrupted one saw); counted in `dropped_unused`."""
        with self._lock:
            dropped = self._num_rollouts
            self._groups.clear()
            self._num_rollouts = self._num_tokens = 0
            self._tokens_by_version.clear()
            self._totals["dropped_unused"] += dropped
        return dropped

    def wait_for_data(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for new rollouts; True if some arrived."""
        with self._data_arrived:
            return self._data_arrived.wait(timeout)

    def size(self) -> tuple[int, int]:
        """(rollouts, tokens) currently held."""
        with self._lock:
            return self._num_rollouts, self._num_tokens

    def tokens_ahead(self) -> int:
        """Tokens held that the next policy version still trains on: env workers pause on this, not on
        `size`, so that rollouts about to age out do not hold back fresh ones (docs/distributed.md, 4
        GPUs). With max_age 0 (nothing is kept across versions) and for a frozen source: all of them."""
        with self._lock:
            if self.algorithm.frozen_source:
                return self._num_tokens
            oldest_kept = self._policy_version + 1 - max(self.config.max_age, 1)
            return sum(tokens for version, tokens in self._tokens_by_version.items() if version >= oldest_kept)

    # ---- reporting ----

    def metrics(self) -> dict[str, float]:
        """The `replays/{env}/...` metrics of design.md section 3; the `new_*` figures reset each call."""
        prefix = f"replays/{self.env}/"
        with self._lock:
            entries = [e for group in self._groups.values() for e in group]
            new, self._new = self._new, _Counters()
            totals = dict(self._totals)
            groups_seen = self._groups_seen
            frac_used = self._frac_used_in_batch
            version = self._policy_version
        out: dict[str, float] = {
            "rollouts_in_buffer": len(entries),
            "tokens_in_buffer": sum(e.num_tokens for e in entries),
            "frac_on_policy": (sum(e.policy_version == version for e in entries) / len(entries)) if entries else 1.0,
            "new_rollouts": new.rollouts,
            "new_tokens": new.tokens,
            "new_generated_tokens": new.generated_tokens,
        }
        if new.rollouts:
            out["reward/mean"] = float(np.mean(new.rewards))
            out["reward/std"] = float(np.std(new.rewards))
            out["frac_truncated"] = new.truncated / new.rollouts
            out["frac_reward_failed"] = new.reward_failed / new.rollouts
            if new.generated_tokens:
                # -log p of sampled tokens averages to the policy's entropy: a collapse shows here first.
                out["sampled_entropy"] = new.neg_logprob / new.generated_tokens
            for name, values in new.named_rewards.items():
                out[f"rewards/{name}/mean"] = float(np.mean(values))
                out[f"rewards/{name}/std"] = float(np.std(values))
        if new.teacher_kl_tokens:
            out["teacher_kl"] = sum(new.teacher_kl) / new.teacher_kl_tokens
        if frac_used is not None:
            out["frac_used_in_batch"] = frac_used
        out["frac_filtered"] = totals["filtered_groups"] / groups_seen if groups_seen else 0.0
        out.update(totals)
        return {prefix + k: float(v) for k, v in out.items()}

    def flush(self) -> None:
        """Write pending rollouts to disk now (also done on `close`)."""
        if self._writer is not None:
            self._writer.flush()

    def flush_if_due(self) -> None:
        if self._writer is not None:
            self._writer.flush_if_due()

    def close(self) -> None:
        self.flush()


def _rewards_all_equal(entries: list[FlatRollout]) -> bool:
    first = entries[0].rollout.reward
    return all(e.rollout.reward == first for e in entries)


def truncate_rollout(rollout: Rollout, max_tokens: int) -> Rollout:
    """Cut a rollout to its first `max_tokens` tokens and mark it truncated."""
    turns: list[Turn] = []
    budget = max_tokens
    for turn in rollout.turns:
        if budget <= 0:
            break
        if len(turn.token_ids) > budget:
            turn = dataclasses.replace(
                turn,
                token_ids=turn.token_ids[:budget],
                logprobs=None if turn.logprobs is None else turn.logprobs[:budget],
            )
        turns.append(turn)
        budget -= len(turn.token_ids)
    if not any(t.is_sampled for t in turns):
        raise RolloutValidationError(
            rollout.rollout_uid, "turns", f"no sampled token within the first {max_tokens} tokens (overlong: truncate)"
        )
    metadata = {**rollout.metadata, "overlong_truncated_from": rollout.num_tokens}
    return dataclasses.replace(rollout, turns=tuple(turns), is_truncated=True, metadata=metadata)
