"""LoRA (`learner.lora`): only the adapters train, and the policy engines and exports get is the merged,
plain model."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from levanter.lora import LoraLinear, partition_lora_params

from marin_rl.learner import Learner, LearnerConfig, LoraConfig, OptimizerConfig, build_model, per_token_logprobs, scored_tokens
from marin_rl.rl_example import RlExample

logprobs = eqx.filter_jit(per_token_logprobs)


def lora_learner(run_dir, tokenizer, model_config, *, exact=None):
    config = LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), vocab_block_size=40, lora=LoraConfig(rank=4, alpha=8.0))
    return Learner(config, model_config, run_dir, tokenizer, key=jax.random.key(0), exact=exact)


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def has_lora_modules(model) -> bool:
    return any(isinstance(n, LoraLinear) for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoraLinear)))


def test_only_the_adapters_train_and_the_policy_is_their_merge(tmp_path, tokenizer, tiny_model_config, packed_batch):
    learner = lora_learner(tmp_path, tokenizer, tiny_model_config)
    example = RlExample.from_packed(packed_batch)
    plain = build_model(tiny_model_config, len(tokenizer), key=jax.random.key(1))
    policy = learner.policy_model
    assert not has_lora_modules(policy) and has_lora_modules(learner.model)
    assert [(x.shape, x.dtype) for x in arrays(policy)] == [(x.shape, x.dtype) for x in arrays(plain)]
    # B starts at zero: the adapted model computes what the base does (up to float rounding).
    np.testing.assert_allclose(np.asarray(logprobs(policy, example)[0].array), np.asarray(logprobs(learner.model, example)[0].array), atol=1e-5)

    base_before, adapters_before = (arrays(part) for part in partition_lora_params(learner.model))
    mask = packed_batch.loss_mask & np.asarray(scored_tokens(packed_batch.segment_ids))
    behaviour = np.asarray(logprobs(policy, example)[0].array)
    positive = RlExample.from_packed(
        dataclasses.replace(packed_batch, advantages=mask.astype(np.float32), policy_logprobs=np.where(mask, behaviour, 0.0))
    )
    for _ in range(3):
        learner.step(positive)
    base_after, adapters_after = (arrays(part) for part in partition_lora_params(learner.model))
    assert all(np.array_equal(a, b) for a, b in zip(base_before, base_after, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(adapters_before, adapters_after, strict=True))
    # The optimizer holds state for the adapters only: nothing of a base weight's size.
    adapter_sizes = {a.size for a in adapters_after}
    assert all(x.size in adapter_sizes or x.size == 1 for x in arrays(learner._opt_state))
    # What the engine gets (W + scale * B A) computes what the learner trains, and learned.
    merged = np.asarray(logprobs(learner.policy_model, positive)[0].array)
    np.testing.assert_allclose(merged, np.asarray(logprobs(learner.model, positive)[0].array), atol=1e-5)
    assert merged[mask].mean() > behaviour[mask].mean() + 0.05


def test_lora_with_exact_numerics_is_refused(tmp_path, tokenizer, tiny_model_config):
    from marin_rl.engine import ExactLayout

    with pytest.raises(ValueError, match="LoRA"):
        lora_learner(tmp_path, tokenizer, tiny_model_config, exact=ExactLayout(tile=8, context=64))


@pytest.mark.parametrize("field, value", [("rank", -1), ("dropout", 1.0)])
def test_bad_lora_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LoraConfig.{field}"):
        LoraConfig(**{"rank": 4, field: value})


def test_a_checkpoint_resumes_the_adapters_and_their_optimizer_state(tmp_path, tokenizer, tiny_model_config, example):
    learner = lora_learner(tmp_path, tokenizer, tiny_model_config)
    learner.step(example)
    learner.save_checkpoint()
    learner.step(example)

    resumed = lora_learner(tmp_path, tokenizer, tiny_model_config)
    assert resumed.restore_latest() == {} and resumed.policy_version == 1
    resumed.step(example)
    for a, b in zip(arrays(resumed.model), arrays(learner.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_hf_export_is_the_merged_model(tmp_path, tokenizer, tiny_model_config, packed_batch):
    from marin_rl.learner import load_hf_model

    learner = lora_learner(tmp_path, tokenizer, tiny_model_config)
    example = RlExample.from_packed(dataclasses.replace(packed_batch, advantages=np.ones_like(packed_batch.advantages)))
    for _ in range(2):
        learner.step(example)
    reloaded = load_hf_model(learner.export_hf(), tiny_model_config, tokenizer=tokenizer)
    assert not has_lora_modules(reloaded)
    np.testing.assert_allclose(
        np.asarray(logprobs(reloaded, example)[0].array), np.asarray(logprobs(learner.model, example)[0].array), atol=1e-5
    )
