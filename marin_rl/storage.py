"""Rollouts on disk: Parquet segments under `RUN/rollouts/{env}/`, written atomically.

One row per rollout; turns are a nested list column. The layout is documented (and versioned) in
docs/rollouts.md; `SCHEMA_VERSION` is stored in every file's metadata. A segment is written to a
dot-prefixed temp file, fsynced, then renamed, so a crash leaves only whole segments; readers
ignore dot files.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marin_rl.errors import naming_full_disk
from marin_rl.types import InferenceMetadata, Rollout, Turn

SCHEMA_VERSION = 2
"""1: first version. 2: turns gain `teacher_logprobs` (version 1 files still read).
"""
SCHEMA_VERSION_KEY = b"marin_rl.rollout_schema_version"
ROLLOUTS_DIR = "rollouts"
REJECTS_DIR = "rejects"
"""`RUN/rejects/{env}.jsonl`: beside, not inside, `RUN/rollouts/{env}/`, which holds only Parquet segments."""
_SEGMENT_RE = re.compile(r"^segment-(\d{8})\.parquet$")

TURN_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),  # null unless the turn carries logprobs
        ("timestamp", pa.float64()),
        # InferenceMetadata, flattened; null on non-assistant turns.
        ("server_id", pa.string()),
        ("model", pa.string()),
        ("policy_version", pa.int64()),
        ("finish_reason", pa.string()),
        ("latency_s", pa.float64()),
        ("sampling_params_json", pa.string()),
        ("teacher_logprobs", pa.list_(pa.float32())),  # null unless a teacher scored the turn
    ]
)
ROLLOUT_SCHEMA = pa.schema(
    [
        ("rollout_uid", pa.string()),
        ("environment", pa.string()),
        ("problem_id", pa.string()),
        ("group_id", pa.string()),
        ("policy_version", pa.int64()),  # oldest version among the assistant turns
        ("reward", pa.float64()),
        ("rewards", pa.map_(pa.string(), pa.float64())),
        ("is_truncated", pa.bool_()),
        ("num_tokens", pa.int64()),
        ("num_generated_tokens", pa.int64()),
        ("metadata_json", pa.string()),
        ("turns", pa.list_(TURN_TYPE)),
        ("written_at", pa.float64()),  # unix seconds when the segment was written
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)


class SegmentError(RuntimeError):
    """A segment file could not be read; names the file."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path


def env_rollout_dir(run_dir: str | os.PathLike, env: str) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / env


def env_rejects_path(run_dir: str | os.PathLike, env: str) -> Path:
    return Path(run_dir) / REJECTS_DIR / f"{env}.jsonl"


def _turn_row(turn: Turn, params_json: Callable[[dict], str]) -> dict[str, Any]:
    meta = turn.inference_metadata
    return {
        "role": turn.role,
        "content": turn.content,
        "token_ids": turn.token_ids,
        "logprobs": turn.logprobs,
        "timestamp": turn.timestamp,
        "server_id": meta.server_id if meta else None,
        "model": meta.model if meta else None,
        "policy_version": meta.policy_version if meta else None,
        "finish_reason": meta.finish_reason if meta else None,
        "latency_s": meta.latency_s if meta else None,
        "sampling_params_json": params_json(meta.sampling_params) if meta else None,
        "teacher_logprobs": turn.teacher_logprobs,
    }


def rollouts_to_table(rollouts: list[Rollout], written_at: float | None = None) -> pa.Table:
    written_at = time.time() if written_at is None else written_at
    # The completions of one request share its sampling-params dict (with its seed, unique to the
    # request): each dict is encoded once.
    encoded: dict[int, tuple[dict, str]] = {}

    def params_json(params: dict) -> str:
        if id(params) not in encoded:
            encoded[id(params)] = params, json.dumps(params, sort_keys=True)  # the dict kept alive: ids stay unique
        return encoded[id(params)][1]

    rows = [
        {
            "rollout_uid": r.rollout_uid,
            "environment": r.environment,
            "problem_id": r.problem_id,
            "group_id": r.group_id,
            "policy_version": r.policy_version,
            "reward": float(r.reward),
            "rewards": [(k, float(v)) for k, v in r.rewards.items()],
            "is_truncated": r.is_truncated,
            "num_tokens": r.num_tokens,
            "num_generated_tokens": r.num_generated_tokens,
            "metadata_json": json.dumps(r.metadata, sort_keys=True, default=str),
            "turns": [_turn_row(t, params_json) for t in r.turns],
            "written_at": written_at,
        }
        for r in rollouts
    ]
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def _turn_from_row(row: dict[str, Any]) -> Turn:
    meta = None
    if row["policy_version"] is not None:
        meta = InferenceMetadata(
            server_id=row["server_id"],
            model=row["model"],
            policy_version=int(row["policy_version"]),
            finish_reason=row["finish_reason"],
            latency_s=row["latency_s"],
            sampling_params=json.loads(row["sampling_params_json"]),
        )
    return Turn(
        role=row["role"],
        content=row["content"],
        token_ids=np.asarray(row["token_ids"], dtype=np.int32),
        logprobs=None if row["logprobs"] is None else np.asarray(row["logprobs"], dtype=np.float32),
        inference_metadata=meta,
        timestamp=row["timestamp"],
        teacher_logprobs=None if row.get("teacher_logprobs") is None else np.asarray(row["teacher_logprobs"], np.float32),
    )


