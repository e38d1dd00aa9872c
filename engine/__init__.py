"""The generation engine: continuous batching, a paged KV cache, one compiled decode step for all slots.

One file per concept: `_config` (sizes), `_request` (jobs and results), `_pages` (the page allocator),
`_kv_cache` (the cache arrays), `_weights` (the engine's copy of a Levanter LM), `_attention` and
`kernels/` (decode and prefill attention), `_forward` (the transformer passes), `_sampling`, `_decode`
(the compiled device calls), `_scheduler` (the host side of continuous batching), `_device_lock`
(turns on a device shared with the learner), `_core` (all of it, one pipelined turn per `step`),
`_engine` (the thread that steps it). See docs/serving.md.

The config imports eagerly; the rest (JAX, Levanter) loads on first use.
"""

from marin_rl._lazy import lazy_attributes
from marin_rl.engine._config import EngineConfig, ExactLayout
from marin_rl.engine._device_lock import DeviceLock
from marin_rl.engine._request import GenerationJob, JobResult, PromptScores, Sample

_LAZY = {
    "Engine": "_engine",
    "EngineStats": "_core",
    "PageAllocator": "_pages",
    "ModelToCome": "_weights",
    "ServingWeights": "_weights",
    "serving_weights": "_weights",
    "unrolled_weights": "_weights",
    "exact_hidden_states": "_exact",
    "fresh_keys_and_values": "_exact",
    "exact_token_logprobs": "_exact",
    "row_windows": "_exact",
    "attention_scale": "_forward",
    "truncates": "_sampling",
}

__all__ = ["DeviceLock", "EngineConfig", "ExactLayout", "GenerationJob", "JobResult", "PromptScores", "Sample", *_LAZY]


__getattr__ = lazy_attributes(__name__, _LAZY)
