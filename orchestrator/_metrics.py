"""Where metrics go: RUN/metrics.jsonl (always), Weights & Biases (when configured), a progress line."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

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
    """A live progress bar (on a terminal) and a one-line summary every `log_every` steps."""

    def __init__(self, max_steps: int, start_step: int, env_names: list[str], log_every: int = 1):
        self.console = Console()
        self.env_names = env_names
        self.log_every = log_every
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
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
        line = summary_line(step, metrics, self.env_names)
        self._progress.update(self._task, completed=step, status=line.split(" | ", 1)[-1])
        if step % self.log_every == 0:
            self.console.print(line, highlight=False, soft_wrap=True)


def summary_line(step: int, metrics: Mapping[str, float], env_names: list[str]) -> str:
    """`step 12 | reward 0.53 | loss ... | tok/s ... | staleness ...` from one step's metrics."""
    rewards = [(env, metrics.get(f"batches/{env}/reward_mean")) for env in env_names]
    shown = [(env, r) for env, r in rewards if r is not None]
    parts = [f"step {step}"]
    if shown:
        mean = sum(r * metrics.get(f"batches/{env}/rollouts_used", 1) for env, r in shown) / max(
            1, sum(metrics.get(f"batches/{env}/rollouts_used", 1) for env, _ in shown)
        )
        per_env = f" ({', '.join(f'{env} {r:.2f}' for env, r in shown)})" if len(shown) > 1 else ""
        parts.append(f"reward {mean:.3f}{per_env}")
    for key, label, fmt in (
        ("learner/loss", "loss", "{:.4f}"),
        ("learner/approx_kl", "kl", "{:.4f}"),
        ("learner/tokens_per_s", "learner tok/s", "{:,.0f}"),
        ("throughput/generated_tokens_per_s", "gen tok/s", "{:,.0f}"),
        ("batch/staleness_mean", "staleness", "{:.2f}"),
        ("time/wait_data_s", "wait", "{:.1f}s"),
    ):
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)
