"""LoRA adapters as they leave the learner (`marin_rl.adapters`): sent alone, rebuilt on a server's copy of
the base bit for bit, merged by the engine in its own copy, and refused when they do not fit."""

import equinox as eqx
import jax
import numpy as np
import pytest

from marin_rl.adapters import adapter_settings, adapters_to_bytes, has_adapters, merged, with_adapters_from_bytes, without_adapters
from marin_rl.weight_bytes import weights_to_bytes
from marin_rl.engine import serving_weights
from marin_rl.errors import BaseMissing
from marin_rl.learner import LoraConfig, ModelConfig, build_model
from marin_rl.server._updates import UpdateLoader
from marin_rl.testing import with_trained_adapters

CONFIG = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64)
VOCAB = 104


def adapted(seed: int, *, rank=4, alpha=8.0, target_modules=None, config=CONFIG):
    """The base (seed 0) with adapters drawn from `seed`, B not zero."""
    base = build_model(config, VOCAB, key=jax.random.key(0))
    return with_trained_adapters(base, LoraConfig(rank=rank, alpha=alpha, target_modules=target_modules), seed=seed)


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_same(a, b):
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("target_modules", [None, ["q_proj", "v_proj"]])
def test_adapters_sent_alone_rebuild_the_policy_bit_for_bit_on_the_base(target_modules):
    model = adapted(1, target_modules=target_modules)
    data = adapters_to_bytes(model)
    base = without_adapters(model)
    assert not has_adapters(base) and adapter_settings(model) == {
        "rank": 4,
        "alpha": 8.0,
        "target_modules": sorted(target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    }
    # Megabytes on a real model; here a small share of the base's bytes.
    assert len(data) < len(weights_to_bytes(base)) / 4
    # Received by another process: a base of its own, equal to the learner's.
    rebuilt = with_adapters_from_bytes(build_model(CONFIG, VOCAB, key=jax.random.key(0)), data)
    assert_same(merged(rebuilt), merged(model))
    # The adapters change the weights (B is not zero), so the comparison above could fail.
    assert any(not np.array_equal(a, b) for a, b in zip(arrays(merged(model)), arrays(base)))


def test_the_engine_merges_the_adapters_into_its_copy():
    model = adapted(2)
    assert_same(serving_weights(model, None), serving_weights(merged(model), None))
    # The merge changes the served weights (B is not zero), so the comparison above could fail.
    assert any(not np.array_equal(a, b) for a, b in zip(arrays(serving_weights(model, None)), arrays(serving_weights(without_adapters(model), None))))


def test_adapters_that_do_not_fit_the_base_are_refused_by_name():
    wide = CONFIG.__class__(**{**CONFIG.__dict__, "intermediate_dim": 96})
    with pytest.raises(ValueError, match="mlp.gate_proj.*shape"):
        with_adapters_from_bytes(build_model(CONFIG, VOCAB, key=jax.random.key(0)), adapters_to_bytes(adapted(1, config=wide)))
    with pytest.raises(ValueError, match="unexpected.*lora_X"):  # tensors renamed in the file, settings kept
        with_adapters_from_bytes(build_model(CONFIG, VOCAB, key=jax.random.key(0)), adapters_to_bytes(adapted(1)).replace(b"lora_A.weight", b"lora_X.weight"))
    with pytest.raises(ValueError, match="not an adapters file"):
        with_adapters_from_bytes(build_model(CONFIG, VOCAB, key=jax.random.key(0)), weights_to_bytes(build_model(CONFIG, VOCAB, key=jax.random.key(0))))


def test_a_server_keeps_the_base_that_came_with_adapters_and_forgets_it_for_whole_weights():
    loads = []

    def load_weights(seed):
        loads.append(seed)
        return build_model(CONFIG, VOCAB, key=jax.random.key(seed))

    loader = UpdateLoader(load_weights)
    first, second = adapted(1), adapted(2)
    with pytest.raises(BaseMissing):
        loader(adapters=adapters_to_bytes(first))  # a fresh server: no base yet
    assert_same(merged(loader(0, adapters_to_bytes(first))), merged(first))
    assert_same(merged(loader(adapters=adapters_to_bytes(second))), merged(second))  # the kept base
    assert loads == [0]
    whole = loader(5)  # whole weights replace the policy and the base
    assert_same(whole, build_model(CONFIG, VOCAB, key=jax.random.key(5)))
    with pytest.raises(BaseMissing):
        loader(adapters=adapters_to_bytes(second))
