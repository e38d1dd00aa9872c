"""Asynchronous against synchronous training on the same devices, one mode after the other.

Each mode runs our side of `bench_vs_trl.py` (the quickstart's task, a randomly initialised Llama of
`--size`, the same seed and so the same initial weights) in a fresh process:
- `sync`: `deterministic: true` with the fast passes (`exact_numerics: false`). Generation for step k
  starts once policy k is served and stops when the batch is full: the engine and the learner never
  work at the same time.
- `async1`, `async2`: the default loop with the buffer's `max_age` 1 and 2. The engine generates the
  next batches while the learner trains on this one.

Completions vary in length: `--stop` ends a completion where the policy samples that string (a random
policy samples each character about once in the vocabulary's size), else at `--max-tokens`. With
`--engine-device 1` the engine has a GPU of its own (`placement.server_devices=[1]`), the learner GPU 0.

Prints, for each mode: seconds per step and steps per minute over the steady steps (and x sync), the
share of the time the learner waits for rollouts, the completion lengths, the mean reward over all
steps and over the last 10, and the seconds from launch to a 5-step mean reward of `--target`.

    python benchmarks/bench_async.py --size 0.5b --steps 40 --max-tokens 512 --engine-device 1    # 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_async.py --size tiny --steps 20 --engine-device 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODES = {
    "sync": ["--deterministic=true", "--exact_numerics=false"],
    "async1": ["--envs.addition.buffer.max_age=1"],
    "async2": ["--envs.addition.buffer.max_age=2"],
}
STEADY_FROM = 2
"""Steps before this index compile and warm up: left out of the per-step figures."""


def run_mode(mode: str, args, work: Path) -> dict:
    out = work / f"{mode}.json"
    overrides = [*MODES[mode], f"--envs.addition.sampling.stop=[{args.stop}]"]
    if args.engine_device is not None:
        overrides.append(f"--placement.server_devices=[{args.engine_device}]")
    command = [
        sys.executable, str(HERE / "bench_vs_trl.py"), "--side=marin", "--init=own", f"--size={args.size}",
        f"--steps={args.steps}", f"--max-tokens={args.max_tokens}", f"--prompts={args.prompts}",
        f"--group-size={args.group_size}", f"--lr={args.lr}", f"--target={args.target}", f"--seed={args.seed}",
        f"--json={out}", *(f"--marin-override={o}" for o in [*overrides, *args.override]),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads(out.read_text())[0]


def figures(result: dict) -> dict:
    from marin_rl.storage import read_rollouts

    run_dir = Path(result["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = records[STEADY_FROM:] or records
    wall = sum(r["time/step_s"] for r in steady)
    lengths = [sum(len(t.token_ids) for t in rollout.turns if t.is_sampled) for rollout in read_rollouts(run_dir, "addition")]
    rewards = result["rewards"]
    return {
        "s/step": wall / len(steady),
        "steps/min": 60 * len(steady) / wall,
        "learner waits": sum(r["time/wait_data_s"] for r in steady) / wall,
        "length p10/50/90/max": "/".join(str(int(v)) for v in np.percentile(lengths, [10, 50, 90, 100])),
        "reward (all steps)": statistics.mean(rewards),
        "reward (last 10)": statistics.mean(rewards[-10:]),
        "launch to target s": result["seconds_from_launch_to_target"],
        "steps to target": result["steps_to_target"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--size", default="tiny", help="bench_vs_trl.py's --size")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--stop", default="x", help="stop string that ends a completion early (lengths vary)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-device", type=int, default=None, help="the engine's device (the learner keeps device 0); default: colocated")
    parser.add_argument("--override", action="append", default=[], help="a further config override for every mode")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    table = {mode: figures(run_mode(mode, args, work)) for mode in args.modes}
    placement = f"engine on device {args.engine_device}, learner on device 0" if args.engine_device is not None else "colocated"
    print(
        f"\n{args.size} model, {args.prompts} prompts x {args.group_size} completions of up to {args.max_tokens} tokens "
        f"(stop {args.stop!r}), {args.steps} steps, {placement}"
    )
    columns = list(next(iter(table.values())))
    print(" | ".join(["mode", *columns, "steps/min x sync"]))
    for mode, row in table.items():
        speedup = row["steps/min"] / table["sync"]["steps/min"] if "sync" in table else float("nan")
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        print(" | ".join([mode, *cells, f"{speedup:.2f}"]))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
