"""Batcher: packs groups from every env's buffer into one fixed-shape batch by token budget.

design.md section 4. A batch is `total_token_budget // max_seq_len` rows of `max_seq_len` tokens
(fixed shapes, so the learner compiles once). Envs get the batch in proportion to their fractions
(the remainder rule in `effective_shares`); when an env cannot fill its share the batcher waits up
to `max_wait_s` for it, then goes on without it and reports it (`batches/{env}/starved`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Literal, Mapping

import numpy as np

from marin_rl.packed import PADDING_SEGMENT_ID, PackedArrays
from marin_rl.replay._algorithms import TokenSignal
from marin_rl.replay._buffer import FlatRollout, ReplayBuffer, ScoredGroup
from marin_rl.replay._packing import BatchPlan, effective_shares, plan_batch

logger = logging.getLogger(__name__)


class BatchCancelled(Exception):
    """`next_batch` was cancelled while waiting for rollouts."""


@dataclass(frozen=True)
class BatcherConfig:
    total_token_budget: int = 16384
    """Tokens per batch (rows x max_seq_len, padding included)."""
    max_seq_len: int = 1024
    """Length of every packed row; longer rollouts are handled by `overlong`."""
    max_wait_s: float = 60.0
    """How long to wait for an env that cannot fill its share before building without it."""
    overlong: Literal["reject", "truncate"] = "reject"
    """A rollout longer than max_seq_len is rejected (counted, in rejects.jsonl) or cut and marked truncated."""
    pad_token_id: int = 0
    """Token id written into padding (never attended, never in a loss)."""
    max_rollouts_per_row: int | None = None
    """At most this many rollouts share a row; None: as many as fit. With `model.attn_backend: cudnn`,
    `model.cudnn_max_segments - 1` keeps every row in cuDNN's packed layout (a row's padding is a
    segment too). Only worth it when rollouts are long: short ones then leave rows mostly padding
    (docs/learner.md)."""

    def __post_init__(self):
        if self.max_seq_len < 1:
            raise ValueError(f"batcher.max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.total_token_budget < self.max_seq_len:
            raise ValueError(
                f"batcher.total_token_budget ({self.total_token_budget}) must be at least one row of "
                f"max_seq_len ({self.max_seq_len})"
            )
        if self.max_rollouts_per_row is not None and self.max_rollouts_per_row < 1:
            raise ValueError(f"batcher.max_rollouts_per_row must be >= 1 or null, got {self.max_rollouts_per_row}")
        if self.overlong not in ("reject", "truncate"):
            raise ValueError(f"batcher.overlong must be 'reject' or 'truncate', got {self.overlong!r}")

    @property
    def num_rows(self) -> int:
        return self.total_token_budget // self.max_seq_len

    def padding_arrays(self) -> PackedArrays:
        """A batch of padding only, shaped like every batch (to compile the learner's step before data comes)."""
        return build_packed_arrays([], BatchPlan(), self.num_rows, self.max_seq_len, self.pad_token_id)


@dataclass
class Batch:
    packed: PackedArrays
    groups: list[ScoredGroup]
    metrics: dict[str, float]
    policy_version: int
    """The learner version this batch was built for."""
    plan: BatchPlan
    """Where each group's rollouts sit: `plan.placements[env][group_id]` is (row, offset) per member."""

    def to_example(self):
        """The batch as an `RlExample` of NamedArrays (imports JAX)."""
        from marin_rl.rl_example import RlExample

        return RlExample.from_packed(self.packed)

    @property
    def rollout_versions(self) -> list[int]:
        return [m.policy_version for g in self.groups for m in g.members]


class Batcher:
    def __init__(self, buffers: Mapping[str, ReplayBuffer], fractions: Mapping[str, float], config: BatcherConfig):
        if set(buffers) != set(fractions):
            raise ValueError(f"fractions must name every env: buffers {sorted(buffers)}, fractions {sorted(fractions)}")
        bad = {env: f for env, f in fractions.items() if not 0.0 <= f <= 1.0}
        if bad:
            raise ValueError(f"env fractions must be in [0, 1], got {bad}")
        if sum(fractions.values()) > 1.0 + 1e-9:
            raise ValueError(f"env fractions must sum to <= 1, got {sum(fractions.values()):.4f} from {dict(fractions)}")
        self.buffers = dict(buffers)
        self.fractions = dict(fractions)
        self.config = config
        self.credit: dict[str, float] = {}
        """Each env's token deficit carried from batch to batch (saved in checkpoints: a resumed run goes on alike)."""

    def next_batch(
        self, policy_version: int, timeout: float | None = None, cancel: threading.Event | None = None
    ) -> Batch:
        """Build the next batch for `policy_version` (stale rollouts are dropped first).

        Waits up to `max_wait_s` for short envs; after that builds from what there is, unless
        there is nothing at all, in which case it keeps waiting until `timeout` (TimeoutError).
        Setting `cancel` ends the wait with `BatchCancelled`.
        """
        for buffer in self.buffers.values():
            buffer.set_policy_version(policy_version)
        cfg = self.config
        start = time.monotonic()
        while True:
            short = self.short_envs()
            waited = time.monotonic() - start
            if not short:
                break
            if waited >= cfg.max_wait_s and any(self._has_data(env) for env in self.buffers):
                logger.warning("batcher: building without a full share for %s after %.1fs", short, waited)
                break
            if cancel is not None and cancel.is_set():
                raise BatchCancelled(f"batcher: cancelled after waiting {waited:.1f}s for {short}")
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"batcher: no rollouts from any env within {timeout:.1f}s (short: {short})")
            self.buffers[short[0]].wait_for_data(min(0.5, max(0.01, cfg.max_wait_s - waited)))
        wait_s = time.monotonic() - start

        shares = effective_shares(self.fractions, [env for env in self.buffers if self._has_data(env)])
        plan = plan_batch(
            {env: buffer.candidates() for env, buffer in self.buffers.items()},
            shares,
            self.credit,
            cfg.num_rows,
            cfg.max_seq_len,
            cfg.max_rollouts_per_row,
        )
        groups: list[ScoredGroup] = []
        for env, placed in plan.placements.items():
            if placed:
                sizes = {group_id: len(where) for group_id, where in placed.items()}
                groups.extend(self.buffers[env].take(sizes))
        packed = build_packed_arrays(groups, plan, cfg.num_rows, cfg.max_seq_len, cfg.pad_token_id)
        metrics = self._metrics(groups, plan, short, wait_s, policy_version)
        return Batch(packed, groups, metrics, policy_version, plan)

    def short_envs(self) -> list[str]:
        """The envs whose buffers cannot fill their share of a batch now."""
        capacity = self.config.num_rows * self.config.max_seq_len
        wanted = effective_shares(self.fractions, list(self.buffers))
        return [env for env in self.buffers if not self._can_fill(env, wanted[env] * capacity)]

    def _can_fill(self, env: str, tokens: float) -> bool:
        have = 0
        for group in self.buffers[env].candidates():
            have += group.num_tokens
            if have >= tokens:
                return True
        return tokens <= 0

    def _has_data(self, env: str) -> bool:
        return next(self.buffers[env].candidates(), None) is not None

    def _metrics(self, groups, plan: BatchPlan, short, wait_s: float, policy_version: int) -> dict[str, float]:
        capacity = self.config.num_rows * self.config.max_seq_len
        total = plan.total_tokens
        out: dict[str, float] = {
            "batch/tokens": total,
            "batch/rows": self.config.num_rows,
            "batch/packing_efficiency": total / capacity,
            "batch/wait_s": wait_s,
        }
        ages = [policy_version - m.policy_version for g in groups for m in g.members]
        if ages:
            out["batch/staleness_mean"] = float(np.mean(ages))
            out["batch/staleness_max"] = float(max(ages))
        for env in self.buffers:
            env_groups = [g for g in groups if g.env == env]
            prefix = f"batches/{env}/"
            out[prefix + "rollouts_used"] = sum(len(g.members) for g in env_groups)
            out[prefix + "groups_used"] = len(env_groups)
            out[prefix + "tokens_used"] = plan.tokens.get(env, 0)
            out[prefix + "frac_used"] = plan.tokens.get(env, 0) / total if total else 0.0
            out[prefix + "fraction"] = self.fractions[env]
            out[prefix + "starved"] = float(env in short)
            if env_groups:
                out[prefix + "reward_mean"] = float(np.mean([m.rollout.reward for g in env_groups for m in g.members]))
        return {k: float(v) for k, v in out.items()}


