"""Hugging Face checkpoints: logits parity with transformers (PyTorch, CPU, fp32), export and reload."""

import json

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from levanter.layers.attention import AttentionMask

from marin_rl.engine._weights import check_same_architecture, is_weight
from marin_rl.learner import Learner, LearnerConfig, ModelConfig, build_model, load_hf_model, per_token_logprobs, save_hf_model
from marin_rl.rl_example import PackedArrays, RlExample

HF_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory, tokenizer):
    """A tiny random model saved by transformers with the char tokenizer:
    (family, directory, torch model, the learner's model loaded from the directory)."""
    family = request.param
    config = HF_CONFIGS[family](
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and biases too, so a mis-mapped parameter shows
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    directory = tmp_path_factory.mktemp(family)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return family, directory, model, load_hf_model(directory, ModelConfig(family=family))


def torch_logits(model, input_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(input_ids, dtype=torch.long)).logits.numpy()


def levanter_logits(model, input_ids: np.ndarray) -> np.ndarray:
    named = hax.named(jnp.asarray(input_ids), ("batch", "position"))
    logits = eqx.filter_jit(lambda m, x: m(x, AttentionMask.causal()))(model, named)
    return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)


INPUT_IDS = np.random.default_rng(0).integers(0, 104, (2, 24))


def test_logits_match_transformers(hf_checkpoint):
    family, directory, torch_model, model = hf_checkpoint
    diff = np.abs(levanter_logits(model, INPUT_IDS) - torch_logits(torch_model, INPUT_IDS)).max()
    assert diff < 1e-4, f"{family}: max |logits difference| = {diff}"


def test_per_token_logprobs_are_transformers_shifted_log_softmax(hf_checkpoint):
    family, directory, torch_model, model = hf_checkpoint
    rows, positions = INPUT_IDS.shape
    zeros = np.zeros((rows, positions), np.float32)
    example = RlExample.from_packed(
        PackedArrays(
            input_ids=INPUT_IDS.astype(np.int32),
            position_ids=np.tile(np.arange(positions, dtype=np.int32), (rows, 1)),
            segment_ids=np.zeros((rows, positions), np.int32),
            loss_mask=zeros.astype(bool),
            **dict.fromkeys(["advantages", "policy_logprobs", "rl_weights", "ce_weights", "kl_weights"], zeros),
        )
    )
    logp = np.asarray(eqx.filter_jit(per_token_logprobs)(model, example, vocab_block_size=40)[0].array)

    log_probs = torch.log_softmax(torch.tensor(torch_logits(torch_model, INPUT_IDS)), dim=-1).numpy()
    expected = np.take_along_axis(log_probs[:, :-1], INPUT_IDS[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(logp[:, 1:], expected, atol=1e-4)
    assert (logp[:, 0] == 0).all()


def test_export_and_reload_round_trip_is_exact(hf_checkpoint, tmp_path, tokenizer):
    family, directory, torch_model, model = hf_checkpoint
    exported = save_hf_model(model, tokenizer, tmp_path / "export")
    reloaded = load_hf_model(exported, ModelConfig(family=family))
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # transformers reads the export too, and computes the same logits as the original.
    torch_reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    np.testing.assert_allclose(torch_logits(torch_reloaded, INPUT_IDS), torch_logits(torch_model, INPUT_IDS), atol=1e-5)
    assert not list(tmp_path.glob(".export*")), "the temporary directory must be renamed away"


def test_fresh_model_exports_in_bfloat16_and_reloads(tiny_model_config, tmp_path, tokenizer):
    model = build_model(tiny_model_config, len(tokenizer), key=jax.random.PRNGKey(1))
    path = save_hf_model(model, tokenizer, tmp_path / "export", dtype=jnp.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = load_hf_model(path, tiny_model_config)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(b))


def test_family_must_match_the_checkpoint(hf_checkpoint):
    family, directory, _, _ = hf_checkpoint
    other = "qwen3" if family == "llama" else "llama"
    with pytest.raises(ValueError, match="model_type"):
        load_hf_model(directory, ModelConfig(family=other))


def test_the_model_shapes_of_a_checkpoint_are_those_of_the_model_loaded_from_it(hf_checkpoint, tokenizer, tmp_path):
    """Read from its config alone (the engines compile for them while the weights load)."""
    family, directory, _, model = hf_checkpoint
    shapes = Learner.model_shapes(LearnerConfig(), ModelConfig(family=family, hf_checkpoint=str(directory)), tokenizer)
    check_same_architecture(shapes, model)
    leaves = [x for x in jax.tree.leaves(shapes) if is_weight(x)]
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # no weight read
