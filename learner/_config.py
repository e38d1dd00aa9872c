"""Learner configs: frozen dataclasses that draccus reads from YAML (`type:` picks a registered choice)."""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass

import draccus

FAMILIES = ("llama", "qwen2", "qwen3")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_BACKENDS = ("default", "jax_flash", "vanilla", "nvte", "splash", "cudnn")
GRADIENT_CHECKPOINTING = ("layer", "none", "offload", "nested")
KL_ESTIMATORS = ("k1", "k3")
EXPORT_DTYPES = ("float32", "bfloat16")


def _check_choice(owner: str, field: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{field} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which Levanter `LmHeadModel` to train and how to run it."""

    family: str = "llama"
    """Architecture family: `llama`, `qwen2` or `qwen3`."""
    hf_checkpoint: str | None = None
    """Local Hugging Face checkpoint directory to start from. When set, the size fields below are ignored:
    sizes come from its `config.json` (its `max_position_embeddings` is kept, so exports round-trip)."""
    hidden_dim: int = 64
    """Width of the residual stream (fresh model only)."""
    intermediate_dim: int = 256
    """Width of the MLP (fresh model only)."""
    num_layers: int = 2
    """Number of transformer blocks (fresh model only)."""
    num_heads: int = 4
    """Query heads (fresh model only)."""
    num_kv_heads: int = 4
    """Key/value heads; fewer than `num_heads` gives grouped-query attention (fresh model only)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_dim // num_heads (fresh model only)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output head (fresh model only)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (fresh model only)."""
    seq_len: int = 1024
    """Longest packed row the learner accepts (a longer row is an error); a fresh model's context length."""
    compute_dtype: str = "auto"
    """dtype of the forward/backward pass: `float32`, `bfloat16`, or `auto` (bfloat16 on GPU/TPU, float32 on
    CPU). Parameters and optimizer state are always float32."""
    attn_backend: str = "default"
    """Attention kernel. Levanter's backends: `default` (NVTE on GPU, which falls back to `jax_flash` with a
    warning when transformer_engine is missing; splash on TPU; jax_flash on CPU), `jax_flash` (Levanter's
    pure-JAX blockwise flash attention; sequences shorter than its block size use `vanilla`), `vanilla`
    (materialises [query, key] scores), `nvte` (Transformer Engine, must be installed), `splash` (TPU).
    Ours: `cudnn` (cuDNN flash attention through `jax.nn.dot_product_attention`, GPU, bf16/fp16 only)."""
    cudnn_max_segments: int = 16
    """`cudnn` on Hopper or later: rows of up to this many segments (packed rollouts, plus the padding at
    the end) attend within each segment only (cuDNN's packed layout: no cross-segment work, no mask read);
    a row with more takes a dense mask over the whole row."""
    flash_block_size: int | None = None
    """Block size of Levanter's flash backends; None uses Levanter's default (1024 for jax_flash)."""
    gradient_checkpointing: str = "layer"
    """Rematerialisation of the scanned layers: `layer` (keep each block's input, recompute its inside in the
    backward pass; Levanter's default), `none` (keep everything: fastest, most memory), `offload` (keep block
    inputs in host memory), `nested` (sqrt-of-layers nested remat)."""

    def __post_init__(self):
        _check_choice("ModelConfig", "family", self.family, FAMILIES)
        _check_choice("ModelConfig", "compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _check_choice("ModelConfig", "attn_backend", self.attn_backend, ATTENTION_BACKENDS)
        _check_choice("ModelConfig", "gradient_checkpointing", self.gradient_checkpointing, GRADIENT_CHECKPOINTING)
        if self.cudnn_max_segments < 1:
            raise ValueError(f"ModelConfig.cudnn_max_segments must be >= 1, got {self.cudnn_max_segments}")
        if self.family == "qwen2" and self.head_dim not in (None, self.hidden_dim // self.num_heads):
            # Levanter's Qwen2 attention always uses hidden_dim // num_heads.
            raise ValueError(
                f"ModelConfig.head_dim must be None or {self.hidden_dim // self.num_heads} for qwen2, "
                f"got {self.head_dim}"
            )


@dataclass(frozen=True)
class Aggregation(draccus.ChoiceRegistry, abc.ABC):
    """How per-token losses become one scalar. Normalisers always come from the whole batch, so gradient
    accumulation over microbatches gives the single-batch gradient."""


@Aggregation.register_subclass("token_mean")
@dataclass(frozen=True)
class TokenMean(Aggregation):
    """`sum_t m_t l_t / sum_t m_t` over every loss token of the batch (DAPO's token-level mean)."""


@Aggregation.register_subclass("sequence_mean")
@dataclass(frozen=True)
class SequenceMean(Aggregation):
    """GRPO: the mean over sequences of each sequence's token mean. A sequence is a (row, segment id) pair
    with at least one loss token."""


@Aggregation.register_subclass("token_sum")
@dataclass(frozen=True)
class TokenSum(Aggregation):
    """Dr.GRPO: `sum_t m_t l_t / constant`, a normaliser that does not depend on the batch's lengths."""

    constant: float = 1.0
    """The constant divisor, e.g. sequences per batch times the generation token limit."""

    def __post_init__(self):
        if self.constant <= 0:
            raise ValueError(f"TokenSum.constant must be > 0, got {self.constant}")


@dataclass(frozen=True)
class LossConfig:
    """Per-token policy loss (see docs/learner.md for the formulas exactly as implemented)."""

    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip range: the ratio is clipped above at 1 + eps_high (DAPO's clip-higher uses ~0.28)."""
    tis_cap: float | None = None
    """Truncated importance sampling for trainer/inference mismatch. None: the ratio is taken against the
    behaviour log-probs from the server. A number C: the ratio is taken against the learner's own log-probs
    under the pre-update weights (stop-gradient; 1 in value since each batch gets one optimizer step), and
    the term is multiplied by the stop-gradient weight min(exp(logp_learner - logp_behaviour), C)."""
    mis_cap: float | None = None
    """Masked importance sampling (IcePop): a token whose ratio exp(logp_learner - logp_behaviour) lies
    outside [1/C, C] gets no policy-gradient term. None: no mask. Combines with `tis_cap`."""
    beta: float = 0.0
    """Coefficient of the KL-to-reference term; 0 turns it (and the reference forward pass) off."""
    kl_estimator: str = "k3"
    """Estimator of KL(pi || ref) from sampled tokens: `k1` = log(pi/ref), `k3` = ref/pi - 1 - log(ref/pi)."""
    aggregation: Aggregation = dataclasses.field(default_factory=TokenMean)
    """How per-token losses are reduced: `token_mean`, `sequence_mean` (GRPO) or `token_sum` (Dr.GRPO)."""

    def __post_init__(self):
        _check_choice("LossConfig", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.mis_cap is not None and self.mis_cap <= 1:
            raise ValueError(f"LossConfig.mis_cap must be > 1 or None, got {self.mis_cap}")
        if self.beta < 0:
            raise ValueError(f"LossConfig.beta must be >= 0, got {self.beta}")


def _warmup(learning_rate: float, warmup_steps: int):
    # Step t < warmup_steps gets learning_rate * (t + 1) / (warmup_steps + 1): no step is wasted at 0.
    import optax

    return optax.linear_schedule(learning_rate / (warmup_steps + 1), learning_rate, warmup_steps)


@dataclass(frozen=True)
class LrSchedule(draccus.ChoiceRegistry, abc.ABC):
    """Learning rate after the linear warmup."""

    @abc.abstractmethod
    def build(self, learning_rate: float, warmup_steps: int):
        """An optax schedule: step -> learning rate, warmup included."""


@LrSchedule.register_subclass("constant")
@dataclass(frozen=True)
class ConstantSchedule(LrSchedule):
    """Constant learning rate after warmup."""

    def build(self, learning_rate: float, warmup_steps: int):
        import optax

        return optax.join_schedules(
            [_warmup(learning_rate, warmup_steps), optax.constant_schedule(learning_rate)],
            [warmup_steps],
        )


@LrSchedule.register_subclass("linear")
@dataclass(frozen=True)
class LinearSchedule(LrSchedule):
    """Linear decay after warmup, down to `min_lr_ratio * learning_rate` at `decay_steps`, constant after
    (transformers' `linear`, TRL's default: `decay_steps` = the run's steps, `min_lr_ratio` 0)."""

    decay_steps: int = 1000
    """Optimizer steps from the end of warmup to the end of the decay."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""

    def build(self, learning_rate: float, warmup_steps: int):
        import optax

        return optax.join_schedules(
            [
                _warmup(learning_rate, warmup_steps),
                optax.linear_schedule(learning_rate, self.min_lr_ratio * learning_rate, self.decay_steps),
            ],
            [warmup_steps],
        )


@LrSchedule.register_subclass("cosine")
@dataclass(frozen=True)
class CosineSchedule(LrSchedule):
    """Cosine decay after warmup, down to `min_lr_ratio * learning_rate` at `decay_steps`, constant after."""

    decay_steps: int = 1000
    """Optimizer steps from the end of warmup to the end of the decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    def build(self, learning_rate: float, warmup_steps: int):
        import optax

        return optax.join_schedules(
            [
                _warmup(learning_rate, warmup_steps),
                optax.cosine_decay_schedule(learning_rate, self.decay_steps, alpha=self.min_lr_ratio),
            ],
            [warmup_steps],
        )


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup, a schedule, and global-norm gradient clipping."""

    learning_rate: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to weight matrices and embeddings only (not norms or biases)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    epsilon: float = 1e-8
    """Adam denominator epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global L2 norm; None disables clipping."""
    warmup_steps: int = 0
    """Steps of linear warmup: step t < warmup_steps uses learning_rate * (t + 1) / (warmup_steps + 1)."""
    schedule: LrSchedule = dataclasses.field(default_factory=ConstantSchedule)
    """Schedule after warmup: `constant` or `cosine`."""

    def __post_init__(self):
        if not self.learning_rate >= 0:  # NaN too
            raise ValueError(f"OptimizerConfig.learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the model's linear layers: only they are trained and held in the
    optimizer's state; the base weights stay as loaded. Off while `rank` is 0."""

    rank: int = 0
    """Rank of each adapter; 0: train every parameter (no adapters)."""
    alpha: float | None = None
    """The adapters' product is scaled by alpha / rank; None: alpha = rank (a scale of 1). On the
    quickstart, rank 16 learned to 0.9 with alpha 16 and stalled near 0.75 with 32 (docs/learner.md)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: list[str] | None = None
    """Names of the linear layers that get adapters (e.g. [q_proj, v_proj]); None: every linear layer of
    the transformer blocks (attention and MLP)."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"LoraConfig.rank must be >= 0, got {self.rank}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class LearnerConfig:
    """Everything the learner needs besides the model."""

    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """The policy loss."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """The optimizer."""
    microbatch_rows: int | None = None
    """Rows per microbatch for gradient accumulation (must divide the batch's rows); None: one pass."""
    vocab_block_size: int = 16384
    """Vocabulary columns scored at a time, so [tokens, vocab] log-softmax is never materialised whole."""
    keep_checkpoints: int = 2
    """How many complete checkpoints to keep under RUN/checkpoints/ (older ones are deleted)."""
    export_dtype: str = "float32"
    """dtype of exported Hugging Face weights (RUN/hf/step-N/); bfloat16 halves their size."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """Train low-rank adapters instead of every parameter (`lora.rank` > 0)."""

    def __post_init__(self):
        _check_choice("LearnerConfig", "export_dtype", self.export_dtype, EXPORT_DTYPES)
        if self.microbatch_rows is not None and self.microbatch_rows <= 0:
            raise ValueError(f"LearnerConfig.microbatch_rows must be > 0 or None, got {self.microbatch_rows}")
        if self.vocab_block_size <= 0:
            raise ValueError(f"LearnerConfig.vocab_block_size must be > 0, got {self.vocab_block_size}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"LearnerConfig.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
