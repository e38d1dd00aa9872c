"""The decode step's attention and KV-cache write alone, per layer call, for the kernel's settings.

A chain of `--layers` calls inside one jitted loop (each call's output is the next query), so the
time per call is the kernel's, not Python's dispatch. Contexts are drawn uniformly from `--context`.

    python benchmarks/bench_decode_attention.py                       # the loop's 0.5B shape, on a GPU
    python benchmarks/bench_decode_attention.py --batch 128 --heads 32 --kv-heads 8 --context 128 384
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import numpy as np


def time_chain(fn, args, layers: int, repeats: int) -> float:
    """Microseconds per call of `fn` in a `layers`-long chain, best of `repeats`."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--context", type=int, nargs=2, default=[16, 80], help="context lengths drawn from [lo, hi]")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pages-per-compute-block", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--min-programs", type=int, nargs="+", default=[2048])
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from marin_rl.engine._attention import choose_kernels, decode_attention
    from marin_rl.engine._kv_cache import write_tokens

    rng = np.random.default_rng(0)
    b, h, kvh, d, ps = args.batch, args.heads, args.kv_heads, args.head_dim, args.page_size
    pages_per_seq = -(-args.max_seq_len // ps)
    num_pages = b * pages_per_seq + 1
    lengths = rng.integers(args.context[0], args.context[1] + 1, b).astype(np.int32)
    tables = 1 + rng.permutation(b * pages_per_seq).reshape(b, pages_per_seq).astype(np.int32)  # page 0: scratch
    k_pages = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    scale = 1 / np.sqrt(d)
    kv_read = 2 * int(lengths.sum()) * kvh * d * 2
    print(f"{jax.devices()[0].device_kind}: batch {b}, {h}/{kvh} heads of {d}, pages of {ps}, contexts {args.context[0]}-{args.context[1]} "
          f"(mean {lengths.mean():.0f}), {kv_read / 1e6:.1f} MB of keys and values per call")

    def attention_chain(kernels):
        def chain(q, k_pages, v_pages, tables, lengths):
            def layer(_, q):
                return decode_attention(kernels, q, k_pages, v_pages, tables, lengths, scale)

            return jax.lax.fori_loop(0, args.layers, layer, q)

        return chain

    base = choose_kernels("auto", jnp.bfloat16)
    width = base.table_width(pages_per_seq)
    padded = np.zeros((b, width), np.int32)
    padded[:, :pages_per_seq] = tables
    inputs = (q, k_pages, v_pages, jnp.asarray(padded), jnp.asarray(lengths))
    rows = []
    if base.decode == "pallas":
        for warps, stages, block, programs in itertools.product(
            args.num_warps, args.num_stages, args.pages_per_compute_block, args.min_programs
        ):
            kernels = dataclasses.replace(base, num_warps=warps, num_warps_one_head=warps, num_stages=stages, pages_per_compute_block=block, min_programs=programs)
            if kernels.table_width(pages_per_seq) != width:
                continue
            us = time_chain(attention_chain(kernels), inputs, args.layers, args.repeats)
            rows.append((us, f"pallas warps={warps} stages={stages} pages/block={block} min_programs={programs} "
                             f"(splits {kernels.splits_for(b, kvh)})"))
            print(f"  {us:8.1f} us  {kv_read / us / 1e6:6.2f} TB/s  {rows[-1][1]}", flush=True)
    gathered = dataclasses.replace(base, decode="jax")
    us = time_chain(attention_chain(gathered), inputs, args.layers, args.repeats)
    print(f"  {us:8.1f} us  {kv_read / us / 1e6:6.2f} TB/s  jax (gather the pages, XLA attention)")
    if rows:
        us, name = min(rows)
        print(f"fastest: {name}: {us:.1f} us per layer")

    # The KV write of one decode step: one token per sequence into its page.
    page_ids = jnp.asarray(tables[np.arange(b), (lengths - 1) // ps])
    offsets = jnp.asarray((lengths - 1) % ps)
    new = jnp.asarray(rng.standard_normal((b, kvh, d)), jnp.bfloat16)

    writes = {
        "write_tokens: one flat row index, unique": write_tokens,
        "two indices (page, offset), as before": lambda p, n, i, o: p.at[:, i, o].set(jnp.swapaxes(n, 0, 1), mode="drop"),
    }
    for name, write in writes.items():
        def write_chain(pages, new, page_ids, offsets, write=write):
            return jax.lax.fori_loop(0, args.layers, lambda i, pages: write(pages, new + i.astype(new.dtype), page_ids, offsets), pages)

        us = time_chain(write_chain, (k_pages, new, page_ids, offsets), args.layers, args.repeats)
        print(f"KV write ({name}): {us:.1f} us per layer call")


if __name__ == "__main__":
    main()
