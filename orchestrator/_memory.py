"""What a run holds in device memory, estimated from its config before anything is built, so that a run
that cannot fit is refused at start with the numbers instead of failing minutes later.

The estimate counts what surely stays resident: the learner's parameters, gradients and optimizer
state (with LoRA: the frozen base in the compute dtype and the adapters' state), the activations a
step keeps between layers, and each engine's weights and KV cache. Transients (XLA's scratch, one
layer's recomputed activations) come on top, so a plan within the device memory may still fail, but
one beyond it cannot run.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from marin_rl._upstream import device_memory_stats
from marin_rl.config import TrainConfig
from marin_rl.errors import ConfigError

GiB = 2**30
ADAPTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only transformer that memory depends on."""

    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @classmethod
    def of(cls, config: TrainConfig, vocab: int) -> Shape:
        """From `model.hf_checkpoint`'s config.json where set (its sizes win), else the model fields."""
        m = config.model
        if m.hf_checkpoint is not None:
            hf = json.loads((Path(m.hf_checkpoint) / "config.json").read_text())
            heads = hf["num_attention_heads"]
            return cls(
                hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], heads, hf.get("num_key_value_heads", heads),
                hf.get("head_dim") or hf["hidden_size"] // heads, hf.get("vocab_size", vocab), hf.get("tie_word_embeddings", False),
            )  # fmt: skip
        head_dim = m.head_dim or m.hidden_dim // m.num_heads
        return cls(m.hidden_dim, m.intermediate_dim, m.num_layers, m.num_heads, m.num_kv_heads, head_dim, vocab, m.tie_word_embeddings)

    def module_sizes(self) -> dict[str, tuple[int, int]]:
        """(inputs, outputs) of each linear layer of a block."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv), "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.mlp), "up_proj": (self.hidden, self.mlp), "down_proj": (self.mlp, self.hidden),
        }  # fmt: skip

    @property
    def parameters(self) -> int:
        block = sum(i * o for i, o in self.module_sizes().values()) + 2 * self.hidden
        return self.layers * block + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def adapter_parameters(self, rank: int, target_modules: list[str] | None) -> int:
        targets = target_modules or ADAPTED_MODULES
        return self.layers * sum(rank * (i + o) for name, (i, o) in self.module_sizes().items() if name in targets)


@dataclass
class MemoryPlan:
    """Bytes each part holds on each device (index into `jax.devices()`)."""

    parts: dict[int, dict[str, int]] = field(default_factory=dict)

    def add(self, device: int, part: str, size: int) -> None:
        parts = self.parts.setdefault(device, {})
        parts[part] = parts.get(part, 0) + int(size)

    def total(self, device: int) -> int:
        return sum(self.parts.get(device, {}).values())

    def line(self, device: int) -> str:
        return "; ".join(f"{part} {size / GiB:.2f} GiB" for part, size in self.parts[device].items())


def _dtype_bytes(name: str | None, backend: str) -> int:
    if name in (None, "auto"):
        return 4 if backend == "cpu" else 2
    return _BYTES[name]


def memory_plan(config: TrainConfig, vocab: int, *, backend: str) -> MemoryPlan:
    """The resident bytes of `config`'s learner and embedded engines on each device. `backend`: where
    `auto` dtypes resolve ("cpu": float32, else bfloat16). A KV cache sized by `kv_cache_memory_fraction`
    takes a share of what is left when its engine starts, so it is not counted."""
    shape, placement, lora = Shape.of(config, vocab), config.placement, config.learner.lora
    compute = _dtype_bytes(config.model.compute_dtype, backend)
    learners = placement.data_parallel
    shards = learners if placement.fsdp else 1
    params = shape.parameters
    plan = MemoryPlan()
    for device in placement.learner_devices:
        if lora.rank:
            plan.add(device, "learner: frozen base (compute dtype)", params * compute / shards)
            trained = shape.adapter_parameters(lora.rank, lora.target_modules)
        else:
            trained = params
            if compute != 4:  # the step's cast of every parameter to the compute dtype
                plan.add(device, "learner: parameters cast to the compute dtype", params * compute / shards)
        # float32 parameters, gradients and Adam's two moments
        plan.add(device, "learner: trained parameters, gradients, optimizer state", 16 * trained / shards)
        rows = config.learner.microbatch_rows or config.batcher.num_rows
        tokens = -(-rows // learners) * config.batcher.max_seq_len
        saved = shape.layers if config.model.gradient_checkpointing != "none" else shape.layers * 4
        plan.add(device, "learner: activations kept between layers", tokens * shape.hidden * saved * compute)
    server = config.server
    # The engine's own copy of the policy: cast to server.compute_dtype, else in the policy's dtype (with
    # LoRA the merged model is in the base's, the compute dtype; else float32).
    engine_dtype = _dtype_bytes(server.compute_dtype, backend) if server.compute_dtype else (compute if lora.rank else 4)
    for device in config.embedded_devices:
        plan.add(device, "engine: weights", params * engine_dtype)
        # A swap makes the next policy's copy while the current one serves.
        plan.add(device, "engine: the next policy's weights, during a swap", params * engine_dtype)
        if server.kv_cache_memory_fraction is None:
            tokens = server.kv_cache_tokens or server.every_slot_tokens
            plan.add(device, f"engine: KV cache ({tokens:,} tokens)", tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * engine_dtype)
    return plan


def check_memory(config: TrainConfig, vocab: int, *, backend: str, device_bytes: dict[int, int]) -> MemoryPlan:
    """ConfigError with the plan's numbers for the first device whose plan exceeds its memory
    (`device_bytes`: device index -> bytes; devices not in it are not checked)."""
    plan = memory_plan(config, vocab, backend=backend)
    for device, limit in device_bytes.items():
        if device in plan.parts and plan.total(device) > limit:
            raise ConfigError(
                f"the run needs at least {plan.total(device) / GiB:.2f} GiB on device {device}, which has {limit / GiB:.2f} GiB "
                f"(placement.device_memory_gib or what the device reports): {plan.line(device)}. Less would fit with learner.lora.rank (adapters on a frozen base), model.gradient_checkpointing: layer, "
                "learner.microbatch_rows, a smaller server.kv_cache_tokens or server.max_seqs, or more learner devices with placement.fsdp"
            )
    return plan


def used_devices(config: TrainConfig) -> list[int]:
    """Indices into `jax.devices()` of the devices the run's learner and embedded engines use."""
    return sorted({*config.placement.learner_devices, *config.embedded_devices})


