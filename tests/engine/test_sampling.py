"""On-device sampling: truncation, log-probs, determinism per key, stop sequences."""

import jax
import jax.numpy as jnp
import numpy as np

from marin_rl.engine._sampling import NO_TOKEN, STOP_PAD, hits_stop, push_history, sample, sample_key_data, seed_key_data, truncates


def keys_for(seeds, samples):
    return sample_key_data(jnp.asarray(np.stack([seed_key_data(s) for s in seeds])), jnp.asarray(samples, jnp.int32))


def draw(logits, seeds, samples, positions, temperature, top_p=1.0, top_k=0, truncate=None):
    b = len(seeds)
    return sample(
        jnp.asarray(logits, jnp.float32),
        keys_for(seeds, samples),
        jnp.asarray(positions, jnp.int32),
        jnp.full(b, temperature, jnp.float32),
        jnp.full(b, top_p, jnp.float32),
        jnp.full(b, top_k, jnp.int32),
        truncate=truncates(temperature, top_p, top_k) if truncate is None else truncate,
    )


def test_top_p_and_top_k_keep_the_right_tokens_and_renormalise():
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = np.log(probs)[None].repeat(400, 0)
    seeds = range(400)
    for top_p, top_k, kept in [(0.6, 0, [0, 1]), (0.7, 0, [0, 1]), (0.71, 0, [0, 1, 2]), (1.0, 2, [0, 1]), (0.9, 1, [0])]:
        tokens, logprobs = draw(logits, seeds, [0] * 400, [3] * 400, 1.0, top_p, top_k)
        tokens = np.asarray(tokens)
        assert set(tokens) == set(kept)  # 400 draws see every kept token
        expected = np.log(probs[tokens] / probs[kept].sum())
        np.testing.assert_allclose(np.asarray(logprobs), expected, rtol=1e-5)


def test_rows_that_do_not_truncate_draw_the_same_with_the_truncation_compiled_in():
    logits = np.random.default_rng(3).standard_normal((8, 50))
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.0, 0.5, 3)]:  # no cut asked, and greedy (which ignores one)
        plain = draw(logits, range(8), range(8), [2] * 8, temperature, top_p, top_k, truncate=False)
        compiled_in = draw(logits, range(8), range(8), [2] * 8, temperature, top_p, top_k, truncate=True)
        np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(compiled_in[0]))
        np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(compiled_in[1]))


def test_logprobs_follow_the_temperature_and_greedy_takes_the_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)) * 3
    for temperature in (1.0, 0.5):
        tokens, logprobs = draw(logits, range(6), range(6), [1] * 6, temperature)
        expected = jax.nn.log_softmax(logits / temperature, axis=-1)[np.arange(6), np.asarray(tokens)]
        np.testing.assert_allclose(np.asarray(logprobs), expected, rtol=1e-5)
    tokens, logprobs = draw(logits, range(6), range(6), [1] * 6, 0.0, top_p=0.5)
    assert list(tokens) == list(logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(logprobs), jax.nn.log_softmax(logits, -1).max(-1), rtol=1e-5)


def test_a_draw_depends_on_its_seed_sample_and_position_only():
    logits = np.zeros((4, 1000))
    a = np.asarray(draw(logits, [7, 7, 7, 8], [0, 1, 0, 0], [5, 5, 6, 5], 1.0)[0])
    assert len(set(a)) == 4  # another sample, position or seed: another draw
    # The same (seed, sample, position) in another row of another batch draws the same token.
    b = np.asarray(draw(logits[:2], [8, 7], [0, 1], [5, 5], 1.0)[0])
    assert (b[0], b[1]) == (a[3], a[1])
    # All 63 bits of a seed count.
    c = np.asarray(draw(logits[:2], [0, 2**62], [0, 0], [5, 5], 1.0)[0])
    assert c[0] != c[1]


def test_stop_sequences_match_the_end_of_the_history():
    stops = np.full((2, 3, 3), STOP_PAD)
    stops[0, 0, 2] = 9  # [9]
    stops[0, 1, 1:] = [4, 5]  # [4, 5]
    stops[1, 0, :] = [1, 2, 3]
    history = jnp.full((2, 3), NO_TOKEN, jnp.int32)
    seen = []
    for t0, t1 in [(4, 1), (5, 2), (6, 3), (9, 3)]:
        history = push_history(history, jnp.asarray([t0, t1], jnp.int32), jnp.asarray([True, True]))
        seen.append(list(np.asarray(hits_stop(history, jnp.asarray(stops)))))
    assert seen == [[False, False], [True, False], [False, True], [True, False]]
    # An inactive row keeps its history.
    kept = push_history(history, jnp.asarray([1, 1], jnp.int32), jnp.asarray([False, True]))
    assert list(np.asarray(kept[0])) == list(np.asarray(history[0]))
