"""LoRA (`learner.lora`): only the adapters train, and the policy engines and exports get is the merged,
plain model."""

import dataclasses
import json

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.lora import LoraLinear, partition_lora_params

from marin_rl.learner import Learner, LearnerConfig, LoraConfig, OptimizerConfig, build_model, per_token_logprobs, scored_tokens
from marin_rl.learner._lora import add_adapters, trainable_params, trainable_spec
from marin_rl.rl_example import RlExample

logprobs = eqx.filter_jit(per_token_logprobs)


def lora_learner(run_dir, tokenizer, model_config, *, exact=None, rank=4, seed=0):
    config = LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), vocab_block_size=40, lora=LoraConfig(rank=rank, alpha=8.0))
    return Learner(config, model_config, run_dir, tokenizer, key=jax.random.key(seed), exact=exact)


def trained_a_little(learner, packed_batch):
    """Two steps with every scored token's advantage 1: B leaves zero, so the adapters change the model."""
    example = RlExample.from_packed(dataclasses.replace(packed_batch, advantages=np.ones_like(packed_batch.advantages)))
    for _ in range(2):
        learner.step(example)
    return example


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


def test_a_checkpoint_holds_the_adapters_alone_and_resumes_them_onto_their_base_only(tmp_path, tokenizer, tiny_model_config, example):
    learner = lora_learner(tmp_path, tokenizer, tiny_model_config)
    learner.step(example)
    path = learner.save_checkpoint()
    learner.step(example)

    # Only the adapters' bytes (and the file's small headers): none of a base weight's.
    _, adapters = partition_lora_params(learner.model)
    adapter_bytes = sum(x.nbytes for x in arrays(adapters))
    base_bytes = sum(x.nbytes for x in arrays(learner.model)) - adapter_bytes
    assert adapter_bytes <= (path / "model.eqx").stat().st_size < adapter_bytes + base_bytes // 10
    base = json.loads((path / "state.json").read_text())["base"]
    assert base["hf_checkpoint"] is None and len(base["fingerprint"]) > 0

    resumed = lora_learner(tmp_path, tokenizer, tiny_model_config)
    assert resumed.restore_latest() == {} and resumed.policy_version == 1
    resumed.step(example)
    for a, b in zip(arrays(resumed.model), arrays(learner.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    # Another random base (another seed) is not the one these adapters were trained on.
    with pytest.raises(ValueError, match="adapters for other base weights"):
        lora_learner(tmp_path, tokenizer, tiny_model_config, seed=1).restore_latest()


def test_a_lora_run_refuses_a_checkpoint_of_the_whole_model(tmp_path, tokenizer, tiny_model_config, example):
    config = LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), vocab_block_size=40)
    full = Learner(config, tiny_model_config, tmp_path, tokenizer, key=jax.random.key(0))
    full.save_checkpoint()
    with pytest.raises(ValueError, match="whole model, not LoRA adapters"):
        lora_learner(tmp_path, tokenizer, tiny_model_config).restore_latest()


