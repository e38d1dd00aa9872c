"""`RlExample`: packed rollouts as Haliax NamedArrays, what the learner trains on.

The numpy form, field meanings and alignment rules are in `marin_rl.packed`.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from marin_rl.packed import BATCH_AXIS, PADDING_SEGMENT_ID, PER_TOKEN_FIELDS, POS_AXIS, PackedArrays

__all__ = ["BATCH_AXIS", "PADDING_SEGMENT_ID", "PER_TOKEN_FIELDS", "POS_AXIS", "PackedArrays", "RlExample"]


class RlExample(eqx.Module):
    """A batch of packed rows over axes (`batch`, `position`); see `PackedArrays` for each field."""

    input_ids: NamedArray
    position_ids: NamedArray
    segment_ids: NamedArray
    loss_mask: NamedArray
    advantages: NamedArray
    policy_logprobs: NamedArray
    rl_weights: NamedArray
    ce_weights: NamedArray
    kl_weights: NamedArray
    reference_logprobs: NamedArray | None = None

    def __check_init__(self):
        axes = self.input_ids.axes
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and value.axes != axes:
                raise ValueError(f"{name} must have axes {axes} like input_ids, got {value.axes}")

    @property
    def Batch(self) -> hax.Axis:
        return self.input_ids.resolve_axis(BATCH_AXIS)

    @property
    def Pos(self) -> hax.Axis:
        return self.input_ids.resolve_axis(POS_AXIS)

    @staticmethod
    def from_packed(packed: PackedArrays) -> RlExample:
        Batch = hax.Axis(BATCH_AXIS, packed.num_rows)
        Pos = hax.Axis(POS_AXIS, packed.max_seq_len)

        def named(array: np.ndarray | None) -> NamedArray | None:
            return None if array is None else hax.named(jnp.asarray(array), (Batch, Pos))

        return RlExample(**{name: named(getattr(packed, name)) for name in PER_TOKEN_FIELDS})

    def to_packed(self) -> PackedArrays:
        return PackedArrays(
            **{
                name: None if getattr(self, name) is None else np.asarray(getattr(self, name).array)
                for name in PER_TOKEN_FIELDS
            }
        )
