"""Which run-time failures are worth retrying.

- transient: a server is down, restarting, overloaded or slow (connection refused or reset, a timeout,
  HTTP 5xx or 429), or not yet serving this run's weights. Retried with backoff: the run goes on.
- permanent: retrying gives the same answer: a `PermanentError` (a missing data file, a prompt longer
  than the row), a `ConfigError`, a 4xx that says the request itself is wrong (a 400 is never
  retried), an answer the sampler cannot use. The run stops with one line, after a checkpoint.
- unknown: anything else, usually an env's own bug with one problem. Retried; an env whose groups fail
  this way `MAX_UNKNOWN_IN_A_ROW` times in a row with no success in between stops the run.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import httpx
import tenacity

from marin_rl.envs import SamplerError
from marin_rl.errors import ConfigError, PermanentError
from marin_rl.server import ApiError

logger = logging.getLogger(__name__)

Fault = Literal["transient", "permanent", "unknown"]

MAX_UNKNOWN_IN_A_ROW = 20
"""Consecutive unclassified failures of one env's groups that stop the run (nothing would ever train)."""

_RETRIED_STATUSES = (408, 429)


class ServerNotReady(Exception):
    """No server that serves this run's weights can take the request now (all down or restarting)."""


def classify(error: BaseException) -> Fault:
    if isinstance(error, (PermanentError, ConfigError, SamplerError, FileNotFoundError)):
        return "permanent"
    # openai's errors exist only where something imported it (over HTTP); a run whose workers all sample
    # in process never does, and importing it here would add 1.1 s to start-up on a 2-core CPU.
    openai = sys.modules.get("openai")
    if openai is not None and isinstance(error, openai.APIStatusError):
        status = error.status_code
    elif isinstance(error, ApiError):  # from the in-process sampler
        status = error.status
    else:
        status = None
    if status is not None:
        return "transient" if status >= 500 or status in _RETRIED_STATUSES else "permanent"
    connection_errors = (httpx.TransportError, ConnectionError, TimeoutError, ServerNotReady)
    if isinstance(error, connection_errors) or (openai is not None and isinstance(error, openai.APIConnectionError)):
        return "transient"
    return "unknown"


def describe(error: BaseException) -> str:
    """One line: the error's type and message (an openai error's message already names the status)."""
    return f"{type(error).__name__}: {error}"


def retry_transient(*, max_backoff_s: float, attempts: int | None = None) -> tenacity.AsyncRetrying:
    """Retries of transient failures (1, 2, 4 ... s, at most `max_backoff_s`); others are raised at once.
    `attempts` None retries until it succeeds or fails otherwise."""
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(lambda e: classify(e) == "transient"),
        wait=tenacity.wait_exponential(multiplier=1, max=max_backoff_s),
        stop=tenacity.stop_never if attempts is None else tenacity.stop_after_attempt(attempts),
        before_sleep=lambda state: logger.warning(
            "attempt %d failed (%s); retrying", state.attempt_number, describe(state.outcome.exception())
        ),
        reraise=True,
    )


REWARD_FAILURE_WINDOW = 64
"""Rollouts (whole groups, at least this many) over which an env's share of failed rewards is judged."""
REWARD_FAILURE_WARN_SHARE = 0.01
"""Share of failed rewards in a window that prints a warning (again each time the share doubles)."""


class RewardFailureWatch:
    """One env's rollouts whose reward failed (raised, timed out, was not a finite number: they score 0).

    Judged over windows of at least `window` rollouts: past `REWARD_FAILURE_WARN_SHARE` a one-line
    warning, past `max_share` a `PermanentError` (training on zeros teaches nothing)."""

    def __init__(self, env: str, max_share: float, window: int = REWARD_FAILURE_WINDOW):
        self.env, self.max_share, self.window = env, max_share, window
        self._rollouts = self._failed = 0
        self._example: str | None = None
        self._warned_share = 0.0

    def observe(self, rollouts: list) -> None:
        """Count a group's rollouts; raises `PermanentError` when a full window fails past `max_share`."""
        for rollout in rollouts:
            errors = rollout.metadata.get("reward_errors")
            self._rollouts += 1
            if errors:
                self._failed += 1
                self._example = self._example or "; ".join(f"{name}: {text}" for name, text in errors.items())
        if self._rollouts < self.window:
            return
        rollouts_seen, failed, example = self._rollouts, self._failed, self._example
        self._rollouts = self._failed = 0
        self._example = None
        share = failed / rollouts_seen
        what = f"env {self.env!r}: rewards failed for {failed} of the last {rollouts_seen} rollouts ({share:.1%}; {example})"
        if share > self.max_share:
            raise PermanentError(
                f"{what}, more than envs[{self.env}].max_reward_failures = {self.max_share:g}: stopped rather than train on zeros"
            )
        if share > REWARD_FAILURE_WARN_SHARE and share >= 2 * self._warned_share:
            self._warned_share = share
            logger.warning("%s; they score 0", what)
