"""Replay buffers (one per env), advantage estimators, and the token-budget batcher."""

from marin_rl.replay._advantages import (
    AdvantageConfig,
    AdvantageFunction,
    DrGrpoConfig,
    GrpoConfig,
    RlooConfig,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from marin_rl.replay._batcher import Batch, BatchCancelled, Batcher, BatcherConfig, build_packed_arrays
from marin_rl.replay._buffer import FlatRollout, ReplayBuffer, ReplayBufferConfig, ScoredGroup, truncate_rollout
from marin_rl.replay._packing import BatchPlan, GroupSpec, RowPacker, effective_shares, plan_batch

__all__ = [
    "AdvantageConfig",
    "AdvantageFunction",
    "Batch",
    "BatchCancelled",
    "BatchPlan",
    "Batcher",
    "BatcherConfig",
    "DrGrpoConfig",
    "FlatRollout",
    "GroupSpec",
    "GrpoConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "RlooConfig",
    "RowPacker",
    "ScoredGroup",
    "build_packed_arrays",
    "dr_grpo_advantages",
    "effective_shares",
    "grpo_advantages",
    "plan_batch",
    "rloo_advantages",
    "truncate_rollout",
]
