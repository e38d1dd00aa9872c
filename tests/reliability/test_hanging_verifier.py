"""A verifier that hangs now and then cannot stall the run; one that always hangs stops it, named."""

import json
import logging
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from marin_rl.config import load_config
from marin_rl.orchestrator import train
from marin_rl.orchestrator._preflight import check_run
from marin_rl.testing import run_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
HANGING = f"{Path(__file__).with_name('hanging_env.py')}:HangingAddition"
VERIFIER_TIMEOUT_S = 0.5


def hanging_run(run_dir: Path, steps: int, hang_every: int, c_hang_s: float = 20.0) -> list[str]:
    return [
        f"--run_dir={run_dir}", f"--max_steps={steps}", f"--envs.addition.type={HANGING}",
        f"--envs.addition.args={{addends: [1], hang_every: {hang_every}, c_hang_s: {c_hang_s}}}",
        f"--envs.addition.verifier_timeout_s={VERIFIER_TIMEOUT_S}",
    ]  # fmt: skip


def verifier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("verifier:addition")}


def stacks(threads: set[threading.Thread]) -> str:
    frames = sys._current_frames()
    return "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}" for t in threads if t.ident in frames)


def test_a_verifier_hanging_on_2_percent_of_rollouts_neither_stalls_learning_nor_piles_up_threads(tmp_path, caplog):
    config = load_config(QUICKSTART, hanging_run(tmp_path / "run", steps=40, hang_every=50, c_hang_s=3.0))
    checked = check_run(config, resume=False)
    env = checked.envs["addition"]
    before = verifier_threads()  # other tests' envs of that name, in this process
    with caplog.at_level(logging.WARNING, logger="marin_rl.workers._faults"):
        train(config, checked=checked)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["batches/addition/reward_mean"] for r in records]
    assert len(records) == 40
    # It learns as the quickstart does (5-step mean 0.71 at step 30 there), every step on a full batch.
    assert statistics.mean(rewards[-5:]) >= 0.55 and statistics.mean(rewards[-5:]) - statistics.mean(rewards[:5]) >= 0.4, rewards
    assert all(r["batches/addition/starved"] == 0 for r in records)
    # Both kinds of hang happened and timed out (but those in flight at the last step's line, or at the stop).
    timeouts = records[-1]["envs/addition/reward_timeouts"]
    assert env.hangs["python"] >= 10 and env.hangs["c"] >= 10
    assert 0.9 * sum(env.hangs.values()) <= timeouts <= sum(env.hangs.values())
    failed = [r["replays/addition/frac_reward_failed"] for r in records if "replays/addition/frac_reward_failed" in r]
    assert 0.005 < statistics.mean(failed) < 0.05
    # Hangs in Python were interrupted; one blocked in C holds its thread until it returns (3 s here),
    # and no more threads serve than the pool's 8.
    hung = [r["envs/addition/hung_verifier_threads"] for r in records]
    assert max(hung) <= env.hangs["c"] / 2, hung
    pool = env.verifier_pool
    assert pool.threads - pool.hung <= env.verifier_threads and pool.hung <= env.hangs["c"]
    # The run closed them: each ends with its call (a hang in C within its 3 s), none is left behind.
    deadline = time.monotonic() + 30
    while verifier_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = verifier_threads() - before
    assert not left and pool.threads == 0, stacks(left)
    print(
        f"2% hanging verifier: 5-step mean reward {statistics.mean(rewards[:5]):.3f} -> {statistics.mean(rewards[-5:]):.3f} "
        f"in 40 steps; {timeouts:.0f} timeouts ({env.hangs}); frac_reward_failed {statistics.mean(failed):.3f}; "
        f"hung threads at most {max(hung):.0f}; median step {statistics.median(r['time/step_s'] for r in records):.2f}s"
    )
    warnings = [r.getMessage() for r in caplog.records if "rewards failed for" in r.getMessage()]
    assert warnings and warnings[0].startswith("env 'addition': rewards failed for ")
    assert "correct: timed out after 0.5s" in warnings[0]


def test_a_verifier_that_always_hangs_stops_the_run_with_one_line_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    done = run_command(["train", QUICKSTART, *hanging_run(run_dir, steps=20, hang_every=1)], cwd=ROOT, timeout=300)
    last_line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-3000:]
    assert last_line.startswith("error: env 'addition': rewards failed for 64 of the last 64 rollouts (100.0%; correct: timed out after 0.5s")
    assert "more than envs[addition].max_reward_failures = 0.5" in last_line
    assert "Traceback" not in done.stderr
    # It stopped before training on zeros for long, and kept a checkpoint of where it was.
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").exists() else []
    assert len(steps) <= 2 and list((run_dir / "checkpoints").glob("step-*"))
