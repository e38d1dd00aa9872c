"""Nothing compiles after step 1: the engine's shapes are derived from the envs and compiled at start
(the quickstart and the multi-env example are checked where their integration tests run)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from marin_rl.config import load_config
from marin_rl.engine._scheduler import MIN_PREFILL_TIME, bucket
from marin_rl.orchestrator import train
from marin_rl.storage import read_rollouts
from marin_rl.testing import QUICK_RUN, compilations_after_first_step, run_command

pytestmark = pytest.mark.slow

RAGGED_ENV = Path(__file__).with_name("ragged_env.py")
QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def test_a_second_start_loads_every_program_from_the_compilation_cache(tmp_path):
    cache = tmp_path / "cache"

    def first_step(name: str, cache_setting: str) -> dict:
        args = ["train", QUICKSTART, f"--run_dir={tmp_path / name}", "--max_steps=2", f"--compilation_cache={cache_setting}", *QUICK_RUN]
        done = run_command(args)
        assert done.returncode == 0, done.stderr
        assert "start-up: " in done.stdout  # the line that splits it by phase
        return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])

    cold = first_step("cold", str(cache))
    assert cold["compile/count"] > 0 and cold["compile/cache_hits"] < cold["compile/count"]
    entries = sorted(cache.iterdir())
    exported = sorted((cache / "marin-rl-exported").iterdir())
    assert any(p.name.startswith("learner_step-") for p in exported)
    warm = first_step("warm", str(cache))
    # Another process found every stored program under its key: none was lowered and written anew.
    assert sorted((cache / "marin-rl-exported").iterdir()) == exported
    # Fewer programs than the cold start: the stored ones are not traced again, nor the small eager
    # computations their tracing ran (the learning-rate schedule's constants).
    assert 0 < warm["compile/cache_hits"] == warm["compile/count"] <= cold["compile/count"]
    off = first_step("off", "off")
    assert off["compile/cache_hits"] == 0 and sorted(cache.iterdir()) == entries
    assert {"startup/imports_s", "startup/model_s", "startup/compile_s", "startup/first_batch_s"} <= set(warm)


def test_a_multi_turn_env_with_ragged_prompts_compiles_nothing_after_step_1(tmp_path):
    run_dir = tmp_path / "run"
    config = {
        "run_dir": str(run_dir),
        "max_steps": 20,
        "tokenizer": "char",
        "checkpoint_every": 10,
        "model": {"hidden_dim": 32, "intermediate_dim": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "seq_len": 64},
        "batcher": {"total_token_budget": 1024, "max_seq_len": 64, "max_wait_s": 20},
        "server": {"max_seqs": 8, "max_seq_len": 64},
        "envs": [
            {"name": "ragged", "type": f"{RAGGED_ENV}:RaggedEcho", "replicas": 4, "group_size": 4, "algorithm": {"type": "grpo"}}
        ],
    }
    (tmp_path / "ragged.yaml").write_text(yaml.safe_dump(config))
    train(load_config(tmp_path / "ragged.yaml"))

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[0]["compile/count"] > 0  # start-up's compilations are counted
    assert compilations_after_first_step(records) == {}
    # The run met what the derivation must cover: prompts of several prefill shapes, second turns
    # (whose prompts hold the first), answers that decode.
    rollouts = read_rollouts(run_dir, "ragged")
    prompt_lens = [len(r.turns[0].token_ids) for r in rollouts]
    second_prompt_lens = [sum(len(t.token_ids) for t in r.turns[:3]) for r in rollouts if len(r.turns) >= 4]
    buckets = {bucket(n, MIN_PREFILL_TIME) for n in prompt_lens + second_prompt_lens}
    assert len(buckets) >= 3, buckets
    assert np.mean([len(r.turns) >= 4 for r in rollouts]) > 0.5
    assert max(len(t.token_ids) for r in rollouts for t in r.turns if t.role == "assistant") > 1


def test_an_entry_left_half_written_by_a_killed_run_does_not_stop_the_cache_from_filling(tmp_path):
    """JAX writes an entry, then its access time; a run killed between the two left an entry JAX's
    eviction scan failed on at every later write, so nothing new was ever cached."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "jit_orphan-0123-cache").write_bytes(b"a program")  # no jit_orphan-0123-atime
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from marin_rl.compiles import enable_compilation_cache\n"
        "enable_compilation_cache(sys.argv[1])\n"
        "print(jax.jit(lambda x: x * 3 + 1)(jnp.arange(4)).tolist())\n"
    )
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code, str(cache)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in cache.iterdir())
    assert "jit_orphan-0123-atime" in names
    written = [n for n in names if n.endswith("-cache") and not n.startswith("jit_orphan")]
    assert written and all(n.removesuffix("-cache") + "-atime" in names for n in written)
