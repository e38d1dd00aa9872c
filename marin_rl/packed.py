"""`PackedArrays`: a packed batch as numpy arrays (no JAX needed: the batcher builds it, tests read it).

Every per-token array is aligned with `input_ids` (index t describes token t). The learner scores
token t with the logits at t - 1 (the causal shift happens there, not here), so the first token of
each segment is never a loss token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    advantages: np.ndarray  # float32; per-token advantage from the env's algorithm, 0 on unsampled tokens
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
