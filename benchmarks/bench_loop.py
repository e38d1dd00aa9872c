"""Loop benchmark: the colocated single-device run (server + env workers + learner in one process).

Trains a randomly initialised Llama-shaped model on the toy task with long completions, so that
generation and training both do real work, and prints:
- generated tokens/s of the embedded server (over the whole run),
- learner tokens/s (packed tokens per second of optimizer step) and its MFU (6N FLOPs per token),
- weight-swap seconds (colocated broadcast, in place),
- the share of wall time the learner waits for data.

    .venv/bin/python benchmarks/bench_loop.py --size 0.5b --steps 8      # on the GPU machine
    .venv/bin/python benchmarks/bench_loop.py --size tiny --steps 4      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SIZES = {
    # hidden, intermediate, layers, heads, kv heads
    "tiny": (64, 256, 2, 4, 4),
    "0.5b": (1024, 4096, 24, 16, 16),  # ~0.4B in the blocks (Llama-shaped; the char vocab adds little)
    # bench_learner.py's ~1B shape (with --seq-len 4096 --max-tokens 256 --override=--server.kv_cache_tokens=131072)
    "1b": (2048, 8192, 16, 32, 8),
    # Llama-3-8B's shape (with --vocab 128256 --override=--learner.lora.rank=16 on one GPU)
    "8b": (4096, 14336, 32, 32, 8),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="learner steps (the first --warmup-steps are left out of the figures)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per completion")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=16, help="env workers (concurrent groups)")
    parser.add_argument("--budget", type=int, default=65536, help="tokens per learner batch")
    parser.add_argument("--max-seqs", type=int, default=128, help="server: sequences decoded together")
    parser.add_argument("--seq-len", type=int, default=512, help="learner rows (packed rollouts), the model's context")
    parser.add_argument("--microbatch-rows", type=int, default=None)
    parser.add_argument("--attn-backend", default="default", help="learner attention (cudnn on GPU)")
    parser.add_argument("--server-dtype", default=None, help="server compute dtype (bfloat16 on GPU)")
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU (H100/H200 dense bf16)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the figures (compilation)")
    parser.add_argument("--summarize", type=Path, default=None, help="only print the figures of an earlier run dir")
    parser.add_argument("--profile", default=None, help="trace --profile-seconds of the run, from step --profile-after-step on, into this dir; print its top ops")
    parser.add_argument("--profile-after-step", type=int, default=3)
    parser.add_argument("--profile-seconds", type=float, default=5.0)
    parser.add_argument("--vocab", type=int, default=None, help="pad the char tokenizer to this many tokens (embedding and LM head of a real size)")
    parser.add_argument("--override", action="append", default=[], help="a further config override (--override=--runtime=ray)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.summarize:
        summarize(args.summarize, args, wall=None)
        return
    from marin_rl.compiles import prepare_process

    prepare_process()  # as `marin-rl train` runs
    from marin_rl.config import load_config
    from marin_rl.orchestrator import train

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-loop-"))
    # Found from this file, not the working directory: Ray runs need a directory without the repo's
    # `marin_rl/` folder in it (Ray puts the driver's directory first on its workers' import path).
    config = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"), loop_overrides(args, run_dir))
    started = time.perf_counter()
    if args.profile:
        window = (args.profile, run_dir / "metrics.jsonl", args.profile_after_step, args.profile_seconds)
        threading.Thread(target=trace_window, args=window, daemon=True).start()
    train(config)
    if args.profile:
        from bench_learner import print_top_ops

        print_top_ops(args.profile, top=25)
    summarize(run_dir, args, wall=time.perf_counter() - started)


def trace_window(trace_dir: str, metrics: Path, after_step: int, seconds: float) -> None:
    """A jax.profiler trace of a window of the running loop (every thread's device work in it), from
    when `after_step` steps are logged (start-up and compilation take minutes on a GPU)."""
    import jax

    while not metrics.exists() or len(metrics.read_text().splitlines()) < after_step:
        time.sleep(0.2)
    with jax.profiler.trace(trace_dir):
        time.sleep(seconds)


def loop_overrides(args, run_dir: Path) -> list[str]:
    """The quickstart's config turned into the benchmark's (`args` from `build_parser`)."""
    hidden, mlp, layers, heads, kv = SIZES[args.size]
    seq_len = args.seq_len
    overrides = [
        f"--run_dir={run_dir}",
        f"--max_steps={args.steps}",
        f"--model.hidden_dim={hidden}",
        f"--model.intermediate_dim={mlp}",
        f"--model.num_layers={layers}",
        f"--model.num_heads={heads}",
        f"--model.num_kv_heads={kv}",
        f"--model.seq_len={seq_len}",
        f"--batcher.max_seq_len={seq_len}",
        f"--batcher.total_token_budget={args.budget}",
        "--batcher.max_wait_s=600",
        f"--server.max_seq_len={seq_len}",
        f"--server.max_seqs={args.max_seqs}",
        "--checkpoint_every=1000000",
        "--server.precompile_prompt_lens=[16]",  # every prefill and decode shape compiled before step 1
        "--learner.optimizer.learning_rate=1e-5",
        f"--envs.addition.group_size={args.group_size}",
        f"--envs.addition.replicas={args.replicas}",
        f"--envs.addition.sampling.max_tokens={args.max_tokens}",
        # No stop: random weights rarely sample EOS; every completion is max_tokens long.
        "--envs.addition.sampling.temperature=1.0",
    ]
    if args.microbatch_rows:
        overrides.append(f"--learner.microbatch_rows={args.microbatch_rows}")
    overrides.append(f"--model.attn_backend={args.attn_backend}")
    if args.server_dtype:
        overrides.append(f"--server.compute_dtype={args.server_dtype}")
    if args.vocab:
        overrides.append(f"--tokenizer={padded_char_tokenizer(args.vocab, run_dir.parent / f'char-tokenizer-{args.vocab}')}")
    return overrides + args.override


def padded_char_tokenizer(size: int, directory: Path) -> Path:
    """The shipped char tokenizer with unused tokens `<t104>`, ... added up to `size`: the run's model
    gets a vocabulary of that size (a random policy samples them; they decode as their names)."""
    import shutil

    from marin_rl.tokenizer import CHAR_TOKENIZER_DIR

    if not directory.exists():
        shutil.copytree(CHAR_TOKENIZER_DIR, directory)
        spec = json.loads((directory / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        vocab.update({f"<t{i}>": i for i in range(len(vocab), size)})
        (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def summarize(run_dir: Path, args, wall: float | None) -> None:
    """The figures, from the run's metrics.jsonl (so a run cut short can still be read)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = records[args.warmup_steps :] or records  # the first steps include compilation
    generated = sum(r["replays/addition/new_generated_tokens"] for r in steady)
    steady_wall = sum(r["time/step_s"] for r in steady)
    size = args.size
    hidden, _, layers, _, _ = SIZES[size]
    total = f", run wall {wall:.0f}s incl. startup" if wall is not None else ""
    print(f"model: {size} ({hidden} hidden, {layers} layers), {len(records)} steps{total}")
    step_seconds = ", ".join(f"{r['time/step_s']:.1f}" for r in steady)
    print(f"step seconds (steady): {step_seconds}")
    print(f"generated tokens/s (server, steady steps): {generated / steady_wall:,.0f}")
    print(f"learner tokens/s (packed tokens / step time): {np.median([r['learner/tokens_per_s'] for r in steady]):,.0f}")
    tflops = np.median([r["learner/model_tflops_per_s"] for r in steady])
    print(f"learner MFU (6N, peak {args.peak_tflops:.0f} TFLOP/s): {tflops / args.peak_tflops:.1%} ({tflops:.0f} TFLOP/s)")
    if "broadcast/swap_seconds" in steady[0]:  # in-process engines (colocated, or on their own devices)
        swap = {part: np.median([r[f"broadcast/swap_{part}seconds"] for r in steady]) for part in ("", "copy_", "wait_")}
        print(
            f"weight swap seconds (in-process engines): {swap['']:.3f} = copy {swap['copy_']:.3f} "
            f"+ install {swap['wait_']:.3f}"
        )
    print(f"broadcast seconds (every server confirmed): {np.median([r['broadcast/seconds'] for r in steady]):.3f}")
    if "server/decode_steps" in steady[-1] and len(records) > len(steady):  # embedded engines' counters
        before, after = records[len(records) - len(steady) - 1], steady[-1]
        counters = ("decode_seconds", "prefill_seconds", "decode_steps", "generated_tokens", "prefill_calls", "requests", "compilations")
        delta = {f"server/{k}": after[f"server/{k}"] - before[f"server/{k}"] for k in counters}
        busy = delta["server/decode_seconds"] + delta["server/prefill_seconds"]
        steps = max(1.0, delta["server/decode_steps"])
        print(
            f"engine busy on device: {busy / steady_wall:.2f} of the wall time (prefill {delta['server/prefill_seconds']:.1f}s, "
            f"decode {delta['server/decode_seconds']:.1f}s); decode step {1000 * delta['server/decode_seconds'] / steps:.2f} ms "
            f"for {delta['server/generated_tokens'] / steps:.0f} tokens on average"
        )
        calls = max(1.0, delta["server/prefill_calls"])
        print(
            f"prefill: {delta['server/prefill_calls']:.0f} calls of {1000 * delta['server/prefill_seconds'] / calls:.1f} ms, "
            f"{delta['server/requests'] / calls:.1f} requests (groups) each; shapes compiled meanwhile: {delta['server/compilations']:.0f}"
        )
    measured = [r for r in steady if "mismatch/addition/kl" in r]  # steps with rollouts of the same policy version
    if measured:
        kl, diff = (np.median([r[f"mismatch/addition/{k}"] for r in measured]) for k in ("kl", "max_abs_diff"))
        print(f"mismatch at the same policy version (median over {len(measured)} steps): KL {kl:.3g}, max |delta log-prob| {diff:.3g}")
    wait = sum(r["time/wait_data_s"] for r in steady)
    print(f"share of wall time the learner waits for data: {wait / steady_wall:.2f}")
    print(f"packing efficiency: {np.mean([r['batch/packing_efficiency'] for r in steady]):.3f}")
    peaks = [r[k] for r in records for k in r if k.startswith("memory/device") and k.endswith("_peak_gib")]
    if peaks:
        print(f"peak device memory (GiB, over the run): {max(peaks):.1f}")


if __name__ == "__main__":
    main()
