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
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    WeightUpdateRequest,
    WeightVersionResponse,
    bad_request,
    token_string,
)

if TYPE_CHECKING:
    from marin_rl.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightUpdates:
    """What POST /v1/weights/update needs: the token, a checkpoint loader and the swap."""

    token: str
    load: Callable[[str], Any]
    """Checkpoint directory -> model (blocking; run in a thread)."""
    swap: Callable[[Any, int], Any]
    """(model, policy_version) -> swap timing (blocking; run in a thread)."""


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
    """The FastAPI app; /v1/weights/update is mounted only when `weight_updates` is given."""
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

    @app.middleware("http")
    async def _internal_error(request: Request, call_next):
        # A failure (e.g. in the engine) is a 500 for that request only. Not an exception_handler for
        # Exception: Starlette re-raises from that one after answering, and uvicorn then resets the
        # connection before the client has read the 500.
        try:
            return await call_next(request)
        except Exception as e:  # noqa: BLE001
            logger.exception("inference request failed")
            return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}").body(), status_code=500)

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
        (result,) = await handler.run([job])
        choices = handler.choices(request, job, result)
        with_logprobs = request.logprobs is not False
        as_ids = request.return_tokens_as_token_ids
        return ChatCompletionResponse(
            model=model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=ChatChoiceLogprobs(
                        content=[
                            ChatTokenLogprob(token=(s := token_string(tokenizer, t, as_ids)), logprob=lp, bytes=list(s.encode()))
                            for t, lp in zip(c.token_ids, c.logprobs)
                        ]
                    )
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
        results = await handler.run(jobs)
        as_ids = request.return_tokens_as_token_ids
        with_logprobs = request.logprobs is not None or "logprobs" not in request.model_fields_set
        choices, all_choices = [], []
        for prompt, job, result in zip(prompts, jobs, results):
            prompt_logprobs = handler.prompt_logprobs(prompt, result.prompt_scores)
            for c in handler.choices(request, job, result):
                pieces = tokenizer.batch_decode([[t] for t in c.token_ids])  # one call, not one per token
                tokens = [f"token_id:{t}" for t in c.token_ids] if as_ids else pieces
                offsets = np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
                choices.append(
                    CompletionChoice(
                        index=len(choices),
                        text=c.text,
                        logprobs=CompletionLogprobs(tokens=tokens, token_logprobs=c.logprobs, text_offset=offsets)
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


def _mount_weight_update(app: FastAPI, engine: Engine, updates: WeightUpdates, instance: str) -> None:
    lock = asyncio.Lock()

    @app.post("/v1/weights/update", response_model=WeightVersionResponse)
    async def update_weights(body: WeightUpdateRequest, authorization: str | None = Header(default=None)):
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing bearer token: send `Authorization: Bearer <weight_update_token>`")
        if not secrets.compare_digest(token.encode(), updates.token.encode()):
            raise ApiError(403, "wrong weight-update token")
        async with lock:  # one update at a time, in order
            if body.policy_version < engine.policy_version and not body.reset:
                raise ApiError(
                    409,
                    f"policy_version {body.policy_version} is older than the served {engine.policy_version} (send reset: true to roll back)",
                    param="policy_version",
                )
            if not os.path.isdir(body.path):
                raise bad_request(f"checkpoint directory {body.path!r} does not exist on the server", param="path")
            start = time.perf_counter()
            try:
                model = await asyncio.to_thread(updates.load, body.path)
            except Exception as e:
                raise bad_request(f"could not load checkpoint {body.path!r}: {type(e).__name__}: {e}", param="path") from e
            load_seconds = time.perf_counter() - start
            try:
                swap = await asyncio.to_thread(updates.swap, model, body.policy_version)
            except ValueError as e:
                raise bad_request(f"checkpoint {body.path!r} cannot replace the served model: {e}", param="path") from e
        logger.info("serving policy version %d from %s (load %.2fs)", body.policy_version, body.path, load_seconds)
        return WeightVersionResponse(
            policy_version=engine.policy_version, instance=instance, load_seconds=load_seconds, swap_seconds=swap.total_seconds
        )

