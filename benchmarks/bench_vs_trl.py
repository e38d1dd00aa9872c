"""Side by side with TRL's `GRPOTrainer`: the same task, model shape and settings, through both.

The task is the quickstart's (`3+1=` -> `4`, reward 1 when the first character of the completion is
the sum mod 10, the character tokenizer and its chat template), a randomly initialised Llama of the
chosen shape, groups of `--group-size` completions of `--prompts` prompts per step, `--max-tokens`
new tokens, temperature 1, the same learning rate, clip range and gradient clipping, no KL term. Both
sides start from the same weights: transformers initialises the model and saves it as a Hugging Face
checkpoint that each side loads (`--init own` lets each side initialise its own, Levanter's against
transformers').
TRL generates with transformers `generate()` (vLLM cannot be installed on the GPU machine). Each side
prints seconds per step (median over steady steps), generated and trained tokens/s, peak device
memory, its reward curve, and the steps, training seconds (the steps' own times) and seconds from
launch (imports, model build and compilation included) until the mean reward over 5 steps first
reaches `--target`.

    python benchmarks/bench_vs_trl.py --size tiny                     # the quickstart on this CPU
    python benchmarks/bench_vs_trl.py --size 0.5b --max-tokens 64 --prompts 16 --steps 60 --lr 1e-4   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCHED = time.time()
"""When this process started (each side runs in a process of its own)."""
SIZES = {
    # hidden, intermediate, layers, heads, kv heads
    "tiny": (64, 256, 2, 4, 4),
    "0.5b": (1024, 4096, 24, 16, 16),
    "1b": (2048, 8192, 16, 32, 8),
}
WINDOW = 5
STARTUP_AFTER_IMPORTS = ["startup/checks_s", "startup/model_s", "startup/compile_s", "startup/first_batch_s", "startup/first_step_s"]
"""Steps in the moving average of the reward compared with --target."""


def time_to_target(rewards: list[float], step_seconds: list[float], target: float) -> tuple[int | None, float | None]:
    """(steps, training seconds) until the mean reward of the last WINDOW steps first reaches `target`."""
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.mean(rewards[end - WINDOW : end]) >= target:
            return end, sum(step_seconds[:end])
    return None, None


def reached_target(rewards: list[float], target: float) -> bool:
    return len(rewards) >= WINDOW and statistics.mean(rewards[-WINDOW:]) >= target


def summary(
    name: str, rewards: list[float], step_seconds: list[float], step_ends: list[float], generated: list[float], trained: list[float], peak_gib, args
) -> dict:
    """`step_ends`: the wall-clock time (time.time()) at which each step ended."""
    steady = slice(min(2, len(step_seconds) - 1), None)  # the first steps compile / warm up
    median = statistics.median(step_seconds[steady])
    steps, seconds = time_to_target(rewards, step_seconds, args.target)
    steps_to_09, _ = time_to_target(rewards, step_seconds, 0.9)
    return {
        "side": name,
        "seconds_per_step": median,
        "generated_tok_s": sum(generated[steady]) / sum(step_seconds[steady]),
        "trained_tok_s": sum(trained[steady]) / sum(step_seconds[steady]),
        "peak_gib": peak_gib,
        "steps_to_target": steps,
        "seconds_to_target": seconds,
        "seconds_from_launch_to_target": None if steps is None else step_ends[steps - 1] - LAUNCHED,
        "steps_to_0.9": steps_to_09,
        "rewards": [round(r, 3) for r in rewards],
        "seconds_from_launch": [round(end - LAUNCHED, 2) for end in step_ends],
        "step_seconds": [round(s, 4) for s in step_seconds],
    }


# ------------------------------------------------------------------------------------------ marin-rl


def run_marin(args, checkpoint: str | None) -> dict:
    if args.side == "both":  # TRL's process runs next on the same GPU while this one keeps what JAX took
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    from marin_rl.compiles import prepare_process

    prepare_process()  # as `marin-rl train` runs
    import jax

    from marin_rl.config import load_config
    from marin_rl.orchestrator import train
    from marin_rl.testing import train_until

    hidden, mlp, layers, heads, kv = SIZES[args.size]
    row = 64 if args.size == "tiny" else 512
    per_rollout = 7 + args.max_tokens  # the rendered prompt is 7 tokens (`marin-rl train` prints it)
    rows = -(-args.prompts * args.group_size * per_rollout // row)
    run_dir = Path(tempfile.mkdtemp(prefix="vs-trl-marin-")) / "run"
    overrides = [
        f"--run_dir={run_dir}",
        f"--max_steps={args.steps}",
        f"--seed={args.seed}",
        f"--model.hidden_dim={hidden}",
        f"--model.intermediate_dim={mlp}",
        f"--model.num_layers={layers}",
        f"--model.num_heads={heads}",
        f"--model.num_kv_heads={kv}",
        f"--model.seq_len={row}",
        f"--batcher.max_seq_len={row}",
        f"--batcher.total_token_budget={rows * row}",
        f"--server.max_seq_len={row}",
        # A slot for every rollout in flight (twice a step's on a GPU, below). On the CPU, the quickstart's
        # 64 slots: more make every prefill larger there, for nothing.
        f"--server.max_seqs={64 if args.size == 'tiny' else min(1024, 2 * args.prompts * args.group_size)}",
        f"--learner.optimizer.learning_rate={args.lr}",
        "--checkpoint_every=1000000",
        f"--envs.addition.group_size={args.group_size}",
        f"--envs.addition.sampling.max_tokens={args.max_tokens}",
        f"--model.gradient_checkpointing={'layer' if args.gradient_checkpointing == 'on' else 'none'}",
        *([f"--model.hf_checkpoint={checkpoint}"] if checkpoint else []),
        *args.marin_override,
    ]
    if jax.default_backend() == "gpu":
        # Twice as many groups in flight as a step takes: the next step's groups generate while this
        # step's rollouts are scored and stored (TRL generates a step's groups in one call). On 2 CPU
        # cores the quickstart's 8 workers are faster (0.143 against 0.154 s per step with 20).
        overrides += ["--model.attn_backend=cudnn", "--server.compute_dtype=bfloat16", f"--envs.addition.replicas={2 * args.prompts}"]
    config = load_config(str(Path(__file__).parent.parent / "configs" / "quickstart.yaml"), overrides)
    if args.stop_at_target:
        train_until(config, lambda records: reached_target([r["batches/addition/reward_mean"] for r in records], args.target))
    else:
        train(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    steady = records[2:] or records
    later = [r["time/step_s"] for r in records[1:]] or [0.0]
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(
        f"marin-rl median step split: {statistics.median(r['time/wait_data_s'] for r in steady):.3f} s waiting for rollouts, "
        f"{statistics.median(r['time/learner_s'] for r in steady):.3f} s learning; launch to the end of step 1 "
        f"{records[0]['time'] - LAUNCHED:.1f} s (checks, model, compile, first batch, first step: "
        f"{', '.join(f'{records[0][k]:.1f}' for k in STARTUP_AFTER_IMPORTS)} s; compilations {records[0]['compile/count']:.0f}, "
        f"{records[0]['compile/cache_hits']:.0f} from the cache, seconds traced / lowered / in XLA "
        f"{records[0]['compile/trace_seconds']:.1f} / {records[0]['compile/lower_seconds']:.1f} / {records[0]['compile/seconds']:.1f}); "
        f"after step 1: {records[-1]['compile/count'] - records[0]['compile/count']:.0f} compilations, longest step "
        f"{max(later):.2f} s = {max(later) / statistics.median(later):.1f}x the median"
    )
    result = summary(
        "marin-rl",
        [r["batches/addition/reward_mean"] for r in records],  # the batch the step trained on
        [r["time/step_s"] for r in records],
        [r["time"] for r in records],
        [r.get("replays/addition/new_generated_tokens", 0) for r in records],
        [r["learner/num_tokens"] for r in records],
        None if peak is None else peak / 2**30,
        args,
    )
    return {**result, "run_dir": str(run_dir)}  # bench_async.py reads the run's metrics and rollouts


# ----------------------------------------------------------------------------------------------- TRL


def trl_tokenizer(args):
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # no token_type_ids: Llama takes none
    return tokenizer


def fresh_hf_model(args):
    """transformers' randomly initialised Llama of `--size` (seeded by `--seed`)."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    tokenizer = trl_tokenizer(args)
    hidden, mlp, layers, heads, kv = SIZES[args.size]
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=len(tokenizer), max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), tokenizer


