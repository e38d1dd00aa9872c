"""What a resumed run does with what its abandoned steps wrote: set aside, never lost, one record per step."""

import dataclasses
import json

import pandas as pd
import pytest

from marin_rl.errors import RunDirError
from marin_rl.orchestrator._metrics import read_metrics
from marin_rl.orchestrator._preflight import check_run_dir
from marin_rl.orchestrator._resume import (
    ABANDONED_METRICS_FILE,
    ABANDONED_ROLLOUTS_DIR,
    PROBLEM_POSITION_KEY,
    set_aside_abandoned,
)
from marin_rl.storage import RolloutWriter, env_rollout_dir, read_rollouts
from marin_rl.testing import make_rollout


def rollout(version, position):
    r = make_rollout(env="math", policy_version=version, seed=position)
    return dataclasses.replace(r, metadata={PROBLEM_POSITION_KEY: position})


@pytest.fixture
def killed_run(tmp_path):
    """A run killed during step 6 whose newest checkpoint is step 3 (problems 0..9 drawn by then)."""
    lines = [json.dumps({"step": s, "learner/loss": s / 10}) + "\n" for s in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 6, "lear')  # cut by the kill
    writer = RolloutWriter(env_rollout_dir(tmp_path, "math"))
    writer.append([rollout(0, 0), rollout(1, 3), rollout(2, 6)])  # all before the checkpoint
    writer.flush()
    writer.append([rollout(3, 9), rollout(3, 10), rollout(4, 8), rollout(5, 12)])  # 10 and 12: drawn after it; 4, 5: its policies
    writer.flush()
    return tmp_path


def test_abandoned_metrics_and_rollouts_are_set_aside_and_nothing_is_lost(killed_run):
    before = {r.rollout_uid for r in read_rollouts(killed_run)}
    moved = set_aside_abandoned(killed_run, 3, {"math": 10})
    assert moved == {"metrics_lines": 3, "rollouts/math": 3}

    assert [r["step"] for r in read_metrics(killed_run)] == [0, 1, 2, 3]  # 0: the baseline evaluation
    abandoned_lines = (killed_run / ABANDONED_METRICS_FILE).read_text().splitlines()
    assert len(abandoned_lines) == 3 and abandoned_lines[-1] == '{"step": 6, "lear'  # 4, 5, the cut line

    kept = read_rollouts(killed_run)
    assert sorted((r.policy_version, r.metadata[PROBLEM_POSITION_KEY]) for r in kept) == [(0, 0), (1, 3), (2, 6), (3, 9)]
    frame = pd.read_parquet(killed_run / "rollouts" / "math")  # the documented way to read an env's rollouts
    assert len(frame) == 4
    aside = pd.read_parquet(killed_run / ABANDONED_ROLLOUTS_DIR / "math")
    assert sorted(aside["policy_version"]) == [3, 4, 5]
    assert {r.rollout_uid for r in kept} | set(aside["rollout_uid"]) == before

    # A second resume at the same step (say, killed again at once) moves nothing more.
    assert set_aside_abandoned(killed_run, 3, {"math": 10}) == {"metrics_lines": 0, "rollouts/math": 0}


def test_a_run_resumed_before_its_first_checkpoint_starts_again(killed_run):
    moved = set_aside_abandoned(killed_run, 0, {"math": 0})
    assert moved["metrics_lines"] == 7 and moved["rollouts/math"] == 7
    assert read_metrics(killed_run) == [] and read_rollouts(killed_run) == []


def test_run_dir_rules(tmp_path):
    run_dir = tmp_path / "run"
    assert check_run_dir(run_dir, resume=True) is None  # killed before it made its folder: starts at step 0
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("a: 1\n")
    assert check_run_dir(run_dir, resume=False) is None  # a start that failed is not a run
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match="already holds a run"):
        check_run_dir(run_dir, resume=False)
    assert check_run_dir(run_dir, resume=True) is None  # resumable without a checkpoint: it starts again
