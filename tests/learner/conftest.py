"""Fixtures for the learner tests: the char tokenizer, tiny model configs, and random packed batches."""

import numpy as np
import pytest

from marin_rl.learner import ModelConfig
from marin_rl.rl_example import PADDING_SEGMENT_ID, PackedArrays, RlExample
from marin_rl.tokenizer import load_tokenizer

VOCAB = 104  # the char tokenizer's size


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("char")


@pytest.fixture(scope="session")
def tiny_model_config():
    return ModelConfig(
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seq_len=64,
        compute_dtype="float32",
    )


def pack(rollout_lengths: list[list[int]], seq_len: int, *, seed: int = 0, loss_fraction: float = 0.7) -> PackedArrays:
    """Random rows packed with rollouts of the given lengths (one list per row), padding at the end.

    Tokens, advantages (one per rollout) and behaviour log-probs are random; loss tokens are a random
    subset of each rollout's tokens after its first; all three loss weights are 1 on loss tokens."""
    rng = np.random.default_rng(seed)
    rows = len(rollout_lengths)
    shape = (rows, seq_len)
    input_ids = rng.integers(0, VOCAB, shape).astype(np.int32)
    position_ids = np.zeros(shape, np.int32)
    segment_ids = np.full(shape, PADDING_SEGMENT_ID, np.int32)
    loss_mask = np.zeros(shape, bool)
    advantages = np.zeros(shape, np.float32)
    for row, lengths in enumerate(rollout_lengths):
        start = 0
        for segment, length in enumerate(lengths):
            span = slice(start, start + length)
            position_ids[row, span] = np.arange(length)
            segment_ids[row, span] = segment
            loss_mask[row, span] = rng.random(length) < loss_fraction
            loss_mask[row, start] = False
            advantages[row, span] = np.where(loss_mask[row, span], rng.normal(), 0.0)
            start += length
        assert start <= seq_len
    policy_logprobs = np.where(loss_mask, -rng.uniform(3.0, 6.0, shape), 0.0).astype(np.float32)
    weights = loss_mask.astype(np.float32)
    return PackedArrays(
        input_ids, position_ids, segment_ids, loss_mask, advantages, policy_logprobs, weights, weights, weights
    )


@pytest.fixture(scope="session")
def packed_batch():
    """Four rows of 32 positions, 1-3 rollouts each, with padding."""
    return pack([[7, 12, 9], [32], [20, 5], [3, 10]], 32, seed=1)


@pytest.fixture(scope="session")
def example(packed_batch):
    return RlExample.from_packed(packed_batch)


@pytest.fixture(scope="session")
def packer():
    """`pack(rollout_lengths, seq_len, *, seed, loss_fraction) -> PackedArrays` for tests that need their own."""
    return pack
