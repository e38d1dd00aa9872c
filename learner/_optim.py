"""optax AdamW with warmup + schedule and global-norm clipping."""

from __future__ import annotations

import haliax as hax
import jax
import optax

from marin_rl.learner._config import OptimizerConfig


def build_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its learning-rate schedule (step -> learning rate)."""
    schedule = config.schedule.build(config.learning_rate, config.warmup_steps)
    adamw = optax.adamw(
        schedule,
        b1=config.beta1,
        b2=config.beta2,
        eps=config.epsilon,
        weight_decay=config.weight_decay,
        mask=weight_decay_mask,
    )
    if config.max_grad_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw), schedule


def weight_decay_mask(params):
    """True for weight matrices and embeddings; False for biases and norm scales."""

    def decays(path, _) -> bool:
        names = [getattr(key, "name", "") for key in path]
        return names[-1] != "bias" and not any("norm" in name for name in names)

    return jax.tree_util.tree_map_with_path(decays, params, is_leaf=lambda x: isinstance(x, hax.NamedArray))
