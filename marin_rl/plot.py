"""`marin-rl plot RUN`: PNG plots of a run's metrics.jsonl (reward, loss, KL, throughput, eval)."""

from __future__ import annotations

import re
from pathlib import Path

from marin_rl.orchestrator._metrics import read_metrics

# Figure name -> (title, [(metric pattern, label template)]); `{env}` matches one env name.
FIGURES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward": (
        "mean reward of new rollouts",
        [(r"replays/(?P<env>[^/]+)/reward/mean", "{env}")],
    ),
    "loss": (
        "learner loss",
        [(r"learner/loss", "loss"), (r"learner/pg_loss", "policy gradient"), (r"learner/ce_loss", "cross-entropy")],
    ),
    "kl": (
        "KL estimates",
        [(r"learner/approx_kl", "behaviour vs learner (k3)"), (r"learner/kl_ref", "learner vs reference")],
    ),
    "throughput": (
        "throughput (tokens/s)",
        [(r"learner/tokens_per_s", "learner"), (r"throughput/generated_tokens_per_s", "generated")],
    ),
    "token_share": (
        "share of batch tokens per env",
        [(r"batches/(?P<env>[^/]+)/frac_used", "{env}")],
    ),
    "eval": (
        "held-out evaluation",
        [(r"eval/(?P<env>[^/]+)/(?P<mode>greedy|sampled)/(?P<metric>reward/mean|pass@\d+)", "{env} {mode} {metric}")],
    ),
}


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> list[Path]:
    """Write one PNG per figure that has data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no records yet")
    out_dir = Path(output) if output else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, series_specs) in FIGURES.items():
        series: dict[str, tuple[list[int], list[float]]] = {}
        for pattern, label in series_specs:
            regex = re.compile(pattern + "$")
            for record in records:
                for key, value in record.items():
                    match = regex.match(key)
                    if match is None or value is None:
                        continue
                    steps, values = series.setdefault(label.format(**match.groupdict()), ([], []))
                    steps.append(record["step"])
                    values.append(value)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, (steps, values) in sorted(series.items()):
            ax.plot(steps, values, label=label, marker="." if len(steps) < 50 else None)
        ax.set_title(f"{title} - {Path(run_dir).name}")
        ax.set_xlabel("step (policy version)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
