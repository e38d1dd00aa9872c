"""configs/multienv.yaml: three envs with different algorithms train a few steps on CPU."""

import json

import pytest

from marin_rl.cli import main
from marin_rl.config import load_config
from marin_rl.orchestrator import train
from marin_rl.testing import compilations_after_first_step

pytestmark = pytest.mark.slow


def test_multienv_trains_10_steps_reports_every_env_and_no_server_or_worker_error(tmp_path):
    run_dir = tmp_path / "multi"
    config = load_config(
        "configs/multienv.yaml",
        [
            f"--run_dir={run_dir}",
            "--max_steps=10",
            "--eval_every=10",
            "--batcher.total_token_budget=4096",
            "--batcher.max_wait_s=20",
            "--envs.arithmetic.eval.max_problems=4",
            "--envs.calculator.eval.max_problems=2",
        ],
    )
    names = [e.name for e in config.envs]
    assert [e.algorithm.name for e in config.envs] == ["rloo", "grpo", "dr_grpo"]
    assert train(config).final_step == 10

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    baseline, *steps = records
    assert baseline["step"] == 0 and [r["step"] for r in steps] == list(range(1, 11))
    for env in names:
        assert f"eval/{env}/greedy/reward/mean" in baseline
        assert f"eval/{env}/greedy/reward/mean" in steps[-1]
    for record in steps:
        assert record["server/errors"] == 0  # the calculator env's long prompts once exhausted the KV pages
        assert record["server/pages_in_use"] <= record["server/pages_total"]
        for env in names:
            assert record[f"batches/{env}/fraction"] == config.fractions[env]
            assert record[f"workers/{env}/errors"] == 0, (record["step"], env)
            for key in (f"batches/{env}/frac_used", f"replays/{env}/rollouts_in_buffer"):
                assert key in record, key
    # Every env reached the batches (each got a share of the tokens at some step).
    for env in names:
        assert sum(r[f"batches/{env}/tokens_used"] for r in steps) > 0, env
    assert steps[-1]["server/completed"] > 0
    assert compilations_after_first_step(steps) == {}  # the engine's shapes were derived from the envs
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "eval.png").is_file() and (run_dir / "plots" / "token_share.png").is_file()
