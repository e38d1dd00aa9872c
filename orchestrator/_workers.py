"""Env workers: asyncio tasks that sample groups forever and push them into their env's buffer.

All workers share one event loop on a background thread, so generation goes on while the learner
trains. A worker that fails (server down, bad response, a bug in an env) logs, counts the error
and retries with exponential backoff; it never stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Mapping

from marin_rl.config import EvalConfig
from marin_rl.envs import Env, OpenAISampler, SamplingParams, cycle_problems, evaluate, sample_group
from marin_rl.orchestrator._sources import DemonstrationSampler, TeacherScorer
from marin_rl.replay import AlgorithmConfig, ReplayBuffer, TeacherConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server the workers sample from."""

    base_url: str
    model: str
    server_id: str
    request_timeout_s: float = 600.0


@dataclass(frozen=True)
class WorkerSpec:
    """How one env's workers run (from its EnvConfig)."""

    replicas: int
    group_size: int
    sampling: SamplingParams | None = None
    """None: the env's own sampling."""
    reward_weights: Mapping[str, float] = field(default_factory=dict)
    """Overrides of the env's reward weights."""
    max_turns: int | None = None
    verifier_timeout_s: float | None = None
    max_buffered_tokens: int = 2**62
    """Pause while the buffer holds this many tokens (rollouts further ahead would go stale)."""
    max_total_tokens: int | None = None
    """Cap on a rollout's length (the batcher's row length): turns are cut to fit."""
    source: str = "policy"
    """Who writes the completions: `policy` (the servers), `teacher` (a frozen teacher server) or
    `dataset` (the problems' demonstrations)."""
    teacher: TeacherConfig | None = None
    """The frozen teacher server, for `source: teacher` or `score_with_teacher`."""
    score_with_teacher: bool = False
    """Ask the teacher for the logprob of every sampled token (on-policy distillation)."""
    eval: EvalConfig | None = None
    """Held-out evaluation settings (None: not evaluated)."""

    @staticmethod
    def for_algorithm(algorithm: AlgorithmConfig, **fields) -> WorkerSpec:
        """Source and scoring follow from the env's algorithm."""
        return WorkerSpec(
            source=algorithm.completion_source,
            teacher=algorithm.teacher,
            score_with_teacher=algorithm.needs_teacher_logprobs,
            **fields,
        )


def _eval_metrics(metrics: dict[str, float], env: str, mode: str) -> dict[str, float]:
    """`eval/{env}/x` -> `eval/{env}/{mode}/x`, so greedy and sampled evals sit side by side."""
    prefix = f"eval/{env}/"
    return {prefix + mode + "/" + key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}


