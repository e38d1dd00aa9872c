"""Exact numerics: a sequence's log-probs are the same bits whatever is batched with it, in the engine's
prefill and decode steps and in the learner's packed rows, so behaviour and learner log-probs agree."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.engine import Engine, EngineConfig, GenerationJob
from marin_rl.learner import LearnerConfig, ModelConfig, build_model, loss_and_gradients
from marin_rl.packed import PADDING_SEGMENT_ID, PackedArrays
from marin_rl.rl_example import RlExample

pytestmark = pytest.mark.slow

SEQ_LEN = 64
VOCAB = 101
CONFIG = EngineConfig(max_seqs=16, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.0, exact_numerics=True)


def tiny(family: str):
    config = ModelConfig(
        family=family, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seq_len=SEQ_LEN
    )
    return build_model(config, VOCAB, key=jax.random.PRNGKey(0))


def generate(engine, rng, count, seed_base=0):
    """`count` requests of random prompts, lengths and sample counts, submitted in waves so that the
    engine batches them differently; [(prompt, sample)] in order."""
    jobs = []
    for i in range(count):
        prompt = rng.integers(1, VOCAB, rng.integers(2, 14)).tolist()
        job = GenerationJob(prompt, n=int(rng.integers(1, 4)), max_tokens=int(rng.integers(1, 24)), temperature=1.0, seed=seed_base + i, stop_sequences=[])
        jobs.append((prompt, engine.submit(job)))
    return [(prompt, sample) for prompt, future in jobs for sample in future.result(timeout=300).samples]


def packed(sequences, rng, rows=24):
    """The sequences packed in a random order into rows of SEQ_LEN (as the batcher does), with the
    behaviour log-probs on the sampled tokens."""
    shape = (rows, SEQ_LEN)
    ids, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    segments, sampled, behaviour = np.full(shape, PADDING_SEGMENT_ID, np.int32), np.zeros(shape, bool), np.zeros(shape, np.float32)
    row, offset = 0, 0
    for segment, index in enumerate(rng.permutation(len(sequences))):
        prompt, sample = sequences[index]
        tokens = prompt + sample.token_ids
        if offset + len(tokens) > SEQ_LEN:
            row, offset = row + 1, 0
        span = slice(offset, offset + len(tokens))
        ids[row, span], positions[row, span], segments[row, span] = tokens, np.arange(len(tokens)), segment
        sampled[row, offset + len(prompt) : span.stop] = True
        behaviour[row, offset + len(prompt) : span.stop] = sample.logprobs
        offset = span.stop
    zeros = np.zeros(shape, np.float32)
    arrays = PackedArrays(
        input_ids=ids, position_ids=positions, segment_ids=segments, loss_mask=sampled, advantages=zeros,
        policy_logprobs=behaviour, rl_weights=zeros, ce_weights=zeros, kl_weights=zeros,
    )  # fmt: skip
    return RlExample.from_packed(arrays), sampled, behaviour


@eqx.filter_jit
def learner_logprobs(model, example, exact):
    _, grads, _, logprobs = loss_and_gradients(model, example, config=LearnerConfig(), compute_dtype=jnp.float32, exact=exact)
    return logprobs, grads


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request):
    model = tiny(request.param)
    engine = Engine(CONFIG, model)
    yield model, engine
    engine.stop()


def test_the_engines_log_probs_are_the_learners_bit_for_bit(family):
    model, engine = family
    rng = np.random.default_rng(0)
    sequences = generate(engine, rng, 20)
    assert engine.stats.prefill_calls > 1 and engine.stats.decode_calls > 1
    example, sampled, behaviour = packed(sequences, rng)
    exact, _ = learner_logprobs(model, example, CONFIG.exact_layout)
    exact = np.asarray(exact)
    assert sampled.sum() > 100
    np.testing.assert_array_equal(exact[sampled], behaviour[sampled])
    # The learner's usual pass agrees only up to float rounding.
    fast, _ = learner_logprobs(model, example, None)
    np.testing.assert_allclose(np.asarray(fast)[sampled], behaviour[sampled], atol=1e-5)


def test_a_request_samples_the_same_bits_alone_or_in_a_crowd(family):
    model, engine = family
    alone = generate(engine, np.random.default_rng(1), 1, seed_base=7)
    crowd = generate(engine, np.random.default_rng(1), 12, seed_base=7)  # the same request first, then others
    assert crowd[: len(alone)] == alone


def test_exact_scoring_has_the_gradient_of_the_usual_pass(family):
    model, engine = family
    rng = np.random.default_rng(2)
    example, sampled, _ = packed(generate(engine, rng, 8), rng)
    sampled_weights = example.loss_mask.astype(jnp.float32)
    example = dataclasses.replace(example, advantages=sampled_weights * 0.5, rl_weights=sampled_weights)
    _, exact_grads = learner_logprobs(model, example, CONFIG.exact_layout)
    _, fast_grads = learner_logprobs(model, example, None)
    leaves = jax.tree.leaves(exact_grads)
    assert max(float(jnp.abs(g).max()) for g in leaves) > 1e-4
    for g, f in zip(leaves, jax.tree.leaves(fast_grads), strict=True):
        np.testing.assert_allclose(g, f, rtol=1e-4, atol=1e-6)
