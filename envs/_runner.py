"""Running an env: `sample_group` for training, `evaluate` for held-out pass@k.

`sample_group` samples `n` rollouts of one problem (one request with `n` choices for the first
turn, then each conversation goes on alone), scores them and returns `Rollout`s sharing a
`group_id`. Everything the run config controls (sampling, reward weights, verifier timeout,
max turns) comes in one `RolloutSettings` (`resolve_settings`); the env's class attributes are the defaults.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from marin_rl.envs._chat import Transcript
from marin_rl.envs._env import Env
from marin_rl.envs._problems import Problem
from marin_rl.envs._rewards import EnvMetrics, score
from marin_rl.envs._sampling import Completion, Sampler, SamplingParams
from marin_rl.errors import ConfigError, PromptTooLong
from marin_rl.types import Rollout

T = TypeVar("T")

SOLVED = 1.0 - 1e-6
"""A rollout counts as solved for pass@k when its success reward reaches 1."""


@dataclass(frozen=True)
class RolloutSettings:
    """What a group of rollouts is sampled and scored with, resolved from the run config and env."""

    sampling: SamplingParams
    reward_weights: dict[str, float]
    """Every reward of the env -> its weight."""
    verifier_timeout_s: float
    max_turns: int
    max_total_tokens: int | None = None
    """Longest rollout in tokens (prompt and all turns), e.g. the learner's row length; None: no cap."""

    def turn_sampling(self, prompt_len: int) -> SamplingParams | None:
        """Sampling for a turn after `prompt_len` tokens: `max_tokens` cut to the room left; None if none is."""
        if self.max_total_tokens is None:
            return self.sampling
        room = self.max_total_tokens - prompt_len
        if room < 1:
            return None
        return self.sampling if room >= self.sampling.max_tokens else replace(self.sampling, max_tokens=room)

    def with_temperature(self, temperature: float) -> RolloutSettings:
        return replace(self, sampling=replace(self.sampling, temperature=temperature))


def resolve_settings(
    env: Env,
    sampling: SamplingParams | None = None,
    *,
    reward_weights: Mapping[str, float] | None = None,
    verifier_timeout_s: float | None = None,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
) -> RolloutSettings:
    """Run-config values where given, else the env's defaults."""
    weights = env.default_reward_weights()
    unknown = set(reward_weights or {}) - set(weights)
    if unknown:
        raise ConfigError(f"env {env.name!r}: reward_weights names unknown rewards {sorted(unknown)}; has {sorted(weights)}")
    weights.update({k: float(v) for k, v in (reward_weights or {}).items()})
    turns = env.max_turns if max_turns is None else max_turns
    if turns < 1:
        raise ConfigError(f"env {env.name!r}: max_turns must be >= 1, got {turns}")
    timeout = env.verifier_timeout_s if verifier_timeout_s is None else verifier_timeout_s
    if not timeout > 0:
        raise ConfigError(f"env {env.name!r}: verifier_timeout_s must be > 0, got {timeout}")
    if max_total_tokens is not None and max_total_tokens < 2:
        raise ConfigError(f"env {env.name!r}: max_total_tokens must be >= 2, got {max_total_tokens}")
    return RolloutSettings(env.sampling.merged(sampling), weights, float(timeout), turns, max_total_tokens)


async def sample_group(
    env: Env,
    problem: Problem,
    sampler: Sampler,
    n: int,
    settings: RolloutSettings | None = None,
    *,
    metrics: EnvMetrics | None = None,
) -> list[Rollout]:
    """`n` scored rollouts of `problem`, sharing one `group_id`, sampled with `settings` (default: the
    env's, `resolve_settings(env)`). Counts go to `metrics` (default `env.metrics`).

    With `settings.max_total_tokens`, no rollout grows past it: a turn's `max_tokens` is cut to the
    room left and a conversation with no room left ends (truncated); a prompt that alone is too long
    raises `PromptTooLong` (retrying cannot help).
    """
    if n < 1:
        raise ValueError(f"sample_group: n must be >= 1, got {n}")
    settings = resolve_settings(env) if settings is None else settings
    metrics = env.metrics if metrics is None else metrics
    rollouts = await env.sample_rollouts(problem, sampler, n, settings, metrics)
    metrics.increment("groups")
    metrics.increment("rollouts", len(rollouts))
    metrics.increment("truncated_rollouts", sum(r.is_truncated for r in rollouts))
    return rollouts


async def run_turns(
    env: Env, problem: Problem, sampler: Sampler, n: int, settings: RolloutSettings, metrics: EnvMetrics
) -> list[Rollout]:
    """The default loop behind `Env.sample_rollouts`: sample, `interact`, repeat; then score."""
    prompt = Transcript(env.tokenizer, env.build_messages(problem))
    sampling = settings.turn_sampling(len(prompt.token_ids))
    if sampling is None:
        raise PromptTooLong(
            f"env {env.name!r}: the prompt of problem {problem.id!r} has {len(prompt.token_ids)} tokens, "
            f"no room left under max_total_tokens={settings.max_total_tokens} (raise batcher.max_seq_len or "
            "drop such problems from the data)"
        )
    first = await sampler.sample(prompt.token_ids, n, sampling)
    if len(first) != n:
        raise RuntimeError(f"env {env.name!r}: sampler returned {len(first)} completions, asked for {n}")
    group_id = uuid.uuid4().hex
    return await gather_all(
        _one_rollout(env, problem, sampler.fork("rollout", i), prompt.copy(), c, settings, metrics, group_id)
        for i, c in enumerate(first)
    )


