"""`marin-rl plot RUN`: PNG plots of a run's metrics.jsonl.

One figure per topic (reward, loss, KL, entropy, throughput, token share, eval), each quantity in
a panel of its own so that lines of different scales never hide one another, and one figure per env
(its rewards, entropy, truncation and evaluation side by side).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from marin_rl.orchestrator import read_metrics

ENV = r"(?P<env>[^/]+)"
LINE_STYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[tuple[str, str], ...]
    """(metric pattern, label template); named groups of the pattern fill the label."""
    skip_if_zero: bool = False
    """Leave the panel out when every value is 0 (a loss part the run does not use)."""


FIGURES: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "reward": ("mean reward of new rollouts", (Panel("reward", ((rf"replays/{ENV}/reward/mean", "{env}"),)),)),
    "loss": (
        "learner loss and its parts",
        (
            Panel("total loss", (("learner/loss", "loss"),)),
            Panel("policy gradient", (("learner/pg_loss", "pg_loss"),), skip_if_zero=True),
            Panel("cross-entropy (sft)", (("learner/ce_loss", "ce_loss"),), skip_if_zero=True),
            Panel("KL to reference", (("learner/kl_loss", "kl_loss"),), skip_if_zero=True),
        ),
    ),
    "kl": (
        "KL estimates",
        (Panel("KL", (("learner/approx_kl", "behaviour vs learner (k3)"), ("learner/kl_ref", "learner vs reference"))),),
    ),
    "entropy": (
        "entropy (a collapse to one answer shows here first)",
        (
            Panel("learner, per token of the batch", (("learner/entropy", "learner"),)),
            Panel("-log p of sampled tokens, per env", ((rf"replays/{ENV}/sampled_entropy", "{env}"),)),
        ),
    ),
    "throughput": (
        "throughput",
        (
            Panel("learner tokens/s", (("learner/tokens_per_s", "learner"),)),
            Panel("generated tokens/s", (("throughput/generated_tokens_per_s", "generated"),)),
        ),
    ),
    "token_share": ("share of batch tokens per env", (Panel("share", ((rf"batches/{ENV}/frac_used", "{env}"),)),)),
    "eval": (
        "held-out evaluation",
        (Panel("eval", ((rf"eval/{ENV}/(?P<mode>greedy|sampled)/(?P<metric>reward/mean|pass@\d+)", "{env} {mode} {metric}"),)),),
    ),
}

ENV_PANELS: tuple[Panel, ...] = (
    Panel("reward", (("replays/{env}/reward/mean", "reward"), (r"replays/{env}/rewards/(?P<name>[^/]+)/mean", "{name}"))),
    Panel("-log p of sampled tokens", (("replays/{env}/sampled_entropy", "entropy estimate"),)),
    Panel("fractions", (("replays/{env}/frac_truncated", "truncated"), ("replays/{env}/frac_filtered", "filtered"))),
    Panel("eval", ((r"eval/{env}/(?P<mode>greedy|sampled)/(?P<metric>reward/mean|pass@\d+)", "{mode} {metric}"),)),
)


def collect(records: list[dict], panel: Panel, env: str | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """label -> (steps, values) of every metric the panel's patterns match (for one env if given)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for pattern, label in panel.series:
        regex = re.compile((pattern.replace("{env}", re.escape(env)) if env else pattern) + "$")
        for record in records:
            for key, value in record.items():
                match = regex.match(key)
                if match is None or value is None:
                    continue
                steps, values = series.setdefault(label.format(**match.groupdict()), ([], []))
                steps.append(record["step"])
                values.append(value)
    if panel.skip_if_zero and all(v == 0 for _, values in series.values() for v in values):
        return {}
    return series


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> list[Path]:
    """Write one PNG per figure that has data, and one per env; returns their paths."""
    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no records yet")
    out_dir = Path(output) if output else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    run_name = Path(run_dir).resolve().name
    written = []
    for name, (title, panels) in FIGURES.items():
        path = _figure(out_dir / f"{name}.png", f"{title} - {run_name}", [(p.title, collect(records, p)) for p in panels])
        written += [path] if path else []
    envs = sorted({m.group("env") for r in records for k in r if (m := re.match(rf"replays/{ENV}/reward/mean$", k))})
    for env in envs:
        panels = [(p.title, collect(records, p, env)) for p in ENV_PANELS]
        path = _figure(out_dir / f"env_{env}.png", f"env {env} - {run_name}", panels)
        written += [path] if path else []
    return written


def _figure(path: Path, title: str, panels: list[tuple[str, dict]]) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, series) for name, series in panels if series]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.2 + 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, series) in zip(axes[:, 0], panels):
        for i, (label, (steps, values)) in enumerate(sorted(series.items())):
            # Sparse series (evaluations every few steps) get visible points; a line style per series
            # keeps lines that coincide (a reward and its only part) both visible.
            style = LINE_STYLES[i % len(LINE_STYLES)]
            ax.plot(steps, values, style, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(name, fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step (policy version)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
