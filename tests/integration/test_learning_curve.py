"""The quickstart's learning curve, pinned: a regression in learning per step fails here.

A deterministic run (one trajectory per machine) of the default config. On this project's 2-core VM
the 5-step mean reward was 0.458 at step 20, 0.708 at step 30, 0.725 at step 40 and 0.792 at step 50
(docs/performance.md). Another CPU may compute other last bits and so take another trajectory, so the
pins leave room for that: a loop that learns at half the rate (0.24 at step 30) fails. Nothing
compiles after step 1.
"""

import json
import statistics

import pytest

from marin_rl.config import load_config
from marin_rl.orchestrator import train
from marin_rl.testing import compilations_after_first_step

pytestmark = pytest.mark.slow

PINS = {20: 0.3, 30: 0.55, 50: 0.65}
"""Step -> the least 5-step mean reward it must have reached."""


def test_the_quickstart_learns_at_its_pinned_rate(tmp_path):
    config = load_config("configs/quickstart.yaml", [f"--run_dir={tmp_path / 'run'}", f"--max_steps={max(PINS)}", "--deterministic=true"])
    train(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["batches/addition/reward_mean"] for r in records]
    means = {step: statistics.mean(rewards[step - 5 : step]) for step in PINS}
    print("5-step mean reward:", {step: round(mean, 3) for step, mean in means.items()})
    for step, least in PINS.items():
        assert means[step] >= least, f"5-step mean reward {means[step]:.3f} at step {step}, pinned at >= {least}: {rewards}"
    assert compilations_after_first_step(records) == {}