def save_initial_weights(args, path: str) -> None:
    """The weights both sides start from, as a Hugging Face checkpoint (float32, with the tokenizer)."""
    model, tokenizer = fresh_hf_model(args)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def run_trl(args, checkpoint: str | None) -> dict:
    import random

    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    gpu = torch.cuda.is_available()
    if checkpoint:
        torch.manual_seed(args.seed)
        tokenizer = trl_tokenizer(args)
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    else:
        model, tokenizer = fresh_hf_model(args)
    # The quickstart's problems, drawn the same way (a + 1 with a uniform in 0..9), as chat messages.
    rng = random.Random(args.seed)
    problems = [rng.randrange(10) for _ in range(args.prompts * args.steps)]
    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"{a}+1="}] for a in problems], "answer": [str((a + 1) % 10) for a in problems]}
    )

    def correct(completions, answer, **_):
        return [float(c[0]["content"].strip()[:1] == a) for c, a in zip(completions, answer)]

    log: list[dict] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            log.append({"seconds": time.perf_counter() - self.start, "end": time.time()})

        def on_log(self, _args, _state, control, logs=None, **__):
            if logs and "reward" in logs and log:
                log[-1].update(reward=logs["reward"], completion_length=logs.get("completions/mean_length", args.max_tokens))
                if args.stop_at_target and reached_target([e.get("reward", 0.0) for e in log], args.target):
                    control.should_training_stop = True

    completions = args.prompts * args.group_size
    grpo = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"),
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        per_device_train_batch_size=completions,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        beta=0.0,
        epsilon=0.2,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        bf16=gpu,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        use_cpu=not gpu,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=grpo, train_dataset=data, processing_class=tokenizer, callbacks=[Timer()])
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    prompt_len = len(tokenizer.apply_chat_template([{"role": "user", "content": "3+1="}], add_generation_prompt=True))
    generated = [completions * e.get("completion_length", args.max_tokens) for e in log]
    return summary(
        f"TRL {__import__('trl').__version__} (transformers {transformers.__version__} generate)",
        [e.get("reward", 0.0) for e in log],
        [e["seconds"] for e in log],
        [e["end"] for e in log],
        generated,
        [g + completions * prompt_len for g in generated],
        torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        args,
    )


