"""A run's lifecycle: periodic work as hooks registered with their period (as Levanter's trainer's
`add_hook(fn, every=N)`), and a shut-down that closes what start-up opened, last opened first."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

from marin_rl.errors import DiskFull

logger = logging.getLogger(__name__)

# When in a step a hook runs, in this order.
LEARNED = "learned"
"""Right after the optimizer step, still holding the device (the broadcast: servers sample the new policy)."""
MEASURED = "measured"
"""Adds to the step's metrics (the parts' counters, an evaluation)."""
LOGGED = "logged"
"""Writes the step's metrics line."""
PERSISTED = "persisted"
"""After the line is written, holding the device (checkpoints, exports): a checkpoint never runs ahead of
the metrics lines, so a resumed run has a line for every step."""
PHASES = (LEARNED, MEASURED, LOGGED, PERSISTED)


@dataclass
class StepInfo:
    """What the step made, handed to each hook; `metrics` is the step's line, which hooks add to."""

    step: int
    batch: object
    learner_metrics: dict[str, float]
    seconds: dict[str, float]
    """`wait_data`, `learner`, `broadcast`, `step` (wall), filled in as the step goes."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Hook:
    fn: Callable[[StepInfo], None]
    every: int
    phase: str


class Hooks:
    def __init__(self):
        self._hooks: list[Hook] = []

    def add(self, fn: Callable[[StepInfo], None], *, every: int | None, phase: str) -> None:
        """Run `fn(info)` after every `every`-th step (0 or None: never), in `phase`, after the hooks added
        before it."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if every is not None and every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        if every:
            self._hooks.append(Hook(fn, every, phase))

    def run(self, phase: str, info: StepInfo) -> None:
        for hook in self._hooks:
            if hook.phase == phase and info.step % hook.every == 0:
                hook.fn(info)


class Shutdown(contextlib.AbstractContextManager):
    """Closes what start-up opened, last opened first, each even if another fails (a full disk fails
    every write). The run's own error, if any, is the one raised; errors while closing are logged in
    one line each then, else the first is in `errors` for the caller to raise."""

    def __init__(self):
        self._stack = contextlib.ExitStack()
        self.errors: list[Exception] = []
        self.ended_by: BaseException | None = None
        """What ended the run: its exception, or a second Ctrl-C while closing."""

    def close_later(self, close: Callable[[], None]) -> None:
        self._stack.callback(self._close, close)

    def enter_context(self, context):
        """Enter `context` now, exit it with the rest."""
        return self._stack.enter_context(context)

    def _close(self, close: Callable[[], None]) -> None:
        try:
            close()
        except KeyboardInterrupt as e:  # a second Ctrl-C while closing: close the rest anyway, then stop
            self.ended_by = e
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)
            if self.ended_by is not None:  # a full disk fails every write: said once, by the run's error
                level = logging.INFO if isinstance(e, DiskFull) and isinstance(self.ended_by, DiskFull) else logging.WARNING
                logger.log(level, "while stopping, %s failed too: %s", getattr(close, "__qualname__", close), " ".join(str(e).split()))

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self.ended_by = exc
        self._stack.close()
        if isinstance(self.ended_by, KeyboardInterrupt) and self.ended_by is not exc:
            raise self.ended_by
        return False
