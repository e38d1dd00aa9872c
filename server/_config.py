"""Configs of the inference server and the `marin-rl serve` process.

Kept free of JAX/Levanter imports so that a command line can parse them before the heavy imports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from marin_rl.engine import EngineConfig

WEIGHT_TOKEN_ENV = "MARIN_RL_WEIGHT_TOKEN"
"""Environment variable read for the weight-update bearer token when the config gives none."""


@dataclass(frozen=True)
class InferenceServerConfig(EngineConfig):
    """An OpenAI-compatible server around the project's generation engine (see docs/serving.md); the
    engine's settings (`max_seqs`, `max_seq_len`, KV cache, ...) are fields of this config too."""

    host: str = "127.0.0.1"
    """Interface to bind. The default keeps the server private to this machine."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from `PolicyServer.base_url`)."""
    model_name: str = "policy"
    """Name served at /v1/models. Requests naming another model get 404; an omitted model is this one."""
    request_timeout_s: float = 600.0
    """A request not answered within this many seconds (queueing included) gets HTTP 504."""
    max_request_bytes: int = 8 * 2**20
    """Largest request body; a larger one gets HTTP 413 before it is read (so before any tokenizing)."""
    max_sequences_per_request: int = 4096
    """Most sequences one request may ask for (prompts x n); more gets HTTP 400 before any prompt is
    validated or tokenized. Admission is fair across requests whatever this is (docs/serving.md)."""
    weight_update_token: str | None = None
    """Bearer token of POST /v1/weights/update (the `serve` process only). None reads the
    MARIN_RL_WEIGHT_TOKEN environment variable; with neither, the endpoint is not mounted."""

    def __post_init__(self):
        super().__post_init__()
        if self.request_timeout_s <= 0:
            raise ValueError(f"InferenceServerConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_request_bytes < 1:
            raise ValueError(f"InferenceServerConfig.max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_sequences_per_request < 1:
            raise ValueError(
                f"InferenceServerConfig.max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"InferenceServerConfig.port must be in [0, 65535], got {self.port}")

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
    compilation_cache: str = "auto"
    """JAX's persistent compilation cache, as a training run's `compilation_cache`: `auto`
    (`$MARIN_RL_COMPILATION_CACHE`, else `~/.cache/marin-rl/jax`), a directory, or `off`. A restarted
    server loads its engine's programs instead of compiling them."""
