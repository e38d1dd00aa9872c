"""The engine's programs kept lowered on disk (`marin_rl/programs.py`): a second start loads them instead of
tracing and lowering, and computes the same bits; an unreadable entry is lowered again; a model that
differs only in a non-array part (same shapes) never gets another model's program."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.engine import Engine, EngineConfig, GenerationJob
from marin_rl.learner import ModelConfig, build_model
from marin_rl.programs import ProgramStore

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(max_seqs=8, max_seq_len=48, page_size=8, decode_steps=4, batch_wait_s=0.0, precompile_prompt_lens=(10,))


def model(rope_theta: float = 10000.0):
    config = ModelConfig(hidden_dim=32, intermediate_dim=40, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=48, rope_theta=rope_theta)
    return build_model(config, 101, key=jax.random.PRNGKey(0))


def samples(engine) -> list:
    jobs = [GenerationJob(list(range(1 + i, 11 + i)), n=3, max_tokens=9, temperature=1.0, seed=i, stop_sequences=[]) for i in range(3)]
    for job in jobs:
        engine.submit(job)
    return [(s.token_ids, s.logprobs) for job in jobs for s in job.future.result(timeout=300).samples]


def start_and_sample(m) -> tuple[list, dict]:
    engine = Engine(CONFIG, m)
    try:
        return samples(engine), engine.compiled_variants()
    finally:
        engine.stop()


def test_a_second_start_loads_every_program_and_samples_the_same_bits(program_stores, caplog):
    made, directory = program_stores
    first, variants = start_and_sample(model())
    shapes = variants["prefill"] + variants["decode"]
    entries = sorted(directory["path"].glob("*.exported"))
    assert made[0].loaded == 0 and len(entries) == shapes > 2

    second, _ = start_and_sample(model())
    assert made[1].loaded == shapes
    assert second == first

    directory["path"] = None  # the jit's own programs, never exported
    assert start_and_sample(model())[0] == first

    # A truncated entry (a disk that filled mid-write, say) is lowered again and rewritten.
    directory["path"] = entries[0].parent
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="marin_rl.programs"):
        assert start_and_sample(model())[0] == first
    assert made[3].loaded == shapes - 1
    assert any(entries[0].name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    start_and_sample(model())
    assert made[4].loaded == shapes


def test_a_model_differing_only_in_a_non_array_part_gets_programs_of_its_own(program_stores):
    made, directory = program_stores
    start_and_sample(model(rope_theta=10000.0))
    other_theta, _ = start_and_sample(model(rope_theta=500.0))
    assert made[1].loaded == 0  # same shapes and dtypes, other rotary embeddings: other keys
    directory["path"] = None
    assert start_and_sample(model(rope_theta=500.0))[0] == other_theta


def test_a_store_holds_a_program_once_written_whether_asked_with_arrays_or_shapes(tmp_path):
    """What the engine asks to decide a warm start (its programs' first runs beside the loading)."""

    def scaled_sum(x, y, scale):
        return (x * scale + y,)

    args = (jnp.arange(3.0), jnp.ones(3))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    store = ProgramStore(tmp_path)
    assert not store.holds("f", args, (2.0,), context="")
    first = store.compile("f", scaled_sum, shapes, (2.0,), donate_argnums=(), context="", returns_like=(0,))
    assert store.holds("f", args, (2.0,), context="") and store.holds("f", shapes, (2.0,), context="")
    assert not store.holds("f", args, (3.0,), context="")  # another static argument
    assert not store.holds("f", (jnp.arange(4.0), jnp.ones(4)), (2.0,), context="")  # other shapes
    assert not store.holds("f", args, (2.0,), context="another model")

    again = ProgramStore(tmp_path)
    second = again.compile("f", scaled_sum, args, (2.0,), donate_argnums=(), context="", returns_like=(0,))
    assert again.loaded == 1 and store.loaded == 0
    np.testing.assert_array_equal(first(*args)[0], second(*args)[0])
    np.testing.assert_array_equal(second(*args)[0], [1.0, 3.0, 5.0])
