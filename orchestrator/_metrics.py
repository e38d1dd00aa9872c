"""Where metrics go: RUN/metrics.jsonl (always), Weights & Biases (when configured), a progress line."""

from __future__ import annotations

import json
import logging
import math
import textwrap
import time
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from marin_rl.errors import naming_full_disk

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends one JSON object per step to RUN/metrics.jsonl and mirrors it to W&B if enabled."""

    def __init__(self, run_dir: Path, wandb_config=None, config_dict: Mapping[str, Any] | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self._file = open(self.path, "a")
        self._wandb = None
        if wandb_config is not None and wandb_config.project:
            import wandb

            self._wandb = wandb.init(
                project=wandb_config.project,
                entity=wandb_config.entity,
                name=wandb_config.name or Path(run_dir).name,
                mode=wandb_config.mode,
                config=dict(config_dict or {}),
                resume="allow",
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        with naming_full_disk(self.path):  # a partial last line is what a killed run leaves too: resumes read past it
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """One record per step from RUN/metrics.jsonl (the last, for a run resumed before resumes set
    abandoned steps aside); a clear error when there is none."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}: is it a marin-rl run directory that has trained a step?")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write leaves a partial last line; anything else is real corruption.
            logger.warning("%s:%d is not valid JSON; skipped", path, number)
    return list({record.get("step"): record for record in records}.values())


class ProgressLine:
    """A live progress bar (on a terminal) and a summary line per `log_every` steps, both within the
    terminal's width (at least `MIN_WIDTH` columns); in a file or a pipe the summary keeps every part."""

    def __init__(self, max_steps: int, start_step: int, env_names: list[str], log_every: int = 1):
        self.console = Console()
        self.env_names = env_names
        self.log_every = log_every
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=True,
        )
        self._task = self._progress.add_task("train", total=max_steps, completed=start_step, status="waiting for rollouts")

    def __enter__(self) -> ProgressLine:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        self._progress.update(self._task, completed=step, status="")
        if step % self.log_every == 0:
            width = max(self.console.width, MIN_WIDTH) if self.console.is_terminal else None
            for line in summary_lines(step, metrics, self.env_names, width):
                self.console.print(line, highlight=False, soft_wrap=True)


MIN_WIDTH = 80


def summary_lines(step: int, metrics: Mapping[str, float], env_names: list[str], width: int | None = None) -> list[str]:
    """`step 12 | reward 0.53 | loss ... | kl ... | gen tok/s ...` from one step's metrics.

    With a `width`, the most useful parts that fit are kept (step and reward always), and with several
    envs their rewards go on a second line when they do not fit on the first.
    """
    rewards = [(env, metrics[f"batches/{env}/reward_mean"]) for env in env_names if f"batches/{env}/reward_mean" in metrics]
    parts: list[tuple[int, str]] = [(0, f"step {step}")]  # (priority: lower is kept longer, text)
    per_env = ", ".join(f"{env} {r:.2f}" for env, r in rewards) if len(rewards) > 1 else ""
    if rewards:
        used = [metrics.get(f"batches/{env}/rollouts_used", 1) for env, _ in rewards]
        mean = sum(r * n for (_, r), n in zip(rewards, used)) / max(1, sum(used))
        parts.append((0, f"reward {mean:.3f}" + (f" ({per_env})" if per_env else "")))
    for priority, key, label, fmt in (
        (1, "learner/loss", "loss", "{:.4f}"),
        (2, "learner/approx_kl", "kl", "{:.4f}"),
        (3, "throughput/generated_tokens_per_s", "gen tok/s", "{:,.0f}"),
        (4, "learner/tokens_per_s", "learner tok/s", "{:,.0f}"),
        (5, "time/wait_data_s", "wait", "{:.1f}s"),
        (6, "batch/staleness_mean", "staleness", "{:.2f}"),
    ):
        if key in metrics:
            parts.append((priority, f"{label} {fmt.format(metrics[key])}"))
    line = " | ".join(text for _, text in parts)
    if width is None or len(line) <= width:
        return [line]
    extra = []
    if per_env:  # the per-env rewards move to a line of their own
        parts[1] = (0, parts[1][1].split(" (")[0])
        extra = textwrap.wrap(f"rewards: {per_env}", width, subsequent_indent="  ")
    kept: set[int] = set()
    for i in sorted(range(len(parts)), key=lambda i: parts[i][0]):  # most useful first, while they fit
        if parts[i][0] == 0 or len(" | ".join(parts[j][1] for j in sorted(kept | {i}))) <= width:
            kept.add(i)
    return [" | ".join(parts[i][1] for i in sorted(kept)), *extra]
