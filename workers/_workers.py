"""Env workers: sample groups of rollouts and push them into their env's buffer.

All workers share one event loop on a background thread. Two ways to run:
- free-running (default): `replicas` asyncio tasks per env sample groups forever while the learner
  trains; a group that fails is counted and the worker goes on with the next problem after a backoff.
- deterministic (`fill`): the train loop asks for step k's groups once policy k is served;
  groups are drawn in a fixed order, retried as they were until they succeed, and added to the
  buffer in that order until every env can fill its share.

Every group's requests are seeded from (run seed, env, the problem's position in the env's stream).

Failures are classified (`_faults.classify`): transient ones (a server down or restarting) are retried
with backoff; permanent ones (a missing data file, a prompt longer than the row, a 400) stop the run
through `on_failure`. Each request goes to the least-loaded endpoint that serves this run's weights
(`LeastLoadedSampler`).

Several `EnvWorkers` (a Ray runtime's env-worker actors) share every env's problem stream through
`shard=(i, n)`: the i-th draws positions i, i + n, i + 2n, ...
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Mapping

from marin_rl.config import EvalConfig, TrainConfig
from marin_rl.envs import Env, OpenAISampler, Problem, ProblemStream, RolloutSettings, async_openai_client, evaluate, gather_all, sample_group
from marin_rl.errors import PermanentError
from marin_rl.replay import AlgorithmConfig, BatchCancelled, ReplayBuffer, TeacherConfig, effective_shares
from marin_rl.types import Rollout
from marin_rl.workers._endpoints import Endpoint, GatedSampler, LeastLoadedSampler, RetryingSampler, SeededSampler, derive_seed
from marin_rl.workers._faults import MAX_UNKNOWN_IN_A_ROW, RewardFailureWatch, ServerNotReady, classify, describe
from marin_rl.workers._sources import DemonstrationSampler, TeacherScorer

logger = logging.getLogger(__name__)

PROBLEM_POSITION_KEY = "problem_position"
"""Rollout metadata: the index of the rollout's problem in its env's problem stream."""

EVAL_ATTEMPTS = 5
"""Tries of one evaluation request that fails transiently before that env's evaluation is recorded as failed."""


@dataclass(frozen=True)
class WorkerSpec:
    """How one env's workers run (from its EnvConfig)."""

    replicas: int
    group_size: int
    settings: RolloutSettings
    """What its groups are sampled and scored with; rollouts capped at the batcher's row length."""
    max_buffered_tokens: int = 2**62
    """Pause while the buffer holds this many tokens that the next policy version still trains on
    (`ReplayBuffer.tokens_ahead`; rollouts further ahead would go stale)."""
    source: str = "policy"
    """Who writes the completions: `policy` (the servers), `teacher` (a frozen teacher server) or
    `dataset` (the problems' demonstrations)."""
    teacher: TeacherConfig | None = None
    """The frozen teacher server, for `source: teacher` or `score_with_teacher`."""
    score_with_teacher: bool = False
    """Ask the teacher for the logprob of every sampled token (on-policy distillation)."""
    eval: EvalConfig | None = None
    """Held-out evaluation settings (None: not evaluated)."""
    max_reward_failures: float = 0.5
    """Share of rollouts whose reward failed that stops the run (`RewardFailureWatch`)."""

    @staticmethod
    def for_algorithm(algorithm: AlgorithmConfig, **fields) -> WorkerSpec:
        """Source and scoring follow from the env's algorithm."""
        return WorkerSpec(
            source=algorithm.completion_source,
            teacher=algorithm.teacher,
            score_with_teacher=algorithm.needs_teacher_logprobs,
            **fields,
        )


def shard_start(position: int, shard: tuple[int, int]) -> int:
    """The first stream position >= `position` that belongs to shard `(i, n)` (is i mod n)."""
    index, count = shard
    return position + (index - position) % count


