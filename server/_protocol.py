"""Wire format of the inference server: OpenAI requests/responses plus vLLM's token-level extensions.

Requests accept the OpenAI fields and the vLLM extras env code uses against vLLM (`return_token_ids`,
`return_tokens_as_token_ids`, `prompt_logprobs`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `ignore_eos`, token-id prompts on /v1/completions). Responses carry vLLM's
`token_ids` (per choice), `prompt_token_ids`, `prompt_logprobs`, `stop_reason`, and our `policy_version`.
Sampling options the engine cannot honour are refused with HTTP 400 rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ----------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as HTTP `status` with an OpenAI-style body `{"error": {...}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "APIError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    500: "InternalServerError",
    504: "TimeoutError",
}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# --------------------------------------------------------------------------------------------- requests

# Sampling options of the OpenAI/vLLM APIs the engine does not implement, with the value that means
# "off". A request setting any other value is refused, so env code never silently gets other sampling.
_NEUTRAL_OPTIONS: dict[str, Any] = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "min_tokens": 0,
    "use_beam_search": False,
    "best_of": 1,
    "echo": False,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """A last event with the usage (and no choices), as OpenAI sends."""


class _Request(BaseModel):
    # Like vLLM, unknown fields are ignored. JSON's Infinity and NaN are refused (400), not sampled with.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    # vLLM extensions
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    return_token_ids: bool = True
    """vLLM defaults to False; we always return the ids unless a request says false."""
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    """0 or -1: no top-k cut (vLLM's convention)."""
    # accepted only with their neutral value (see _NEUTRAL_OPTIONS)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    use_beam_search: bool | None = None
    best_of: int | None = None
    echo: bool | None = None
    stream: bool = False
    """Server-sent events: each choice's text, token ids and log-probs as they are generated."""
    stream_options: StreamOptions | None = None

    def check_supported(self) -> None:
        for name, neutral in _NEUTRAL_OPTIONS.items():
            value = getattr(self, name)
            allowed = neutral if isinstance(neutral, tuple) else (neutral,)
            if value is not None and value not in allowed:
                raise bad_request(
                    f"{name}={value!r} is not supported by this server; "
                    f"omit it or use {allowed[0]!r}",
                    param=name,
                )

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(s == "" for s in stops):
            raise bad_request("stop strings must be non-empty", param="stop")
        return stops


class ChatMessage(BaseModel):
    """A chat message; fields beyond role/content (tool_calls, name, ...) pass to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def to_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"only text content parts are supported, got {part.get('type')!r}", "messages")
                parts.append(part["text"])
            message["content"] = "".join(parts)
        return message


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    """None (not sent) returns logprobs anyway: RL needs them; false omits them."""
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    """Passed to the chat template; tool calls in the output are not parsed (the text is returned)."""
    chat_template_kwargs: dict[str, Any] | None = None

    def alternatives(self) -> tuple[int, str]:
        """(top alternatives per sampled token, the field that asked)."""
        if self.top_logprobs and self.logprobs is False:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return self.top_logprobs or 0, "top_logprobs"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, texts, one token-id list, or several token-id lists."""
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    """Any value >= 0 returns the sampled tokens' logprobs (None too, see chat), and k > 0 also the k
    most likely tokens at each position (`top_logprobs`)."""

    def alternatives(self) -> tuple[int, str]:
        """(top alternatives per sampled token, the field that asked)."""
        return self.logprobs or 0, "logprobs"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# -------------------------------------------------------------------------------------------- responses


class Logprob(BaseModel):
    """vLLM's per-token logprob record (used in `prompt_logprobs`)."""

    logprob: float
    rank: int | None = None
    """1 = the model's most likely token at that position."""
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token: None for the first, else {token_id: Logprob} holding the actual prompt
token and up to `prompt_logprobs` top alternatives."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the choice; None for EOS or length (as vLLM)."""
    token_ids: list[int] | None = None
    """The sampled ids, including a final EOS/stop token, excluding anything after a stop string."""


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    """The chat template's rendering of `messages` (with the generation prompt): what the model saw."""
    prompt_logprobs: PromptLogprobs | None = None
    policy_version: int
    """The policy version (learner step) whose weights produced every choice of this response."""


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: list[dict[str, float]] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    policy_version: int
    """The policy version (learner step) whose weights produced every choice of this response."""


class WeightUpdateRequest(BaseModel):
    path: str | None = None
    """Local directory of an HF safetensors checkpoint with the serving architecture; with `adapters`,
    the base they sit on (kept: later updates may bring adapters alone)."""
    adapters: str | None = None
    """Local path of a LoRA adapters file (`marin_rl.adapters` format), put on the base: `path`'s, or the
    one kept from an earlier update."""
    policy_version: int = Field(ge=0)
    reset: bool = False
    """Accept a version older than the served one: a resumed run rolls its servers back to its checkpoint."""


class WeightVersionResponse(BaseModel):
    policy_version: int
    instance: str | None = None
    """Random id of this server process: a restarted server has another (the broadcaster re-syncs it)."""
    load_seconds: float | None = None
    swap_seconds: float | None = None


# ------------------------------------------------------------------------------------- output handling


def truncate_at_stop(
    token_ids: list[int], decode, stop_strings: list[str], include_stop_str: bool
) -> tuple[int, str, str | None]:
    """Cut a completion at the first stop string it produces.

    `decode(ids) -> str`. Returns `(num_tokens_kept, text, stop_string_or_None)`: the kept tokens end
    with the token that completed the stop string (what the model sampled); the text ends before the
    stop string, or after it with `include_stop_str` (vLLM's semantics).
    """
    text = decode(token_ids)
    if not stop_strings or not any(s in text for s in stop_strings):
        return len(token_ids), text, None
    # Smallest prefix whose text contains a stop string (prefix texts grow monotonically).
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(token_ids[:mid]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    prefix_text = decode(token_ids[:lo])
    start, stop = min((prefix_text.find(s), s) for s in stop_strings if s in prefix_text)
    end = start + len(stop) if include_stop_str else start
    return lo, prefix_text[:end], stop