def build_packed_arrays(
    groups: list[ScoredGroup], plan: BatchPlan, num_rows: int, max_seq_len: int, pad_token_id: int = 0
) -> PackedArrays:
    """Write each rollout at its planned (row, offset); everything else is padding.

    Built row by row, concatenating straight into the batch (`out=`): a 1M-token batch holds
    thousands of rollouts, and per-rollout numpy calls and temporaries dominated the time.
    """
    shape = (num_rows, max_seq_len)
    fields = {  # name -> (array, padding value, what each member contributes)
        "input_ids": (np.empty(shape, np.int32), pad_token_id, lambda m, s: m.token_ids),
        "loss_mask": (np.empty(shape, bool), False, lambda m, s: m.sampled_mask),
        "policy_logprobs": (np.empty(shape, np.float32), 0.0, lambda m, s: m.behaviour_logprobs),
        "advantages": (np.empty(shape, np.float32), 0.0, lambda m, s: s.advantages),
        "rl_weights": (np.empty(shape, np.float32), 0.0, lambda m, s: s.rl_weights),
        "ce_weights": (np.empty(shape, np.float32), 0.0, lambda m, s: s.ce_weights),
        "kl_weights": (np.empty(shape, np.float32), 0.0, lambda m, s: s.kl_weights),
    }
    position_ids = np.zeros(shape, np.int32)
    segment_ids = np.full(shape, PADDING_SEGMENT_ID, np.int32)
    rows: list[list[tuple[int, FlatRollout, TokenSignal]]] = [[] for _ in range(num_rows)]
    for group in groups:
        for member, signal, (row, offset) in zip(group.members, group.signals, plan.placements[group.env][group.group_id]):
            rows[row].append((offset, member, signal))
    positions = np.arange(max_seq_len, dtype=np.int32)
    for row, members in enumerate(rows):
        members.sort(key=lambda item: item[0])
        lengths = [m.num_tokens for _, m, _ in members]
        end = sum(lengths)
        assert not members or (members[0][0] == 0 and end <= max_seq_len), "planned spans must tile the row from 0"
        for array, padding, part in fields.values():
            if members:
                np.concatenate([part(m, s) for _, m, s in members], out=array[row, :end])
            array[row, end:] = padding
        if members:
            np.concatenate([positions[:n] for n in lengths], out=position_ids[row, :end])
            segment_ids[row, :end] = np.repeat(np.arange(len(members), dtype=np.int32), lengths)
    return PackedArrays(
        position_ids=position_ids, segment_ids=segment_ids, **{name: array for name, (array, _, _) in fields.items()}
    )
