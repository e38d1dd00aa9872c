"""The server's requests, checked and turned into engine jobs, and the engine's results into responses."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from marin_rl.engine import GenerationJob, JobResult, PromptScores
from marin_rl.server._config import InferenceServerConfig
from marin_rl.server._protocol import (
    ApiError,
    ChatCompletionRequest,
    Logprob,
    PromptLogprobs,
    Usage,
    bad_request,
    truncate_at_stop,
)

if TYPE_CHECKING:
    from marin_rl.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    top_ids: np.ndarray | None = None
    """[len(token_ids), k] the top alternatives at each token (None unless asked for)."""
    top_logprobs: np.ndarray | None = None


class RequestHandler:
    """Turns validated requests into engine jobs and engine results into responses."""

    def __init__(self, config: InferenceServerConfig, tokenizer, engine: Engine, vocab_size: int):
        self.config = config
        self.tokenizer = tokenizer
        self.engine = engine
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(config.seed)
        # No token covers more characters than the longest token's text, so a text longer than this
        # cannot fit in max_seq_len tokens: refused before tokenizing (which costs memory and time).
        self.chars_per_token = max(len(t or "") for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        self.max_prompt_chars = config.max_seq_len * self.chars_per_token
        self._pieces: dict[int, str] = {}

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's text decoded alone, as logprob records show it; cached per id (transformers'
        decode costs tens of microseconds a call, and a response has thousands of tokens)."""
        missing = list({t for t in token_ids if t not in self._pieces})
        if missing:
            self._pieces.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing])))
        return [self._pieces[t] for t in token_ids]

    # -------------------------------------------------------------------------------------- requests

    def check_model(self, model: str | None) -> str:
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.config.model_name}`.", param="model")
        return self.config.model_name

    def check_prompt_text(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.config.max_seq_len} tokens and the prompt has "
                f"{num_chars} characters: more tokens than that with this tokenizer.",
                param=param,
            )

    def precheck(self, path: str, body: Any) -> None:
        """What can be refused from the parsed JSON alone, before it is validated into request objects
        (which takes memory and time in proportion to the prompts): too many sequences or messages."""
        if not isinstance(body, dict):
            return  # validation answers
        n = body.get("n", 1)
        n = n if isinstance(n, int) and n >= 1 else 1
        if path == "/v1/completions":
            prompt = body.get("prompt")
            several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (list, str))
            prompts, param = (len(prompt) if several else 1), "prompt"
        else:
            messages = body.get("messages")
            if isinstance(messages, list) and len(messages) >= self.config.max_seq_len:
                raise bad_request(
                    f"This model's maximum context length is {self.config.max_seq_len} tokens and the request has "
                    f"{len(messages)} messages: every message renders as one token at least.",
                    param="messages",
                )
            prompts, param = 1, "n"
        cap = self.config.max_sequences_per_request
        if prompts * n > cap:
            raise bad_request(
                f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences; the server's "
                f"max_sequences_per_request is {cap}",
                param=param,
            )

    def check_prompt_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if len(ids) >= self.config.max_seq_len:
            raise bad_request(
                f"This model's maximum context length is {self.config.max_seq_len} tokens and the prompt has "
                f"{len(ids)}: no room for a completion token.",
                param=param,
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param=param)
        return ids

    def jobs(self, request, prompts: list[list[int]], max_tokens: int | None, prompt_param: str) -> list[GenerationJob]:
        request.check_supported()
        limit = self.config.max_seq_len
        if request.n > self.config.max_seqs:
            raise bad_request(f"n={request.n} exceeds the server's max_seqs={self.config.max_seqs}", param="n")
        k = request.prompt_logprobs
        if k is not None and not 0 <= k <= self.config.max_logprobs:
            raise bad_request(f"prompt_logprobs must be in [0, {self.config.max_logprobs}], got {k}", param="prompt_logprobs")
        top, top_param = request.alternatives()
        if top > self.config.max_logprobs:
            raise bad_request(f"{top_param} must be in [0, {self.config.max_logprobs}], got {top}", param=top_param)
        if top and request.stream:
            raise bad_request(f"{top_param} > 0 is not supported with stream: alternatives are scored when a completion ends", param=top_param)
        stop_sequences = self._stop_sequences(request)
        seed = request.seed if request.seed is not None else int(self._rng.integers(0, 2**31))
        request_key = object()  # the engine admits jobs fairly across requests
        jobs = []
        for prompt in prompts:  # each already shorter than max_seq_len (check_prompt_ids)
            budget = max_tokens if max_tokens is not None else limit - len(prompt)
            if len(prompt) + budget > limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(prompt) + budget} tokens ({len(prompt)} in the prompt, {budget} in the completion). "
                    "Please reduce the length of the prompt or of max_tokens.",
                    param="max_tokens",
                )
            jobs.append(
                GenerationJob(
                    prompt,
                    request.n,
                    budget,
                    request.temperature,
                    seed,
                    stop_sequences,
                    top_p=request.top_p if request.top_p is not None else 1.0,
                    top_k=min(max(request.top_k or 0, 0), self.vocab_size),  # past the vocabulary: keep all (as vLLM)
                    prompt_logprobs=k,
                    top_logprobs=top,
                    request=request_key,
                )
            )
        return jobs

    def _stop_sequences(self, request) -> list[list[int]]:
        # Stop token ids and EOS must end generation on device; stop strings are best effort there
        # (they are always applied to the returned text) and are only sent when their tokens
        # decode back to the string exactly.
        ids = list(dict.fromkeys(request.stop_token_ids or []))
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(f"stop_token_ids must be in [0, {self.vocab_size}), got {t}", param="stop_token_ids")
        eos = self.tokenizer.eos_token_id
        if not request.ignore_eos and eos is not None and eos not in ids:
            ids.insert(0, eos)
        sequences = [[t] for t in ids]
        capacity = self.config.max_stop_sequences
        if len(sequences) > capacity:
            raise bad_request(
                f"{len(ids)} stop tokens (EOS included) exceed the server's max_stop_sequences={capacity}", param="stop_token_ids"
            )
        for stop in request.stop_strings():
            if len(stop) > self.config.max_stop_tokens * self.chars_per_token:
                continue  # too long for the device whatever its tokens: applied to the output only
            tokens = self.tokenizer.encode(stop, add_special_tokens=False)
            fits = 0 < len(tokens) <= self.config.max_stop_tokens and len(sequences) < capacity
            if fits and self.tokenizer.decode(tokens) == stop:
                sequences.append(tokens)
        return sequences

    async def run(self, jobs: list[GenerationJob]) -> list[JobResult]:
        futures = [self.engine.submit(job) for job in jobs]
        gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        # A wait cancelled midway (the request or its worker went away) leaves the gather's
        # CancelledError unread, which asyncio logs as an error at exit: read it.
        gathered.add_done_callback(lambda g: g.cancelled() or g.exception())
        try:
            return await asyncio.wait_for(gathered, self.config.request_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(
                504,
                f"no answer within request_timeout_s={self.config.request_timeout_s} s "
                "(queued behind other requests or generation too long)",
            ) from None
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            # A job the engine cancelled (it is stopping) is a 503; a cancelled request (the client went
            # away) stays a cancellation.
            if not any(f.cancelled() for f in futures) or asyncio.current_task().cancelling():
                raise
            raise ApiError(503, "the inference server is shutting down") from None
        finally:
            for f in futures:
                f.cancel()  # no-op when done; drops queued jobs of a timed-out request

    # ------------------------------------------------------------------------------------- responses

    def choices(self, request, job: GenerationJob, result: JobResult) -> list[_Choice]:
        stops = request.stop_strings()
        stop_ids = set(request.stop_token_ids or [])
        eos = None if request.ignore_eos else self.tokenizer.eos_token_id

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)

        out = []
        for sample in result.samples:
            ids = sample.token_ids
            kept, text, stop_string = truncate_at_stop(ids, decode, stops, request.include_stop_str_in_output)
            ids = ids[:kept]
            if stop_string is not None:
                finish, reason = "stop", stop_string
            elif ids and ids[-1] in stop_ids:
                finish, reason = "stop", ids[-1]
            elif ids and ids[-1] == eos:
                finish, reason = "stop", None
            elif len(ids) == job.max_tokens:
                finish, reason = "length", None
            else:
                raise ApiError(500, f"the engine returned {len(ids)} tokens without a stop (max_tokens={job.max_tokens})")
            top_ids = None if sample.top_ids is None else sample.top_ids[:kept]
            top_logprobs = None if sample.top_logprobs is None else sample.top_logprobs[:kept]
            out.append(_Choice(ids, sample.logprobs[:kept], text, finish, reason, top_ids, top_logprobs))
        return out

    def prompt_logprobs(self, prompt: list[int], scores: PromptScores | None) -> PromptLogprobs | None:
        if scores is None:
            return None
        entries: PromptLogprobs = [None]
        for t in range(len(prompt) - 1):
            token = prompt[t + 1]
            (piece,) = self.token_pieces([token])
            entry = {token: Logprob(logprob=float(scores.logprobs[t]), rank=int(scores.ranks[t]), decoded_token=piece)}
            alternatives = scores.top_ids[t].tolist()
            for rank, (alt, lp, alt_piece) in enumerate(zip(alternatives, scores.top_logprobs[t].tolist(), self.token_pieces(alternatives)), start=1):
                entry.setdefault(alt, Logprob(logprob=float(lp), rank=rank, decoded_token=alt_piece))
            entries.append(entry)
        return entries

    def usage(self, prompts: list[list[int]], choices: list[_Choice]) -> Usage:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def render_chat(handler: RequestHandler, tokenizer, request: ChatCompletionRequest) -> list[int]:
    messages = [m.to_template() for m in request.messages]
    handler.check_prompt_text(sum(len(m.get("content") or "") for m in messages), "messages")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            tokenize=False,
            **(request.chat_template_kwargs or {}),
        )
    except Exception as e:  # a template error is the request's fault (bad roles/order for this template)
        raise bad_request(f"the chat template could not render these messages: {e}", param="messages") from e
    # The rendered text is measured before it is tokenized (tokens cost far more memory than characters);
    # tokenized as apply_chat_template(tokenize=True) does.
    handler.check_prompt_text(len(text), "messages")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_prompts(handler: RequestHandler, prompt) -> list[list[int]]:
    """The token ids of a completions request's `prompt` (texts are tokenized), checked."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [handler.check_prompt_ids(list(prompt), "prompt")]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            handler.check_prompt_text(len(p), "prompt")
            p = handler.tokenizer.encode(p, add_special_tokens=True)
        out.append(handler.check_prompt_ids(list(p), "prompt"))
    return out