def test_the_peft_export_loads_onto_the_hf_base_and_computes_our_logits(tmp_path, tokenizer, tiny_model_config, packed_batch):
    """The adapters as a PEFT directory: `peft` finds the base where the run loaded it from, and the
    merged model (and the unmerged one) computes the logits our merged policy does."""
    import torch
    import transformers
    from peft import AutoPeftModelForCausalLM

    from marin_rl.learner import save_hf_model

    base_dir = save_hf_model(build_model(tiny_model_config, len(tokenizer), key=jax.random.key(3)), tokenizer, tmp_path / "base")
    learner = lora_learner(tmp_path / "run", tokenizer, dataclasses.replace(tiny_model_config, hf_checkpoint=str(base_dir)))
    trained_a_little(learner, packed_batch)
    peft_dir = learner.export_peft()
    assert peft_dir == tmp_path / "run" / "peft" / "step-2"
    adapter_config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir) and adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0
    assert sorted(adapter_config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    input_ids = np.random.default_rng(0).integers(0, len(tokenizer), (2, 24))
    named = hax.named(jnp.asarray(input_ids), ("batch", "position"))
    ours = eqx.filter_jit(lambda m, x: m(x, AttentionMask.causal()))(learner.policy_model, named)
    ours = np.asarray(ours.rearrange(("batch", "position", "vocab")).array)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(peft_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        unmerged = peft_model(torch.tensor(input_ids)).logits.numpy()
        merged = peft_model.merge_and_unload()(torch.tensor(input_ids)).logits.numpy()
        base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)(torch.tensor(input_ids)).logits.numpy()
    np.testing.assert_allclose(merged, ours, atol=1e-4)
    np.testing.assert_allclose(unmerged, ours, atol=1e-4)
    assert np.abs(merged - base).max() > 1e-3  # the adapters changed the model: the comparisons above could fail


def test_a_run_exports_merged_weights_and_the_peft_adapter(tmp_path, tokenizer, tiny_model_config, packed_batch):
    learner = lora_learner(tmp_path, tokenizer, tiny_model_config)
    trained_a_little(learner, packed_batch)
    hf, peft = learner.export()
    assert (hf / "model.safetensors").is_file() and (peft / "adapter_model.safetensors").is_file()
    plain = Learner(LearnerConfig(vocab_block_size=40), tiny_model_config, tmp_path / "plain", tokenizer, key=jax.random.key(0))
    assert [p.parent.name for p in plain.export()] == ["hf"]
    with pytest.raises(ValueError, match="LoRA"):
        plain.export_peft()


def test_the_hf_export_is_the_merged_model(tmp_path, tokenizer, tiny_model_config, packed_batch):
    from marin_rl.learner import load_hf_model

    learner = lora_learner(tmp_path, tokenizer, tiny_model_config)
    example = trained_a_little(learner, packed_batch)
    reloaded = load_hf_model(learner.export_hf(), tiny_model_config, tokenizer=tokenizer)
    assert not has_lora_modules(reloaded)
    np.testing.assert_allclose(
        np.asarray(logprobs(reloaded, example)[0].array), np.asarray(logprobs(learner.model, example)[0].array), atol=1e-5
    )


def test_a_bf16_run_stores_its_frozen_base_in_bf16_and_trains_exactly_as_with_a_float32_one(tmp_path, tokenizer, tiny_model_config, packed_batch):
    """The step casts the whole model to the compute dtype, so a base stored cast changes nothing."""
    bf16 = dataclasses.replace(tiny_model_config, compute_dtype="bfloat16")
    learner = lora_learner(tmp_path / "a", tokenizer, bf16)
    trained, frozen = eqx.partition(learner.model, trainable_spec(learner.model))
    assert {x.dtype for x in arrays(frozen) if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in arrays(trained)} == {np.dtype(np.float32)}
    assert {x.dtype for x in arrays(learner._opt_state) if x.size > 1} == {np.dtype(np.float32)}

    # The same learner with the float32 base it was built from (the same keys as Learner.__init__).
    init_key = jax.random.split(jax.random.key(0))[0]
    base = build_model(bf16, len(tokenizer), key=init_key)
    float32_base = lora_learner(tmp_path / "b", tokenizer, bf16)
    float32_base.model = add_adapters(base, float32_base.config.lora, key=jax.random.split(init_key)[1])
    np.testing.assert_array_equal(arrays(trainable_params(float32_base.model))[0], arrays(trained)[0])
    assert {x.dtype for x in arrays(float32_base.model)} == {np.dtype(np.float32)}
    example = RlExample.from_packed(dataclasses.replace(packed_batch, advantages=np.ones_like(packed_batch.advantages)))
    for _ in range(2):
        assert learner.step(example)["loss"] == float32_base.step(example)["loss"]
    for a, b in zip(arrays(trainable_params(learner.model)), arrays(trainable_params(float32_base.model)), strict=True):
        np.testing.assert_array_equal(a, b)
