"""Batcher benchmark: packing efficiency and batch-building time on heavy-tailed rollout lengths.

100k rollouts over 4 envs (groups of 8): most are short, a few near max_seq_len. Prints the packing
efficiency (real tokens / padded tokens) of the batcher's packed rows, the same figure for
one-rollout-per-row padding, and the time to build one batch of ~1M tokens.

    .venv/bin/python benchmarks/bench_batcher.py [--rollouts 100000] [--max-seq-len 4096]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from marin_rl.replay import Batcher, BatcherConfig, ReplayBuffer, ReplayBufferConfig
from marin_rl.types import InferenceMetadata, Rollout, Turn

ENVS = ("math", "code", "chat", "tools")
FRACTIONS = {"math": 0.4, "code": 0.3, "chat": 0.2, "tools": 0.1}


def heavy_tailed_lengths(rng: np.random.Generator, n: int, max_seq_len: int) -> np.ndarray:
    """90% short (log-normal around ~250 tokens), 10% long (up to max_seq_len)."""
    short = rng.lognormal(mean=5.3, sigma=0.6, size=n)
    long = rng.uniform(0.4 * max_seq_len, max_seq_len, size=n)
    lengths = np.where(rng.random(n) < 0.9, short, long)
    return np.clip(lengths, 16, max_seq_len).astype(int)


def make_rollouts(env: str, n: int, group_size: int, max_seq_len: int, rng: np.random.Generator) -> list[Rollout]:
    lengths = heavy_tailed_lengths(rng, n, max_seq_len)
    meta = InferenceMetadata(server_id="bench", model="bench", policy_version=0, finish_reason="stop")
    rollouts = []
    for i, length in enumerate(lengths):
        prompt_len = max(1, length // 4)
        completion = length - prompt_len
        rollouts.append(
            Rollout(
                environment=env,
                problem_id=f"{env}-{i // group_size}",
                rollout_uid=f"{env}-{i}",
                group_id=f"{env}-{i // group_size}",
                turns=(
                    Turn("user", "", np.ones(prompt_len, np.int32)),
                    Turn("assistant", "", np.ones(completion, np.int32), np.full(completion, -0.5, np.float32), meta),
                ),
                rewards={"correct": float(i % 2)},
                reward=float(i % 2),
            )
        )
    return rollouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=1_000_000, help="tokens per batch (rounded down to rows)")
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    buffers = {env: ReplayBuffer(env, ReplayBufferConfig(max_age=10**9)) for env in ENVS}
    started = time.perf_counter()
    per_env = args.rollouts // len(ENVS)
    for env in ENVS:
        buffers[env].add(make_rollouts(env, per_env, args.group_size, args.max_seq_len, rng))
    print(f"filled 4 buffers with {per_env * len(ENVS)} rollouts in {time.perf_counter() - started:.1f}s")

    config = BatcherConfig(total_token_budget=args.budget, max_seq_len=args.max_seq_len, max_wait_s=0.0)
    batcher = Batcher(buffers, FRACTIONS, config)
    build_s, convert_s, efficiency, one_per_row, shares = [], [], [], [], []
    for _ in range(args.batches):
        t0 = time.perf_counter()
        batch = batcher.next_batch(policy_version=0)
        t1 = time.perf_counter()
        example = batch.to_example()
        example.input_ids.array.block_until_ready()
        t2 = time.perf_counter()
        build_s.append(t1 - t0)
        convert_s.append(t2 - t1)
        lengths = [m.num_tokens for g in batch.groups for m in g.members]
        efficiency.append(batch.metrics["batch/packing_efficiency"])
        one_per_row.append(sum(lengths) / (len(lengths) * args.max_seq_len))
        shares.append([batch.metrics[f"batches/{env}/frac_used"] for env in ENVS])

    tokens = config.num_rows * config.max_seq_len
    print(f"batch: {config.num_rows} rows x {config.max_seq_len} = {tokens} tokens, {args.batches} batches")
    print(f"packing efficiency (real / padded tokens), packed rows:      {np.mean(efficiency):.4f} (min {min(efficiency):.4f})")
    print(f"packing efficiency (real / padded tokens), one rollout a row: {np.mean(one_per_row):.4f}")
    print(f"time to build one batch (select + pack + numpy arrays): {1e3 * np.median(build_s):.1f} ms median, {1e3 * max(build_s):.1f} ms max")
    print(f"time to convert it to an RlExample (NamedArrays):       {1e3 * np.median(convert_s):.1f} ms median")
    mean_shares = np.mean(shares, axis=0)
    print("token share per env (configured -> achieved): " + ", ".join(f"{e} {FRACTIONS[e]:.2f}->{s:.3f}" for e, s in zip(ENVS, mean_shares)))


if __name__ == "__main__":
    main()
