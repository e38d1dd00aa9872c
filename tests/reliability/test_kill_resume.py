"""kill -9 of `marin-rl train` at three random moments, resumed each time, against an uninterrupted run.

A deterministic run (`deterministic: true`) killed and resumed must end with the same parameters and
optimizer state as an uninterrupted one, and log the same per-step metrics, one line per step; every
segment stays readable and each kill loses at most the rollouts of one flush window.
"""

import filecmp
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from marin_rl.config import load_config
from marin_rl.orchestrator import train
from marin_rl.orchestrator._resume import ABANDONED_METRICS_FILE, ABANDONED_ROLLOUTS_DIR
from marin_rl.storage import list_segments, read_rollouts, read_segment, table_to_rollouts
from marin_rl.testing import QUICK_RUN, run_command

pytestmark = pytest.mark.slow

MAX_STEPS = 15  # three kills need 12: each comes within KILL_WITHIN_STEPS of a checkpoint every 3
FLUSH_WINDOW = 64
KILL_WITHIN_STEPS = 5
"""Each kill comes at most this many steps past the checkpoint it resumed from (or the start)."""
RUNS = {  # config -> its env: the quickstart, and a two-turn task
    "configs/quickstart.yaml": "addition",
    "configs/multiturn.yaml": "letters",
}


def args_of(config: str) -> list[str]:
    return [
        config, f"--max_steps={MAX_STEPS}", "--batcher.total_token_budget=640", "--server.max_seqs=16",
        "--checkpoint_every=3", "--eval_every=6", "--deterministic=true", f"--envs.{RUNS[config]}.buffer.flush_every_rollouts={FLUSH_WINDOW}",
    ]  # fmt: skip


TIMING = ("time", "seconds", "_s", "per_s")
PROCESS = ("server/", "compile/")
"""The engine's own counters (device calls, queue, busy slots) depend on when requests arrive, and a
process compiles only what it has not compiled before."""


