"""Replay buffers (one per env), per-env algorithms (credit assignment), and the token-budget batcher."""

from marin_rl.replay._advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from marin_rl.replay._algorithms import (
    AlgorithmConfig,
    DrGrpoConfig,
    GroupAdvantageConfig,
    GrpoConfig,
    OpdConfig,
    RlooConfig,
    SftConfig,
    TeacherConfig,
    TokenSignal,
)
from marin_rl.replay._batcher import Batch, BatchCancelled, Batcher, BatcherConfig, build_packed_arrays
from marin_rl.replay._buffer import FlatRollout, ReplayBuffer, ReplayBufferConfig, ScoredGroup, truncate_rollout
from marin_rl.replay._mismatch import DEFAULT_MISMATCH_CAP, mismatch_metrics
from marin_rl.replay._packing import BatchPlan, GroupSpec, RowPacker, effective_shares, plan_batch

__all__ = [
    "DEFAULT_MISMATCH_CAP",
    "AlgorithmConfig",
    "Batch",
    "BatchCancelled",
    "BatchPlan",
    "Batcher",
    "BatcherConfig",
    "DrGrpoConfig",
    "FlatRollout",
    "GroupAdvantageConfig",
    "GroupSpec",
    "GrpoConfig",
    "OpdConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "RlooConfig",
    "RowPacker",
    "ScoredGroup",
    "SftConfig",
    "TeacherConfig",
    "TokenSignal",
    "build_packed_arrays",
    "dr_grpo_advantages",
    "effective_shares",
    "grpo_advantages",
    "mismatch_metrics",
    "plan_batch",
    "rloo_advantages",
    "truncate_rollout",
]
