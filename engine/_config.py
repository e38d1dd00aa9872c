"""`EngineConfig`: sizes and options of the generation engine (no JAX imports: command lines parse it)."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")
_ATTENTION = ("auto", "pallas", "jax")


@dataclass(frozen=True)
class ExactLayout:
    """The fixed shapes of the exact forward pass (`_exact.py`); the engine and the learner use equal ones."""

    tile: int
    """Tokens per tile: every matmul and reduction of the pass is `tile` rows."""
    context: int
    """Keys every attention window holds (the longest sequence the engine serves, in whole KV pages)."""

    def __post_init__(self):
        if self.tile < 1 or self.context < 1:
            raise ValueError(f"ExactLayout: tile and context must be >= 1, got {self.tile} and {self.context}")


@dataclass(frozen=True)
class EngineConfig:
    """The generation engine: continuous batching over `max_seqs` slots and a paged KV cache (docs/serving.md)."""

    max_seqs: int = 16
    """Sequences decoded together (a request with `n` samples takes `n` slots). Requests beyond it wait
    in a queue and are admitted as soon as slots and KV pages free up."""
    max_seq_len: int = 1024
    """Longest prompt + completion in tokens. A request that cannot fit gets HTTP 400."""
    page_size: int = 16
    """Tokens per KV-cache page. The `n` samples of a prompt share its full prompt pages."""
    kv_cache_tokens: int | None = None
    """KV-cache size in tokens. None: `kv_cache_memory_fraction` if set, else enough whole pages for every
    slot to reach `max_seq_len` (`max_seqs * max_seq_len`, rounded up to pages per slot)."""
    kv_cache_memory_fraction: float | None = None
    """Size the KV cache to this fraction of the device memory free when the engine starts (GPU/TPU).
    Leave room for the learner when colocated."""
    max_prefill_tokens: int | None = None
    """Prompt tokens (padded) prefilled in one device call; None means `max(max_seq_len, 4096)`.
    Larger values admit more new prompts at once."""
    max_prefill_rows: int | None = None
    """Prompts prefilled in one device call at most (None: as many as `max_prefill_tokens` and the free
    slots allow). Prompts beyond it wait for the next prefill call. `marin-rl train` sets it to the
    prompts its env workers can have in flight (at most 4 on a CPU), so that start-up compiles no prefill
    shape the run cannot use."""
    precompile_prompt_lens: tuple[int, ...] = ()
    """At start, compile prefill for every number of prompts of these lengths (their power-of-two
    buckets) and decode for every number of busy slots (seconds each on a GPU), so that no request
    waits on a compilation. Empty: each shape compiles on first use; `marin-rl train` derives them from
    its envs' prompts."""
    precompile_decode: bool = True
    """With `precompile_prompt_lens`, compile the decode shapes too. Off where every request asks for one
    token (the first comes from the prefill, so nothing decodes): about 5 s less start-up in the quickstart."""
    precompile_truncated: bool = False
    """With `precompile_prompt_lens`, compile the variants of top-p/top-k sampling too."""
    min_decode_slots: int | None = None
    """Fewest rows a decode call computes: the slots in use are padded to a power of two from it (then to
    multiples of 128), one program compiled at start each. None: 32 on a GPU, 8 elsewhere. On an H200 each
    decode program autotunes its own Triton GEMMs: from 32 rows the 1B engine compiled in 14.3-15.8 s cold
    instead of 18.5-25.3 s, and 8 busy slots decoded in 1.17 ms a step instead of 0.99 (docs/serving.md).
    Set 8 where few requests at a time matter more than the start."""
    min_prefill_tokens: int | None = None
    """Fewest tokens (prompts times their padded length) a prefill call computes: a call of fewer prompts
    is padded to more rows (powers of four), so that fewer prefill programs compile at start. None: 256 on
    a GPU, where a call of fewer tokens takes as long (the 0.5B loop's 16-token prompts compile no 1- and
    4-prompt programs), 1 elsewhere."""
    decode_steps: int = 16
    """Decode steps per device call before the host collects finished sequences and admits new ones."""
    compute_dtype: str | None = None
    """Cast the served parameters and the KV cache to this dtype ("float32", "bfloat16", "float16");
    None keeps the dtype of the model handed over (fp32 from the learner)."""
    attention: str = "auto"
    """Decode attention kernel: "pallas" (the Triton paged-attention kernel, GPU), "jax" (gathers the
    pages, any device), "auto" (pallas on GPU with a 16-bit cache, else jax)."""
    max_stop_sequences: int = 8
    """Stop sequences (EOS, stop token ids, tokenized stop strings) checked on device per sequence.
    Stop strings beyond this are still honoured when the completion is returned."""
    max_stop_tokens: int = 16
    """Longest tokenized stop string checked on device (longer ones are honoured on return)."""
    max_logprobs: int = 20
    """Largest `prompt_logprobs` (top-k alternatives per prompt token) a request may ask for."""
    batch_wait_s: float = 0.005
    """When a request arrives at an idle engine, wait this long for others to prefill with it."""
    seed: int = 0
    """Seeds the sampling keys of requests that give no `seed`."""
    exact_numerics: bool = False
    """Batch-invariant passes: a sequence's log-probs are the same bits whatever is batched with it,
    and the learner's exact scoring gives them too (docs/algorithms.md). Slower; `deterministic: true`
    runs turn it on."""
    exact_tile: int = 16
    """Tokens per tile of the exact passes (every matmul and reduction is this many rows)."""

    def __post_init__(self):
        for name in ("max_seqs", "max_seq_len", "page_size", "decode_steps", "max_stop_sequences", "max_stop_tokens", "exact_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prefill_rows", "min_decode_slots", "min_prefill_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.max_seq_len:
            raise ValueError(
                f"{type(self).__name__}.max_prefill_tokens must be >= max_seq_len ({self.max_seq_len}) so that "
                f"any prompt fits, got {self.max_prefill_tokens}"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError(f"{type(self).__name__}: set kv_cache_tokens or kv_cache_memory_fraction, not both")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(
                f"{type(self).__name__}.kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}"
            )
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
            raise ValueError(f"{type(self).__name__}.compute_dtype must be one of {_DTYPES} or None, got {self.compute_dtype!r}")
        if any(not 0 < n < self.max_seq_len for n in self.precompile_prompt_lens):
            raise ValueError(
                f"{type(self).__name__}.precompile_prompt_lens must be in [1, max_seq_len), got {self.precompile_prompt_lens}"
            )
        if self.batch_wait_s < 0:
            raise ValueError(f"{type(self).__name__}.batch_wait_s must be >= 0, got {self.batch_wait_s}")
        if self.attention not in _ATTENTION:
            raise ValueError(f"{type(self).__name__}.attention must be one of {_ATTENTION}, got {self.attention!r}")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def every_slot_tokens(self) -> int:
        """KV-cache tokens for every slot to reach `max_seq_len`, in whole pages: the cache's default size."""
        return self.max_seqs * self.pages_per_seq * self.page_size

    @property
    def exact_layout(self) -> ExactLayout | None:
        """The exact passes' shapes (None unless `exact_numerics`): windows of a whole max_seq_len in pages."""
        return ExactLayout(self.exact_tile, self.pages_per_seq * self.page_size) if self.exact_numerics else None

    @property
    def prefill_rows(self) -> int:
        """The most prompts one prefill call can hold."""
        return min(self.max_seqs, self.max_prefill_rows or self.max_seqs)

    @property
    def prefill_tokens(self) -> int:
        return self.max_prefill_tokens if self.max_prefill_tokens is not None else max(self.max_seq_len, 4096)
