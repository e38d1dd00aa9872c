"""What goes in and out of the engine: a job (one prompt, `n` samples) and its result."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationJob:
    """One prompt to sample `n` completions for (a request with several prompts makes several jobs)."""

    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    """0 samples greedily."""
    seed: int
    """63-bit seed; sample i at position p draws with a key derived from (seed, i, p) alone, so its
    output does not depend on what else is batched with it."""
    stop_sequences: list[list[int]]
    """Token sequences that end a completion on device (EOS, stop token ids, tokenized stop strings)."""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    prompt_logprobs: int | None = None
    """Score the prompt and keep this many top alternatives per position; None skips the forward pass."""
    top_logprobs: int = 0
    """Keep this many top alternatives per sampled token: each finished sample is scored with a forward
    pass over prompt + completion (the model's own distribution, the weights installed at completion)."""
    request: Hashable | None = None
    """The jobs of one request (its prompts) share this: admission is fair across requests. None: a
    request of its own."""
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    on_tokens: Callable[[int, list[int], list[float]], None] | None = None
    """Streaming: called on the engine's thread with (sample index, new token ids, their log-probs) as
    each sample's tokens are read back, before the future completes. Must not block."""
    submitted_at: float | None = None
    """`time.perf_counter()` when the engine queued it."""
    first_token_at: float | None = None
    """`time.perf_counter()` when its first tokens were drawn (time to first token = the difference)."""


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    """Same length as `token_ids`: log-probability of each sampled token under the distribution it was
    drawn from (temperature, top-p and top-k applied; the raw model distribution for greedy)."""
    top_ids: np.ndarray | None = None
    """[len(token_ids), job.top_logprobs] the most likely tokens at each sampled position, best first
    (the model's distribution, without temperature); None unless the job asked for them."""
    top_logprobs: np.ndarray | None = None
    """Their log-probabilities, same shape."""


@dataclass(frozen=True)
class PromptScores:
    """Scores of prompt tokens 1..L-1 given their prefixes (token 0 has none)."""

    logprobs: np.ndarray
    """[L-1] log p(prompt[t] | prompt[:t])."""
    ranks: np.ndarray
    """[L-1] 1-based rank of prompt[t] among the vocabulary."""
    top_ids: np.ndarray
    """[L-1, k] most likely tokens at each position."""
    top_logprobs: np.ndarray
    """[L-1, k] their log-probabilities."""


@dataclass(frozen=True)
class JobResult:
    samples: list[Sample]
    prompt_scores: PromptScores | None
    policy_version: int
    """The oldest policy version whose weights produced any token of the samples (weights swapped in
    while a sequence is decoding serve its later tokens)."""
