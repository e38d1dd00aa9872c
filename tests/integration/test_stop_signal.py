"""SIGTERM during `marin-rl train`: rollouts are flushed and a checkpoint is written before exit."""

import json
import signal
import subprocess
import sys
import time

import pytest

from marin_rl.storage import read_rollouts


@pytest.mark.slow
def test_sigterm_flushes_rollouts_and_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "marin_rl.cli", "train", "configs/quickstart.yaml",
        f"--run_dir={run_dir}", "--max_steps=1000", "--batcher.total_token_budget=640",
        "--batcher.max_wait_s=5", "--server.max_seqs=16", "--checkpoint_every=1000",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no training step within 300 s"
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()  # a hung run must not outlive the test
        process.wait()
    assert process.returncode == 0, output
    assert "SIGTERM" in output and "stopped early" in output

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    last_step = records[-1]["step"]
    assert (run_dir / "checkpoints" / f"step-{last_step}").is_dir()
    # Every rollout the buffer accepted is on disk, though no flush threshold was reached.
    accepted = sum(r["replays/addition/new_rollouts"] for r in records)
    assert len(read_rollouts(run_dir, env="addition")) >= accepted