class EnvWorkers:
    """Runs `replicas` workers per env; replica i of every env samples from endpoint i mod N."""

    def __init__(
        self,
        envs: Mapping[str, Env],
        specs: Mapping[str, WorkerSpec],
        buffers: Mapping[str, ReplayBuffer],
        endpoints: list[Endpoint],
        *,
        seed: int = 0,
        max_backoff_s: float = 30.0,
    ):
        if not endpoints:
            raise ValueError("EnvWorkers needs at least one endpoint")
        self.envs, self.specs, self.buffers, self.endpoints = dict(envs), dict(specs), dict(buffers), endpoints
        self.seed = seed
        self.max_backoff_s = max_backoff_s
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()

    # ---- lifecycle ----

    def start(self) -> EnvWorkers:
        self._thread = threading.Thread(target=self._run_loop, name="marin-rl-env-workers", daemon=True)
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

    def _run_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        from openai import AsyncOpenAI

        self._stopping = asyncio.Event()
        clients = [AsyncOpenAI(base_url=e.base_url, api_key="EMPTY", max_retries=0, timeout=e.request_timeout_s) for e in self.endpoints]
        samplers = [OpenAISampler(c, e.model, server_id=e.server_id) for c, e in zip(clients, self.endpoints)]
        tasks = []
        for env_index, (name, env) in enumerate(self.envs.items()):
            spec = self.specs[name]
            problems = cycle_problems(env, seed=self.seed + env_index)  # one stream per env, shared by its replicas
            teacher_sampler = scorer = None
            if spec.teacher is not None:
                teacher_client = AsyncOpenAI(base_url=spec.teacher.base_url, api_key=spec.teacher.api_key, max_retries=0)
                clients.append(teacher_client)
                # A frozen teacher reports no useful version: its rollouts never age (algorithm.frozen_source).
                teacher_sampler = OpenAISampler(teacher_client, spec.teacher.model, server_id="teacher", policy_version=0)
                scorer = TeacherScorer(teacher_client, spec.teacher.model) if spec.score_with_teacher else None
            for replica in range(spec.replicas):
                policy_sampler = samplers[replica % len(samplers)]
                sampler = teacher_sampler if spec.source == "teacher" else policy_sampler
                tasks.append(asyncio.create_task(self._worker(name, env, problems, sampler, scorer), name=f"{name}/{replica}"))
        self._policy_sampler = samplers[0]
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
        for client in clients:
            await client.close()

    # ---- one worker ----

    async def _worker(self, name: str, env: Env, problems, sampler, scorer: TeacherScorer | None) -> None:
        spec, buffer = self.specs[name], self.buffers[name]
        backoff = 1.0
        while True:
            while buffer.size()[1] >= spec.max_buffered_tokens:
                await asyncio.sleep(0.05)
            try:
                problem = next(problems)
                rollouts = await sample_group(
                    env,
                    problem,
                    DemonstrationSampler(problem, env.tokenizer) if spec.source == "dataset" else sampler,
                    spec.group_size,
                    spec.sampling,
                    reward_weights=spec.reward_weights,
                    verifier_timeout_s=spec.verifier_timeout_s,
                    max_turns=spec.max_turns,
                    max_total_tokens=spec.max_total_tokens,
                )
                if scorer is not None:
                    rollouts = await scorer.score(rollouts)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a worker must survive anything an env or server does
                self._count(f"workers/{name}/errors")
                logger.warning("env %s worker: %s: %s (retrying in %.0fs)", name, type(e).__name__, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self.max_backoff_s)
                continue
            backoff = 1.0
            accepted = buffer.add(rollouts)
            self._count(f"workers/{name}/groups")
            self._count(f"workers/{name}/rollouts_rejected", len(rollouts) - accepted)

    # ---- evaluation ----

    def evaluate(self) -> dict[str, float]:
        """Evaluate every env's held-out problems with the current policy (blocks until done).

        Runs on the workers' event loop next to training's requests; eval rollouts are not trained on.
        """
        return asyncio.run_coroutine_threadsafe(self._evaluate_all(), self._loop).result()

    async def _evaluate_all(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, env in self.envs.items():
            spec = self.specs[name]
            problems = env.eval_problems() if spec.eval is not None else None
            if problems is None:
                continue
            problems = list(problems)[: spec.eval.max_problems]
            common = dict(
                reward_weights=spec.reward_weights,
                verifier_timeout_s=spec.verifier_timeout_s,
                max_turns=spec.max_turns,
                max_total_tokens=spec.max_total_tokens,
            )
            sampling = env.sampling.merged(spec.sampling)
            if spec.eval.greedy:
                result = await evaluate(env, self._policy_sampler, problems, sampling=replace(sampling, temperature=0.0), **common)
                metrics.update(_eval_metrics(result.metrics(), name, "greedy"))
            if spec.eval.pass_at_k:
                n = spec.eval.samples or max(spec.eval.pass_at_k)
                sampled = replace(sampling, temperature=spec.eval.temperature)
                result = await evaluate(env, self._policy_sampler, problems, n=n, ks=spec.eval.pass_at_k, sampling=sampled, **common)
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
