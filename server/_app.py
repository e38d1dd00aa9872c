"""HTTP layer of the inference server: OpenAI routes, vLLM extensions, weight-update routes, errors
(`_handler` checks the requests and runs them on the engine)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pydantic_core
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from marin_rl.errors import BaseMissing
from marin_rl.server._config import InferenceServerConfig
from marin_rl.server._handler import RequestHandler, completion_prompts, render_chat
from marin_rl.server._protocol import (
    ApiError,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TopLogprob,
    Usage,
    WeightUpdateRequest,
    WeightVersionResponse,
    bad_request,
)
from marin_rl.server._stream import Delta, server_sent_events, stream_deltas

if TYPE_CHECKING:
    from marin_rl.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightUpdates:
    """What POST /v1/weights/update and /v1/weights/upload need: the token, a loader and the swap."""

    token: str
    load: Callable[[Any, Any], Any]
    """(weights: a checkpoint directory or safetensors bytes; adapters: a file's path or bytes; either may be
    None) -> model (blocking; run in a thread): an `UpdateLoader`."""
    swap: Callable[[Any, int], Any]
    """(model, policy_version) -> swap timing (blocking; run in a thread)."""


class _InternalErrors:
    """ASGI middleware: a failure (e.g. in the engine) is a 500 for that request only. Not an
    exception_handler for Exception (Starlette re-raises from that one after answering, and uvicorn then
    resets the connection before the client has read the 500), and not Starlette's BaseHTTPMiddleware
    (it copies every response through a stream of its own: a fifth of the server's time at 128
    concurrent requests)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001
            logger.exception("inference request failed")
            if started:  # the status line is out (a stream): nothing else can be said
                raise
            await JSONResponse(ApiError(500, f"{type(e).__name__}: {e}").body(), status_code=500)(scope, receive, send)


