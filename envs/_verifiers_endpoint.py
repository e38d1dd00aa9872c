"""The model endpoint of verifiers rollouts: OpenAI chat completions served token-exactly.

verifiers sends each model call of a rollout through its interception server to the endpoint of the
run's `EvalClientConfig`, with the rollout's trace id in the `X-Session-ID` header. This is that
endpoint, on 127.0.0.1 behind a token. Per session it keeps the conversation as a
`Transcript` (the ids sampled so far), renders only the new messages, samples through the env's
`Sampler` and parses tool calls in the model family's format (`_tool_calls`). The rollout is built
from the transcript afterwards, never from text.

Tool-call parsing lives here, next to the exact ids, rather than in the inference server (where vLLM
has its `--tool-call-parser`): a server re-renders the conversation from the parsed messages on each
turn, which re-tokenizes earlier tool calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from marin_rl.envs._chat import Transcript
from marin_rl.envs._runner import RolloutSettings
from marin_rl.envs._sampling import Completion, Sampler, SamplingParams
from marin_rl.envs._tool_calls import parse_tool_calls

logger = logging.getLogger(__name__)

ROLLOUT_ENDS = "marin-rl: the rollout ends here"
"""Start of the error for a turn past `max_turns` or `max_total_tokens`: the harness ends cleanly on it."""
TOKEN_HEADER = "X-Marin-Token"
SESSION_HEADER = "X-Session-ID"
"""verifiers' per-rollout routing header: the trace id, the same on every turn."""


class RequestError(ValueError):
    """A request this endpoint cannot serve (answered with HTTP 400)."""


_session_ids = itertools.count()


@dataclass
class Session:
    """One verifiers rollout's conversation."""

    transcript: Transcript | None = None
    tools: list[dict[str, Any]] | None = None
    seen: list[tuple] = field(default_factory=list)
    """The conversation as the harness sends it (normalised): it may only grow."""
    stop_reason: str | None = None
    """`max_turns` or `max_total_tokens` when this endpoint ended the conversation (on the turn before)."""
    malformed_tool_calls: int = 0
    sampler: Sampler | None = None
    """Samples its turns after the first: the group's sampler forked for this rollout (its own seeds)."""
    id: str = field(default_factory=lambda: f"{next(_session_ids):x}")
    """Unique in the process (its chat completions' ids)."""


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"only text message content is supported, got {content!r:.200}")


def _key(message: Mapping[str, Any]) -> tuple:
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ())
    return message.get("role"), _text(message.get("content")), calls, message.get("tool_call_id")


def _prompt_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = {"role": message.get("role"), "content": _text(message.get("content"))}
    out.update({k: message[k] for k in ("tool_call_id", "name") if message.get(k) is not None})
    return out


