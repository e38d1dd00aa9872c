"""Configs of the inference server and the `marin-rl serve` process.

Kept free of JAX/Levanter imports so that a command line can parse them before the heavy imports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

WEIGHT_TOKEN_ENV = "MARIN_RL_WEIGHT_TOKEN"
"""Environment variable read for the weight-update bearer token when the config gives none."""

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class InferenceServerConfig:
    """An OpenAI-compatible server around Levanter's JAX inference engine (see docs/serving.md)."""

    host: str = "127.0.0.1"
    """Interface to bind. The default keeps the server private to this machine."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from `PolicyServer.base_url`)."""
    model_name: str = "policy"
    """Name served at /v1/models. Requests naming another model get 404; an omitted model is this one."""
    max_seqs: int = 16
    """Sequences decoded together (a request with `n` samples takes `n`). Requests beyond it wait in a queue."""
    max_seq_len: int = 1024
    """Longest prompt + completion in tokens. A request that cannot fit gets HTTP 400."""
    page_size: int = 64
    """Tokens per KV-cache page. The page pool is derived: `num_pages = max_seqs * ceil(max_seq_len /
    page_size)`, enough for every sequence to reach `max_seq_len`, so a batch never runs out of pages."""
    max_prefill_tokens: int | None = None
    """Prompt tokens prefilled in one device call (a static buffer size); None means `max_seq_len`.
    A batch's prompts must fit in it, so larger values batch more long prompts together."""
    max_rounds: int = 32
    """Decode steps per device call before the host collects finished sequences."""
    compute_dtype: str | None = None
    """Cast the served parameters and the KV cache to this dtype ("float32", "bfloat16", "float16");
    None keeps the dtype of the model handed over (fp32 from the learner)."""
    request_timeout_s: float = 600.0
    """A request not answered within this many seconds (queueing included) gets HTTP 504."""
    batch_wait_s: float = 0.005
    """After the first queued request, wait this long for more to batch with it."""
    max_stop_sequences: int = 8
    """Stop sequences (EOS, stop token ids, tokenized stop strings) checked on device per sequence.
    Stop strings beyond this are still honoured when the completion is returned."""
    max_stop_tokens: int = 16
    """Longest tokenized stop string checked on device (longer ones are honoured on return)."""
    max_logprobs: int = 20
    """Largest `prompt_logprobs` (top-k alternatives per prompt token) a request may ask for."""
    seed: int = 0
    """Seeds the sampling keys of requests that give no `seed`."""
    max_request_bytes: int = 8 * 2**20
    """Largest request body; a larger one gets HTTP 413 before it is read (so before any tokenizing)."""
    weight_update_token: str | None = None
    """Bearer token of POST /v1/weights/update (the `serve` process only). None reads the
    MARIN_RL_WEIGHT_TOKEN environment variable; with neither, the endpoint is not mounted."""

    def __post_init__(self):
        for name in ("max_seqs", "max_seq_len", "page_size", "max_rounds", "max_stop_sequences", "max_stop_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"InferenceServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.max_seq_len:
            raise ValueError(
                f"InferenceServerConfig.max_prefill_tokens must be >= max_seq_len ({self.max_seq_len}) so that "
                f"any prompt fits, got {self.max_prefill_tokens}"
            )
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
            raise ValueError(f"InferenceServerConfig.compute_dtype must be one of {_DTYPES} or None, got {self.compute_dtype!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"InferenceServerConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_request_bytes < 1:
            raise ValueError(f"InferenceServerConfig.max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"InferenceServerConfig.port must be in [0, 65535], got {self.port}")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def num_pages(self) -> int:
        """Size of the KV page pool: every sequence slot can grow to `max_seq_len`."""
        return self.max_seqs * self.pages_per_seq

    @property
    def prefill_tokens(self) -> int:
        return self.max_prefill_tokens if self.max_prefill_tokens is not None else self.max_seq_len

    def resolved_weight_token(self) -> str | None:
        """The weight-update token from the config, else from MARIN_RL_WEIGHT_TOKEN, else None."""
        return self.weight_update_token or os.environ.get(WEIGHT_TOKEN_ENV) or None


@dataclass(frozen=True)
class ServeConfig:
    """`marin-rl serve`: serve an HF checkpoint and take new weights through a token-protected endpoint."""

    checkpoint: str
    """Local Hugging Face checkpoint directory (config.json + safetensors) served at start."""
    tokenizer: str | None = None
    """Tokenizer directory, or "char" for the shipped character tokenizer; None uses `checkpoint`."""
    policy_version: int = 0
    """Policy version reported for the starting checkpoint."""
    server: InferenceServerConfig = field(default_factory=lambda: InferenceServerConfig(port=8000))
    """Server settings; set `server.weight_update_token` (or MARIN_RL_WEIGHT_TOKEN) to accept weight updates."""
    ready_file: str | None = None
    """Once serving, write `{"base_url": ..., "pid": ...}` here (atomically), e.g. for a launcher that used port 0."""
