"""Run a `verifiers` (0.4, v1 API) environment against our servers, token-exact.

What runs is verifiers' own episode (`vf.Env.run_episode`: the env's `run()` driving its agents,
each agent's rollout lifecycle with task setup, `@stop`/`@intercept` hooks, tool servers, finalize,
`@reward` scoring, the `Trace`, then the env's `finalize()`), through its public API, with two
pieces of ours plugged in where verifiers takes plugins:

- the model endpoint (`_verifiers_endpoint`): every agent's model calls reach it through verifiers'
  interception server as the run's OpenAI-compatible endpoint; it renders each conversation with
  the policy tokenizer (`Transcript`), samples through our `Sampler` and parses tool calls in the
  model family's format, so every assistant turn keeps its sampled ids and logprobs;
- the harness (`_verifiers_harness`): verifiers' `null` chat loop (chat plus the task's MCP tools)
  as an in-process coroutine. Seats with no harness or `null` get it; harnesses that run their own
  program (bash, codex, ...) are refused.

Agents run in the subprocess runtime (tool servers verifiers starts itself as local processes);
remote and container runtimes are refused. Every trainable agent's trace becomes a `Rollout`.
Scoring failures (a reward that raises, times out or returns NaN) give reward 0 with the error
recorded; any other failure of an episode raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

from marin_rl.envs._env import Env, importable_from_cwd, register_env
from marin_rl.envs._optional import import_optional
from marin_rl.envs._problems import Problem
from marin_rl.envs._rewards import EnvMetrics
from marin_rl.envs._runner import RolloutSettings, gather_all
from marin_rl.envs._sampling import Sampler
from marin_rl.envs._tool_calls import resolve_tool_call_format
from marin_rl.envs._verifiers_endpoint import ChatEndpoint, ChatSessions, Session
from marin_rl.errors import ConfigError
from marin_rl.types import Rollout

VERIFIERS_VERSION = "0.4.0"
_IN_PROCESS_HARNESSES = (None, "null")
"""Harness ids our in-process chat harness stands in for (None: a seat left to verifiers' default,
`bash`, which would hand the model a shell; marin-rl runs no model-written code)."""


def _vf():
    _cache_pydantic_default_factory_check()
    return import_optional("verifiers.v1", "verifiers", "verifiers")


@functools.cache
def _cache_pydantic_default_factory_check() -> None:
    """pydantic 2.14 inspects a field's default factory's signature (`inspect.signature`, which parses the
    text signature of a builtin like `list`) every time `model_construct` fills the field; verifiers'
    message graph constructs a few models per turn: 70% of a single-turn rollout's time here. The answer
    depends on the factory alone, so it is kept."""
    from pydantic._internal import _fields

    check = _fields.takes_validated_data_argument
    cached = functools.cache(check)

    def takes_validated_data_argument(default_factory):
        try:
            return cached(default_factory)
        except TypeError:  # an unhashable factory
            return check(default_factory)

    _fields.takes_validated_data_argument = takes_validated_data_argument


@register_env("verifiers")
class VerifiersEnv(Env):
    """A verifiers environment: an installed taskset (`taskset: gsm8k-v1`, the id `vf-eval` takes),
    optionally paired with an env (`env: user-sim`; default: the taskset's own or single-agent).
    `taskset_args` / `env_args` are their config fields. The tasks' `@reward` functions and weights
    score the rollouts (the run config's `reward_weights` override the weights)."""

    max_turns = 32

    def __init__(
        self,
        taskset: str,
        taskset_args: Mapping[str, Any] | None = None,
        env: str = "",
        env_args: Mapping[str, Any] | None = None,
        model: str = "policy",
        tool_call_format: str = "auto",
        direct: bool = True,
    ):
        vf = _vf()
        taskset = _taskset_id(taskset)
        self._config = vf.resolve_env_config({**(env_args or {}), "id": env, "taskset": {**(taskset_args or {}), "id": taskset}})
        self._envs: dict[float, Any] = {}
        self._serving: dict[Any, _Serving] = {}
        self.vf_env = self._vf_env(self.verifier_timeout_s)
        """The verifiers env (its taskset gives the problems)."""
        _check_tool_servers(self.vf_env.taskset)
        self.model = model
        """Model name verifiers records on its traces (sampling goes through our `Sampler`)."""
        self.tool_call_format = tool_call_format
        """`auto` (from the tokenizer's special tokens), `hermes` (Qwen2.5/Qwen3) or `llama3`."""
        self.direct = direct
        """Sample and score single-turn tasks without verifiers' episode where they allow it
        (`episode_needed`); False: every rollout runs as an episode."""

    def problems(self) -> Iterator[Problem]:
        for task in self.vf_env.taskset:
            yield Problem(id=task.key, prompt=task.data.prompt_text, extras={"task": task})

    @functools.cached_property
    def _reward_weights(self) -> dict[str, float]:
        # Read off the first task (a taskset yields one task type); loading it once is enough.
        task = next(iter(self.vf_env.taskset), None)
        if task is None:
            return {}
        weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")}
        weights.update({judge.reward_name: float(judge.config.weight) for judge in task.plugged_judges()})
        return weights

    def default_reward_weights(self) -> dict[str, float]:
        return dict(self._reward_weights)

    def _vf_env(self, scoring_timeout_s: float) -> Any:
        """The verifiers env whose agents score with this timeout (the run config may set its own)."""
        if scoring_timeout_s not in self._envs:
            vf_env = _vf().load_environment(_local_config(self._config, scoring_timeout_s))
            self._envs[scoring_timeout_s] = vf_env
            self._serving[vf_env] = _Serving(vf_env)
        return self._envs[scoring_timeout_s]

    @functools.cached_property
    def _tool_call_format(self) -> str | None:
        return resolve_tool_call_format(self.tokenizer, self.tool_call_format)

    @functools.cached_property
    def episode_needed(self) -> str | None:
        """Why this taskset's rollouts run verifiers' episode; None: its single-turn tasks are sampled and
        scored without one (`_verifiers_direct`)."""
        from marin_rl.envs._verifiers_direct import episode_needed

        if not self.direct:
            return "direct: false"
        return episode_needed(self.vf_env, type(self.vf_env.taskset).task_type(), self.vf_env.taskset)

    async def sample_rollouts(
        self, problem: Problem, sampler: Sampler, n: int, settings: RolloutSettings, metrics: EnvMetrics
    ) -> list[Rollout]:
        vf = _vf()
        sessions = ChatSessions(self.tokenizer, sampler, settings, self._tool_call_format, group_size=n)
        vf_env = self._vf_env(settings.verifier_timeout_s)
        task = problem.extras["task"]
        group_id = uuid.uuid4().hex
        if self.episode_needed is None:
            from marin_rl.envs._verifiers_direct import sample_and_score

            traced = await sample_and_score(vf_env, task, sessions, n, settings, self.model)
            return [self._to_rollout(problem, trace, session, settings, metrics, group_id) for trace, session in traced]
        async with self._serving[vf_env]() as endpoint, endpoint.group(sessions) as on_trace:
            ctx = vf.ModelContext(model=self.model, client=vf.EvalClientConfig(**endpoint.client_config()))
            episodes = await gather_all(vf_env.run_episode(task, ctx, on_trace=on_trace) for _ in range(n))
        rollouts = []
        for episode in episodes:
            if episode.errors:  # the env's own run() or finalize() failed
                raise RuntimeError(f"verifiers episode of task {problem.id!r} failed: {_describe(episode.errors)}")
            for trace in episode.traces:
                if trace.agent.trainable:
                    session = sessions.sessions.get(trace.id)
                    rollouts.append(self._to_rollout(problem, trace, session, settings, metrics, group_id))
        return rollouts

    def _to_rollout(
        self,
        problem: Problem,
        trace: Any,
        session: Session | None,
        settings: RolloutSettings,
        metrics: EnvMetrics,
        group_id: str,
    ) -> Rollout:
        transcript = session.transcript if session is not None else None
        scored = trace.timing.scoring.start > 0  # everything before scoring succeeded
        if transcript is None or transcript.num_assistant_turns == 0 or (trace.errors and not scored):
            details = _describe(trace.errors) or "no assistant turn"
            if session is not None and session.stop_reason == "max_total_tokens":
                details = f"the prompt alone does not fit under max_total_tokens={settings.max_total_tokens}"
            raise RuntimeError(
                f"verifiers rollout of task {problem.id!r} failed (stop condition {trace.stop_condition!r}): {details}"
            )
        timed_out = trace.stop_condition == "scoring_timeout"
        scoring_error = next((e.message for e in reversed(trace.errors)), "scoring timed out" if timed_out else None)
        rewards, errors, total = {}, {}, 0.0
        for name, value in trace.rewards.items():
            score = None if value is None else value.score
            if score is None or not math.isfinite(score):
                error = scoring_error or f"returned {score!r}, expected a finite number"
                metrics.increment("reward_timeouts" if timed_out else "reward_errors")
                errors[name], score = error, 0.0
            weight = settings.reward_weights.get(name, 1.0 if value is None else value.weight)
            rewards[name] = float(score)
            total += weight * score
        if scoring_error is not None and not trace.rewards:
            metrics.increment("reward_timeouts" if timed_out else "reward_errors")
            errors["verifiers"] = scoring_error
        if session.malformed_tool_calls:
            metrics.increment("malformed_tool_calls", session.malformed_tool_calls)
        turns = transcript.turns()
        truncated = (
            trace.is_truncated
            or session.stop_reason == "max_total_tokens"
            or any(t.inference_metadata is not None and t.inference_metadata.finish_reason == "length" for t in turns)
        )
        metadata: dict[str, Any] = {
            "verifiers": {
                "version": VERIFIERS_VERSION,
                "trace_id": trace.id,
                "agent": trace.agent.name,
                "stop_condition": trace.stop_condition,
                "metrics": {k: v for k, v in trace.metrics.items() if v is not None and math.isfinite(v)},
            },
            "stop_reason": session.stop_reason or trace.stop_condition,
            "num_turns": transcript.num_assistant_turns,
        }
        if errors:
            metadata["reward_errors"] = errors
        return Rollout(
            environment=self.name,
            problem_id=problem.id,
            rollout_uid=trace.id,  # unique (a uuid4), and names the verifiers trace
            group_id=group_id,
            turns=turns,
            rewards=rewards,
            reward=float(total),
            is_truncated=truncated,
            metadata=metadata,
        )


class _Serving:
    """The model endpoint and `vf_env.serving()` (its interception pool, shared tool servers), held
    while any group runs: verifiers keeps what `serving()` opens on the env object, so concurrent
    groups share one. The first group in opens it, the last one out closes it."""

    def __init__(self, vf_env: Any):
        self.vf_env = vf_env
        self._users = 0
        self._endpoint: ChatEndpoint | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[ChatEndpoint]:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop: what an earlier one opened went with it
            self._loop, self._lock, self._users = loop, asyncio.Lock(), 0
        async with self._lock:
            if self._users == 0:
                async with contextlib.AsyncExitStack() as stack:  # closes the endpoint if serving() fails
                    self._endpoint = await stack.enter_async_context(ChatEndpoint())
                    await stack.enter_async_context(self.vf_env.serving())
                    self._stack = stack.pop_all()
            self._users += 1
        try:
            yield self._endpoint
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0:
                    await self._stack.aclose()


def _taskset_id(taskset: str) -> str:
    """The id verifiers imports: an installed taskset's id, a module in the current directory, or the
    module of a file `path/to/my_taskset.py` (its folder goes on the import path)."""
    if not taskset.endswith(".py"):
        importable_from_cwd()
        return taskset
    file = Path(taskset).resolve()
    if not file.is_file():
        raise ConfigError(f"verifiers taskset: no file {taskset!r} (relative paths start at {os.getcwd()})")
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    return file.stem


def _describe(errors: list) -> str:
    return "; ".join(f"{e.type}: {e.message}" for e in errors)


def _local_config(config: Any, scoring_timeout_s: float) -> Any:
    """`config` with every seat on our in-process chat harness and the subprocess runtime, scoring
    with `scoring_timeout_s`.

    A seat that pins another harness or a remote/container runtime is refused: marin-rl runs
    verifiers agents in its own process, with tool servers verifiers starts as local processes."""
    vf = _vf()
    from marin_rl.envs._verifiers_harness import HARNESS_ID

    bundled = vf.default_harness_id(config.taskset.id)  # verifiers' `bash` unless the taskset ships one
    seats = {}
    for name, seat in config:
        if not isinstance(seat, vf.AgentConfig):
            continue
        harness = seat.harness
        harness_id = harness.id if harness is not None else None if bundled == "bash" else bundled
        if harness_id not in _IN_PROCESS_HARNESSES:
            raise ValueError(
                f"verifiers env {config.env_id!r}: seat {name!r} uses harness {harness_id!r}, which runs its own "
                f"program in a runtime; marin-rl plays verifiers agents with its in-process chat harness (verifiers' "
                f"`null` loop with the task's tools): leave {name}.harness unset or use 'null'"
            )
        fields = harness.model_dump(exclude={"id"}) if harness is not None else {}
        update = {
            "harness": vf.HarnessConfig(**fields, id=HARNESS_ID),
            "timeout": seat.timeout.model_copy(update={"scoring": scoring_timeout_s}),
        }
        if "runtime" not in seat.model_fields_set:
            update["runtime"] = vf.SubprocessConfig()  # verifiers' default is a remote sandbox
        elif not isinstance(seat.runtime, vf.SubprocessConfig):
            raise ValueError(
                f"verifiers env {config.env_id!r}: seat {name!r} asks for the {seat.runtime.type!r} runtime; "
                "marin-rl runs verifiers agents locally (subprocess runtime) only, not in remote or container runtimes"
            )
        seats[name] = seat.model_copy(update=update)
    return config.model_copy(update=seats)


def _check_tool_servers(taskset: Any) -> None:
    """Refuse tool servers that are not local processes verifiers starts itself (remote URLs, containers)."""
    vf = _vf()
    task_cls = type(taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        raise ValueError(f"verifiers task {task_cls.__name__} needs a container runtime, which marin-rl does not run")
    servers = [*task_cls.toolsets(taskset.config.task), *type(taskset).toolsets(taskset.config)]
    for server in servers:
        config = server.config
        if getattr(config, "url", None):
            raise ValueError(
                f"verifiers tool server {server.server_name!r} is remote ({config.url}); marin-rl only runs tool "
                "servers verifiers starts itself as local processes"
            )
        if not isinstance(config.runtime, vf.SubprocessConfig):
            raise ValueError(
                f"verifiers tool server {server.server_name!r} asks for the {config.runtime.type!r} runtime; "
                "marin-rl only runs tool servers as local processes (subprocess runtime)"
            )