# ---------------------------------------------------------------------------------------------- main


def plot(paths: list[str], png: str) -> None:
    """Each result of the --json files (label: the file name and the side) against steps and against
    seconds from launch, with the 5-step mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path in paths:
        for result in json.loads(Path(path).read_text()):
            rewards = result["rewards"]
            mean = [statistics.mean(rewards[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(rewards))]
            label = f"{Path(path).stem}: {result['side'].split(' (')[0]}"
            by_step.plot(range(1, len(mean) + 1), mean, label=label)
            by_time.plot(result["seconds_from_launch"], mean, label=label)
    by_step.set_xlabel("step")
    by_time.set_xlabel("seconds from launch")
    for axis in (by_step, by_time):
        axis.set_ylabel(f"mean reward over {WINDOW} steps")
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def trl_side(args, side: str) -> str:
    """Run `--side={side}` with the TRL interpreter in a process of its own; returns what it printed."""
    passed, skip = [], False
    for arg in sys.argv[1:]:  # all but --side and --checkpoint (as --x=v or --x v)
        if skip or arg.startswith(("--side", "--checkpoint")):
            skip = not skip and "=" not in arg
            continue
        passed.append(arg)
    command = [args.trl_python, __file__, f"--side={side}", *passed, *([f"--checkpoint={args.checkpoint}"] if args.checkpoint else [])]
    env = {**os.environ, **({"PYTHONPATH": os.environ["TRL_PYTHONPATH"]} if "TRL_PYTHONPATH" in os.environ else {})}
    env.pop("USE_TORCH", None)
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(out.stdout[-3000:], out.stderr[-5000:])
        raise SystemExit(f"the TRL side's {side} failed (exit {out.returncode})")
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--prompts", type=int, default=20, help="prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=0.8, help="mean reward over 5 steps to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-target", action="store_true", help="each side stops once its mean reward reached --target")
    parser.add_argument(
        "--gradient-checkpointing",
        choices=["on", "off"],
        default="on",
        help="both sides: on recomputes each layer's inside in the backward pass (both defaults), off keeps it",
    )
    parser.add_argument("--init", choices=["same", "own"], default="same", help="same: both sides load one HF checkpoint; own: each initialises its own")
    parser.add_argument("--marin-override", action="append", default=[], help="a config override for our side (--marin-override=--envs.addition.buffer.max_age=0)")
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)  # set for the sides' processes
    parser.add_argument("--side", choices=["both", "marin", "trl", "init"], default="both")
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with torch, transformers and trl")
    parser.add_argument("--tokenizer", default=str(Path(__file__).parent.parent / "marin_rl" / "assets" / "char_tokenizer"))
    parser.add_argument("--json", default=None, help="also write both results here")
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON", help="only draw the reward curves of earlier --json files into --png")
    parser.add_argument("--png", default="vs_trl.png")
    args = parser.parse_args()

    if args.plot:
        plot(args.plot, args.png)
        return
    if args.side == "trl":
        print("RESULT " + json.dumps(run_trl(args, args.checkpoint)), flush=True)
        return
    if args.side == "init":
        save_initial_weights(args, args.checkpoint)
        return
    if args.init == "same" and args.checkpoint is None:  # transformers' init, made with the TRL side's interpreter
        args.checkpoint = str(Path(tempfile.mkdtemp(prefix="vs-trl-init-")) / "model")
        trl_side(args, "init")
        global LAUNCHED
        LAUNCHED = time.time()  # our side's launch: the shared weights are not its start-up
    results = []
    if args.side in ("both", "marin"):
        results.append(run_marin(args, args.checkpoint))
    if args.side == "both":  # its own process: its own threads, and on a GPU its own CUDA context
        lines = [line for line in trl_side(args, "trl").splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit("the TRL side printed no result")
        results.append(json.loads(lines[-1][len("RESULT ") :]))

    print(
        f"\n{args.size} model, {args.prompts} prompts x {args.group_size} completions of {args.max_tokens} tokens, lr {args.lr}, "
        f"gradient checkpointing {args.gradient_checkpointing}, initial weights: {args.init}"
        + (f", ours with {' '.join(args.marin_override)}" if args.marin_override else "")
    )
    print(f"seconds from launch to a mean reward of {args.target} over {WINDOW} steps:")
    for r in results:
        launch = r["seconds_from_launch_to_target"]
        print(f"  {r['side']}: " + (f"{launch:.1f} s (step {r['steps_to_target']})" if launch else "not reached"))
    for r in results:
        reached = (
            f"step {r['steps_to_target']}, {r['seconds_to_target']:.1f} s of training, {r['seconds_from_launch_to_target']:.1f} s from launch"
            if r["steps_to_target"]
            else "not reached"
        )
        peak = f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] else ""
        print(
            f"{r['side']}: {r['seconds_per_step']:.3f} s/step, {r['generated_tok_s']:,.0f} generated tok/s, "
            f"{r['trained_tok_s']:,.0f} trained tok/s{peak}; mean reward {args.target} over {WINDOW} steps: {reached}; "
            f"0.9: {'step ' + str(r['steps_to_0.9']) if r['steps_to_0.9'] else 'not reached'}"
        )
        print(f"  rewards: {r['rewards']}")
    if len(results) == 2:
        print(f"marin-rl is {results[1]['seconds_per_step'] / results[0]['seconds_per_step']:.1f}x faster per step")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
