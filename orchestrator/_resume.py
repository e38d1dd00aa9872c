"""A resumed run: what the steps after its checkpoint wrote, set aside so that readers see one record per step.

A resumed run continues from its newest complete checkpoint, step k (or from step 0 when the run was
stopped before writing one). The steps after k are abandoned: they are trained again. So that every
reader sees one record per step and one population of rollouts per policy version, what they wrote is
set aside, never deleted:

- `metrics.jsonl` lines of steps after k (and a partial last line) move to `metrics.abandoned.jsonl`;
- rollouts sampled by a policy version after k, or drawn from an env's problem stream at or after the
  position the checkpoint saved (the resumed run samples those problems again), move from
  `RUN/rollouts/{env}/` to `RUN/rollouts-abandoned/{env}/` (segments are rewritten atomically).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marin_rl.orchestrator._metrics import METRICS_FILE
from marin_rl.storage import ROLLOUTS_DIR, list_env_dirs, list_segments, read_segment, write_segment_atomic
from marin_rl.workers import PROBLEM_POSITION_KEY

logger = logging.getLogger(__name__)

ABANDONED_METRICS_FILE = "metrics.abandoned.jsonl"
ABANDONED_ROLLOUTS_DIR = "rollouts-abandoned"


def set_aside_abandoned(run_dir: Path, step: int, positions: Mapping[str, int]) -> dict[str, int]:
    """Move what the steps after `step` wrote out of the readers' way; returns how much moved."""
    moved = {"metrics_lines": _set_aside_metrics(run_dir, step)}
    if (run_dir / ROLLOUTS_DIR).is_dir():
        for env_dir in list_env_dirs(run_dir):
            moved[f"rollouts/{env_dir.name}"] = _set_aside_rollouts(run_dir, env_dir, step, positions.get(env_dir.name))
    if any(moved.values()):
        logger.warning("resuming at step %d: set aside what the abandoned steps wrote: %s", step, moved)
    return moved


def _set_aside_metrics(run_dir: Path, step: int) -> int:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    kept, abandoned = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            record_step = None  # a line cut by a kill
        # Step 0 holds only the baseline evaluation, which a run resumed from step 0 writes again.
        keep = record_step is not None and record_step <= step and (record_step > 0 or step > 0)
        (kept if keep else abandoned).append(line)
    if abandoned:
        with open(run_dir / ABANDONED_METRICS_FILE, "a") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in abandoned)
        _replace_text(path, "".join(kept))
    return len(abandoned)


def _set_aside_rollouts(run_dir: Path, env_dir: Path, step: int, position: int | None) -> int:
    moved = 0
    for path in list_segments(env_dir):
        try:
            abandoned = _abandoned_rows(pq.read_table(path, columns=["policy_version", "metadata_json"]), step, position)
        except (pa.ArrowException, OSError) as e:  # readers skip it too (named on stderr)
            logger.warning("resume: %s is unreadable, left as it is: %s", path, e)
            continue
        if not abandoned.any():
            continue  # most segments: only two columns read
        table = read_segment(path)
        # First a copy where readers do not look (named like the segment: a retry after a crash finds
        # it there already), then the segment without those rows.
        target = run_dir / ABANDONED_ROLLOUTS_DIR / env_dir.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_segment_atomic(target, table.filter(pa.array(abandoned)))
        rest = table.filter(pa.array(~abandoned))
        if rest.num_rows:
            tmp = path.with_name(f".{path.name}.rewrite")
            tmp.unlink(missing_ok=True)  # left by a crash here: write_segment_atomic never replaces a file
            write_segment_atomic(tmp, rest)
            os.replace(tmp, path)
        else:
            path.unlink()
        moved += int(abandoned.sum())
    return moved


def _abandoned_rows(table: pa.Table, step: int, position: int | None) -> np.ndarray:
    abandoned = pc.greater(table["policy_version"], step).to_numpy(zero_copy_only=False)
    if position is not None:
        drawn = [json.loads(m).get(PROBLEM_POSITION_KEY) for m in table["metadata_json"].to_pylist()]
        abandoned |= np.array([p is not None and p >= position for p in drawn], dtype=bool)
    return abandoned


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.rewrite")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