def reproducible(record: dict) -> dict:
    """What a deterministic run must reproduce: everything but timings, the engine's counters and compilations."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(PROCESS) and not any(k.endswith(t) or k.startswith(t) for t in TIMING)
    }


def per_step(record: dict, env: str) -> dict:
    """The reproducible metrics of the step alone (not the counters a process accumulates since it started)."""
    prefixes = ("learner/", "batch/", "batches/", "eval/", "mismatch/", "broadcast/version", f"replays/{env}/new_", f"replays/{env}/reward")
    return {k: v for k, v in reproducible(record).items() if k.startswith(prefixes) or k == "step"}


def lines(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # cut by a kill
    return records


def rollouts_on_disk(run_dir: Path, env: str) -> list:
    found = []
    for root in (run_dir / "rollouts" / env, run_dir / ABANDONED_ROLLOUTS_DIR / env):
        for path in list_segments(root) if root.is_dir() else []:
            found.extend(table_to_rollouts(read_segment(path)))  # raises if a segment is unreadable
    return found


def accepted_and_stored(run_dir: Path, env: str) -> tuple[float, int]:
    """Rollouts the logged steps accepted (metrics lines, set aside or not), rollouts on disk (anywhere)."""
    records = lines(run_dir / "metrics.jsonl") + lines(run_dir / ABANDONED_METRICS_FILE)
    return sum(r.get(f"replays/{env}/new_rollouts", 0) for r in records), len(rollouts_on_disk(run_dir, env))


def fingerprint(rollouts) -> Counter:
    return Counter((r.policy_version, r.problem_id, r.token_ids().tobytes(), r.reward) for r in rollouts)


def same_file(a: Path, b: Path) -> bool:
    return filecmp.cmp(a, b, shallow=False)


@pytest.mark.parametrize("config", list(RUNS))
def test_killed_and_resumed_deterministic_run_equals_uninterrupted_ones(tmp_path, config):
    env, args = RUNS[config], args_of(config)
    # --- an uninterrupted run (in this process); the killed run below, in other processes, must equal it
    a = tmp_path / "a"
    train(load_config(args[0], [*args[1:], f"--run_dir={a}"]))
    final = f"checkpoints/step-{MAX_STEPS}"
    # Exact numerics (on with deterministic): the learner's log-probs are the server's, bit for bit.
    steps = [r for r in lines(a / "metrics.jsonl") if r["step"] > 0]
    assert steps and all(r[f"mismatch/{env}/max_abs_diff"] == 0.0 and r[f"mismatch/{env}/tokens"] > 0 for r in steps)

    # --- the same run in processes killed with SIGKILL at random moments, resumed each time
    seed = int(os.environ.get("RELIABILITY_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    run_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "marin_rl.cli", "train", *args, f"--run_dir={run_dir}"]
    kills = []
    process = None
    try:
        for attempt in range(4):
            before = accepted_and_stored(run_dir, env)
            resumed_at = max([int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*")], default=0)
            with open(tmp_path / f"attempt-{attempt}.log", "w") as log:
                # Always --resume, as a job that may be preempted at any moment runs it: a fresh run starts at step 0.
                process = subprocess.Popen([*command, "--resume"], stdout=log, stderr=subprocess.STDOUT)
            if attempt == 3:
                assert process.wait(timeout=600) == 0, (tmp_path / f"attempt-{attempt}.log").read_text()[-3000:]
                break
            log_tail = lambda: (tmp_path / f"attempt-{attempt}.log").read_text()[-3000:]  # noqa: E731
            reached = lambda step: any(r["step"] >= step for r in lines(run_dir / "metrics.jsonl"))  # noqa: E731
            if attempt:  # two steps past where it resumed, then anywhere in a step: sampling, learning, a checkpoint
                deadline = time.monotonic() + 300
                while not reached(resumed_at + 2):
                    assert process.poll() is None and time.monotonic() < deadline, log_tail()
                    time.sleep(0.05)
            # Attempt 0: anywhere from start-up (imports, compilation) to the first steps. The random delay
            # is cut short by a step bound, so that a fast machine cannot finish the run first.
            kill_at = time.monotonic() + (rng.uniform(0, 1.5) if attempt else rng.uniform(3, 30))
            while time.monotonic() < kill_at and not reached(resumed_at + KILL_WITHIN_STEPS):
                assert process.poll() is None, log_tail()
                time.sleep(0.05)
            assert process.poll() is None, "finished before it could be killed"
            process.send_signal(signal.SIGKILL)
            process.wait()
            after = accepted_and_stored(run_dir, env)
            lost = (after[0] - before[0]) - (after[1] - before[1])
            kills.append({"resumed_at": resumed_at, "lost": lost})
            assert lost <= FLUSH_WINDOW, f"kill {attempt} (seed {seed}) lost {lost} rollouts"
    finally:
        if process is not None and process.poll() is None:
            process.kill()  # a failed check must not leave a run training past the test
            process.wait()
    print(f"seed {seed}: kills {kills}")

    # Identical parameters and optimizer state; one line per step with the uninterrupted metrics.
    for name in ("model.eqx", "opt_state.eqx"):
        assert same_file(run_dir / final / name, a / final / name), f"seed {seed}, kills {kills}"
    killed_lines = lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in killed_lines] == list(range(MAX_STEPS + 1))  # 0: the baseline evaluation
    assert [per_step(r, env) for r in killed_lines] == [per_step(r, env) for r in lines(a / "metrics.jsonl")]

    # Rollouts: every segment readable (rollouts_on_disk reads them all); the kept ones are the
    # uninterrupted run's (one population per version), short of at most a flush window per kill.
    kept, reference = fingerprint(read_rollouts(run_dir)), fingerprint(read_rollouts(a))
    assert not kept - reference, "rollouts no uninterrupted run sampled"
    assert sum((reference - kept).values()) <= FLUSH_WINDOW * len(kills)


def test_a_run_killed_during_start_up_resumes_from_step_0(tmp_path):
    run_dir = tmp_path / "run"
    command = [str(Path(sys.executable).with_name("marin-rl")), "train", "configs/quickstart.yaml", f"--run_dir={run_dir}", "--max_steps=3", *QUICK_RUN]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "config.yaml").exists():  # the run directory is made once the checks pass
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    assert not list((run_dir / "checkpoints").glob("step-*")) and not lines(run_dir / "metrics.jsonl")
    resumed = run_command(["train", "configs/quickstart.yaml", f"--run_dir={run_dir}", "--max_steps=3", *QUICK_RUN, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"note: --resume: {run_dir} holds no complete checkpoint yet: the run starts at step 0" in resumed.stdout
    assert [r["step"] for r in lines(run_dir / "metrics.jsonl")] == [1, 2, 3] and "done at step 3" in resumed.stdout
