"""Run a `verifiers` (v1 API) taskset against our servers, token-exact.

Supported version: verifiers==0.3.1 (the newest release that allows the pinned openai 3.x; 0.4.0
requires openai<3). What runs is verifiers' own rollout lifecycle (`verifiers.v1.rollout.Rollout`:
task setup, `@stop`/`@intercept` hooks, the interception server, finalize, `@reward` scoring with
its timeout, the `Trace`), with two pieces of ours plugged in:

- a model `Client` that renders each intercepted chat request with the policy tokenizer
  (`Transcript`, the same incremental rendering as native envs) and samples through our `Sampler`,
  so every assistant turn carries the sampled ids and logprobs (also handed to verifiers as
  `TurnTokens`, so its trace has them too);
- an in-process chat harness (verifiers allows a harness to run its loop in-process as long as
  model calls go through the interception endpoint): the task prompt, one model call per segment.

Scope: single-agent tasks without tools (MCP tool servers and tool-call parsing are model
specific and not wired) and no container runtimes. Scoring failures (a reward that raises, times out
or returns NaN) give reward 0 with the error recorded; any other failure of the rollout raises.
"""

from __future__ import annotations

import functools
import importlib
import math
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from marin_rl.envs._chat import Transcript
from marin_rl.envs._env import Env, register_env
from marin_rl.envs._optional import import_optional
from marin_rl.envs._problems import Problem
from marin_rl.envs._rewards import EnvMetrics
from marin_rl.envs._runner import RolloutSettings, gather_all
from marin_rl.envs._sampling import Sampler
from marin_rl.types import Rollout

VERIFIERS_VERSION = "0.3.1"


def _vf():
    return import_optional("verifiers.v1", "verifiers", "verifiers")


@register_env("verifiers")
class VerifiersEnv(Env):
    """A verifiers taskset: by installed id (`taskset: gsm8k-v1`), import path (`pkg.module:MyTaskset`),
    or a `Taskset` instance; `taskset_args` are its config fields. Its tasks' `@reward` functions and
    weights score the rollouts (the run config's `reward_weights` override the weights)."""

    def __init__(self, taskset: Any, taskset_args: Mapping[str, Any] | None = None, model: str = "policy"):
        vf = _vf()
        self.taskset = taskset if isinstance(taskset, vf.Taskset) else _load_taskset(taskset, taskset_args or {})
        self.model = model
        """Model name recorded on the verifiers trace (sampling goes through our `Sampler`)."""

    def problems(self) -> Iterator[Problem]:
        for task in self.taskset:
            yield Problem(id=task.key, prompt=task.data.prompt_text, extras={"task": task})

    @functools.cached_property
    def _reward_weights(self) -> dict[str, float]:
        # Read off the first task (a taskset yields one task type); loading it once is enough.
        task = next(iter(self.taskset), None)
        if task is None:
            return {}
        weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")}
        weights.update({judge.reward_name: float(judge.config.weight) for judge in task.plugged_judges()})
        return weights

    def default_reward_weights(self) -> dict[str, float]:
        return dict(self._reward_weights)

    async def sample_rollouts(
        self, problem: Problem, sampler: Sampler, n: int, settings: RolloutSettings, metrics: EnvMetrics
    ) -> list[Rollout]:
        from verifiers.v1.interception import InterceptionServer
        from verifiers.v1.utils.compile import validate_pairing

        vf = _vf()
        task = problem.extras["task"]
        harness = _chat_harness_class()(vf.HarnessConfig(id="marin-rl-chat"))
        validate_pairing(harness, type(task), vf.SubprocessConfig(), tools=task.toolsets(task.config))
        client = _token_client_class()(self.tokenizer, sampler, settings)

        class Interception(InterceptionServer):
            def _client(self, config):  # every session samples through our token-exact client
                return client

        group_id = uuid.uuid4().hex
        async with Interception() as server:
            traces = await gather_all(self._run(task, harness, server, settings) for _ in range(n))
        return [self._to_rollout(problem, trace, client, settings, metrics, group_id) for trace in traces]

    async def _run(self, task: Any, harness: Any, server: Any, settings: RolloutSettings) -> Any:
        from verifiers.v1.rollout import Rollout as VfRollout
        from verifiers.v1.rollout import RolloutTimeouts
        from verifiers.v1.session import RolloutLimits

        vf = _vf()
        sampling = settings.sampling
        ctx = vf.ModelContext(
            model=self.model,
            # Never contacted: the interception hands every session our client.
            client=vf.EvalClientConfig(base_url="http://127.0.0.1:9/unused", api_key_var="MARIN_RL_UNUSED"),
            sampling=vf.Sampling(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens),
        )
        timeout = task.data.timeout
        run = VfRollout(
            task=task,
            agent_config=vf.AgentConfig(model=self.model, runtime=vf.SubprocessConfig(), max_turns=settings.max_turns),
            harness=harness,
            ctx=ctx,
            runtime_config=vf.SubprocessConfig(),
            timeouts=RolloutTimeouts(
                setup=timeout.setup, agent=timeout.agent, finalize=timeout.finalize, scoring=settings.verifier_timeout_s
            ),
            limits=RolloutLimits(max_turns=settings.max_turns),
            interception=server,
        )
        try:  # the lifecycle of `verifiers.v1.Agent.run`, with our harness instance
            if await run.open():
                await run.step()
                if run.ok:
                    run.trace.stop("agent_completed")
            return await run.close()
        except BaseException:
            await run.abort()
            raise

    def _to_rollout(
        self,
        problem: Problem,
        trace: Any,
        client: Any,
        settings: RolloutSettings,
        metrics: EnvMetrics,
        group_id: str,
    ) -> Rollout:
        transcript = client.transcripts.pop(trace.id, None)
        scored = trace.timing.scoring.start > 0  # everything before scoring succeeded
        if transcript is None or transcript.num_assistant_turns == 0 or (trace.errors and not scored):
            details = "; ".join(f"{e.type}: {e.message}" for e in trace.errors) or "no assistant turn"
            raise RuntimeError(
                f"verifiers rollout of task {problem.id!r} failed (stop condition {trace.stop_condition!r}): {details}"
            )
        scoring_error = next((e.message for e in reversed(trace.errors)), None)
        rewards, errors, total = {}, {}, 0.0
        for name, value in trace.rewards.items():
            score = None if value is None else value.score
            if score is None or not math.isfinite(score):
                error = scoring_error or f"returned {score!r}, expected a finite number"
                metrics.increment("reward_timeouts" if "timed out" in error else "reward_errors")
                errors[name], score = error, 0.0
            weight = settings.reward_weights.get(name, 1.0 if value is None else value.weight)
            rewards[name] = float(score)
            total += weight * score
        if scoring_error is not None and not trace.rewards:
            metrics.increment("reward_timeouts" if "timed out" in scoring_error else "reward_errors")
            errors["verifiers"] = scoring_error
        turns = transcript.turns()
        truncated = trace.is_truncated or any(
            t.inference_metadata is not None and t.inference_metadata.finish_reason == "length" for t in turns
        )
        metadata: dict[str, Any] = {
            "verifiers": {
                "version": VERIFIERS_VERSION,
                "trace_id": trace.id,
                "stop_condition": trace.stop_condition,
                "metrics": {k: v for k, v in trace.metrics.items() if v is not None and math.isfinite(v)},
            },
            "num_turns": transcript.num_assistant_turns,
        }
        if errors:
            metadata["reward_errors"] = errors
        return Rollout(
            environment=self.name,
            problem_id=problem.id,
            rollout_uid=uuid.uuid4().hex,
            group_id=group_id,
            turns=turns,
            rewards=rewards,
            reward=float(total),
            is_truncated=truncated,
            metadata=metadata,
        )


