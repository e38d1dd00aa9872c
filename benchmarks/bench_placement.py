"""Placement benchmark on a host of 2 or more GPUs: the loop of `bench_loop.py` in each placement, one
after the other. `--engines 1 3` runs each placement but `colocated` with 1 and with 3 engines.

- `colocated`: learner and engine take turns on GPU 0 (today's default).
- `split`: one process, learner on GPU 0, an engine on each of GPUs 1..N; each swap is a device-to-device
  copy.
- `ray`: a Ray cluster whose GPUs are GPUs 1..N (`ray start --head --num-gpus=N` with
  CUDA_VISIBLE_DEVICES=1,..,N), the driver (learner) on GPU 0 joining it, a server actor on each; weights
  through the object store. `ray_checkpoint`: the same with weights through an HF checkpoint on disk.

Each mode runs `bench_loop.py` in a fresh process and prints its figures (generated tok/s, learner
tok/s, share of time the learner waits, swap / broadcast seconds), then one table of all modes.

    python benchmarks/bench_placement.py --size 0.5b --steps 8 --server-dtype bfloat16 --attn-backend jax_flash
    python benchmarks/bench_placement.py --modes colocated split --engines 1 3 --size 0.5b ...   # 4 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_placement.py --cpu --size tiny --steps 3

Any option not listed here goes to `bench_loop.py` (see its --help). `--cpu`: CPU smoke run (two host
devices for `split`, CPU server actors, no CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]
MODES = ("colocated", "split", "ray", "ray_checkpoint")


def mode_overrides(mode: str, engines: int, cpu: bool) -> list[str]:
    ray = ["--runtime=ray", "--ray.address=auto", f"--ray.server_num_gpus={0 if cpu else 1}", f"--ray.num_servers={engines}"]
    return {
        "colocated": [],
        "split": [f"--placement.server_devices=[{','.join(str(d) for d in range(1, engines + 1))}]"],
        "ray": [*ray, "--ray.weight_transfer=object_store"],
        "ray_checkpoint": [*ray, "--ray.weight_transfer=checkpoint"],
    }[mode]


def run_mode(mode: str, engines: int, cpu: bool, loop_args: list[str], work: Path) -> Path:
    run_dir = work / f"{mode}_x{engines}"
    env = dict(os.environ)
    started_ray = mode.startswith("ray")
    if started_ray:  # the cluster's GPUs are GPUs 1..N; the driver keeps GPU 0
        gpus = ",".join(str(d) for d in range(1, engines + 1))
        ray_env = {**env, **({} if cpu else {"CUDA_VISIBLE_DEVICES": gpus})}
        head = ["start", "--head", f"--num-gpus={0 if cpu else engines}", f"--num-cpus={4 * engines}", "--include-dashboard=false", "--disable-usage-stats"]
        head += ["--object-store-memory=200000000"] if cpu else []
        subprocess.run([*RAY_CLI, *head], env=ray_env, check=True)
        if not cpu:
            env["CUDA_VISIBLE_DEVICES"] = "0"
    overrides = [f"--override={o}" for o in mode_overrides(mode, engines, cpu)]
    try:
        subprocess.run([sys.executable, str(HERE / "bench_loop.py"), *loop_args, f"--run-dir={run_dir}", *overrides], env=env, check=True)
    finally:
        if started_ray:
            subprocess.run([*RAY_CLI, "stop", "--force"], env=env, check=False)
    return run_dir


def figures(run_dir: Path, warmup: int) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = records[warmup:] or records
    wall = sum(r["time/step_s"] for r in steady)
    swap = [r.get("broadcast/swap_seconds", r["broadcast/seconds"]) for r in steady]
    return {
        "generated tok/s": sum(r["replays/addition/new_generated_tokens"] for r in steady) / wall,
        "learner tok/s": float(np.median([r["learner/tokens_per_s"] for r in steady])),
        "learner waits": sum(r["time/wait_data_s"] for r in steady) / wall,
        "swap s": float(np.median(swap)),
        "broadcast s": float(np.median([r["broadcast/seconds"] for r in steady])),
        "step s": wall / len(steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--cpu", action="store_true", help="CPU smoke run")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the figures (compilation)")
    parser.add_argument("--engines", type=int, nargs="+", default=[1], help="engines (GPUs besides the learner's) of the split and ray modes")
    args, loop_args = parser.parse_known_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-placement-"))
    loop_args = [*loop_args, f"--warmup-steps={args.warmup_steps}"]
    rows = {}
    for mode in args.modes:
        for engines in [1] if mode == "colocated" else args.engines:
            name = mode if mode == "colocated" else f"{mode} x{engines}"
            print(f"=== {name}", flush=True)
            rows[name] = figures(run_mode(mode, engines, args.cpu, loop_args, work), args.warmup_steps)
    columns = list(next(iter(rows.values())))
    print("\n| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for mode, row in rows.items():
        print(f"| {mode} | " + " | ".join(f"{row[c]:,.3f}" if row[c] < 10 else f"{row[c]:,.0f}" for c in columns) + " |")
    print("(swap s: the in-process swap for colocated/split; for ray modes the whole broadcast, export included)")


if __name__ == "__main__":
    main()
