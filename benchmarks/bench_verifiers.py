"""A verifiers taskset against the same task as a native env: seconds per step and steps to a reward.

The quickstart's config and task (`3+1=` -> `4`), once with the native `toy_addition` env and once
with `tests/verifiers_envs/marin_vf_addition.py` (the task as a verifiers taskset, `type: verifiers`),
for each `--seed`; prints each run's median step, its wait for rollouts, and the step at which the
5-step mean reward first reaches `--target`, then the medians over seeds.

    python benchmarks/bench_verifiers.py --seeds 0 1 2 --steps 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERIFIERS_ENV = {
    "name": "addition",
    "type": "verifiers",
    "args": {"taskset": "marin_vf_addition"},
}


def run(kind: str, seed: int, steps: int) -> dict:
    from marin_rl.config import load_config
    from marin_rl.orchestrator import train

    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-vf-{kind}-")) / "run"
    overrides = [f"--run_dir={run_dir}", f"--max_steps={steps}", f"--seed={seed}", "--checkpoint_every=1000000"]
    if kind == "verifiers":
        overrides += [f"--envs.addition.{key}={json.dumps(value)}" for key, value in VERIFIERS_ENV.items() if key != "name"]
    train(load_config(ROOT / "configs" / "quickstart.yaml", overrides))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_to(rewards: list[float], target: float) -> int | None:
    return next((end for end in range(5, len(rewards) + 1) if statistics.mean(rewards[end - 5 : end]) >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--target", type=float, default=0.8)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "verifiers_envs"))
    summary: dict[str, list] = {"native": [], "verifiers": []}
    for seed in args.seeds:
        for kind in summary:
            records = run(kind, seed, args.steps)
            steady = records[2:]
            step = statistics.median(r["time/step_s"] for r in steady)
            wait = statistics.median(r["time/wait_data_s"] for r in steady)
            reached = steps_to([r["batches/addition/reward_mean"] for r in records], args.target)
            summary[kind].append((step, reached))
            print(f"seed {seed} {kind}: {step:.3f} s/step ({wait:.3f} s waiting for rollouts); {args.target} at step {reached}", flush=True)
    for kind, rows in summary.items():
        reached = [r for _, r in rows if r is not None]
        print(
            f"{kind}: median {statistics.median(s for s, _ in rows):.3f} s/step; {args.target} reached in {len(reached)} of "
            f"{len(rows)} seeds, median step {statistics.median(reached) if reached else None}"
        )


if __name__ == "__main__":
    main()
