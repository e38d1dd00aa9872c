"""The `cudnn` backend's packed-row layout: segments as (start, length) lists, checked against the dense
same-segment mask (on CPU the layout itself; on a Hopper GPU the cuDNN kernel's output and gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl._upstream import cudnn_packed_attention
from marin_rl.learner._attention import _packed_layout_supported, same_segment_mask, segment_layout

PADDING = -1


def mask_from_layout(lengths: np.ndarray, starts: np.ndarray, positions: int) -> np.ndarray:
    """[batch, 1, q, k]: q and k fall in the same listed (start, length) run."""
    run = np.full((len(lengths), positions), -1)
    for row in range(len(lengths)):
        for index, (start, length) in enumerate(zip(starts[row], lengths[row])):
            if length > 0:
                run[row, start : start + length] = index
    return (run[:, None, :, None] == run[:, None, None, :]) & (run[:, None, :, None] >= 0)


def test_the_layout_lists_each_run_and_covers_every_position():
    segment_ids = jnp.array(
        [
            [0, 0, 0, 1, 1, 2, PADDING, PADDING],  # three rollouts and a padding run
            [4, 4, 4, 4, 4, 4, 4, 4],  # one rollout filling the row
            [7, 7, 3, 3, 3, 3, 9, 9],  # ids need not be sorted, only contiguous
        ]
    )
    lengths, starts, fits = (np.asarray(x) for x in segment_layout(segment_ids, max_segments=4))
    assert bool(fits)
    np.testing.assert_array_equal(lengths, [[3, 2, 1, 2], [8, -1, -1, -1], [2, 4, 2, -1]])
    np.testing.assert_array_equal(starts, [[0, 3, 5, 6, -1], [0, -1, -1, -1, -1], [0, 2, 6, -1, -1]])
    np.testing.assert_array_equal(mask_from_layout(lengths, starts, 8), np.asarray(same_segment_mask(segment_ids)))


def test_a_row_with_more_runs_than_listed_does_not_fit():
    segment_ids = jnp.array([[0, 1, 2, 3, 4, PADDING, PADDING, PADDING], [0, 0, 0, 0, 1, 1, 1, 1]])
    *_, fits = segment_layout(segment_ids, max_segments=5)
    assert not bool(fits)  # six runs in row 0 (five rollouts and the padding)
    *_, fits = segment_layout(segment_ids, max_segments=6)
    assert bool(fits)


def test_random_rows_give_the_dense_mask():
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows, positions = 3, 64
        segment_ids = np.full((rows, positions), PADDING)
        for row in range(rows):
            cuts = np.sort(rng.choice(np.arange(1, positions), size=rng.integers(0, 6), replace=False))
            fill = rng.integers(cuts[-1] if len(cuts) else 1, positions + 1)
            for index, (a, b) in enumerate(zip([0, *cuts], [*cuts, fill])):
                segment_ids[row, a:b] = index
        lengths, starts, fits = (np.asarray(x) for x in segment_layout(jnp.asarray(segment_ids), max_segments=8))
        assert bool(fits)
        np.testing.assert_array_equal(mask_from_layout(lengths, starts, positions), np.asarray(same_segment_mask(jnp.asarray(segment_ids))))


@pytest.mark.skipif(not _packed_layout_supported(), reason="cuDNN's packed layout needs a Hopper or later GPU")
def test_cudnn_packed_rows_equal_the_dense_masked_attention_with_gradients():
    rows, positions, heads, kv_heads, head_size = 2, 256, 8, 2, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, positions, heads, head_size), jnp.bfloat16)
    k = jax.random.normal(keys[1], (rows, positions, kv_heads, head_size), jnp.bfloat16)
    v = jax.random.normal(keys[2], (rows, positions, kv_heads, head_size), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    segment_ids = np.full((rows, positions), PADDING)
    segment_ids[0, :100], segment_ids[0, 100:180], segment_ids[0, 180:250] = 0, 1, 2
    segment_ids[1, :256] = 5
    segment_ids = jnp.asarray(segment_ids)
    lengths, starts, fits = segment_layout(segment_ids, max_segments=8)
    assert bool(fits)

    def packed(q, k, v):
        return cudnn_packed_attention(q, k, v, lengths, starts, 0.125)

    def dense(q, k, v):
        return jax.nn.dot_product_attention(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
            mask=same_segment_mask(segment_ids), scale=0.125, is_causal=True, implementation="xla",
        )

    (out, pull), (ref, ref_pull) = jax.vjp(packed, q, k, v), jax.vjp(dense, q, k, v)
    valid = np.asarray(segment_ids != PADDING)  # padding rows' outputs are never used
    np.testing.assert_allclose(np.asarray(out, np.float32)[valid], np.asarray(ref)[valid], atol=2e-2, rtol=2e-2)
    masked = cotangent * valid[:, :, None, None]
    for got, want in zip(pull(masked), ref_pull(masked.astype(jnp.float32))):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=5e-2, rtol=5e-2)
