"""A remote `marin-rl serve` that hangs in the middle of a run, is killed (-9), and restarts.

Frozen first (SIGSTOP) so that requests are in flight when it dies, whatever the timing: the push
that it does not confirm within `confirm_timeout_s` marks it down. The run goes on without it, and once it is back it gets the run's current weights before it is
sampled from again. Its own checkpoint claims policy version 999: a rollout labelled 999 would be one
sampled from weights this run never pushed (at the start, or after the restart).
"""

import signal
import threading
import time

import httpx
import jax
import pytest

from marin_rl.config import load_config
from marin_rl.learner import build_model, save_hf_model
from marin_rl.orchestrator import train
from marin_rl.storage import read_rollouts
from marin_rl.testing import free_port, metrics_records, start_serve_process
from marin_rl.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"
OWN_VERSION = 999


def wait_for(condition, what, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def served_by_remote(run_dir) -> bool:
    return any(r.turns[-1].inference_metadata.server_id == "remote0" for r in read_rollouts(run_dir))


def test_a_remote_server_killed_and_restarted_mid_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_RL_WEIGHT_TOKEN", TOKEN)
    port = free_port()
    run_dir = tmp_path / "run"
    config = load_config(
        "configs/quickstart.yaml",
        [
            f"--run_dir={run_dir}", "--max_steps=1000", "--batcher.total_token_budget=640", "--server.max_seqs=16",
            "--checkpoint_every=1000", f"--broadcaster.remote_servers=[http://127.0.0.1:{port}/v1]",
            "--broadcaster.reconnect_max_backoff_s=2", "--broadcaster.confirm_timeout_s=5",
            "--max_buffered_batches=1000",  # workers go on sampling, from it too, while a push waits on it
        ],
    )  # fmt: skip
    tokenizer = load_tokenizer("char")
    own = save_hf_model(build_model(config.model, len(tokenizer), key=jax.random.key(123)), tokenizer, tmp_path / "own")
    flags = ["--tokenizer=char", "--server.max_seqs=16", "--server.max_seq_len=64", f"--policy_version={OWN_VERSION}"]
    process, _ = start_serve_process(own, tmp_path, token=TOKEN, port=port, flags=flags)
    stop = threading.Event()
    result = {}
    trainer = threading.Thread(target=lambda: result.setdefault("run", train(config, stop=stop)))
    trainer.start()
    try:
        # On a loaded machine its first push can outlast confirm_timeout_s: it must have served before it hangs.
        frozen_at = wait_for(
            lambda: max((r["step"] for r in metrics_records(run_dir)), default=0) >= 3 and served_by_remote(run_dir) and metrics_records(run_dir)[-1]["step"],
            "3 steps, rollouts sampled from the remote server among them",
        )
        process.send_signal(signal.SIGSTOP)  # hung: requests sent to it now wait on it
        wait_for(lambda: metrics_records(run_dir)[-1]["step"] >= frozen_at + 2, "steps while it hangs")
        process.kill()
        process.wait()
        # The run goes on without it, and reports it down.
        down = wait_for(
            lambda: [r for r in metrics_records(run_dir) if r["step"] > frozen_at + 2 and r["broadcast/servers_down"] == 1], "steps without it"
        )
        process, _ = start_serve_process(own, tmp_path, token=TOKEN, port=port, flags=flags)  # its own weights again
        back_at = wait_for(
            lambda: next((r["step"] for r in metrics_records(run_dir) if r["step"] > down[0]["step"] and r["broadcast/servers_down"] == 0), None),
            "the server to be back",
        )
        wait_for(lambda: metrics_records(run_dir)[-1]["step"] >= back_at + 4, "steps after it came back")
    finally:
        stop.set()
        trainer.join(timeout=300)
    try:
        run = result["run"]
        assert run.stopped_early and run.final_step >= back_at + 4
        served = httpx.get(f"http://127.0.0.1:{port}/v1/weights/version").json()["policy_version"]
        assert served == run.final_step  # it follows the run again
    finally:
        process.terminate()
        process.wait(timeout=60)

    rollouts = read_rollouts(run_dir)
    remote = [r for r in rollouts if r.turns[-1].inference_metadata.server_id == "remote0"]
    versions = sorted({r.policy_version for r in remote})
    down_steps = sum(r["broadcast/servers_down"] == 1 for r in metrics_records(run_dir))
    print(
        f"frozen after step {frozen_at} then killed, back at step {back_at} ({down_steps} steps reported it down), run stopped at "
        f"{run.final_step}; {len(remote)} of {len(rollouts)} rollouts from the remote server, versions {versions[0]}..{versions[-1]}"
    )
    assert OWN_VERSION not in versions  # never sampled from before it had this run's weights
    assert any(v < frozen_at for v in versions) and any(v >= back_at for v in versions)  # used before and after
    assert max(r["workers/addition/errors"] for r in metrics_records(run_dir)) >= 1  # requests left hanging on it failed at the kill, and were retried
