"""The engine's programs kept lowered on disk (`marin_rl/programs.py`): a second start loads them instead of
tracing and lowering, and computes the same bits; an unreadable entry is lowered again; a model that
differs only in a non-array part (same shapes) never gets another model's program."""

import concurrent.futures
import dataclasses
import logging
import time
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.engine import Engine, EngineConfig, GenerationJob, ModelToCome
from marin_rl.learner import ModelConfig, build_model
from marin_rl.programs import ProgramStore

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(max_seqs=8, max_seq_len=48, page_size=8, decode_steps=4, batch_wait_s=0.0, precompile_prompt_lens=(10,))


def model_config(rope_theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(hidden_dim=32, intermediate_dim=40, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=48, rope_theta=rope_theta)


def model(rope_theta: float = 10000.0):
    return build_model(model_config(rope_theta), 101, key=jax.random.PRNGKey(0))


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


def test_an_engine_started_on_a_model_to_come_compiles_its_programs_before_it_arrives_then_serves_it(program_stores, tmp_path):
    made, directory = program_stores
    given = model()
    reference, variants = start_and_sample(given)
    programs = variants["prefill"] + variants["decode"]

    directory["path"] = tmp_path / "to_come"
    arrival = concurrent.futures.Future()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(Engine, CONFIG, ModelToCome(eqx.filter_eval_shape(lambda: given), arrival))
        deadline = time.monotonic() + 300
        while len(list(directory["path"].glob("*.exported"))) < programs:  # each lowered and stored, then compiled
            if starting.done():
                starting.result()  # its error
            assert not starting.done() and time.monotonic() < deadline, "the programs were not made while the model was to come"
            time.sleep(0.05)
        assert not starting.done()  # it waits for the model
        arrival.set_result(types.SimpleNamespace(model=given, policy_version=7))
        engine = starting.result(timeout=300)
    try:
        assert engine.policy_version == 7
        assert samples(engine) == reference
        assert engine.compiled_variants() == variants  # nothing compiled for the arrived arrays
    finally:
        engine.stop()


def test_a_model_to_come_that_fails_or_arrives_with_other_shapes_fails_the_engines_start():
    shapes = eqx.filter_eval_shape(model)
    failed = concurrent.futures.Future()
    failed.set_exception(MemoryError("out of memory building the model"))
    with pytest.raises(MemoryError, match="building the model"):
        Engine(CONFIG, ModelToCome(shapes, failed))

    other = dataclasses.replace(model_config(), intermediate_dim=48)
    arrived = concurrent.futures.Future()
    arrived.set_result(types.SimpleNamespace(model=build_model(other, 101, key=jax.random.PRNGKey(0)), policy_version=1))
    with pytest.raises(ValueError, match="different model structure or config"):
        Engine(CONFIG, ModelToCome(shapes, arrived))


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
