"""Sampling: the seam between an env and an inference server.

Token-in, token-out. An env renders the conversation to token ids itself and sends those ids as
the prompt; the server returns the sampled ids and their logprobs (vLLM's token-id extensions to
the OpenAI completions API). Nothing is re-tokenized on the way back, so the learner trains on
exactly what was sampled.

`Sampler` is the seam: `OpenAISampler` talks to a real server through `openai.AsyncOpenAI` (all
production sampling), `ScriptedSampler` returns scripted completions for tests and for trying an
env without a model.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from marin_rl.types import FINISH_REASONS, InferenceMetadata


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled for one env (sent with every request)."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 512
    """Most tokens sampled per assistant turn."""
    stop: tuple[str, ...] = ()
    """Stop strings. An env's own stop strings (e.g. a tool tag) are always kept, see `merged`."""
    seed: int | None = None
    """Server-side sampling seed, where the server supports one."""

    def __post_init__(self):
        # YAML gives lists; keep the dataclass hashable and comparable.
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")

    def merged(self, override: SamplingParams | None) -> SamplingParams:
        """`override` (from run config) wins, but this env's stop strings stay: a tool env needs them."""
        if override is None:
            return self
        stop = tuple(dict.fromkeys((*override.stop, *self.stop)))
        return replace(override, stop=stop)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: np.ndarray
    """int32, the sampled ids (a sampled EOS included)."""
    logprobs: np.ndarray
    """float32, same length as `token_ids`: the behaviour policy's logprob of each sampled id."""
    metadata: InferenceMetadata
    """Who sampled it, with which policy version, why it stopped."""

    def __post_init__(self):
        object.__setattr__(self, "token_ids", np.asarray(self.token_ids, dtype=np.int32))
        object.__setattr__(self, "logprobs", np.asarray(self.logprobs, dtype=np.float32))
        if self.token_ids.shape != self.logprobs.shape:
            raise ValueError(
                f"Completion: logprobs must have length {len(self.token_ids)} like token_ids, "
                f"got {len(self.logprobs)}"
            )

    @property
    def finish_reason(self) -> str:
        return self.metadata.finish_reason


class SamplerError(RuntimeError):
    """A server answered something the token-in/token-out contract cannot use."""


class Sampler(ABC):
    """Samples `n` completions of a token-id prompt."""

    @abstractmethod
    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        """`n` completions of `prompt_ids`, in order."""

    async def aclose(self) -> None:
        """Release connections; call before the event loop closes."""

    def fork(self, *key: int | str) -> Sampler:
        """The sampler for one part of the work, e.g. `fork("rollout", i)` for the later turns of a group's
        i-th rollout: a seeded sampler gives each key a random stream of its own (so conversations that
        coincide still sample apart); others return themselves."""
        return self


def async_openai_client(base_url: str, api_key: str, **kwargs):
    """An `openai.AsyncOpenAI` client over aiohttp (`kwargs`: the client's, e.g. `max_retries`, `timeout`).
    With 128 requests in flight, httpx (the SDK's default) spent about 10 ms of CPU a request in its
    connection pool on the 2-core VM and aiohttp about 3 (`benchmarks/bench_http.py --latency 0.25
    --client ...`): over httpx one env-worker process could not keep a GPU engine's slots full. Make it
    inside the event loop that uses it."""
    from openai import AsyncOpenAI, DefaultAioHttpClient

    return AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=DefaultAioHttpClient(), **kwargs)


def token_prompt_arguments(prompt_ids: Sequence[int], **extra_body) -> dict[str, Any]:
    """`completions.create` arguments that send the token-id prompt as it is, with `extra_body`. The SDK
    walks its arguments element by element to transform them (on the 2-core VM 1.7 of its 2.7 ms of CPU a
    request for a 96-token prompt, growing with the prompt); extra_body goes into the JSON body untouched."""
    return {"prompt": [], "extra_body": {"prompt": [int(t) for t in prompt_ids], **extra_body}}


class OpenAISampler(Sampler):
    """Samples from an OpenAI-compatible server with vLLM's token-id extensions.

    `policy_version`: servers of this project report the version that sampled each response and a
    response without one is an error. A plain vLLM server does not report it: pass the version it
    serves here (it is used only when the response carries none).
    """

    def __init__(self, client, model: str, *, server_id: str | None = None, policy_version: int | None = None):
        self.client = client
        self.model = model
        self.server_id = server_id if server_id is not None else str(client.base_url)
        self.policy_version = policy_version

    @classmethod
    def from_url(cls, base_url: str, model: str, *, api_key: str = "EMPTY", **kwargs) -> OpenAISampler:
        return cls(async_openai_client(base_url, api_key), model, **kwargs)

    async def aclose(self) -> None:
        await self.client.close()

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        prompt = [int(t) for t in prompt_ids]
        start = time.perf_counter()
        response = await self.client.completions.create(
            model=self.model,
            n=n,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            logprobs=1,
            stop=list(params.stop) or None,
            seed=params.seed,
            # vLLM extensions: the sampled ids, and ids (`token_id:N`) in the logprob tokens.
            **token_prompt_arguments(prompt, return_token_ids=True, return_tokens_as_token_ids=True),
        )
        latency_s = time.perf_counter() - start
        return parse_completions(
            response,
            prompt,
            n,
            server_id=self.server_id,
            model=self.model,
            default_policy_version=self.policy_version,
            latency_s=latency_s,
            sampling_params=params.to_dict(),
        )


