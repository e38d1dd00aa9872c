"""The learner's step kept lowered on disk (`marin_rl/programs.py`): a second start loads it instead of
tracing and lowering, and it trains to the same bits as the jitted step; a batch of another shape takes
the jitted step."""

import jax
import numpy as np
import pytest

from marin_rl.compiles import CompileCounter
from marin_rl.learner import Learner, LearnerConfig, LoraConfig, LossConfig, OptimizerConfig
from marin_rl.rl_example import RlExample

pytestmark = pytest.mark.slow


def train(run_dir, tokenizer, model_config, examples, *, lora_rank=0, compile_like=None):
    """Metrics, log-probs and parameters after a step on each example, from one seed."""
    config = LearnerConfig(
        loss=LossConfig(beta=0.1),  # the frozen reference is one of the step's inputs too
        optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=1, max_grad_norm=1.0),
        microbatch_rows=2,
        lora=LoraConfig(rank=lora_rank),
    )
    learner = Learner(config, model_config, run_dir, tokenizer, key=jax.random.key(0))
    if compile_like is not None:
        learner.compile_step(compile_like)
    steps = []
    with CompileCounter() as compiles:
        for example in examples:
            metrics = learner.step(example)
            steps.append(({k: v for k, v in metrics.items() if k not in ("step_time_s", "tokens_per_s", "model_tflops_per_s")}, learner.last_logprobs))
    return steps, [np.asarray(x) for x in jax.tree.leaves(learner.model)], len(compiles.compiled)


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_second_start_loads_the_step_and_trains_to_the_same_bits(program_stores, tmp_path, tokenizer, tiny_model_config, packer, lora_rank):
    made, directory = program_stores
    batches = [RlExample.from_packed(packer([[7, 12, 9], [32], [20, 5], [3, 10]], 32, seed=s)) for s in range(2)]
    like = RlExample.from_packed(packer([[32], [4, 4], [9], [30]], 32, seed=9))  # other rollouts, same shape

    jitted, jitted_params, _ = train(tmp_path / "a", tokenizer, tiny_model_config, batches, lora_rank=lora_rank)
    assert made == []  # no compile_step: the jitted step alone

    first, first_params, _ = train(tmp_path / "b", tokenizer, tiny_model_config, batches, lora_rank=lora_rank, compile_like=like)
    assert made[0].loaded == 0 and len(list(directory["path"].glob("learner_step-*.exported"))) == 1
    second, second_params, compiled = train(tmp_path / "c", tokenizer, tiny_model_config, batches, lora_rank=lora_rank, compile_like=like)
    assert made[1].loaded == 1 and compiled == 0

    for stored, stored_params in ((first, first_params), (second, second_params)):
        for (metrics, logprobs), (jitted_metrics, jitted_logprobs) in zip(stored, jitted, strict=True):
            assert metrics == jitted_metrics
            np.testing.assert_array_equal(logprobs, jitted_logprobs)
        for a, b in zip(stored_params, jitted_params, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_batch_of_another_shape_takes_the_jitted_step(program_stores, tmp_path, tokenizer, tiny_model_config, packer):
    wide = RlExample.from_packed(packer([[7, 12, 9], [32], [20, 5], [3, 10]], 32, seed=1))
    narrow = RlExample.from_packed(packer([[7, 5], [16]], 16, seed=2))
    stored, stored_params, compiled = train(tmp_path / "a", tokenizer, tiny_model_config, [wide, narrow, wide], compile_like=wide)
    jitted, jitted_params, _ = train(tmp_path / "b", tokenizer, tiny_model_config, [wide, narrow, wide])
    assert compiled == 1  # the narrow batch's shape, and only it
    assert [metrics for metrics, _ in stored] == [metrics for metrics, _ in jitted]
    for a, b in zip(stored_params, jitted_params, strict=True):
        np.testing.assert_array_equal(a, b)
