"""The learner: gradient accumulation, learning direction, the frozen KL reference, checkpoints, exports."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner import (
    Learner,
    LearnerConfig,
    LossConfig,
    OptimizerConfig,
    SequenceMean,
    TokenMean,
    TokenSum,
    build_model,
    kl_estimate,
    loss_and_gradients,
    per_token_logprobs,
    save_hf_model,
    scored_tokens,
)
from marin_rl.compiles import CompileCounter
from marin_rl.rl_example import RlExample

logprobs = eqx.filter_jit(per_token_logprobs)


@pytest.mark.parametrize(
    "aggregation",
    [
        SequenceMean(),
        pytest.param(TokenMean(), marks=pytest.mark.slow),
        pytest.param(TokenSum(50.0), marks=pytest.mark.slow),
    ],
    ids=lambda a: type(a).__name__,
)
def test_gradient_accumulation_equals_single_batch_gradient(tiny_model_config, packed_batch, aggregation):
    model = build_model(tiny_model_config, 104, key=jax.random.PRNGKey(0))
    # Reference log-probs given with the batch (the reference-model path is covered by the Learner tests).
    reference_logprobs = packed_batch.policy_logprobs + np.random.default_rng(0).normal(
        0, 0.3, packed_batch.input_ids.shape
    )
    example = RlExample.from_packed(
        dataclasses.replace(packed_batch, reference_logprobs=reference_logprobs.astype(np.float32))
    )
    config = LearnerConfig(loss=LossConfig(beta=0.1, tis_cap=2.0, aggregation=aggregation), vocab_block_size=40)

    @eqx.filter_jit
    def run(microbatch_rows):
        return loss_and_gradients(
            model,
            example,
            config=dataclasses.replace(config, microbatch_rows=microbatch_rows),
            compute_dtype=jnp.float32,
        )

    whole_loss, whole_grads, whole_metrics, whole_logp = run(None)
    loss, grads, metrics, logp = run(1)  # four microbatches of one row
    np.testing.assert_allclose(logp, whole_logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
    for name in whole_metrics:
        np.testing.assert_allclose(metrics[name], whole_metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)
    leaves, whole_leaves = jax.tree.leaves(grads), jax.tree.leaves(whole_grads)
    # float32 sums in another order: differences up to ~1e-6 (seen once under load) on gradients ~1e-3, so
    # 1e-3 of each leaf's largest gradient; a wrong normaliser would be off by a share of every gradient.
    for g, w in zip(leaves, whole_leaves, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3 * float(jnp.abs(w).max()))
    assert max(float(jnp.abs(w).max()) for w in whole_leaves) > 1e-3


def make_learner(run_dir, tokenizer, model_config, *, key=0, **loss):
    config = LearnerConfig(
        loss=LossConfig(**loss),
        optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=1, max_grad_norm=1.0),
        microbatch_rows=2,
        vocab_block_size=40,
    )
    return Learner(config, model_config, run_dir, tokenizer, key=jax.random.key(key))


def mean_loss_token_logprob(model, example, mask):
    return float(np.asarray(logprobs(model, example)[0].array)[mask].mean())


def test_steps_with_positive_advantage_raise_those_tokens_logprobs(
    tmp_path, tokenizer, tiny_model_config, packed_batch
):
    learner = make_learner(tmp_path, tokenizer, tiny_model_config)
    example = RlExample.from_packed(packed_batch)
    # On-policy batch: behaviour log-probs are the learner's own; every loss token has advantage +1.
    behaviour = np.asarray(logprobs(learner.model, example)[0].array)
    mask = packed_batch.loss_mask & np.asarray(scored_tokens(jnp.asarray(packed_batch.segment_ids)))
    positive = dataclasses.replace(
        packed_batch, advantages=mask.astype(np.float32), policy_logprobs=np.where(mask, behaviour, 0.0)
    )
    batch = RlExample.from_packed(positive)
    before = mean_loss_token_logprob(learner.model, batch, mask)
    for _ in range(4):
        metrics = learner.step(batch)
    after = mean_loss_token_logprob(learner.model, batch, mask)
    assert learner.policy_version == 4
    assert after > before + 0.1, (before, after)
    assert metrics["num_loss_tokens"] == mask.sum() and metrics["learning_rate"] == pytest.approx(3e-3)


def test_kl_reference_is_the_frozen_initial_policy(tmp_path, tokenizer, tiny_model_config, example, packed_batch):
    learner = make_learner(tmp_path, tokenizer, tiny_model_config, beta=0.5, kl_estimator="k3")
    initial = learner.model  # never donated: still usable after steps
    first = learner.step(example)
    assert first["kl_ref"] == 0.0  # the model is its own reference before any update
    after_one = learner.model
    second = learner.step(example)

    mask = jnp.asarray(packed_batch.loss_mask) & scored_tokens(jnp.asarray(packed_batch.segment_ids))
    kl = kl_estimate(logprobs(after_one, example)[0].array, logprobs(initial, example)[0].array, mask, "k3")
    assert second["kl_ref"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-4)
    assert second["kl_ref"] > 0


def test_checkpoint_kill_resume_gives_the_uninterrupted_parameters(tmp_path, tokenizer, tiny_model_config, packer):
    first, second = (RlExample.from_packed(packer([[10, 14], [32], [8, 8, 8], [20]], 32, seed=s)) for s in (5, 6))
    uninterrupted = make_learner(tmp_path / "a", tokenizer, tiny_model_config)
    uninterrupted.step(first)
    uninterrupted.step(second)

    interrupted = make_learner(tmp_path / "b", tokenizer, tiny_model_config)
    interrupted.step(first)
    checkpoint = interrupted.save_checkpoint({"problem_positions": {"math": 12}})
    assert checkpoint == tmp_path / "b" / "checkpoints" / "step-1"
    del interrupted  # the "kill"
    (tmp_path / "b" / "checkpoints" / "step-7").mkdir()  # an incomplete checkpoint: no completion marker

    resumed = make_learner(tmp_path / "b", tokenizer, tiny_model_config, key=99)  # the key comes from the checkpoint
    assert resumed.restore_latest() == {"problem_positions": {"math": 12}}  # the loop's state, saved with it
    assert resumed.policy_version == 1
    resumed.step(second)
    assert resumed.policy_version == 2
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(uninterrupted.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(resumed._opt_state), jax.tree.leaves(uninterrupted._opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(jax.random.key_data(resumed._key), jax.random.key_data(uninterrupted._key))


def test_nothing_to_restore_and_checkpoint_pruning(tmp_path, tokenizer, tiny_model_config, example):
    learner = make_learner(tmp_path, tokenizer, tiny_model_config)
    assert learner.restore_latest() is None
    for _ in range(3):
        learner.step(example)
        learner.save_checkpoint()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-2", "step-3"]  # keep_checkpoints = 2; no temporary directories left


def test_export_hf_writes_run_hf_step_n(tmp_path, tokenizer, tiny_model_config, example):
    learner = make_learner(tmp_path, tokenizer, tiny_model_config)
    learner.step(example)
    path = learner.export_hf()
    assert path == tmp_path / "hf" / "step-1"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}


def test_non_finite_loss_stops_with_the_step_number(tmp_path, tokenizer, tiny_model_config, packed_batch):
    learner = make_learner(tmp_path, tokenizer, tiny_model_config)
    policy_logprobs = np.where(packed_batch.loss_mask, np.nan, 0.0).astype(np.float32)
    bad = RlExample.from_packed(dataclasses.replace(packed_batch, policy_logprobs=policy_logprobs))
    with pytest.raises(FloatingPointError, match="learner step 1"):
        learner.step(bad)


def test_bad_shapes_are_rejected(tmp_path, tokenizer, tiny_model_config, packer):
    learner = make_learner(tmp_path, tokenizer, dataclasses.replace(tiny_model_config, seq_len=16))
    with pytest.raises(ValueError, match="ModelConfig.seq_len"):
        learner.step(RlExample.from_packed(packer([[20]], 24)))
    with pytest.raises(ValueError, match="microbatch_rows"):
        learner.step(RlExample.from_packed(packer([[8], [8], [8]], 16)))


@pytest.mark.parametrize("start", ["fresh", "hf_checkpoint", "restored"])
def test_compile_step_leaves_no_step_anything_to_compile(start, tmp_path, tokenizer, tiny_model_config, packer, example):
    """Whatever the state starts from, its placement is the step's outputs': a Hugging Face checkpoint's
    arrays (loaded on a mesh) once made step 2 compile again."""
    if start == "hf_checkpoint":
        checkpoint = save_hf_model(build_model(tiny_model_config, len(tokenizer), key=jax.random.key(1)), tokenizer, tmp_path / "hf")
        tiny_model_config = dataclasses.replace(tiny_model_config, hf_checkpoint=str(checkpoint))
    learner = make_learner(tmp_path / "run", tokenizer, tiny_model_config)
    if start == "restored":
        learner.save_checkpoint({})
        learner = make_learner(tmp_path / "run", tokenizer, tiny_model_config)
        learner.restore_latest()
    before = jax.tree.leaves(learner.model)
    learner.compile_step(RlExample.from_packed(packer([[4], [30], [2, 2], [9]], 32, seed=3)))  # other rollouts, same shape
    assert learner.policy_version == 0
    for a, b in zip(before, jax.tree.leaves(learner.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # compiled, not run

    with CompileCounter() as compiles:
        for _ in range(3):
            learner.step(example)
    assert compiles.compiled == [] and learner.policy_version == 3


@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_the_model_shapes_are_those_of_the_model_the_learner_builds(tmp_path, tokenizer, tiny_model_config, rank):
    """What the engines compile for while the learner builds its model (`ModelToCome`)."""
    from marin_rl.engine._weights import check_same_architecture, is_weight
    from marin_rl.learner import LoraConfig

    config = LearnerConfig(lora=LoraConfig(rank=rank, alpha=8.0))
    shapes = Learner.model_shapes(config, tiny_model_config, tokenizer)
    learner = Learner(config, tiny_model_config, tmp_path, tokenizer, key=jax.random.key(0))
    check_same_architecture(shapes, learner.model)  # same structure, static parts, shapes and dtypes
    leaves = [x for x in jax.tree.leaves(shapes) if is_weight(x)]
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing computed
    assert len(leaves) == len(jax.tree.leaves(eqx.filter(learner.model, eqx.is_array)))
    smaller = dataclasses.replace(tiny_model_config, intermediate_dim=32)
    with pytest.raises(ValueError, match="different model structure or config"):
        check_same_architecture(Learner.model_shapes(config, smaller, tokenizer), learner.model)
