"""End to end: the quickstart task through the whole loop (server, workers, buffers, batcher, learner)."""

import dataclasses

import pytest

from marin_rl.cli import main
from marin_rl.config import load_config
from marin_rl.orchestrator import train
from marin_rl.storage import read_rollouts
from marin_rl.testing import metrics_records

pytestmark = pytest.mark.slow

QUICKSTART = "configs/quickstart.yaml"


def small_run_config(run_dir, max_steps):
    """The quickstart, shrunk: fewer rollouts per step so a step is quick on a shared CPU."""
    return load_config(
        QUICKSTART,
        [
            f"--run_dir={run_dir}",
            f"--max_steps={max_steps}",
            "--batcher.total_token_budget=640",
            "--batcher.max_wait_s=5",
            "--server.max_seqs=16",
            "--checkpoint_every=2",
        ],
    )


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "quick"
    config = small_run_config(run_dir, max_steps=3)
    result = train(config)
    return config, result


def test_policy_versions_advance_and_every_step_is_logged(short_run):
    config, result = short_run
    assert result.final_step == 3 and not result.stopped_early
    records = metrics_records(result.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["broadcast/version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["learner/num_loss_tokens"] > 0 for r in records)


def test_no_rollout_older_than_max_age_is_trained_on(short_run):
    config, result = short_run
    max_age = config.envs[0].buffer.max_age
    for record in metrics_records(result.run_dir):
        assert record["batch/staleness_max"] <= max_age


def test_rollouts_on_disk_carry_the_versions_that_generated_them(short_run):
    config, result = short_run
    rollouts = read_rollouts(result.run_dir, env="addition")
    assert rollouts, "rollouts must be flushed to disk"
    versions = {r.policy_version for r in rollouts}
    # Servers only ever had versions 0..final; rollouts from several versions prove weights were swapped in.
    assert versions <= set(range(result.final_step + 1))
    assert len(versions) >= 2
    for r in rollouts:
        (assistant,) = [t for t in r.turns if t.role == "assistant"]
        assert assistant.inference_metadata.server_id == "embedded"
        assert len(assistant.logprobs) == len(assistant.token_ids)


def test_rollouts_summary_reads_the_run(short_run, capsys):
    _, result = short_run
    assert main(["rollouts", "summary", str(result.run_dir)]) == 0
    assert "addition" in capsys.readouterr().out


def test_plot_writes_pngs(short_run):
    _, result = short_run
    assert main(["plot", str(result.run_dir)]) == 0
    for name in ("reward", "loss", "kl", "throughput"):
        assert (result.run_dir / "plots" / f"{name}.png").stat().st_size > 0


def test_checkpoint_and_hf_export_are_written(short_run):
    _, result = short_run
    assert (result.run_dir / "checkpoints" / "step-3").is_dir()
    assert (result.run_dir / "hf" / "step-3" / "config.json").is_file()
    assert (result.run_dir / "config.yaml").read_text().count("toy_addition") == 1


def test_resume_continues_from_the_latest_checkpoint(short_run):
    config, result = short_run
    resumed = train(dataclasses.replace(config, max_steps=4), resume=True)
    assert resumed.final_step == 4
    assert [r["step"] for r in metrics_records(result.run_dir)] == [1, 2, 3, 4]


def test_a_second_run_into_the_same_dir_is_refused(short_run):
    config, _ = short_run
    from marin_rl.errors import RunDirError

    with pytest.raises(RunDirError, match="--resume"):
        train(config)