@dataclass
class _Batch:
    size: int = 0
    full: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class FirstTurns:
    """A group's first turns, sampled together.

    The rollouts of a group start on the same prompt; identical prompts that arrive within
    `window_s` (or until `group_size` have) go to the server as one request with `n` choices, as a
    native env samples a group: one prefill, and the server's batches fill. A fixed seed is offset
    by the completions already drawn for the prompt, so a later request draws anew.
    """

    def __init__(self, sampler: Sampler, group_size: int, window_s: float = 0.25):
        self.sampler = sampler
        self.group_size = group_size
        self.window_s = window_s
        self._open: dict[tuple, _Batch] = {}
        self._drawn: collections.Counter = collections.Counter()
        self._sampled = 0
        self._tasks: list[asyncio.Task] = []

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, Completion]:
        """A completion of `prompt_ids`, and its index among this group's first turns."""
        key = (tuple(prompt_ids), params)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch()
            batch.task = asyncio.ensure_future(self._draw(key, batch, prompt_ids, params))
            self._tasks.append(batch.task)
        index = batch.size
        batch.size += 1
        if batch.size >= self.group_size:
            batch.full.set()
        self._sampled += 1
        return self._sampled - 1, (await asyncio.shield(batch.task))[index]

    async def _draw(self, key: tuple, batch: _Batch, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(batch.full.wait(), self.window_s)
        del self._open[key]
        if params.seed is not None:
            params = replace(params, seed=params.seed + self._drawn[key])
        self._drawn[key] += batch.size
        completions = await self.sampler.sample(prompt_ids, batch.size, params)
        if len(completions) != batch.size:
            raise RuntimeError(f"sampler returned {len(completions)} completions, asked for {batch.size}")
        return completions

    async def aclose(self) -> None:
        """Stop draws nobody waits for any more (the group ended or was cancelled), and wait for them."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class ChatSessions:
    """The token-exact chat completion of each session's next turn (no HTTP: see `ChatEndpoint`)."""

    def __init__(
        self, tokenizer: Any, sampler: Sampler, settings: RolloutSettings, tool_call_format: str | None, group_size: int = 1
    ):
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.settings = settings
        self.tool_call_format = tool_call_format
        self.first_turns = FirstTurns(sampler, group_size)
        self.sessions: dict[str, Session] = {}

    async def complete(self, session_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat completion (an OpenAI `chat.completion` dict) for `body`'s conversation."""
        session = self.sessions.setdefault(session_id, Session())
        messages, tools = self._request(body)
        if session.transcript is not None and session.transcript.num_assistant_turns >= self.settings.max_turns:
            session.stop_reason = "max_turns"
            raise RequestError(f"{ROLLOUT_ENDS}: max_turns={self.settings.max_turns} reached")
        transcript = self._extend(session, messages, tools)
        params = self._turn_sampling(session, transcript)
        if session.transcript is None:
            index, completion = await self.first_turns.sample(transcript.token_ids, params)
            session.sampler = self.sampler.fork("rollout", index)
        else:
            [completion] = await session.sampler.sample(transcript.token_ids, 1, params)
        return self._commit(session, body, messages, transcript, completion, tools)

    async def complete_first_turns(self, body: Mapping[str, Any], n: int) -> list[tuple[str, dict[str, Any]]]:
        """The first turns of `n` new sessions of `body`'s conversation, as `complete` gives each, but
        rendered once and sampled in one request of `n`: (session id, chat completion) each."""
        messages, tools = self._request(body)
        first = Session()
        transcript = self._extend(first, messages, tools)
        params = self._turn_sampling(first, transcript)
        completions = await self.sampler.sample(transcript.token_ids, n, params)
        replies = []
        for index, completion in enumerate(completions):
            session_id = f"first-turn-{len(self.sessions)}"
            session = self.sessions[session_id] = Session(tools=first.tools, sampler=self.sampler.fork("rollout", index))
            replies.append((session_id, self._commit(session, body, messages, transcript.copy(), completion, tools)))
        return replies

    def _request(self, body: Mapping[str, Any]) -> tuple[list, list | None]:
        """The request's messages and tools."""
        tools = body.get("tools") or None
        if tools and self.tool_call_format is None:
            raise RequestError(
                "verifiers task has tools, but the tool-call format of this tokenizer is unknown; "
                "set the env's tool_call_format ('hermes' for Qwen2.5/Qwen3, 'llama3' for Llama 3)"
            )
        return body.get("messages") or [], tools

    def _turn_sampling(self, session: Session, transcript: Transcript) -> SamplingParams:
        """The turn's sampling after `transcript`'s prompt; the rollout ends when no room is left."""
        params = self.settings.turn_sampling(len(transcript.token_ids))
        if params is None:
            session.stop_reason = "max_total_tokens"
            raise RequestError(
                f"{ROLLOUT_ENDS}: {len(transcript.token_ids)} prompt tokens leave no room under "
                f"max_total_tokens={self.settings.max_total_tokens}"
            )
        return params

    def _commit(
        self, session: Session, body: Mapping[str, Any], messages: list, transcript: Transcript, completion: Completion, tools: list | None
    ) -> dict[str, Any]:
        """Record the sampled turn on the session; its chat completion."""
        usage = {"prompt_tokens": len(transcript.token_ids), "completion_tokens": len(completion.token_ids)}
        message, finish = self._reply(session, transcript, completion, tools)
        session.transcript = transcript
        session.seen = [*(_key(m) for m in messages), _key(message)]
        return {
            "id": f"chatcmpl-{session.id}-{transcript.num_assistant_turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {**usage, "total_tokens": sum(usage.values())},
        }

    def _reply(
        self, session: Session, transcript: Transcript, completion: Completion, tools: list | None
    ) -> tuple[dict[str, Any], str]:
        """The assistant message for a sampled turn (its tool calls parsed when the task has tools)."""
        message: dict[str, Any] = {"role": "assistant", "content": transcript.add_completion(completion)}
        finish = completion.finish_reason
        if not tools:
            return message, finish
        parsed = parse_tool_calls(self.tokenizer, completion.token_ids.tolist(), self.tool_call_format)
        session.malformed_tool_calls += parsed.malformed_calls
        message["content"] = parsed.content or None
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
            finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    def _extend(self, session: Session, messages: Sequence[Mapping[str, Any]], tools: list | None) -> Transcript:
        """The session's transcript with the new messages (a copy: committed once the turn is sampled)."""
        if session.transcript is None:
            session.tools = tools
            try:
                return Transcript(self.tokenizer, [_prompt_message(m) for m in messages], tools)
            except ValueError as e:
                raise RequestError(f"verifiers prompt: {e}") from e
        if tools != session.tools:
            raise RequestError("verifiers: the tools changed during a rollout; token-exact rollouts need fixed tools")
        known = len(session.seen)
        if [_key(m) for m in messages[:known]] != session.seen:
            raise RequestError(
                "verifiers: earlier messages of the conversation were rewritten (an @intercept hook?); "
                "token-exact rollouts need a conversation that only grows"
            )
        extended = session.transcript.copy()
        try:
            extended.add_messages([_prompt_message(m) for m in messages[known:]])
        except ValueError as e:
            raise RequestError(f"verifiers: {e}") from e
        return extended


class ChatEndpoint:
    """The groups' `ChatSessions` served over HTTP on 127.0.0.1 (an ephemeral port).

    One endpoint serves every group in flight (verifiers then keeps one model client for all of
    them); a model call reaches the group that minted its rollout's trace (see `group`).
    """

    def __init__(self):
        self.token = secrets.token_urlsafe(16)
        self.base_url = ""
        self._routes: dict[str, ChatSessions] = {}
        self._runner = None

    async def __aenter__(self) -> ChatEndpoint:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    def client_config(self) -> dict[str, Any]:
        """Fields of the verifiers `EvalClientConfig` that reaches this endpoint (the token rides in its own header)."""
        return {"base_url": self.base_url, "api_key_var": "MARIN_RL_UNUSED", "headers": {TOKEN_HEADER: self.token}}

    @contextlib.asynccontextmanager
    async def group(self, sessions: ChatSessions) -> AsyncIterator[Callable[[Any], None]]:
        """An `on_trace` callback for the group's episodes: the model calls of each trace it sees go to `sessions`."""
        traces: list[str] = []

        def on_trace(trace: Any) -> None:
            traces.append(trace.id)
            self._routes[trace.id] = sessions

        try:
            yield on_trace
        finally:
            for trace_id in traces:
                self._routes.pop(trace_id, None)
            await sessions.first_turns.aclose()

    async def _handle(self, request):
        if not secrets.compare_digest(request.headers.get(TOKEN_HEADER, ""), self.token):
            return _json({"error": {"message": "missing or wrong token", "code": 401}}, status=401)
        session_id = request.headers.get(SESSION_HEADER)
        sessions = self._routes.get(session_id or "")
        if sessions is None:
            return _json({"error": {"message": f"unknown rollout ({SESSION_HEADER}: {session_id!r})", "code": 400}}, status=400)
        try:
            body = json.loads(await request.read())
            return _json(await sessions.complete(session_id, body))
        except (RequestError, json.JSONDecodeError) as e:
            return _json({"error": {"message": str(e), "code": 400}}, status=400)
        except ConnectionError:  # the caller went away (a run stopping with rollouts in flight): no one to answer
            logger.debug("verifiers model call abandoned by its caller (session %s)", session_id)
            return _json({"error": {"message": "the caller went away", "code": 499}}, status=499)
        except Exception as e:  # noqa: BLE001 - the rollout records it as a failed model call
            logger.exception("verifiers model call failed (session %s)", session_id)
            return _json({"error": {"message": f"{type(e).__name__}: {e}", "code": 500}}, status=500)


def _json(body: dict[str, Any], status: int = 200):
    from aiohttp import web  # the envs extra; the module itself imports with the core install

    return web.json_response(body, status=status)