def worker_specs(config: TrainConfig, envs: Mapping[str, Env], *, replica_share: int = 1) -> dict[str, WorkerSpec]:
    """Each env's `WorkerSpec` from the run config and the env built from it; `replica_share` divides
    (rounding up) every env's replicas among that many `EnvWorkers` (a Ray runtime's env-worker actors)."""
    budget = config.batcher.num_rows * config.batcher.max_seq_len
    # Each env buffers up to max_buffered_batches of its share (an env with fraction 0 lives on the
    # remainder, so it gets an even share for this purpose).
    shares = effective_shares(config.fractions, list(config.fractions))
    buffered_share = {name: max(share, 1 / len(shares)) for name, share in shares.items()}
    return {
        e.name: WorkerSpec.for_algorithm(
            e.algorithm,
            replicas=-(-e.replicas // replica_share),
            group_size=e.group_size,
            settings=e.rollout_settings(envs[e.name], config.batcher.max_seq_len),
            max_buffered_tokens=int(config.max_buffered_batches * buffered_share[e.name] * budget),
            eval=e.eval,
            max_reward_failures=e.max_reward_failures,
        )
        for e in config.envs
    }


def _eval_metrics(metrics: dict[str, float], env: str, mode: str) -> dict[str, float]:
    """`eval/{env}/x` -> `eval/{env}/{mode}/x`, so greedy and sampled evals sit side by side."""
    prefix = f"eval/{env}/"
    return {prefix + mode + "/" + key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}


class EnvWorkers:
    """Samples every env's groups on a background event loop (see the module docstring)."""

    def __init__(
        self,
        envs: Mapping[str, Env],
        specs: Mapping[str, WorkerSpec],
        buffers: Mapping[str, ReplayBuffer],
        endpoints: list[Endpoint],
        *,
        seed: int = 0,
        max_backoff_s: float = 30.0,
        positions: Mapping[str, int] | None = None,
        on_failure: Callable[[PermanentError], None] | None = None,
        shard: tuple[int, int] = (0, 1),
    ):
        """`positions`: each env's problem-stream position to continue from (a checkpoint's).
        `on_failure` is called once, from the workers' thread, with the first permanent failure.
        `shard=(i, n)`: draw only the stream positions that are i mod n (the module docstring)."""
        if not endpoints:
            raise ValueError("EnvWorkers needs at least one endpoint")
        self.envs, self.specs, self.buffers, self.endpoints = dict(envs), dict(specs), dict(buffers), endpoints
        self.seed = seed
        self.max_backoff_s = max_backoff_s
        self._shard, self._shards = shard
        self.streams = {
            name: ProblemStream(env, seed=seed + index, position=shard_start((positions or {}).get(name, 0), shard))
            for index, (name, env) in enumerate(self.envs.items())
        }  # one per env, shared by its replicas
        self.failure: PermanentError | None = None
        self._on_failure = on_failure
        self._reward_watches = {name: RewardFailureWatch(name, spec.max_reward_failures) for name, spec in self.specs.items()}
        self._unknown_in_a_row: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()

    # ---- lifecycle ----

    def start(self, free_running: bool = True) -> EnvWorkers:
        """Start the event loop; with `free_running`, also the workers (else the loop waits for `fill`)."""
        self._thread = threading.Thread(target=self._run_loop, args=(free_running,), name="marin-rl-env-workers", daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every worker (requests in flight are abandoned) and close the envs."""
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("env workers did not stop within %.0fs", timeout)

    def positions(self) -> dict[str, int]:
        """Each env's problem-stream position (problems drawn so far), for checkpoints."""
        return {name: stream.position for name, stream in self.streams.items()}

    def _run_loop(self, free_running: bool) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main(free_running))
        finally:
            self._loop.close()

    async def _main(self, free_running: bool) -> None:
        self._stopping = asyncio.Event()
        clients = []  # over HTTP: the endpoints in other processes, teachers
        self._samplers = []
        for e in self.endpoints:
            if e.local is None:
                clients.append(async_openai_client(e.base_url, "EMPTY", max_retries=0, timeout=e.request_timeout_s))
            self._samplers.append(GatedSampler(e.local or OpenAISampler(clients[-1], e.model, server_id=e.server_id), e))
        self._router = LeastLoadedSampler(self._samplers)
        self._teachers: dict[str, tuple[OpenAISampler, TeacherScorer | None]] = {}
        for name, spec in self.specs.items():
            if spec.teacher is not None:
                teacher_client = async_openai_client(spec.teacher.base_url, spec.teacher.api_key, max_retries=0)
                clients.append(teacher_client)
                # A frozen teacher reports no useful version: its rollouts never age (algorithm.frozen_source).
                sampler = OpenAISampler(teacher_client, spec.teacher.model, server_id="teacher", policy_version=0)
                scorer = TeacherScorer(teacher_client, spec.teacher.model) if spec.score_with_teacher else None
                self._teachers[name] = (sampler, scorer)
        tasks = []
        if free_running:
            for name, spec in self.specs.items():
                for replica in range(spec.replicas):
                    tasks.append(asyncio.create_task(self._worker(name), name=f"{name}/{replica}"))
        self._ready.set()
        await self._stopping.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for env in self.envs.values():
            try:
                await env.aclose()
            except Exception:  # noqa: BLE001 - closing must not hide the run's outcome
                logger.exception("closing env %s failed", env.name)
            env.close_verifier_threads()
        for client in clients:
            await client.close()

    # ---- one group ----

    def _draw(self, name: str) -> tuple[int, Problem]:
        """The env's next problem of this shard and its position in the stream (kept in the rollouts' metadata)."""
        stream = self.streams[name]
        position = stream.position
        problem = next(stream)
        for _ in range(self._shards - 1):  # the other shards' positions
            next(stream)
        return position, problem

    async def _group(self, name: str, drawn: tuple[int, Problem]) -> list[Rollout]:
        env, spec = self.envs[name], self.specs[name]
        position, problem = drawn
        teacher, scorer = self._teachers.get(name, (None, None))
        if spec.source == "dataset":
            sampler = DemonstrationSampler(problem, env.tokenizer)
        else:
            sampler = teacher if spec.source == "teacher" else self._router
        # Seeded by the problem's position in the stream: unique in the run, resumes included, and the
        # same in every run with this seed (a deterministic run's samples depend on nothing else).
        sampler = SeededSampler(sampler, derive_seed(self.seed, name, position))
        rollouts = await sample_group(env, problem, sampler, spec.group_size, spec.settings)
        if scorer is not None:
            rollouts = await scorer.score(rollouts)
        self._unknown_in_a_row[name] = 0
        return [replace(r, metadata={**r.metadata, PROBLEM_POSITION_KEY: position}) for r in rollouts]

    def _note_failure(self, name: str, error: Exception) -> None:
        """Count a failed group; raise the `PermanentError` that stops the run if retrying cannot help."""
        self._count(f"workers/{name}/errors")
        fault = classify(error)
        if fault == "unknown":
            self._unknown_in_a_row[name] += 1
            if self._unknown_in_a_row[name] >= MAX_UNKNOWN_IN_A_ROW:
                raise PermanentError(f"env {name!r}: {MAX_UNKNOWN_IN_A_ROW} groups in a row failed, the last with {describe(error)}") from error
        if fault == "permanent" and isinstance(error, PermanentError):
            raise error
        if fault == "permanent":
            raise PermanentError(f"env {name!r}: {describe(error)}") from error
        if not isinstance(error, ServerNotReady):
            logger.warning("env %s: %s (retrying)", name, describe(error))

    def _fail(self, error: PermanentError) -> None:
        if self.failure is None:
            self.failure = error  # reported once, by whoever ends the run (train raises it)
            if self._on_failure is not None:
                self._on_failure(error)

    def _add(self, name: str, rollouts: list[Rollout]) -> None:
        """Buffer a group; too many failed rewards, or a disk too full for its rollouts, end the run
        (`self.failure`)."""
        try:
            accepted = self.buffers[name].add(rollouts)
            self._count(f"workers/{name}/groups")
            self._count(f"workers/{name}/rollouts_rejected", len(rollouts) - accepted)
            self._reward_watches[name].observe(rollouts)
        except PermanentError as failure:
            self._fail(failure)

    # ---- free-running ----

    async def _worker(self, name: str) -> None:
        spec, buffer = self.specs[name], self.buffers[name]
        backoff = 1.0
        # Checks `_stopping` too: Python 3.11's `asyncio.wait_for` can swallow a cancellation that
        # races with its result, and the worker must not sample on against stopped servers.
        while self.failure is None and not self._stopping.is_set():
            while buffer.tokens_ahead() >= spec.max_buffered_tokens:
                await asyncio.sleep(0.05)
            try:
                rollouts = await self._group(name, self._draw(name))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a worker must survive anything an env or server does
                try:
                    self._note_failure(name, e)
                except PermanentError as failure:
                    self._fail(failure)
                    return
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self.max_backoff_s)
                continue
            backoff = 1.0
            self._add(name, rollouts)

    # ---- deterministic ----

    def fill(self, short: Callable[[], list[str]], cancel: threading.Event | None = None) -> None:
        """Sample groups in a fixed order until `short()` (the envs that cannot fill their share of the
        batch) is empty. Raises the `PermanentError` that stops the run, and
        `BatchCancelled` when `cancel` is set while a group is being retried."""
        asyncio.run_coroutine_threadsafe(self._fill(short, cancel or threading.Event()), self._loop).result()

    async def _fill(self, short: Callable[[], list[str]], cancel: threading.Event) -> None:
        async def fill_env(name: str) -> None:
            replicas = self.specs[name].replicas
            while name in short():
                problems = [self._draw(name) for _ in range(replicas)]
                groups = await gather_all(self._group_retried(name, p, cancel) for p in problems)
                for rollouts in groups:  # in group order, whatever order they finished in
                    if name not in short():
                        break  # the rest of this wave is not needed (its problems stay drawn)
                    self._add(name, rollouts)
                    if self.failure is not None:
                        raise self.failure

        await gather_all(fill_env(name) for name in self.envs)

    async def _group_retried(self, name: str, drawn: tuple[int, Problem], cancel: threading.Event) -> list[Rollout]:
        backoff = 1.0
        while True:
            try:
                return await self._group(name, drawn)
            except Exception as e:  # noqa: BLE001 - retried with the same problem and seed, so the result is the same
                self._note_failure(name, e)
            if cancel.is_set():
                raise BatchCancelled(f"env {name!r}: stopped while retrying a group")
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.max_backoff_s)

    # ---- evaluation ----

    def evaluate(self, step: int = 0) -> dict[str, float]:
        """Evaluate every env's held-out problems with the current policy (blocks until done).

        Runs on the workers' event loop next to training's requests; eval rollouts are not trained on.
        A request that fails transiently is retried; an env whose evaluation still fails is recorded
        (`eval/{env}/failed`), never raised: evaluation does not end a run.
        """
        return asyncio.run_coroutine_threadsafe(self._evaluate_all(step), self._loop).result()

    async def _evaluate_all(self, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, env in self.envs.items():
            if self.specs[name].eval is None:
                continue
            sampler = RetryingSampler(self._router, max_backoff_s=self.max_backoff_s, attempts=EVAL_ATTEMPTS)
            sampler = SeededSampler(sampler, derive_seed(self.seed, name, "eval", step))
            try:
                metrics.update(await self._evaluate_env(name, env, sampler))
                metrics[f"eval/{name}/failed"] = 0.0
            except Exception as e:  # noqa: BLE001 - recorded: training goes on
                logger.warning("evaluation of env %s at step %d failed: %s", name, step, describe(e))
                metrics[f"eval/{name}/failed"] = 1.0
        return metrics

    async def _evaluate_env(self, name: str, env: Env, sampler) -> dict[str, float]:
        spec = self.specs[name]
        problems = env.eval_problems()
        if problems is None:
            return {}
        problems = list(problems)[: spec.eval.max_problems]
        metrics: dict[str, float] = {}
        if spec.eval.greedy:
            result = await evaluate(env, sampler, problems, settings=spec.settings.with_temperature(0.0))
            metrics.update(_eval_metrics(result.metrics(), name, "greedy"))
        if spec.eval.pass_at_k:
            n = spec.eval.samples or max(spec.eval.pass_at_k)
            sampled = spec.settings.with_temperature(spec.eval.temperature)
            result = await evaluate(env, sampler, problems, n=n, ks=spec.eval.pass_at_k, settings=sampled)
            metrics.update(_eval_metrics(result.metrics(), name, "sampled"))
        return metrics

    def _count(self, key: str, by: int = 1) -> None:
        with self._lock:
            self._counts[key] += by

    def metrics(self) -> dict[str, float]:
        """Cumulative worker counters plus each env's own (`envs/{name}/...`)."""
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
        for name, env in self.envs.items():
            out.setdefault(f"workers/{name}/errors", 0.0)
            out.update(env.metrics.as_dict())
        return out
