"""Decode and prefill attention against a dense float64 reference, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.engine._attention import AttentionKernels, decode_attention, prefill_attention

ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    # GPUs multiply float32 at reduced (TF32) precision by default; the float32 paths are checked exactly.
    with jax.default_matmul_precision("highest"):
        yield


def dense_reference(q, k, v, lengths, scale):
    """q [b, h, d], k/v [b, t, kvh, d] (float64 numpy): softmax over the first lengths[b] keys."""
    b, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros((b, h, d))
    for i in range(b):
        for head in range(h):
            keys, values = k[i, : lengths[i], head // group], v[i, : lengths[i], head // group]
            logits = keys @ q[i, head] * scale
            w = np.exp(logits - logits.max())
            out[i, head] = (w / w.sum()) @ values
    return out


def random_paged(rng, batch, heads, kv_heads, head_dim, page_size, pages_per_seq, dtype):
    """A random cache with shuffled page assignments; returns the paged arrays and the dense view."""
    num_pages = batch * pages_per_seq + 1
    k_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim))
    v_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim))
    tables = 1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    lengths = rng.integers(1, pages_per_seq * page_size + 1, batch)
    lengths[0] = 1  # edge cases: a single token, a full table
    lengths[-1] = pages_per_seq * page_size
    dense_k = k_pages[:, tables].reshape(kv_heads, batch, -1, head_dim).transpose(1, 2, 0, 3)
    dense_v = v_pages[:, tables].reshape(kv_heads, batch, -1, head_dim).transpose(1, 2, 0, 3)
    q = rng.standard_normal((batch, heads, head_dim))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k_pages), cast(v_pages), jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)), (
        q,
        dense_k,
        dense_v,
        lengths,
    )


def relative_error(out, ref):
    return np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)


def check_decode(kernels, dtype, tolerance, seed, *, batch=5, heads=8, kv_heads=2, head_dim=32, page_size=4, pages_per_seq=6):
    rng = np.random.default_rng(seed)
    width = kernels.table_width(pages_per_seq)
    (q, k_pages, v_pages, tables, lengths), (q64, dense_k, dense_v, lengths64) = random_paged(
        rng, batch, heads, kv_heads, head_dim, page_size, pages_per_seq, dtype
    )
    # Extra table entries point at page 0 (the scratch page), past every length.
    tables = jnp.pad(tables, ((0, 0), (0, width - pages_per_seq)))
    scale = 1 / np.sqrt(head_dim)
    out = decode_attention(kernels, q, k_pages, v_pages, tables, lengths, scale)
    assert out.shape == q.shape and np.all(np.isfinite(np.asarray(out, np.float32)))
    ref = dense_reference(q64, dense_k, dense_v, lengths64, scale)
    assert relative_error(out, ref) < tolerance


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gathered_decode_attention_equals_the_dense_reference(seed):
    check_decode(AttentionKernels(decode="jax", prefill="xla"), jnp.float32, 1e-5, seed)


def test_pallas_block_tables_split_into_power_of_two_blocks():
    kernels = AttentionKernels(decode="pallas", prefill="cudnn", pages_per_compute_block=8)  # 16 splits of blocks of up to 8 pages
    assert [kernels.table_width(p) for p in (1, 16, 17, 72, 128, 129, 300)] == [16, 16, 32, 128, 128, 256, 384]
    one_page = AttentionKernels(decode="pallas", prefill="cudnn", pages_per_compute_block=1)  # the default: any whole split
    assert [one_page.table_width(p) for p in (1, 16, 17, 72, 300)] == [16, 16, 32, 80, 304]
    assert AttentionKernels(decode="jax", prefill="xla").table_width(72) == 72


def test_pallas_splits_sequences_only_while_the_batch_gives_too_few_programs():
    kernels = AttentionKernels(decode="pallas", prefill="cudnn", k_splits=16, min_programs=2048)
    assert kernels.splits_for(1, 8) == 16  # one sequence: every split it can take
    assert kernels.splits_for(128, 8) == 2
    assert kernels.splits_for(256, 16) == 1  # 4,096 programs without splitting
    for splits in (1, 2, 4, 8, 16):  # any of them divides the table into whole compute blocks
        for pages in (1, 5, 17, 72, 300):
            partition = kernels.table_width(pages) // splits
            assert partition * splits == kernels.table_width(pages)
            assert partition % min(partition, kernels.pages_per_compute_block) == 0


@pytest.mark.slow
@pytest.mark.parametrize("min_programs", [1, 64])  # one split (normalised in the kernel), and four (combined after it)
@pytest.mark.parametrize("heads", [2, 6, 32])  # query heads per KV head: 1 (multiply-and-sum), 3 (padded to 4), 16 (dot)
def test_pallas_kernel_in_the_interpreter_equals_the_dense_reference(min_programs, heads):
    kernels = AttentionKernels(decode="pallas", prefill="xla", k_splits=4, pages_per_compute_block=2, min_programs=min_programs, interpret=True)
    assert kernels.splits_for(2, 2) == (1 if min_programs == 1 else 4)
    check_decode(kernels, jnp.float32, 1e-4, 3, batch=2, heads=heads, kv_heads=2, head_dim=16, pages_per_seq=6)


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
@pytest.mark.parametrize("pages_per_seq", [3, 20, 72])
@pytest.mark.parametrize("min_programs", [1, 2048])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (16, 16), (32, 2)])  # 4, 1 and 16 query heads per KV head
def test_pallas_kernel_on_gpu_equals_the_dense_reference(pages_per_seq, min_programs, heads, kv_heads):
    kernels = AttentionKernels(decode="pallas", prefill="cudnn", min_programs=min_programs)
    check_decode(
        kernels, jnp.bfloat16, 2e-2, pages_per_seq, batch=9, heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, pages_per_seq=pages_per_seq
    )


@pytest.mark.parametrize("implementation", ["xla"] + (["cudnn"] if ON_GPU else []))
def test_prefill_attention_is_causal_within_each_prompt(implementation):
    rng = np.random.default_rng(7)
    batch, time, heads, kv_heads, head_dim = 3, 16, 4, 2, 32
    dtype = jnp.bfloat16 if implementation == "cudnn" else jnp.float32
    q, k, v = (rng.standard_normal((batch, time, h, head_dim)) for h in (heads, kv_heads, kv_heads))
    lengths = np.array([16, 5, 1])
    scale = 1 / np.sqrt(head_dim)
    kernels = AttentionKernels(decode="jax", prefill=implementation)
    out = np.asarray(prefill_attention(kernels, *(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(lengths, jnp.int32), scale), np.float64)
    for i in range(batch):
        for t in range(lengths[i]):  # query t sees keys 0..t of its own row
            ref = dense_reference(q[i, t][None], k[i][None], v[i][None], [t + 1], scale)[0]
            assert relative_error(out[i, t], ref) < (2e-2 if implementation == "cudnn" else 1e-5)
