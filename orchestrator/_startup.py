"""Seconds from launch to the end of step 1, by phase: the line `train` prints after its first step."""

from __future__ import annotations

import os
import time
from pathlib import Path


def seconds_since_launch() -> float | None:
    """This process's age, from Linux's /proc; None where it cannot be read."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Started once the run's modules are imported; `mark(phase)` ends a phase. `imports` is launch to
    then, less the checks (which `check_run` times)."""

    def __init__(self, checks_seconds: float):
        launched = seconds_since_launch()
        self.phases: dict[str, float] = {}
        if launched is not None:
            self.phases["imports"] = max(0.0, launched - checks_seconds)
        self.phases["checks"] = checks_seconds
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        out = {f"startup/{phase.replace(' ', '_')}_s": seconds for phase, seconds in self.phases.items()}
        out["startup/total_s"] = sum(self.phases.values())
        return out

    def line(self, step: int) -> str:
        """`start-up: 9.8 s to the end of step 1 (imports 3.1 s, checks 0.4 s, model 1.2 s, ...)`."""
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases.items())
        return f"start-up: {sum(self.phases.values()):.1f} s to the end of step {step} ({parts})"
