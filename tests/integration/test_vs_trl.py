"""The quickstart side by side with TRL's GRPOTrainer on this CPU (benchmarks/bench_vs_trl.py): both
learn the task (each side stops once it did), and our asynchronous run compiles nothing after step 1;
the times are printed, never asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marin_rl.testing import compilations_after_first_step

pytestmark = pytest.mark.slow

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_vs_trl.py"


def test_marin_rl_and_trl_both_reach_the_target_reward(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCH), "--size=tiny", "--steps=110", "--stop-at-target", f"--json={out}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=BENCH.parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    marin, trl = json.loads(out.read_text())
    for side in (marin, trl):
        print(f"{side['side']}: {side['seconds_per_step']:.3f} s/step, 0.8 at step {side['steps_to_target']} "
              f"after {side['seconds_to_target']} s of training")  # fmt: skip
        assert side["steps_to_target"] is not None, f"{side['side']} never reached a mean reward of 0.8: {side['rewards']}"
    records = [json.loads(line) for line in (Path(marin["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert compilations_after_first_step(records) == {}
