"""`UpdateLoader`: what a weight update brings (whole weights, or LoRA adapters) turned into the model to
serve. Used by `marin-rl serve`'s POST /v1/weights/update and by Ray's server actors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from marin_rl.errors import BaseMissing


class UpdateLoader:
    """`load_weights` reads whole weights (a checkpoint path, safetensors bytes) into a model.

    Whole weights alone are the policy. Weights with adapters are the base they sit on: it is kept, cast
    to the serving `dtype` (what the engine computes in anyway), and the next updates may bring adapters
    alone. Adapters without a base kept raise `BaseMissing`.
    """

    def __init__(self, load_weights: Callable[[Any], Any], dtype: str | None = None):
        self._load_weights = load_weights
        self._dtype = dtype
        self._base = None

    def __call__(self, weights: Any = None, adapters: bytes | str | None = None):
        """The model to serve; `adapters` as bytes, or the path of a file holding them."""
        from marin_rl.adapters import with_adapters_from_bytes

        if weights is None and adapters is None:
            raise ValueError("a weight update needs weights, adapters, or both")
        if weights is not None:
            model = self._load_weights(weights)
            if adapters is None:
                self._base = None  # adapters trained on another base must not land on this one
                return model
            self._base = self._cast(model)
        if self._base is None:
            raise BaseMissing("adapters came alone, and this server holds no base weights for them: send the base with them")
        return with_adapters_from_bytes(self._base, Path(adapters).read_bytes() if isinstance(adapters, str) else adapters)

    def _cast(self, model):
        import jax.numpy as jnp

        from marin_rl.learner import cast_floating

        return model if self._dtype is None else cast_floating(model, jnp.dtype(self._dtype))
