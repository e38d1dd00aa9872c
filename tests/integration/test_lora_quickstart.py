"""The quickstart with LoRA (`--learner.lora.rank=16`) still learns: only the adapters train, and the
engine samples from the merged weights it gets at every swap."""

import statistics

import pytest

from marin_rl.config import load_config
from marin_rl.errors import ConfigError
from marin_rl.testing import compilations_after_first_step, train_until

pytestmark = pytest.mark.slow


def best_five_step_mean(records) -> float:
    rewards = [r["batches/addition/reward_mean"] for r in records]
    return max((statistics.mean(rewards[i - 5 : i]) for i in range(5, len(rewards) + 1)), default=0.0)


def test_the_quickstart_with_rank_16_adapters_reaches_0_8_within_150_steps(tmp_path):
    config = load_config("configs/quickstart.yaml", [f"--run_dir={tmp_path / 'run'}", "--max_steps=150", "--learner.lora.rank=16"])
    _, records = train_until(config, lambda records: best_five_step_mean(records) >= 0.8)
    rewards = [r["batches/addition/reward_mean"] for r in records]
    assert best_five_step_mean(records) >= 0.8, f"best 5-step mean reward {best_five_step_mean(records):.3f}: {[round(r, 2) for r in rewards]}"
    assert statistics.mean(rewards[:5]) < 0.3  # it learned here, from near chance
    assert compilations_after_first_step(records) == {}


def test_lora_with_deterministic_numerics_is_refused_naming_the_fields(tmp_path):
    with pytest.raises(ConfigError, match="learner.lora.rank.*exact_numerics: false"):
        load_config("configs/quickstart.yaml", [f"--run_dir={tmp_path}", "--learner.lora.rank=16", "--deterministic=true"])
    load_config("configs/quickstart.yaml", [f"--run_dir={tmp_path}", "--learner.lora.rank=16", "--deterministic=true", "--exact_numerics=false"])
