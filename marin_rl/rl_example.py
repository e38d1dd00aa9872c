"""`RlExample`: packed rollouts as Haliax NamedArrays, what the learner trains on.

Every per-token array is aligned with `input_ids` (index t describes token t). The learner scores
token t with the logits at t - 1 (the causal shift happens there, not here), so the first token of
each segment is never a loss token.
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

BATCH_AXIS = "batch"
POS_AXIS = "position"
PADDING_SEGMENT_ID = -1
"""Segment id of padding. No rollout has it, so padding never attends to a rollout or is attended by one."""


@dataclass(frozen=True)
class PackedArrays:
    """The numpy form of a packed batch (what the batcher builds; cheap to test and to inspect).

    All arrays have shape `[rows, max_seq_len]`.
    """

    input_ids: np.ndarray  # int32
    position_ids: np.ndarray  # int32; restarts at 0 for every rollout, so packing does not move RoPE positions
    segment_ids: np.ndarray  # int32; unique per rollout within a row, PADDING_SEGMENT_ID on padding
    loss_mask: np.ndarray  # bool; True on tokens the policy sampled (the tokens a loss may apply to)
    advantages: np.ndarray  # float32; the rollout's advantage on its loss tokens, 0 elsewhere
    policy_logprobs: np.ndarray  # float32; behaviour-policy logprob of each sampled token, 0 elsewhere
    rl_weights: np.ndarray  # float32; weight of the policy-gradient term per token
    ce_weights: np.ndarray  # float32; weight of the cross-entropy (SFT) term per token
    kl_weights: np.ndarray  # float32; weight of the KL-to-reference term per token (times the learner's beta)
    reference_logprobs: np.ndarray | None = None  # float32 or None: the learner computes them if it needs them

    def __post_init__(self):
        shape = self.input_ids.shape
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if value.shape != shape:
                raise ValueError(f"{name} must have shape {shape} like input_ids, got {value.shape}")

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.input_ids.shape[1]


PER_TOKEN_FIELDS: tuple[str, ...] = (
    "input_ids",
    "position_ids",
    "segment_ids",
    "loss_mask",
    "advantages",
    "policy_logprobs",
    "rl_weights",
    "ce_weights",
    "kl_weights",
    "reference_logprobs",
)


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
