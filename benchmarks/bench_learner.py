"""Throughput and MFU of one learner training step on packed rows.

MFU = 6 * N * tokens / step time / peak FLOP/s, with N the parameters that take part in matmuls (all of
them except the input embedding table, whose lookup is not a matmul; a tied head counts once). Attention
score FLOPs are not in 6N; the `mfu_with_attention` line adds them (Levanter's per-token count, which
assumes the full [seq, seq] score matrix, times 3 for forward + backward).

Smoke check on CPU:
    .venv/bin/python benchmarks/bench_learner.py --hidden-dim 64 --intermediate-dim 128 --num-layers 2 \
        --num-heads 4 --num-kv-heads 2 --vocab-size 512 --seq-len 128 --rows 4 --microbatch-rows 2 --steps 3
One H100, ~1B Llama shape, seq 4096, bf16 (the defaults; compare --attn-backend and --gradient-checkpointing):
    python benchmarks/bench_learner.py --rows 16 --microbatch-rows 4 --attn-backend cudnn
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

H100_BF16_DENSE_FLOPS = 989e12


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--hidden-dim", type=int, default=2048)
    parser.add_argument("--intermediate-dim", type=int, default=8192)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=4096, help="positions per packed row")
    parser.add_argument("--rows", type=int, default=16, help="rows per batch (one optimizer step)")
    parser.add_argument("--microbatch-rows", type=int, default=None, help="rows per microbatch (default: all)")
    parser.add_argument("--rollouts-per-row", type=int, default=4, help="segments packed in each row")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="compute dtype")
    parser.add_argument(
        "--attn-backend", default="default", choices=["default", "jax_flash", "vanilla", "nvte", "splash", "cudnn"]
    )
    parser.add_argument("--cudnn-max-segments", type=int, default=16, help="cudnn: packed layout up to this many segments a row (1: dense mask)")
    parser.add_argument("--flash-block-size", type=int, default=None, help="block size of Levanter's flash backends")
    parser.add_argument("--gradient-checkpointing", default="layer", choices=["layer", "none", "offload", "nested"])
    parser.add_argument("--vocab-block-size", type=int, default=16384, help="vocab columns scored at a time")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s (default: H100 bf16 on GPU)")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base (0: every parameter)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--profile", default=None, help="trace one more step with jax.profiler into this dir; print its top ops")
    return parser.parse_args()


def packed_batch(rows: int, seq_len: int, rollouts_per_row: int, vocab_size: int, seed: int = 0):
    """Rows filled exactly with rollouts of random lengths (no padding), half of each rollout's tokens sampled."""
    import numpy as np

    from marin_rl.rl_example import PackedArrays, RlExample

    rng = np.random.default_rng(seed)
    shape = (rows, seq_len)
    position_ids = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    for row in range(rows):
        cuts = np.sort(rng.choice(np.arange(2, seq_len - 1), size=rollouts_per_row - 1, replace=False))
        for segment, (start, end) in enumerate(zip([0, *cuts], [*cuts, seq_len], strict=True)):
            position_ids[row, start:end] = np.arange(end - start)
            segment_ids[row, start:end] = segment
    loss_mask = (position_ids >= 1) & (rng.random(shape) < 0.5)
    advantages = np.where(loss_mask, rng.normal(size=shape), 0.0).astype(np.float32)
    policy_logprobs = np.where(loss_mask, -rng.uniform(0.5, 3.0, shape), 0.0).astype(np.float32)
    weights = loss_mask.astype(np.float32)
    zeros = np.zeros(shape, np.float32)
    packed = PackedArrays(
        rng.integers(0, vocab_size, shape).astype(np.int32),
        position_ids,
        segment_ids,
        loss_mask,
        advantages,
        policy_logprobs,
        weights,
        zeros,
        zeros,
    )
    return RlExample.from_packed(packed)


