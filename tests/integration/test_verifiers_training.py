"""A verifiers taskset trains on CPU: the quickstart's model and task, defined as a verifiers taskset."""

import gc
import json
from pathlib import Path

import pytest
import yaml

from marin_rl.config import load_config
from marin_rl.orchestrator import train

pytest.importorskip("verifiers.v1")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_envs")]

STEPS = 50


def test_reward_of_a_verifiers_taskset_rises(tmp_path):
    raw = yaml.safe_load(Path("configs/quickstart.yaml").read_text())
    raw["envs"] = [
        {
            "name": "vf-addition",
            "type": "verifiers",
            "args": {"taskset": "marin_vf_addition"},  # tests/verifiers_envs/marin_vf_addition.py
            "replicas": 8,
            "group_size": 16,
            "sampling": {"temperature": 1.0, "max_tokens": 1},
            "algorithm": {"type": "grpo"},  # as the quickstart: RLOO can stall with prompts locked on a wrong digit
            "buffer": {"max_age": 1},
        }
    ]
    path = tmp_path / "vf.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path, [f"--run_dir={tmp_path / 'run'}", f"--max_steps={STEPS}", "--checkpoint_every=100"])
    result = train(config)
    assert result.final_step == STEPS

    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["replays/vf-addition/reward/mean"] for r in records if "replays/vf-addition/reward/mean" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    # Chance is about 0.01. 50 steps (0.2 s each since single-turn tasks skip the episode): 0.06 -> 0.61,
    # 0.56; 30 steps once gave 0.28.
    assert last > first + 0.25
    assert all(r.get("workers/vf-addition/errors", 0) == 0 for r in records)
    # A connection or server the run left open is reported here (warnings are errors), not in a later test.
    gc.collect()


def test_the_docs_verifiers_taskset_trains_from_the_working_directory(tmp_path):
    """docs/envs.md's first verifiers taskset and config, saved as a newcomer saves them, train with
    `marin-rl train` run in their folder (the taskset module found there, not installed)."""
    import re

    from marin_rl.storage import read_rollouts
    from marin_rl.testing import run_command

    section = Path("docs/envs.md").read_text().split("**Your first taskset.**", 1)[1]
    taskset = re.findall(r"^```python\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)[0]
    config = re.findall(r"^```yaml\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)[0]
    (tmp_path / "my_vf_taskset.py").write_text(taskset)
    (tmp_path / "my_vf.yaml").write_text(config)
    done = run_command(["train", "my_vf.yaml", "--max_steps=3", "--batcher.total_token_budget=640", "--server.max_seqs=16"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "my_vf"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["workers/last-letter/errors"] == 0 for r in records)
    rollouts = read_rollouts(run_dir)
    assert rollouts and all(r.metadata["verifiers"]["stop_condition"] == "agent_completed" for r in rollouts)
    assert {r.rewards["correct"] for r in rollouts} <= {0.0, 1.0}
