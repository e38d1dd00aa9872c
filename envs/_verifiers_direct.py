"""Single-turn verifiers tasks without an episode: verifiers' own trace and scoring, no interception.

A plain chat task (verifiers' single-agent env, no tools, no `setup`/`finalize`/`stop`/`intercept`
hooks, no judges, rewards that need no runtime) is one model call and a score. Its episode costs about
9 ms of Python a rollout (the interception server and two HTTP hops per call, the rollout lifecycle,
pydantic models), where a native env spends 0.2 ms: a verifiers taskset trained 17x slower a step than
the same task written as a native env. Here the group's first turns come from our endpoint's sessions
(`ChatSessions.complete_first_turns`: the rendering, sampling and replies the episode's harness would
get, in one request of `n`), each reply is committed on a `Trace` by verifiers' message graph as its
interception server does, and `Task.score(trace)` scores it without a runtime, as `vf-replay`
re-scores saved traces. Everything else (tools, multi-turn, hooks, judges) runs the episode.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from marin_rl.envs._runner import RolloutSettings
from marin_rl.envs._verifiers_endpoint import ChatSessions, RequestError, Session
from marin_rl.envs._verifiers_harness import initial_messages
from marin_rl.errors import PromptTooLong

_LIFECYCLE = ("setup", "finalize", "stage_verifier")
"""Task methods that need a runtime: overridden, the task runs its episode."""


def episode_needed(vf_env: Any, task_cls: type, taskset: Any) -> str | None:
    """Why tasks of `task_cls` need verifiers' episode (None: scored here, without one)."""
    import verifiers.v1 as vf
    from verifiers.v1.envs.single_agent.env import SingleAgentEnv

    config = taskset.config.task
    if type(vf_env) is not SingleAgentEnv:
        return f"env {type(vf_env).__name__} is not verifiers' single-agent env"
    if task_cls.toolsets(config) or type(taskset).toolsets(taskset.config):
        return "the task has tools"
    overridden = [name for name in _LIFECYCLE if getattr(task_cls, name) is not getattr(vf.Task, name)]
    if overridden:
        return f"the task overrides {overridden}"
    if config.judges or config.stops:
        return "the task has judges or stops"
    task = next(iter(taskset), None)
    if task is None:
        return "the taskset is empty"
    for kind in ("stop", "intercept"):
        if _decorated(task, kind):
            return f"the task has @{kind} hooks"
    for fn in (*task.hooks("reward"), *task.hooks("metric")):
        if _requires_runtime(fn):
            return f"{fn.__name__} needs a runtime"
    return None


@functools.cache
def _build():
    """The verifiers version a trace records (its default factory looks it up for every trace)."""
    import verifiers.v1 as vf

    return vf.Trace.model_fields["verifiers"].default_factory()


def _decorated(task: Any, kind: str) -> list:
    from verifiers.v1.utils.decorators import discover_decorated

    return discover_decorated(task, kind)


def _requires_runtime(fn) -> bool:
    import inspect

    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


async def sample_and_score(
    vf_env: Any, task: Any, sessions: ChatSessions, n: int, settings: RolloutSettings, model: str
) -> list[tuple[Any, Session]]:
    """`n` traces of `task`, each with the session that sampled it."""
    import verifiers.v1 as vf
    from verifiers.v1 import graph
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.trace import AgentInfo, TraceTask

    dialect = ChatDialect()
    body = {"model": model, "messages": initial_messages(task.data)}
    request = dialect.parse_request(body)
    try:
        replies = await sessions.complete_first_turns(body, n)
    except RequestError as e:  # the prompt alone leaves no room (retrying cannot help)
        raise PromptTooLong(
            f"verifiers task {task.key!r}: the prompt alone does not fit under max_total_tokens={settings.max_total_tokens}"
        ) from e
    # Shared by the group's traces, as in an episode: the row, the seat. Unvalidated, as verifiers'
    # graph builds its records: the parts are valid already.
    trace_task = TraceTask.model_construct(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
    agent = AgentInfo.model_construct(config=vf_env.config.agent)

    async def score(session_id: str, completion: dict) -> tuple[Any, Session]:
        trace = vf.Trace.model_construct(task=trace_task, agent=agent, verifiers=_build())
        graph.prepare_turn(trace, request.messages, request.tools).commit(dialect.parse_response(dialect.validate_response(completion)))
        trace.stop("agent_completed")
        trace.timing.scoring.start = time.time()
        try:
            async with asyncio.timeout(settings.verifier_timeout_s):
                await task.score(trace)
        except TimeoutError:
            trace.record_timeout("scoring")
        except Exception as e:  # noqa: BLE001 - a scoring failure scores 0, as in the episode
            trace.record_error(e)
        trace.timing.scoring.end = time.time()
        return trace, sessions.sessions[session_id]

    # One after another: a task per trace cost 16% more here (the group's rewards are cheap; groups in
    # flight still overlap, and `direct: false` runs each rollout as its own episode).
    return [await score(session_id, completion) for session_id, completion in replies]