def main() -> None:
    args = parse_args()
    from marin_rl.compiles import prepare_process

    prepare_process()  # as `marin-rl train` runs
    # Heavy imports after parsing, so --help is instant.
    import equinox as eqx
    import jax
    import numpy as np
    from marin_rl.learner import Learner, LearnerConfig, LoraConfig, ModelConfig, OptimizerConfig, compute_dtype

    model_config = ModelConfig(
        family=args.family,
        hidden_dim=args.hidden_dim,
        intermediate_dim=args.intermediate_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        seq_len=args.seq_len,
        compute_dtype=args.dtype,
        attn_backend=args.attn_backend,
        flash_block_size=args.flash_block_size,
        cudnn_max_segments=args.cudnn_max_segments,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    config = LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=1e-5),
        microbatch_rows=args.microbatch_rows,
        vocab_block_size=args.vocab_block_size,
        lora=LoraConfig(rank=args.lora_rank),
    )
    device = jax.devices()[0]
    peak = (
        args.peak_flops
        if args.peak_flops is not None
        else (H100_BF16_DENSE_FLOPS if device.platform == "gpu" else None)
    )

    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        learner = Learner(config, model_config, run_dir, None, key=jax.random.PRNGKey(0), vocab_size=args.vocab_size)
        build_s = time.perf_counter() - start
        example = packed_batch(args.rows, args.seq_len, args.rollouts_per_row, args.vocab_size)
        warmup_s = []
        for _ in range(args.warmup_steps):
            warmup_s.append(learner.step(example)["step_time_s"])
        step_s = [learner.step(example)["step_time_s"] for _ in range(args.steps)]
        if args.profile:
            with jax.profiler.trace(args.profile, create_perfetto_trace=True):
                learner.step(example)

    model = learner.policy_model  # with LoRA: the base's shape, adapters merged
    total_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    embedding_lookup = 0 if model.config.tie_word_embeddings else model.embeddings.token_embeddings.weight.size
    matmul_params = total_params - embedding_lookup
    tokens = args.rows * args.seq_len
    seconds = statistics.median(step_s)
    flops = 6 * matmul_params * tokens
    flops_with_attention = 3 * model.config.flops_per_token(args.vocab_size) * tokens

    print(
        f"device: {device.device_kind} ({device.platform}), compute dtype {np.dtype(compute_dtype(model_config)).name}"
    )
    print(
        f"model: {args.family} hidden {args.hidden_dim} intermediate {args.intermediate_dim} layers {args.num_layers} "
        f"heads {args.num_heads}/{args.num_kv_heads} vocab {args.vocab_size}; attention {args.attn_backend} "
        f"(flash block {args.flash_block_size}), checkpointing {args.gradient_checkpointing}"
    )
    print(f"params: {total_params:,} total, {matmul_params:,} in matmuls (N for 6N)")
    if args.lora_rank:
        from marin_rl.learner._lora import trainable_params

        trained = sum(x.size for x in jax.tree.leaves(trainable_params(learner.model)))
        print(f"lora rank {args.lora_rank}: {trained:,} trained parameters (no weight gradients: 6N overstates the work, about 4N)")
    print(
        f"batch: {args.rows} rows x {args.seq_len} positions = {tokens} tokens, {args.rollouts_per_row} rollouts/row, "
        f"microbatch rows {args.microbatch_rows or args.rows}"
    )
    print(f"build_s: {build_s:.2f}")
    print(f"warmup_step_s (first compiles): {', '.join(f'{s:.3f}' for s in warmup_s)}")
    print(f"step_s (median of {len(step_s)}): {seconds:.4f}  [min {min(step_s):.4f}, max {max(step_s):.4f}]")
    print(f"tokens_per_s: {tokens / seconds:,.0f}")
    print(f"model_tflops_per_s (6N): {flops / seconds / 1e12:.2f}")
    if peak is None:
        print("mfu: n/a (no --peak-flops on this platform)")
    else:
        print(f"mfu (6N, peak {peak:.3g} FLOP/s): {flops / seconds / peak:.1%}")
        print(f"mfu_with_attention: {flops_with_attention / seconds / peak:.1%}")
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"peak_device_memory_gib: {stats['peak_bytes_in_use'] / 2**30:.1f}")
    if args.profile:
        print_top_ops(args.profile)


def print_top_ops(trace_dir: str, top: int = 20) -> None:
    """Device time per op name in the traced step (from the Perfetto trace), largest first."""
    import collections
    import glob
    import gzip
    import json

    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[-1:]
    events = json.load(gzip.open(path))["traceEvents"]
    # Device streams are the processes whose name mentions the GPU (/device:GPU:0 ...).
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name" and "device" in str(e.get("args", {}).get("name", "")).lower()}
    totals: collections.Counter[str] = collections.Counter()
    spans = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices:
            totals[e["name"]] += e.get("dur", 0)
            spans.append((e["ts"], e["ts"] + e.get("dur", 0)))
    total = sum(totals.values())
    # Busy = the union of kernel intervals; the rest of the span the GPU sat idle (launch or host bound).
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    print(f"profile: {total / 1e3:.1f} ms of device time in {len(spans)} kernels, {len(totals)} op names ({path})")
    print(f"  device busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span ({busy / max(span, 1):.0%}); mean kernel {total / max(len(spans), 1):.1f} us")
    for name, dur in totals.most_common(top):
        print(f"  {dur / 1e3:9.2f} ms  {dur / max(total, 1):6.1%}  {name[:110]}")


if __name__ == "__main__":
    main()
