import json

import pytest

from marin_rl.cli import main
from marin_rl.storage import RolloutWriter
from marin_rl.testing import make_group, make_rollout


@pytest.fixture
def run_dir(tmp_path):
    writer = RolloutWriter(tmp_path / "rollouts" / "math")
    writer.append(make_group([1.0, 0.0, 0.5], env="math", group_id="a", policy_version=0))
    writer.append(make_group([1.0, 1.0], env="math", group_id="b", policy_version=1))
    writer.close()
    writer = RolloutWriter(tmp_path / "rollouts" / "toy")
    writer.append([make_rollout(env="toy", rewards={"correct": 1.0, "format": 0.25}, is_truncated=True)])
    writer.close()
    return tmp_path


def test_summary_reports_each_env_and_version(run_dir, capsys):
    assert main(["rollouts", "summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in out.splitlines() if line.startswith("│")]
    versions, named = rows[:3], rows[3:]
    assert versions[0] == ["math", "0", "3", "21", "3.0", "0.500", "0.408", "0%"]
    assert versions[2][0] == "toy" and versions[2][7] == "100%"
    assert named == [
        ["math", "correct", "0.500", "1.000", "0.700"],
        ["toy", "correct", "1.000", "1.000", "1.000"],
        ["toy", "format", "0.250", "0.250", "0.250"],
    ]


def test_summary_fits_80_columns_without_cutting_env_names(tmp_path, monkeypatch, capsys):
    names = ["arithmetic_with_long_name", "calculator"]
    for env in names:
        writer = RolloutWriter(tmp_path / "rollouts" / env)
        rewards = {"correct": 1.0, "format": 1.0, "used_calculator": 0.0, "another_named_reward": 0.5}
        writer.append([make_rollout(env=env, rewards=rewards)])
        writer.close()
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["rollouts", "summary", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    for env in names:
        assert any(f"│ {env} " in line for line in lines)


def test_show_filters_by_env_reward_and_version(run_dir, capsys):
    assert main(["rollouts", "show", str(run_dir), "--env", "math", "--max-reward", "0.5", "--version", "0", "-n", "10"]) == 0
    out = capsys.readouterr().out
    assert out.count("problem a") == 2 and out.count("math · reward") == 2
    assert "reward 1 " not in out
    assert "assistant" in out and "user" in out


def test_show_folds_a_groups_identical_samples_and_fits_80_columns(tmp_path, monkeypatch, capsys):
    problem = "9f" * 32  # a verifiers problem id: a sha256
    same = [make_rollout(env="vf-math", group_id="g", problem_id=problem, reward=0.0, seed=1) for _ in range(3)]
    other = make_rollout(env="vf-math", group_id="g", problem_id=problem, reward=1.0, rewards={"correct": 1.0, "brief": 0.25}, seed=2)
    writer = RolloutWriter(tmp_path / "rollouts" / "vf-math")
    writer.append([*same, other])
    writer.close()
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["rollouts", "show", str(tmp_path), "-n", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("╭") == 2 and "x3 identical in its group" in out  # four samples, two distinct
    assert max(len(line) for line in out.splitlines()) <= 80
    assert f"problem {problem}" in out  # whole, where a title would have cut it
    assert "rewards correct=1 brief=0.25" in out and "reward 1 · v0" in out


def test_summary_by_problem_names_the_failing_problem_first(tmp_path, monkeypatch, capsys):
    writer = RolloutWriter(tmp_path / "rollouts" / "addition")
    for version in range(15):
        for a in range(4):
            rewards = [0.0] * 4 if a == 2 else [1.0, 1.0, 0.0, 1.0]
            writer.append(make_group(rewards, env="addition", group_id=f"g{version}-{a}", problem_id=f"{a}+1=", policy_version=version, seed=a))
    writer.close()
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["rollouts", "summary", str(tmp_path), "--by", "problem"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    assert rows[0][:5] == ["addition", "2+1=", "0.00", "never", "100%"]
    assert [row[1] for row in rows[1:]] == ["0+1=", "1+1=", "3+1="] and all(row[2] == "0.75" for row in rows[1:])
    assert max(len(line) for line in lines) <= 80


def test_export_jsonl_round_trips_token_ids(run_dir, tmp_path, capsys):
    target = tmp_path / "out.jsonl"
    assert main(["rollouts", "export", str(run_dir), "--format", "jsonl", "-o", str(target)]) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 6
    assert {r["environment"] for r in records} == {"math", "toy"}
    assert all(len(r["turns"][1]["token_ids"]) == len(r["turns"][1]["logprobs"]) for r in records)


def test_corrupt_segment_is_named_and_the_rest_still_summarised(run_dir, capsys):
    (run_dir / "rollouts" / "math" / "segment-00000007.parquet").write_bytes(b"junk")
    assert main(["rollouts", "summary", str(run_dir)]) == 1
    captured = capsys.readouterr()
    out, err = captured.out.replace("\n", ""), captured.err.replace("\n", "")
    assert "segment-00000007.parquet" in err and "segment-00000007" not in out  # stdout stays the report
    assert "toy" in out and "math" in out


def test_missing_and_empty_runs_are_clear_errors(tmp_path, capsys):
    assert main(["rollouts", "summary", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "rollouts" / "math").mkdir(parents=True)
    assert main(["rollouts", "show", str(tmp_path)]) == 1
    assert "no rollouts yet" in capsys.readouterr().err.replace("\n", "")