def table_to_rollouts(table: pa.Table) -> list[Rollout]:
    return [
        Rollout(
            environment=row["environment"],
            problem_id=row["problem_id"],
            rollout_uid=row["rollout_uid"],
            group_id=row["group_id"],
            turns=tuple(_turn_from_row(t) for t in row["turns"]),
            rewards=dict(row["rewards"]),
            reward=row["reward"],
            is_truncated=row["is_truncated"],
            metadata=json.loads(row["metadata_json"]),
        )
        for row in table.to_pylist()
    ]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_segment_atomic(path: Path, table: pa.Table) -> bool:
    """Write `table` to `path` so that `path` either does not exist or holds the whole segment.

    Never replaces an existing file (returns False instead): hard-linking the finished temp file
    into place fails if the name is taken, where a rename would silently overwrite it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        _fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


class RolloutWriter:
    """Buffers one env's rollouts and writes them as numbered segments.

    Flushes when `flush_every_rollouts` are pending, when the oldest pending rollout is older
    than `flush_every_s` (checked on `append` and `flush_if_due`), and on `close`.
    """

    def __init__(self, directory: str | os.PathLike, flush_every_rollouts: int = 512, flush_every_s: float = 30.0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flush_every_rollouts = flush_every_rollouts
        self.flush_every_s = flush_every_s
        self._pending: list[Rollout] = []
        self._oldest_pending_at: float | None = None
        self._lock = threading.Lock()
        # Continue numbering after a resumed run's segments.
        existing = [int(m.group(1)) for p in self.directory.iterdir() if (m := _SEGMENT_RE.match(p.name))]
        self._next_index = max(existing, default=-1) + 1
        self.segments_written = 0
        self.rollouts_written = 0

    def append(self, rollouts: list[Rollout]) -> None:
        with self._lock:
            if not self._pending:
                self._oldest_pending_at = time.monotonic()
            self._pending.extend(rollouts)
            if self._due():
                self._flush_locked()

    def flush_if_due(self) -> None:
        with self._lock:
            if self._due():
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        self.flush()

    def _due(self) -> bool:
        if not self._pending:
            return False
        aged = time.monotonic() - (self._oldest_pending_at or 0.0) >= self.flush_every_s
        return len(self._pending) >= self.flush_every_rollouts or aged

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        table = rollouts_to_table(self._pending)
        # Another writer may have taken the next name (two writers on one dir): skip ahead.
        while True:
            path = self.directory / f"segment-{self._next_index:08d}.parquet"
            with naming_full_disk(path):  # the rollouts stay pending: a later flush writes them
                if write_segment_atomic(path, table):
                    break
            self._next_index += 1
        self._next_index += 1
        self.segments_written += 1
        self.rollouts_written += len(self._pending)
        self._pending = []
        self._oldest_pending_at = None


def append_reject(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one rejected rollout (uid, field, reason, ...) to an env's rejects file (`env_rejects_path`)."""
    path = Path(path)
    with naming_full_disk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record, sort_keys=True, default=str) + "\n")


# ---- reading ----


def list_env_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """The per-env rollout directories of a run; a clear error if the run has none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    root = run_dir / ROLLOUTS_DIR
    if not root.is_dir():
        raise FileNotFoundError(f"{run_dir} has no {ROLLOUTS_DIR}/ directory: is it a marin-rl run directory?")
    return sorted(p for p in root.iterdir() if p.is_dir())


def list_segments(env_dir: Path) -> list[Path]:
    return sorted(p for p in env_dir.iterdir() if _SEGMENT_RE.match(p.name))


def read_segment(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Read one segment (only `columns` if given), checking its schema version; `SegmentError` names
    the file if it is bad."""
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise SegmentError(path, f"unreadable Parquet segment ({e})") from e
    version = (table.schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        raise SegmentError(path, "no marin-rl rollout schema version in its metadata")
    if int(version) > SCHEMA_VERSION:
        raise SegmentError(path, f"schema version {int(version)} is newer than this marin-rl reads ({SCHEMA_VERSION})")
    return table


@dataclass(frozen=True)
class SegmentRead:
    path: Path
    table: pa.Table | None
    error: SegmentError | None


def iter_run_segments(
    run_dir: str | os.PathLike, env: str | None = None, columns: list[str] | None = None
) -> Iterator[SegmentRead]:
    """Every segment of a run (optionally one env; only `columns` if given), yielding errors instead of
    raising them."""
    env_dirs = list_env_dirs(run_dir)
    if env is not None:
        env_dirs = [d for d in env_dirs if d.name == env]
        if not env_dirs:
            raise FileNotFoundError(f"{run_dir} has no rollouts for env {env!r}")
    for env_dir in env_dirs:
        for path in list_segments(env_dir):
            try:
                yield SegmentRead(path, read_segment(path, columns), None)
            except SegmentError as e:
                yield SegmentRead(path, None, e)


def read_rollouts(run_dir: str | os.PathLike, env: str | None = None) -> list[Rollout]:
    """All rollouts of a run (raises `SegmentError` on a corrupt segment)."""
    rollouts: list[Rollout] = []
    for segment in iter_run_segments(run_dir, env):
        if segment.error is not None:
            raise segment.error
        rollouts.extend(table_to_rollouts(segment.table))
    return rollouts
