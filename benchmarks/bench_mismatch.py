"""Train/inference mismatch, and what exact numerics cost: the engine samples, the learner scores.

For each mode (`fast`: the engine's kernels and the learner's usual pass; `exact`: the exact passes of
`marin_rl.engine._exact` on both sides) a randomly initialised model of `--size` serves `--groups`
groups of `--group-size` samples of `--max-tokens` tokens (random prompts, submitted at once so the
engine batches them as it likes), then the learner scores the same tokens packed into rows as the
batcher packs them (its training step's log-probs, `loss_and_gradients`). Prints, per mode, the
mismatch at the same weights (KL(mu || pi) by the k3 estimate, the largest |delta log-prob|, the share
of tokens a TIS cap of 2 would touch), generated tokens/s, and the learner step's seconds.

    python benchmarks/bench_mismatch.py --size 0.5b --dtype bfloat16 --attn-backend cudnn   # GPU machine
    python benchmarks/bench_mismatch.py --size tiny --groups 8                              # CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np

SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab (bench_loop.py's shapes; 1b: bench_generate.py's)
    "tiny": (64, 256, 2, 4, 4, 104),
    "0.5b": (1024, 4096, 24, 16, 16, 104),
    "1b": (2048, 8192, 16, 32, 8, 32000),
}
CAP = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--modes", nargs="+", choices=("fast", "exact"), default=["fast", "exact"])
    parser.add_argument("--dtype", default="float32", help="compute dtype of the engine and the learner (bfloat16 on GPU)")
    parser.add_argument("--attn-backend", default="default", help="the learner's attention in its usual pass (cudnn on GPU)")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128, help="the engine's max_seq_len and the learner's rows")
    parser.add_argument("--exact-tile", type=int, default=16, help="tokens per tile of the exact passes")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds after a warm-up round")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    import jax

    from marin_rl.learner import ModelConfig, build_model

    hidden, mlp, layers, heads, kv, vocab = SIZES[args.size]
    model_config = ModelConfig(
        hidden_dim=hidden, intermediate_dim=mlp, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        seq_len=args.seq_len, attn_backend=args.attn_backend, compute_dtype=args.dtype,
    )  # fmt: skip
    model = build_model(model_config, vocab, key=jax.random.PRNGKey(0))
    print(f"{args.size} on {jax.devices()[0].device_kind}, {args.dtype}: {args.groups} groups x {args.group_size} x {args.max_tokens} tokens")
    for mode in args.modes:
        print(json.dumps({"mode": mode, **measure(model, vocab, args, exact=mode == "exact")}))


def measure(model, vocab: int, args, *, exact: bool) -> dict:
    import jax.numpy as jnp

    from marin_rl.engine import Engine, EngineConfig, GenerationJob

    config = EngineConfig(
        max_seqs=args.groups * args.group_size, max_seq_len=args.seq_len, compute_dtype=args.dtype,
        exact_numerics=exact, exact_tile=args.exact_tile,
    )  # fmt: skip
    started = time.perf_counter()
    engine = Engine(config, model)
    startup = time.perf_counter() - started
    rng = np.random.default_rng(0)
    rounds = []
    try:
        for _ in range(1 + args.repeats):
            jobs = [
                GenerationJob(rng.integers(0, vocab, args.prompt_len).tolist(), args.group_size, args.max_tokens, 1.0, int(rng.integers(2**62)), [])
                for _ in range(args.groups)
            ]
            start = time.perf_counter()
            for job in jobs:
                engine.submit(job)
            samples = [(job.prompt_ids, s) for job in jobs for s in job.future.result().samples]
            rounds.append((time.perf_counter() - start, samples))
    finally:
        engine.stop()
    generated = sum(len(s.token_ids) for _, samples in rounds[1:] for _, s in samples)
    tokens_per_s = generated / sum(seconds for seconds, _ in rounds[1:])

    example, sampled, behaviour = pack(rounds[-1][1], args.seq_len)
    layout = config.exact_layout
    learner_seconds = []
    for _ in range(1 + args.repeats):
        start = time.perf_counter()
        logprobs = np.asarray(learner_step(model, example, jnp.dtype(args.dtype), layout))
        learner_seconds.append(time.perf_counter() - start)
    log_ratio = (logprobs[sampled] - behaviour[sampled]).astype(np.float64)
    return {
        "kl": float(np.mean(np.expm1(log_ratio) - log_ratio)),
        "max_abs_diff": float(np.abs(log_ratio).max()),
        "frac_capped": float(np.mean(log_ratio > np.log(CAP))),
        "tokens": int(sampled.sum()),
        "generated_tokens_per_s": round(tokens_per_s),
        "learner_step_s": round(float(np.median(learner_seconds[1:])), 4),
        "engine_startup_s": round(startup, 1),
    }


def pack(sequences, row_len: int):
    """The sequences in rows of `row_len` as the batcher packs them: (RlExample, sampled mask, behaviour log-probs)."""
    from marin_rl.packed import PADDING_SEGMENT_ID, PackedArrays
    from marin_rl.rl_example import RlExample

    per_row = max(1, row_len // len(sequences[0][0] + sequences[0][1].token_ids))
    rows = -(-len(sequences) // per_row)
    shape = (rows, row_len)
    ids, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    segments, sampled, behaviour = np.full(shape, PADDING_SEGMENT_ID, np.int32), np.zeros(shape, bool), np.zeros(shape, np.float32)
    for index, (prompt, sample) in enumerate(sequences):
        row, slot = divmod(index, per_row)
        tokens = prompt + sample.token_ids
        offset = slot * len(tokens)
        span = slice(offset, offset + len(tokens))
        ids[row, span], positions[row, span], segments[row, span] = tokens, np.arange(len(tokens)), slot
        sampled[row, offset + len(prompt) : span.stop] = True
        behaviour[row, offset + len(prompt) : span.stop] = sample.logprobs
    weights = sampled.astype(np.float32)
    arrays = PackedArrays(
        input_ids=ids, position_ids=positions, segment_ids=segments, loss_mask=sampled, advantages=weights,
        policy_logprobs=behaviour, rl_weights=weights, ce_weights=np.zeros(shape, np.float32), kl_weights=np.zeros(shape, np.float32),
    )  # fmt: skip
    return RlExample.from_packed(arrays), sampled, behaviour


def learner_step(model, example, dtype, layout):
    """The learner's log-probs of `example` from its loss-and-gradients pass (what a training step runs)."""
    import jax

    logprobs, grads = _compiled_step()(model, example, dtype, layout)
    jax.block_until_ready(grads)
    return logprobs


@functools.cache
def _compiled_step():
    import equinox as eqx

    from marin_rl.learner import LearnerConfig, loss_and_gradients

    @eqx.filter_jit
    def run(model, example, dtype, layout):  # dtype and layout: static (compiled once per mode)
        _, grads, _, logprobs = loss_and_gradients(model, example, config=LearnerConfig(), compute_dtype=dtype, exact=layout)
        return logprobs, grads

    return run


if __name__ == "__main__":
    main()
