"""Weight swap of the colocated loop: the learner's float32 model into the engine's serving copy.

    python benchmarks/bench_swap.py            # the 1B shape of bench_generate.py, on the GPU machine
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_generate import SIZES, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--swaps", type=int, default=5)
    args = parser.parse_args()

    import jax

    from marin_rl.engine import Engine, EngineConfig

    model = build(args.size, 1024)
    engine = Engine(EngineConfig(max_seqs=8, max_seq_len=1024, compute_dtype=args.dtype), model)
    seconds = []
    for version in range(1, args.swaps + 1):
        start = time.perf_counter()
        engine.swap(model, version)  # copy (cast, one array per layer) + install at the next device call
        seconds.append(time.perf_counter() - start)
    engine.stop()
    params = sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size"))
    print(f"{jax.devices()[0].device_kind}: {args.size} ({params / 1e9:.2f}B params) swap into {args.dtype}: "
          f"first {seconds[0]:.3f} s, then median {statistics.median(seconds[1:]):.3f} s")


if __name__ == "__main__":
    main()
