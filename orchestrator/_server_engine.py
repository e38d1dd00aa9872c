"""The thread that owns Levanter's `InferenceEngine`: batches queued requests, generates, swaps weights.

Levanter's own `InferenceServer` is not used: its batcher admits requests the page pool cannot hold
("Out of free pages", after which every request fails), concatenates all stop strings into one stop
sequence, reports every finish as "stop" and drops token ids. Here one thread drives the engine:

- A batch holds at most `max_seqs` sequences and `prefill_tokens` prompt tokens, so the engine admits
  all of it in its first prefill; the page pool is sized for every slot to reach `max_seq_len`, so the
  engine can never run out of pages. Requests beyond a batch wait in the queue.
- Weight swaps are applied between batches: every completion comes from one policy version.
- `prompt_logprobs` come from a separate forward pass over the prompt with the same weights.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.inference.utils import INVALID
from levanter.layers.attention import AttentionMask

import marin_rl._compat  # noqa: F401  (haliax/JAX version workarounds)
from marin_rl.orchestrator._server_config import InferenceServerConfig

logger = logging.getLogger(__name__)


@dataclass
class GenerationJob:
    """One prompt to sample `n` completions for (a request with several prompts makes several jobs)."""

    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: int
    stop_sequences: list[list[int]]
    """Token sequences that end a completion on device (EOS, stop token ids, tokenized stop strings)."""
    prompt_logprobs: int | None = None
    """Score the prompt and keep this many top alternatives per position; None skips the forward pass."""
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    """Same length as `token_ids`: log-probability of each sampled token under the sampling distribution."""


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


def serving_copy(model, compute_dtype: str | None):
    """The server's own copy of `model`'s arrays, floating ones cast to `compute_dtype` (None keeps them).

    A copy, not a view: the learner may donate or overwrite its buffers after handing the model over.
    """

    def leaf(x):
        if not eqx.is_array(x):
            return x
        dtype = compute_dtype if compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jnp.array(x, dtype=dtype, copy=True)

    return jax.block_until_ready(jax.tree.map(leaf, model))


def check_same_architecture(served, new) -> None:
    """Raise ValueError unless `new` has the served model's structure, config, shapes and dtypes.

    Anything else would recompile the engine's kernels (or fail inside them).
    """
    served_leaves, served_def = jax.tree.flatten(served)
    new_leaves, new_def = jax.tree.flatten(new)
    if served_def != new_def:
        raise ValueError(
            "new weights have a different model structure or config than the served model "
            f"(served config {getattr(served, 'config', None)}, new config {getattr(new, 'config', None)})"
        )
    for i, (a, b) in enumerate(zip(served_leaves, new_leaves)):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(f"new weights: leaf {i} is {b.dtype}{list(b.shape)}, the served model has {a.dtype}{list(a.shape)}")


def _kv_dtype(model, compute_dtype: str | None):
    if compute_dtype is not None:
        return jnp.dtype(compute_dtype)
    floats = [x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))]
    return floats[0] if floats else jnp.float32


@eqx.filter_jit
def _score_prompt(model, tokens: jax.Array, top_k: int):
    """Log-prob, rank and top-k alternatives of tokens[1:] under `model` (tokens padded at the end)."""
    # A batch axis of 1: some attention kernels (the learner's `cudnn` backend) require one.
    ids = hax.named(tokens[None, :], ("batch", "position"))
    logits = model(ids, AttentionMask.causal()).rearrange(("batch", "position", model.Vocab)).array[0].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    token_logp = jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logp > token_logp[:, None], axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, top_k)
    return token_logp, ranks, top_ids, top_logp


class EngineWorker:
    """Owns the engine and its thread. `submit` jobs, `swap` weights, `stop` at the end."""

    def __init__(self, config: InferenceServerConfig, model, tokenizer, policy_version: int):
        self._config = config
        self._tokenizer = tokenizer
        self._engine_config = InferenceEngineConfig(
            max_seq_len=config.max_seq_len,
            page_size=config.page_size,
            max_pages=config.num_pages,
            max_seqs=config.max_seqs,
            max_seqs_in_prefill=config.max_seqs,
            max_prefill_size=config.prefill_tokens,
            max_queued_tokens=2 * config.max_seqs,
            max_rounds=config.max_rounds,
            max_stop_seqs=config.max_stop_sequences,
            max_stop_tokens=config.max_stop_tokens,
            # Always on: a decode state without the logprob buffer is a different pytree (a recompile).
            enable_logprobs=True,
            compute_dtype=_kv_dtype(model, config.compute_dtype),
            seed=config.seed,
        )
        self._model = model
        self._engine = InferenceEngine.from_model_with_config(model, tokenizer, self._engine_config)
        self._policy_version = policy_version
        self._top_k = max(1, min(config.max_logprobs, model.Vocab.size))
        self._jobs: collections.deque[GenerationJob] = collections.deque()
        self._swaps: collections.deque[tuple[object, int, threading.Event]] = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="marin-rl-inference", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def submit(self, job: GenerationJob) -> concurrent.futures.Future:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the inference server is shut down")
            self._jobs.append(job)
            self._cv.notify()
        return job.future

    def swap(self, model, policy_version: int, wait: bool = True) -> None:
        """Install `model` before the next batch (a running batch finishes with the old weights).
        With `wait`, block until installed; either way, a job submitted after this returns runs on the
        new weights (or newer)."""
        check_same_architecture(self._model, model)
        installed = threading.Event()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the inference server is shut down")
            self._swaps.append((model, policy_version, installed))
            self._cv.notify()
        if wait:
            installed.wait()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    # ------------------------------------------------------------------------------------ worker thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._jobs or self._swaps):
                    self._cv.wait()
                if self._stopped:
                    pending, self._jobs = list(self._jobs), collections.deque()
                    swaps = list(self._swaps)
                    break
                swaps, self._swaps = list(self._swaps), collections.deque()
            for model, version, installed in swaps:
                # The engine passes the model to its jitted kernels as an argument: same structure and
                # shapes, so the compiled kernels are reused.
                self._model = self._engine.model = model
                self._policy_version = version
                installed.set()
            if self._jobs:
                if self._config.batch_wait_s > 0:
                    time.sleep(self._config.batch_wait_s)
                batch = self._take_batch()
                if batch:
                    self._run_batch(batch)
        for job in pending:
            job.future.cancel()
        for _, _, installed in swaps:
            installed.set()

    def _take_batch(self) -> list[GenerationJob]:
        """FIFO jobs that the engine admits in one prefill (skipping those cancelled by a timeout)."""
        batch: list[GenerationJob] = []
        seqs = tokens = 0
        with self._cv:
            while self._jobs:
                job = self._jobs[0]
                if batch and (
                    seqs + job.n > self._config.max_seqs or tokens + len(job.prompt_ids) > self._config.prefill_tokens
                ):
                    break
                self._jobs.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
                batch.append(job)
                seqs += job.n
                tokens += len(job.prompt_ids)
        return batch

    def _run_batch(self, batch: list[GenerationJob]) -> None:
        try:
            self._generate(batch)
        except Exception as e:  # every request gets an answer (HTTP 500), and the thread lives on
            logger.exception("inference batch failed; rebuilding the engine")
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
            try:  # the engine donates its state to its kernels: after a failure it may hold deleted arrays
                self._engine = InferenceEngine.from_model_with_config(self._model, self._tokenizer, self._engine_config)
            except Exception:
                logger.exception("could not rebuild the inference engine")

    def _generate(self, batch: list[GenerationJob]) -> None:
        version = self._policy_version
        scores = [self._score(job) if job.prompt_logprobs is not None else None for job in batch]
        result = self._engine.generate([self._engine_request(i, job) for i, job in enumerate(batch)])
        if len(self._engine.free_slots) != self._config.max_seqs:
            # Upstream: the engine's outer loop gives up after max_seq_len decode rounds and can leave
            # slots allocated; start the next batch from a clean state.
            logger.warning("engine kept %d slots busy after a batch; resetting it", self._config.max_seqs - len(self._engine.free_slots))
            self._engine.reset()
        assert result.logprobs is not None  # enable_logprobs is always on
        offset = 0
        for job, score in zip(batch, scores):
            samples = [Sample(list(result.tokens[offset + k]), list(result.logprobs[offset + k])) for k in range(job.n)]
            offset += job.n
            job.future.set_result(JobResult(samples, score, version))

    def _engine_request(self, request_id: int, job: GenerationJob) -> Request:
        stops = np.full((self._config.max_stop_sequences, self._config.max_stop_tokens), INVALID, dtype=np.int32)
        for row, seq in enumerate(job.stop_sequences):
            stops[row, len(stops[row]) - len(seq) :] = seq  # the engine matches stop sequences right-aligned
        params = SeqDecodingParams(
            max_num_tokens=np.int32(len(job.prompt_ids) + job.max_tokens),
            stop_tokens=hax.named(jnp.asarray(stops), ("stop_seq", "position")),
            temperature=np.float32(job.temperature),
            # A raw threefry key [hi, lo] of the 63-bit seed: jax.random.PRNGKey would keep only the low 32
            # bits without x64 (seeds 0 and 2**62 would sample alike).
            key=np.array([job.seed >> 32, job.seed & 0xFFFFFFFF], dtype=np.uint32),
        )
        return Request(
            prompt_tokens=list(job.prompt_ids),
            request_id=request_id,
            decode_params=params,
            n_generations=job.n,
            enable_logprobs=True,
        )

    def _score(self, job: GenerationJob) -> PromptScores:
        n = len(job.prompt_ids)
        # Pad to a power of two (causal attention: padding at the end changes nothing before it), so the
        # forward pass compiles once per bucket rather than once per prompt length.
        padded = max(16, 1 << (n - 1).bit_length())
        tokens = np.zeros(padded, dtype=np.int32)
        tokens[:n] = job.prompt_ids
        logp, ranks, top_ids, top_logp = jax.device_get(_score_prompt(self._model, jnp.asarray(tokens), self._top_k))
        k = job.prompt_logprobs
        return PromptScores(logp[: n - 1], ranks[: n - 1], top_ids[: n - 1, :k], top_logp[: n - 1, :k])
