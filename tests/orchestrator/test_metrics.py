import json

from marin_rl.config import WandbConfig
from marin_rl.orchestrator._metrics import MetricsLog, read_metrics, summary_lines


def test_metrics_log_appends_jsonl_and_mirrors_to_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    log = MetricsLog(tmp_path, WandbConfig(project="marin-rl-test", mode="offline"), config_dict={"a": 1})
    log.log(1, {"learner/loss": 0.5, "x": float("nan")})
    log.log(2, {"learner/loss": 0.25})
    assert log._wandb is not None
    log.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and records[0]["x"] is None
    assert any((tmp_path / "wandb").iterdir()), "W&B wrote its offline run"


def test_a_partial_last_line_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_a_run_resumed_before_abandoned_steps_were_set_aside_reads_one_record_per_step(tmp_path):
    lines = [{"step": 1, "v": "a"}, {"step": 2, "v": "abandoned"}, {"step": 2, "v": "b"}, {"step": 3, "v": "c"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [(r["step"], r["v"]) for r in read_metrics(tmp_path)] == [(1, "a"), (2, "b"), (3, "c")]


def test_summary_line_shows_reward_per_env_and_throughput():
    metrics = {
        "batches/a/reward_mean": 1.0,
        "batches/a/rollouts_used": 3,
        "batches/b/reward_mean": 0.0,
        "batches/b/rollouts_used": 1,
        "learner/loss": 0.1,
        "learner/tokens_per_s": 1234.0,
        "batch/staleness_mean": 0.5,
    }
    [line] = summary_lines(7, metrics, ["a", "b"])
    assert line.startswith("step 7 | reward 0.750 (a 1.00, b 0.00)")
    assert "learner tok/s 1,234" in line and "staleness 0.50" in line


def test_summary_lines_fit_80_columns_keeping_the_most_useful_parts():
    envs = ["addition", "arithmetic", "calculator"]
    metrics = {f"batches/{env}/reward_mean": 0.5 for env in envs} | {
        "learner/loss": -0.0123,
        "learner/approx_kl": 0.3740,
        "learner/tokens_per_s": 31714.0,
        "throughput/generated_tokens_per_s": 786.0,
        "batch/staleness_mean": 0.2,
        "time/wait_data_s": 12.5,
    }
    [full] = summary_lines(12345, metrics, envs)
    assert len(full) > 80 and "staleness 0.20" in full  # a log file keeps everything
    first, *rest = summary_lines(12345, metrics, envs, width=80)
    assert all(len(line) <= 80 for line in [first, *rest])
    assert first.startswith("step 12345 | reward 0.500 | loss -0.0123 | kl 0.3740 | gen tok/s 786")
    assert rest == ["rewards: addition 0.50, arithmetic 0.50, calculator 0.50"]
    [one_env] = summary_lines(7, metrics | {"batches/addition/reward_mean": 1.0}, ["addition"], width=80)
    assert one_env == "step 7 | reward 1.000 | loss -0.0123 | kl 0.3740 | gen tok/s 786 | wait 12.5s"