def _load_taskset(taskset: str, args: Mapping[str, Any]) -> Any:
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    if ":" in taskset:
        module_name, _, attr = taskset.partition(":")
        cls = getattr(importlib.import_module(module_name), attr, None)
        if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
            raise ValueError(f"verifiers taskset {taskset!r}: {module_name}.{attr} is not a verifiers Taskset (got {cls!r})")
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return cls(config_cls.model_validate(dict(args)))
    config_cls = vf.taskset_config_type(taskset)
    return vf.load_taskset(config_cls.model_validate({**args, "id": taskset}))


@functools.cache
def _chat_harness_class():
    """The in-process chat harness (built lazily: verifiers takes seconds to import)."""
    from openai import AsyncOpenAI
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.runtimes import ProgramResult

    vf = _vf()

    class ChatHarness(vf.Harness):
        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> ProgramResult:
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages.extend(message_to_wire(m) for m in prompt or [])
            async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            return ProgramResult(exit_code=0, stdout="", stderr="")

    return ChatHarness


@functools.cache
def _token_client_class():
    """A verifiers model `Client` that samples token-exact through our `Sampler` (built lazily)."""
    from verifiers.v1.clients import Client
    from verifiers.v1.clients.train import serialize_completion
    from verifiers.v1.errors import OverlongPromptError
    from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage, content_text

    class TokenClient(Client):
        def __init__(self, tokenizer: Any, sampler: Sampler, settings: RolloutSettings):
            self.tokenizer = tokenizer
            self.sampler = sampler
            self.settings = settings
            self.transcripts: dict[str, Transcript] = {}
            """Per verifiers trace id, the conversation with its exact token ids."""

        async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None) -> Response:
            prompt = turn.prompt if turn is not None else dialect.parse_request(body).messages
            messages = [{"role": m.role, "content": content_text(m.content)} for m in prompt]
            transcript = self._extend(session_id or "", messages)
            prompt_ids, spans = transcript.token_ids, transcript.message_spans()
            params = self.settings.turn_sampling(len(prompt_ids))
            if params is None:  # verifiers ends the rollout as a clean truncation (`context_length`)
                raise OverlongPromptError(f"{len(prompt_ids)} prompt tokens leave no room under max_total_tokens")
            [completion] = await self.sampler.sample(prompt_ids, 1, params)
            content = transcript.add_completion(completion)
            response = Response(
                id=f"marin-{uuid.uuid4().hex}",
                created=int(time.time()),
                model=body.get("model", ""),
                message=AssistantMessage(content=content),
                finish_reason=completion.finish_reason,
                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(completion.token_ids)),
                tokens=TurnTokens(
                    prompt_ids=prompt_ids,
                    completion_ids=completion.token_ids.tolist(),
                    completion_logprobs=completion.logprobs.tolist(),
                    message_spans=spans,
                ),
            )
            response.raw = serialize_completion(response, response.model)
            return response

        def _extend(self, session_id: str, messages: list[dict[str, Any]]) -> Transcript:
            transcript = self.transcripts.get(session_id)
            if transcript is None:
                transcript = self.transcripts[session_id] = Transcript(self.tokenizer, messages)
                return transcript
            known = transcript.messages
            if [(m["role"], m["content"]) for m in messages[: len(known)]] != [(m["role"], m["content"]) for m in known]:
                raise ValueError(
                    "verifiers: the harness rewrote earlier messages of the conversation; token-exact rollouts "
                    "need a conversation that only grows"
                )
            transcript.add_messages(messages[len(known) :])
            return transcript

    return TokenClient