class _Precheck:
    """ASGI middleware: refuses from a fast parse of the JSON body what `RequestHandler.precheck` can
    tell is too large (60k prompts, 200k messages), before FastAPI validates it into request objects,
    which takes time and memory in proportion. Other requests get their body replayed unchanged."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, handler: RequestHandler):
        self.app, self.handler = app, handler

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        messages, chunks = [], []
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break  # the client went away: the app sees it
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except StarletteHTTPException as e:  # a chunked body past max_request_bytes: 413
            return await JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)(scope, receive, send)
        try:
            self.handler.precheck(scope["path"], pydantic_core.from_json(b"".join(chunks)))
        except ApiError as e:
            return await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
        except ValueError:
            pass  # not JSON: validation answers

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def build_app(
    config: InferenceServerConfig,
    tokenizer,
    engine: Engine,
    vocab_size: int,
    weight_updates: WeightUpdates | None = None,
) -> FastAPI:
    """The FastAPI app; /v1/weights/update and /v1/weights/upload are mounted only when `weight_updates` is given."""
    # FastAPI answers 413 to a body over the limit before reading it (Content-Length), or as soon as
    # the bytes read pass it (chunked).
    app = FastAPI(title="marin-rl inference server", max_body_size=config.max_request_bytes)
    handler = RequestHandler(config, tokenizer, engine, vocab_size)
    app.state.handler = handler  # the in-process sampler of the embedded server uses it too
    instance = uuid.uuid4().hex

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        problems = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors())
        return JSONResponse(ApiError(400, f"invalid request: {problems}", param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    app.add_middleware(_InternalErrors)
    app.add_middleware(_Precheck, handler=handler)  # added last: outermost, it reads the body as sent

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": engine.policy_version, "instance": instance}

    @app.get("/v1/models")
    async def models():
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "marin-rl", "max_model_len": config.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_none=False)
    async def chat_completions(request: ChatCompletionRequest) -> ChatCompletionResponse:
        model = handler.check_model(request.model)
        prompt = handler.check_prompt_ids(render_chat(handler, tokenizer, request), "messages")
        (job,) = handler.jobs(request, [prompt], request.requested_max_tokens(), "messages")
        if request.stream:
            return _event_stream(_chat_chunks(handler, request, job, model, prompt))
        (result,) = await handler.run([job])
        choices = handler.choices(request, job, result)
        with_logprobs = request.logprobs is not False
        return ChatCompletionResponse(
            model=model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=chat_logprobs(handler, c.token_ids, c.logprobs, request.return_tokens_as_token_ids, c.top_ids, c.top_logprobs)
                    if with_logprobs
                    else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if request.return_token_ids else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=handler.usage([prompt], choices),
            prompt_token_ids=prompt if request.return_token_ids else None,
            prompt_logprobs=handler.prompt_logprobs(prompt, result.prompt_scores),
            policy_version=result.policy_version,
        )

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(request: CompletionRequest) -> CompletionResponse:
        model = handler.check_model(request.model)
        prompts = completion_prompts(handler, request.prompt)
        jobs = handler.jobs(request, prompts, request.requested_max_tokens(), "prompt")
        if request.stream:
            return _event_stream(_completion_chunks(handler, request, jobs, model, prompts))
        results = await handler.run(jobs)
        with_logprobs = _completion_logprobs_wanted(request)
        choices, all_choices = [], []
        for prompt, job, result in zip(prompts, jobs, results):
            prompt_logprobs = handler.prompt_logprobs(prompt, result.prompt_scores)
            for c in handler.choices(request, job, result):
                choices.append(
                    CompletionChoice(
                        index=len(choices),
                        text=c.text,
                        logprobs=completion_logprobs(
                            handler, c.token_ids, c.logprobs, request.return_tokens_as_token_ids, top_ids=c.top_ids, top_logprobs=c.top_logprobs
                        )
                        if with_logprobs
                        else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=c.token_ids if request.return_token_ids else None,
                        prompt_token_ids=prompt if request.return_token_ids else None,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
                all_choices.append(c)
        return CompletionResponse(
            model=model,
            choices=choices,
            usage=handler.usage(prompts, all_choices),
            policy_version=min(r.policy_version for r in results),
        )

    @app.get("/v1/weights/version", response_model=WeightVersionResponse)
    async def weights_version() -> WeightVersionResponse:
        return WeightVersionResponse(policy_version=engine.policy_version, instance=instance)

    if weight_updates is not None:
        _mount_weight_update(app, engine, weight_updates, instance)
    return app


def chat_logprobs(handler: RequestHandler, token_ids: list[int], logprobs: list[float], as_token_ids: bool, top_ids=None, top_logprobs=None) -> ChatChoiceLogprobs:
    """`top_ids`, `top_logprobs`: `[len(token_ids), k]` alternatives (None: none asked for)."""
    alternatives = _alternatives(handler, top_ids, top_logprobs, as_token_ids) if top_ids is not None else [[]] * len(token_ids)
    content = []
    for token, lp, alts in zip(_token_names(handler, token_ids, as_token_ids), logprobs, alternatives, strict=True):
        top = [TopLogprob(token=alt, logprob=alt_lp, bytes=list(alt.encode())) for alt, alt_lp in alts]
        content.append(ChatTokenLogprob(token=token, logprob=lp, bytes=list(token.encode()), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(
    handler: RequestHandler, token_ids: list[int], logprobs: list[float], as_token_ids: bool, offset: int = 0, top_ids=None, top_logprobs=None
) -> CompletionLogprobs:
    """`offset`: characters of the choice's tokens before these (a streamed choice's later tokens)."""
    pieces = handler.token_pieces(token_ids)
    tokens = [f"token_id:{t}" for t in token_ids] if as_token_ids else pieces
    offsets = (offset + np.cumsum([0] + [len(p) for p in pieces])[: len(pieces)]).tolist()
    top = None if top_ids is None else [dict(alts) for alts in _alternatives(handler, top_ids, top_logprobs, as_token_ids)]
    return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets, top_logprobs=top)


def _token_names(handler: RequestHandler, token_ids: list[int], as_token_ids: bool) -> list[str]:
    """Tokens as logprob records show them: `token_id:N` (vLLM's `return_tokens_as_token_ids`) or their text."""
    return [f"token_id:{t}" for t in token_ids] if as_token_ids else handler.token_pieces(token_ids)


def _alternatives(handler: RequestHandler, top_ids, top_logprobs, as_token_ids: bool) -> list[list[tuple[str, float]]]:
    """Each position's (token as logprob records show it, log-prob) pairs, best first."""
    rows = top_ids.tolist()
    names = iter(_token_names(handler, [t for row in rows for t in row], as_token_ids))
    return [[(next(names), lp) for lp in lps] for lps in top_logprobs.tolist()]


def _completion_logprobs_wanted(request: CompletionRequest) -> bool:
    return request.logprobs is not None or "logprobs" not in request.model_fields_set


def _event_stream(chunks) -> StreamingResponse:
    return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream")


def _usage_chunk(head: dict, prompts: list[list[int]], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)
    return {**head, "choices": [], "usage": usage.model_dump()}


def _finish_fields(choice: dict, delta: Delta, request) -> dict:
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    if request.return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


async def _chat_chunks(handler: RequestHandler, request: ChatCompletionRequest, job, model: str, prompt: list[int]):
    """OpenAI's `chat.completion.chunk` events: the role first, then each choice's deltas; the vLLM
    extensions (`token_ids`, `prompt_token_ids`, `stop_reason`) and `policy_version` (on a choice's
    last chunk) as in the answer without streaming."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    first = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(request.n)]}
    if request.return_token_ids:
        first["prompt_token_ids"] = prompt
    yield first
    with_logprobs = request.logprobs is not False
    completion_tokens = 0
    async for delta in stream_deltas(handler, request, [job]):
        completion_tokens += len(delta.token_ids)
        logprobs = chat_logprobs(handler, delta.token_ids, delta.logprobs, request.return_tokens_as_token_ids).model_dump() if with_logprobs else None
        content = {"content": delta.text} if delta.text else {}
        choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        chunk = {**head, "choices": [_finish_fields(choice, delta, request)]}
        if delta.policy_version is not None:
            chunk["policy_version"] = delta.policy_version
        yield chunk
    if request.stream_options is not None and request.stream_options.include_usage:
        yield _usage_chunk(head, [prompt], completion_tokens)


async def _completion_chunks(handler: RequestHandler, request: CompletionRequest, jobs, model: str, prompts: list[list[int]]):
    """`text_completion` events: each choice's text deltas (choice index: prompt index x n + sample)."""
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    with_logprobs = _completion_logprobs_wanted(request)
    token_chars: dict[int, int] = {}  # characters of each choice's tokens sent so far (the offsets)
    completion_tokens = 0
    async for delta in stream_deltas(handler, request, jobs):
        completion_tokens += len(delta.token_ids)
        logprobs = None
        if with_logprobs:
            offset = token_chars.get(delta.index, 0)
            record = completion_logprobs(handler, delta.token_ids, delta.logprobs, request.return_tokens_as_token_ids, offset)
            token_chars[delta.index] = offset + sum(len(p) for p in handler.token_pieces(delta.token_ids))
            logprobs = record.model_dump()
        choice = {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if delta.finish_reason is not None and request.return_token_ids:
            choice["prompt_token_ids"] = prompts[delta.index // request.n]
        chunk = {**head, "choices": [_finish_fields(choice, delta, request)]}
        if delta.policy_version is not None:
            chunk["policy_version"] = delta.policy_version
        yield chunk
    if request.stream_options is not None and request.stream_options.include_usage:
        yield _usage_chunk(head, prompts, completion_tokens)


MAX_UPLOAD_BYTES = 2**40
"""Largest body of POST /v1/weights/upload (a terabyte: any model's weights)."""


def _mount_weight_update(app: FastAPI, engine: Engine, updates: WeightUpdates, instance: str) -> None:
    lock = asyncio.Lock()

    def check_token(authorization: str | None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing bearer token: send `Authorization: Bearer <weight_update_token>`")
        if not secrets.compare_digest(token.encode(), updates.token.encode()):
            raise ApiError(403, "wrong weight-update token")

    def check_version(policy_version: int, reset: bool) -> None:
        if policy_version < engine.policy_version and not reset:
            raise ApiError(
                409,
                f"policy_version {policy_version} is older than the served {engine.policy_version} (send reset: true to roll back)",
                param="policy_version",
            )

    async def apply(weights, adapters, policy_version: int, reset: bool, source: str, param: str, base_param: str) -> WeightVersionResponse:
        """Load `weights` and/or `adapters` (paths, or bytes) and serve them as `policy_version`;
        `param` names the request's field at fault, `base_param` the one that brings a base."""
        async with lock:  # one update at a time, in order
            check_version(policy_version, reset)
            start = time.perf_counter()
            try:
                model = await asyncio.to_thread(updates.load, weights, adapters)
            except BaseMissing as e:
                raise ApiError(409, str(e), param=base_param) from e
            except Exception as e:
                raise bad_request(f"could not load {source}: {type(e).__name__}: {e}", param=param) from e
            load_seconds = time.perf_counter() - start
            try:
                swap = await asyncio.to_thread(updates.swap, model, policy_version)
            except ValueError as e:
                raise bad_request(f"{source} cannot replace the served model: {e}", param=param) from e
        logger.info("serving policy version %d from %s (load %.2fs)", policy_version, source, load_seconds)
        return WeightVersionResponse(
            policy_version=engine.policy_version, instance=instance, load_seconds=load_seconds, swap_seconds=swap.total_seconds
        )

    @app.post("/v1/weights/update", response_model=WeightVersionResponse)
    async def update_weights(body: WeightUpdateRequest, authorization: str | None = Header(default=None)):
        check_token(authorization)
        if body.path is None and body.adapters is None:
            raise bad_request("send `path` (a checkpoint directory), `adapters` (a LoRA adapters file), or both", param="path")
        if body.path is not None and not os.path.isdir(body.path):
            raise bad_request(f"checkpoint directory {body.path!r} does not exist on the server", param="path")
        if body.adapters is not None and not os.path.isfile(body.adapters):
            raise bad_request(f"adapters file {body.adapters!r} does not exist on the server", param="adapters")
        source = " + ".join(repr(p) for p in (body.path, body.adapters) if p is not None)
        param = "adapters" if body.adapters else "path"
        return await apply(body.path, body.adapters, body.policy_version, body.reset, source, param, "path")

    # Weights are gigabytes, past the API's max_request_bytes; only a holder of the token gets them read.
    @app.post("/v1/weights/upload", response_model=WeightVersionResponse, max_body_size=MAX_UPLOAD_BYTES)
    async def upload_weights(
        request: Request,
        policy_version: int = Query(ge=0),
        reset: bool = False,
        weights_bytes: int | None = Query(default=None, ge=0),
        authorization: str | None = Header(default=None),
    ):
        check_token(authorization)  # before the body is read, as is a version it would refuse
        check_version(policy_version, reset)
        data = await request.body()
        split = len(data) if weights_bytes is None else weights_bytes
        if split > len(data):
            raise bad_request(f"weights_bytes={split} is more than the body's {len(data)} bytes", param="weights_bytes")
        weights, adapters = data[:split] or None, data[split:] or None
        if weights is None and adapters is None:
            raise bad_request("the body is empty: send the weights (safetensors bytes), then the adapters' bytes", param="weights_bytes")
        source = " + ".join(f"{len(part)} bytes of {name}" for name, part in (("weights", weights), ("adapters", adapters)) if part)
        return await apply(weights, adapters, policy_version, reset, source, "weights_bytes", "weights_bytes")