def reserve_device_memory(config: TrainConfig) -> list[threading.Thread]:
    """Make the first allocation on each accelerator the run uses, each in a thread of its own, and return
    the threads (none on a CPU).

    JAX's allocator reserves most of a GPU's memory at its first allocation: 1.7-1.9 s for an H200's
    105 GiB, which came inside the model's build (2.5 s of a warm 0.5B start under a profiler). Begun
    before the run's heavy imports, it happens beside them: made beside an import on an H200, it
    delayed nothing."""
    import jax
    import numpy as np

    if jax.default_backend() == "cpu":
        return []
    devices = jax.devices()

    def first_allocation(device) -> None:
        try:
            jax.device_put(np.zeros((), np.int8), device).block_until_ready()
        except Exception:  # noqa: BLE001 - the build's own first allocation on it reports the error
            logger.debug("reserving memory on %s failed", device, exc_info=True)

    threads = [
        threading.Thread(target=first_allocation, args=(devices[index],), name=f"marin-rl-reserve-{index}", daemon=True)
        for index in used_devices(config)
        if index < len(devices)
    ]
    for thread in threads:
        thread.start()
    return threads


def device_memory(config: TrainConfig) -> dict[int, int]:
    """Bytes each device the run uses may hold: `placement.device_memory_gib` where set, else what the
    device's allocator reports (none on a CPU)."""
    used = used_devices(config)
    if config.placement.device_memory_gib is not None:
        return {device: int(config.placement.device_memory_gib * GiB) for device in used}
    import jax

    devices = jax.devices()
    limits = {}
    for device in used:
        stats = device_memory_stats(devices[device]) if device < len(devices) else None
        if stats and "bytes_limit" in stats:
            limits[device] = stats["bytes_limit"]
    return limits