_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def parse_completions(
    response: Any,
    prompt_ids: Sequence[int],
    n: int,
    *,
    server_id: str,
    model: str,
    default_policy_version: int | None,
    latency_s: float,
    sampling_params: dict[str, Any],
) -> list[Completion]:
    """Read a vLLM-style completions response (an openai `Completion`) into `Completion`s."""
    version = _extra(response, "policy_version")
    if version is None:
        version = default_policy_version
    if version is None:
        raise SamplerError(
            f"server {server_id!r}: response has no policy_version; servers of this project report one, "
            "for other servers pass OpenAISampler(policy_version=...)"
        )
    choices = sorted(response.choices, key=lambda c: c.index)
    if len(choices) != n:
        raise SamplerError(f"server {server_id!r}: asked for n={n} choices, got {len(choices)}")
    echoed = _extra(response, "prompt_token_ids")
    completions = []
    for choice in choices:
        echoed_here = _extra(choice, "prompt_token_ids")
        echoed_prompt = echoed_here if echoed_here is not None else echoed
        if echoed_prompt is not None and list(echoed_prompt) != list(prompt_ids):
            raise SamplerError(
                f"server {server_id!r}: prompt_token_ids differ from the prompt sent "
                f"(length {len(echoed_prompt)} vs {len(prompt_ids)}); the server re-tokenized the prompt"
            )
        token_ids, logprobs = _choice_tokens(choice, server_id)
        if choice.finish_reason not in FINISH_REASONS:
            raise SamplerError(
                f"server {server_id!r}: finish_reason must be one of {FINISH_REASONS}, got {choice.finish_reason!r}"
            )
        meta = InferenceMetadata(
            server_id=server_id,
            model=model,
            policy_version=int(version),
            finish_reason=choice.finish_reason,
            latency_s=latency_s,
            sampling_params=sampling_params,
        )
        completions.append(Completion(token_ids, logprobs, meta))
    return completions


def _choice_tokens(choice: Any, server_id: str) -> tuple[list[int], list[float]]:
    logprobs = choice.logprobs
    if logprobs is None or logprobs.token_logprobs is None:
        raise SamplerError(f"server {server_id!r}: choice {choice.index} has no logprobs (send logprobs=1)")
    values = list(logprobs.token_logprobs)
    if any(v is None for v in values):
        raise SamplerError(f"server {server_id!r}: choice {choice.index} has a null token logprob")
    token_ids = _extra(choice, "token_ids")
    if token_ids is None:
        token_ids = []
        for token in logprobs.tokens or []:
            match = _TOKEN_ID.match(token)
            if match is None:
                raise SamplerError(
                    f"server {server_id!r}: choice {choice.index} has no token_ids and its logprob token "
                    f"{token!r} is not `token_id:N` (send return_tokens_as_token_ids)"
                )
            token_ids.append(int(match.group(1)))
    token_ids = [int(t) for t in token_ids]
    if len(token_ids) != len(values):
        raise SamplerError(
            f"server {server_id!r}: choice {choice.index}: {len(values)} logprobs for {len(token_ids)} token ids"
        )
    return token_ids, [float(v) for v in values]


def _extra(obj: Any, name: str) -> Any:
    # vLLM's extensions arrive as extra fields on openai's pydantic models.
    value = getattr(obj, name, None)
    if value is None and isinstance(getattr(obj, "model_extra", None), dict):
        value = obj.model_extra.get(name)
    return value


Script = Callable[[str], str] | Sequence[str]


@dataclass
class ScriptedSampler(Sampler):
    """Returns scripted completions, tokenized with `tokenizer`: for tests and for trying an env.

    `script` is a function of the decoded prompt text (so a multi-turn script can react to tool
    results) or a list of texts used in turn. A text that reaches a stop string ends there with
    finish `stop` (its ids keep the stop string, as vLLM's do); one longer than `max_tokens` is cut
    with finish `length`; otherwise EOS is appended with finish `stop`. Every prompt is recorded in
    `prompts`.
    """

    tokenizer: Any
    script: Script
    logprob: float = -0.5
    policy_version: int = 0
    prompts: list[list[int]] = field(default_factory=list)
    _next: int = field(default=0, init=False, repr=False)

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        prompt = [int(t) for t in prompt_ids]
        self.prompts.append(prompt)
        prompt_text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        return [self._complete(self._text(prompt_text), params) for _ in range(n)]

    def _text(self, prompt_text: str) -> str:
        if callable(self.script):
            return self.script(prompt_text)
        text = self.script[self._next % len(self.script)]
        self._next += 1
        return text

    def _complete(self, text: str, params: SamplingParams) -> Completion:
        finish = "stop"
        stops = [text.index(s) + len(s) for s in params.stop if s in text]
        if stops:
            text = text[: min(stops)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        meta = InferenceMetadata(
            server_id="scripted",
            model="scripted",
            policy_version=self.policy_version,
            finish_reason=finish,
            sampling_params=params.to_dict(),
        )
        return Completion(ids, np.full(len(ids), self.logprob, np.float32), meta)
