"""Packing rollouts into fixed rows, and choosing groups across envs by token deficit.

Pure functions over lengths, so they can be property-tested without rollouts:
- `RowPacker`: best-fit placement of sequences into `num_rows` rows of `max_seq_len` (and at most
  `max_per_row` sequences a row); a group is placed atomically (all of its rollouts or none).
- `plan_batch`: deficit round-robin over envs (the env furthest below its share goes next), newest
  group first within an env, whole groups only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

# Stop trying once this many groups in a row failed to fit: the batch is as full as it gets.
MAX_CONSECUTIVE_MISSES = 64


class RowPacker:
    """Best-fit: each sequence goes into the fullest row that still has room for it (a row holding
    `max_per_row` sequences takes no more; None: no limit)."""

    def __init__(self, num_rows: int, max_seq_len: int, max_per_row: int | None = None):
        if num_rows < 1 or max_seq_len < 1:
            raise ValueError(f"need num_rows >= 1 and max_seq_len >= 1, got {num_rows} and {max_seq_len}")
        if max_per_row is not None and max_per_row < 1:
            raise ValueError(f"need max_per_row >= 1 or None, got {max_per_row}")
        self.num_rows = num_rows
        self.max_seq_len = max_seq_len
        self.max_per_row = max_per_row
        self.fill = [0] * num_rows
        self.count = [0] * num_rows
        self.free_tokens = num_rows * max_seq_len
        # (free space, row) sorted ascending, open rows only: bisect finds the tightest row that fits.
        self._free = [(max_seq_len, row) for row in range(num_rows)]

    @property
    def largest_free(self) -> int:
        return self._free[-1][0] if self._free else 0

    def _closed(self, row: int) -> bool:
        return self.max_per_row is not None and self.count[row] >= self.max_per_row

    def place_group(self, lengths: Sequence[int]) -> list[tuple[int, int]] | None:
        """Place every length or none; returns (row, offset) per length in the given order."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        placed: dict[int, tuple[int, int]] = {}
        for i in order:
            where = self._place(lengths[i])
            if where is None:
                for j, (row, offset) in reversed(list(placed.items())):
                    self._unplace(row, offset, lengths[j])
                return None
            placed[i] = where
        return [placed[i] for i in range(len(lengths))]

    def _place(self, length: int) -> tuple[int, int] | None:
        if length > self.max_seq_len or length <= 0:
            return None
        k = bisect.bisect_left(self._free, (length, -1))
        if k == len(self._free):
            return None
        space, row = self._free.pop(k)
        offset = self.fill[row]
        self.fill[row] += length
        self.count[row] += 1
        self.free_tokens -= length
        if not self._closed(row):
            bisect.insort(self._free, (space - length, row))
        return row, offset

    def _unplace(self, row: int, offset: int, length: int) -> None:
        # Only the most recent placement in a row can be undone (offset must be the row's end).
        assert offset + length == self.fill[row], "groups are undone in reverse order"
        space = self.max_seq_len - self.fill[row]
        if not self._closed(row):
            self._free.pop(bisect.bisect_left(self._free, (space, row)))
        self.fill[row] -= length
        self.count[row] -= 1
        self.free_tokens += length
        bisect.insort(self._free, (space + length, row))


@dataclass(frozen=True)
class GroupSpec:
    """A candidate group: its key and the token length of each rollout."""

    key: str
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class BatchPlan:
    """Which groups go where. `placements[env][key]` gives (row, offset) per rollout."""

    placements: dict[str, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    row_fill: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())


def effective_shares(fractions: Mapping[str, float], envs_with_data: Sequence[str]) -> dict[str, float]:
    """Each env's share of this batch: its fraction, plus the remainder (1 - sum of fractions, and
    the share of envs without data) split among envs with data in proportion to their fractions."""
    present = [e for e in envs_with_data if e in fractions]
    total = sum(fractions[e] for e in present)
    if not present:
        return {e: 0.0 for e in fractions}
    if total <= 0:  # all-zero fractions: split evenly
        return {e: (1.0 / len(present) if e in present else 0.0) for e in fractions}
    return {e: (fractions[e] / total if e in present else 0.0) for e in fractions}


def plan_batch(
    candidates: Mapping[str, Iterable[GroupSpec]],
    shares: Mapping[str, float],
    credit: dict[str, float],
    num_rows: int,
    max_seq_len: int,
    max_per_row: int | None = None,
) -> BatchPlan:
    """Fill `num_rows` rows by deficit round-robin over envs.

    `candidates[env]` is newest first and is consumed lazily (only as far as needed). `credit` carries each env's token deficit across batches
    (updated in place): it grows by the env's share of the batch and shrinks by what it got, so
    over many batches each env's token share converges to its share even though whole groups make
    single batches lumpy. A group that does not fit is skipped and stays for a later batch.
    """
    packer = RowPacker(num_rows, max_seq_len, max_per_row)
    capacity = num_rows * max_seq_len
    plan = BatchPlan(placements={env: {} for env in candidates}, tokens={env: 0 for env in candidates})
    for env, share in shares.items():
        if share > 0:
            # Bounded both ways, so a long-starved or long-greedy env does not skew later batches.
            credit[env] = min(max(credit.get(env, 0.0) + share * capacity, -capacity), capacity)
    streams = {env: iter(groups) for env, groups in candidates.items()}
    active = [env for env in candidates if shares.get(env, 0.0) > 0]
    misses = 0
    while active and misses < MAX_CONSECUTIVE_MISSES:
        env = max(active, key=lambda e: credit.get(e, 0.0))
        group = next(streams[env], None)
        if group is None:
            active.remove(env)
            continue
        if group.num_tokens > packer.free_tokens or max(group.lengths) > packer.largest_free:
            misses += 1
            continue
        where = packer.place_group(group.lengths)
        if where is None:
            misses += 1
            continue
        misses = 0
        plan.placements[env][group.key] = where
        plan.tokens[env] += group.num_tokens
        credit[env] = credit.get(env, 0.0) - group.num_tokens
    plan.row_fill = list(packer.fill)
    return plan