async def gather_all(coroutines: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather`, but one failure cancels the rest instead of leaving them sampling unseen."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        # Let them unwind (close their connections) before the caller's own cleanup runs.
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _one_rollout(
    env: Env,
    problem: Problem,
    sampler: Sampler,
    transcript: Transcript,
    completion: Completion,
    settings: RolloutSettings,
    metrics: EnvMetrics,
    group_id: str,
) -> Rollout:
    state: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    while True:
        transcript.add_completion(completion)
        if completion.finish_reason == "length" and env.length_ends_rollout:
            stop_reason = "length"
            break
        if transcript.num_assistant_turns >= settings.max_turns:
            stop_reason = "max_turns"
            break
        try:
            new_messages = await env.interact(transcript.messages, problem, state)
        except Exception as e:  # noqa: BLE001 - a failing tool ends this rollout, not the run
            metrics.increment("interact_errors")
            metadata["interact_error"] = f"{type(e).__name__}: {e}"
            stop_reason = "interact_error"
            break
        if not new_messages:
            stop_reason = "env"
            break
        if not isinstance(new_messages, list):
            raise TypeError(
                f"env {env.name!r}: interact must return a list of messages or None, got {type(new_messages).__name__}"
            )
        extended = transcript.copy()
        extended.add_messages(new_messages)
        sampling = settings.turn_sampling(len(extended.token_ids))
        if sampling is None:  # the new messages leave no room: end on the last assistant turn
            stop_reason = "max_total_tokens"
            break
        transcript = extended
        [completion] = await sampler.sample(transcript.token_ids, 1, sampling)
    messages = transcript.messages
    scores = await score(
        {name: (fn, settings.reward_weights[name]) for name, (fn, _) in env.reward_functions().items()},
        {
            "problem": problem,
            "answer": problem.answer,
            "completion": messages[-1]["content"],
            "messages": messages,
            "state": state,
        },
        timeout_s=settings.verifier_timeout_s,
        metrics=metrics,
        threads=env.verifier_pool,
    )
    metadata.update(answer=_jsonable(problem.answer), stop_reason=stop_reason, num_turns=transcript.num_assistant_turns)
    if scores.errors:
        metadata["reward_errors"] = scores.errors
    return Rollout(
        environment=env.name,
        problem_id=problem.id,
        rollout_uid=uuid.uuid4().hex,
        group_id=group_id,
        turns=transcript.turns(),
        rewards=scores.rewards,
        reward=scores.reward,
        is_truncated=stop_reason in ("length", "max_total_tokens"),
        metadata=metadata,
    )


def _jsonable(value: Any) -> Any:
    # Rollout metadata must be JSON-serialisable; answers are usually plain, sometimes not.
    return json.loads(json.dumps(value, default=str))


# --- evaluation ---------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def is_solved(env: Env, rollout: Rollout) -> bool:
    value = rollout.rewards[env.success_reward] if env.success_reward is not None else rollout.reward
    return value >= SOLVED


@dataclass(frozen=True)
class EvalResult:
    env: str
    num_problems: int
    samples_per_problem: int
    mean_reward: float
    reward_means: dict[str, float]
    pass_at_k: dict[int, float]
    counters: dict[str, float]
    """The eval's own `EnvMetrics` (verifier errors, timeouts, ...), kept apart from training's."""
    rollouts: tuple[Rollout, ...]

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/{self.env}/reward/mean": self.mean_reward}
        out.update({f"{prefix}/{self.env}/pass@{k}": v for k, v in self.pass_at_k.items()})
        out.update({f"{prefix}/{self.env}/rewards/{name}/mean": v for name, v in self.reward_means.items()})
        out.update({f"{prefix}/{key.removeprefix('envs/')}": v for key, v in self.counters.items()})
        return out


async def evaluate(
    env: Env,
    sampler: Sampler,
    problems: Iterable[Problem] | None = None,
    *,
    n: int = 1,
    ks: Sequence[int] = (1,),
    settings: RolloutSettings | None = None,
    max_concurrency: int = 8,
) -> EvalResult:
    """pass@k and mean rewards over held-out problems (default `env.eval_problems()`), sampled with
    `settings` (default: the env's, greedy)."""
    if problems is None:
        problems = env.eval_problems()
        if problems is None:
            raise ValueError(f"env {env.name!r} has no eval_problems(); pass problems=")
    problems = list(problems)
    if not problems:
        raise ValueError(f"env {env.name!r}: no problems to evaluate")
    if max(ks) > n:
        raise ValueError(f"evaluate: pass@{max(ks)} needs n >= {max(ks)} samples per problem, got n={n}")
    settings = resolve_settings(env, replace(env.sampling, temperature=0.0)) if settings is None else settings
    metrics = EnvMetrics(env.name)
    gate = asyncio.Semaphore(max_concurrency)

    async def one(index: int, problem: Problem) -> list[Rollout]:
        async with gate:
            return await sample_group(
                env,
                problem,
                sampler.fork("problem", index),  # seeds that do not depend on which problem starts first
                n,
                settings,
                metrics=metrics,
            )

    groups = await gather_all(one(i, p) for i, p in enumerate(problems))
    rollouts = [r for group in groups for r in group]
    names = rollouts[0].rewards.keys()
    return EvalResult(
        env=env.name,
        num_problems=len(problems),
        samples_per_problem=n,
        mean_reward=float(np.mean([r.reward for r in rollouts])),
        reward_means={name: float(np.mean([r.rewards[name] for r in rollouts])) for name in names},
        pass_at_k={
            k: float(np.mean([pass_at_k(n, sum(is_solved(env, r) for r in group), k) for group in groups])) for k in ks
        },
        counters=metrics.as_dict(),
        rollouts=tuple(rollouts),
    )
