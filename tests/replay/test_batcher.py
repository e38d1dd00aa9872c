import dataclasses
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marin_rl.packed import PADDING_SEGMENT_ID
from marin_rl.replay import (
    Batcher,
    BatcherConfig,
    GroupSpec,
    ReplayBuffer,
    ReplayBufferConfig,
    RowPacker,
    effective_shares,
    plan_batch,
)
from marin_rl.testing import make_group

MAX_SEQ_LEN = 64

group_lengths = st.lists(st.integers(1, MAX_SEQ_LEN), min_size=1, max_size=4)
env_groups = st.lists(group_lengths, min_size=0, max_size=25)


def segments_of(packed):
    """{(row, segment): (token ids, advantages, loss mask, position ids)} read back from a batch."""
    found = {}
    for row in range(packed.num_rows):
        seg_row = packed.segment_ids[row]
        for segment in np.unique(seg_row[seg_row != PADDING_SEGMENT_ID]):
            (where,) = np.nonzero(seg_row == segment)
            assert (np.diff(where) == 1).all(), "a rollout's tokens must be contiguous"
            found[(row, int(segment))] = (
                packed.input_ids[row, where],
                packed.advantages[row, where],
                packed.loss_mask[row, where],
                packed.position_ids[row, where],
            )
    return found


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.dictionaries(st.sampled_from(["a", "b", "c"]), env_groups, min_size=1),
    num_rows=st.integers(1, 6),
    max_per_row=st.one_of(st.none(), st.integers(1, 4)),
)
def test_plan_places_whole_groups_within_rows_and_budget(lengths, num_rows, max_per_row):
    candidates = {env: [GroupSpec(f"{env}{i}", tuple(g)) for i, g in enumerate(gs)] for env, gs in lengths.items()}
    shares = effective_shares({env: 1 / len(lengths) for env in lengths}, list(lengths))
    plan = plan_batch(candidates, shares, {}, num_rows, MAX_SEQ_LEN, max_per_row)
    assert plan.total_tokens <= num_rows * MAX_SEQ_LEN
    occupied = [[] for _ in range(num_rows)]
    specs = {g.key: g for gs in candidates.values() for g in gs}
    for env, placed in plan.placements.items():
        for key, where in placed.items():
            assert len(where) == len(specs[key].lengths), "whole groups only"
            for (row, offset), length in zip(where, specs[key].lengths):
                occupied[row].append((offset, offset + length))
    for row, spans in enumerate(occupied):
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "overlap"
        assert all(end <= MAX_SEQ_LEN for _, end in spans)
        assert sum(e - s for s, e in spans) == plan.row_fill[row]
        assert max_per_row is None or len(spans) <= max_per_row


@settings(max_examples=25, deadline=None)
@given(
    groups=st.dictionaries(
        st.sampled_from(["a", "b"]),
        st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), min_size=1, max_size=12),
        min_size=1,
    ),
    num_rows=st.integers(1, 4),
)
def test_batch_loses_splits_or_duplicates_no_token(groups, num_rows):
    buffers = {env: ReplayBuffer(env, ReplayBufferConfig(min_group_size=1)) for env in groups}
    originals = {}
    for env_index, (env, gs) in enumerate(groups.items()):
        for i, completion_lens in enumerate(gs):
            rollouts = make_group(
                [float(k) for k in range(len(completion_lens))],
                env=env,
                group_id=f"{env}-{i}",
                completion_lens=completion_lens,
                seed=env_index * 1000 + i * 10,  # distinct tokens per rollout, to find each in the batch
            )
            buffers[env].add(rollouts)
            originals.update({r.rollout_uid: r for r in rollouts})
    fractions = {env: 1 / len(groups) for env in groups}
    config = BatcherConfig(total_token_budget=num_rows * MAX_SEQ_LEN, max_seq_len=MAX_SEQ_LEN, max_wait_s=0.0)
    batch = Batcher(buffers, fractions, config).next_batch(policy_version=0)

    read_back = segments_of(batch.packed)
    in_batch = [m for g in batch.groups for m in g.members]
    assert len(read_back) == len(in_batch)
    # Each rollout appears exactly once, whole, with its group's advantage on its sampled tokens.
    remaining = list(read_back.values())
    for group in batch.groups:
        rloo = np.array([m.rollout.reward for m in group.members])
        rloo = rloo - (rloo.sum() - rloo) / max(1, len(rloo) - 1) if len(rloo) > 1 else np.zeros(1)
        for member, advantage in zip(group.members, rloo):
            match = [i for i, seg in enumerate(remaining) if np.array_equal(seg[0], member.token_ids)]
            assert match, "rollout missing from the batch"
            tokens, advs, mask, positions = remaining.pop(match[0])
            np.testing.assert_array_equal(mask, member.sampled_mask)
            np.testing.assert_allclose(advs[mask], np.float32(advantage), atol=1e-6)
            assert (advs[~mask] == 0).all()
            np.testing.assert_array_equal(positions, np.arange(len(tokens)))
    # Nothing lost: whatever is not in the batch is still in its buffer.
    left = sum(b.size()[0] for b in buffers.values())
    assert left + len(in_batch) == len(originals)
    assert batch.metrics["batch/tokens"] == sum(m.num_tokens for m in in_batch) <= config.total_token_budget
    padding = batch.packed.segment_ids == PADDING_SEGMENT_ID
    assert not batch.packed.loss_mask[padding].any()


def test_row_packer_undoes_a_group_that_does_not_fit():
    packer = RowPacker(num_rows=2, max_seq_len=10)
    assert packer.place_group([6, 6]) == [(0, 0), (1, 0)] or packer.fill == [6, 6]
    assert packer.place_group([4, 4, 1]) is None
    assert packer.fill == [6, 6]
    assert packer.place_group([4, 4]) is not None
    assert packer.fill == [10, 10]


def test_row_packer_closes_a_row_at_its_sequence_limit_and_reopens_it_when_a_group_is_undone():
    packer = RowPacker(num_rows=2, max_seq_len=10, max_per_row=2)
    assert packer.place_group([1, 1, 1]) is not None
    assert sorted(packer.count) == [1, 2] and sorted(packer.fill) == [1, 2]
    assert packer.place_group([1, 1]) is None  # one place left: the group is undone whole
    assert sorted(packer.count) == [1, 2] and packer.free_tokens == 17
    assert packer.place_group([5]) is not None  # the open row took it, though the closed one has room
    assert sorted(packer.count) == [2, 2] and sorted(packer.fill) == [2, 6]
    assert packer.largest_free == 0 and packer.place_group([1]) is None
    with pytest.raises(ValueError, match="max_per_row"):
        RowPacker(num_rows=1, max_seq_len=10, max_per_row=0)


def test_effective_shares_give_the_remainder_to_envs_with_data():
    fractions = {"a": 0.5, "b": 0.3, "c": 0.1}
    shares = effective_shares(fractions, ["a", "b", "c"])
    assert shares == pytest.approx({"a": 0.5 / 0.9, "b": 0.3 / 0.9, "c": 0.1 / 0.9})
    shares = effective_shares(fractions, ["a", "c"])
    assert shares == pytest.approx({"a": 0.5 / 0.6, "b": 0.0, "c": 0.1 / 0.6})


def test_token_shares_converge_to_fractions_when_data_is_plentiful():
    rng = np.random.default_rng(0)
    fractions = {"a": 0.6, "b": 0.3, "c": 0.1}
    credit: dict = {}
    totals = dict.fromkeys(fractions, 0)
    shares = effective_shares(fractions, list(fractions))
    for step in range(300):
        candidates = {
            env: [GroupSpec(f"{env}{step}-{i}", tuple(rng.integers(5, 200, size=4))) for i in range(40)]
            for env in fractions
        }
        plan = plan_batch(candidates, shares, credit, num_rows=8, max_seq_len=512)
        for env, tokens in plan.tokens.items():
            totals[env] += tokens
    grand = sum(totals.values())
    for env, fraction in fractions.items():
        assert totals[env] / grand == pytest.approx(fraction, abs=0.01)


def test_batcher_waits_for_a_short_env_and_then_reports_it_starved():
    buffers = {env: ReplayBuffer(env) for env in ("fast", "slow")}
    buffers["fast"].add(make_group([1.0, 0.0], env="fast", group_id="f", completion_lens=[60, 60]))
    config = BatcherConfig(total_token_budget=256, max_seq_len=128, max_wait_s=0.3)
    started = time.monotonic()
    batch = Batcher(buffers, {"fast": 0.5, "slow": 0.5}, config).next_batch(policy_version=0)
    assert time.monotonic() - started >= 0.3
    assert batch.metrics["batches/slow/starved"] == 1.0
    assert batch.metrics["batches/fast/starved"] == 0.0
    assert batch.metrics["batches/fast/rollouts_used"] == 2
    assert batch.metrics["batch/wait_s"] >= 0.3


def test_batcher_unblocks_when_the_short_env_delivers():
    buffers = {env: ReplayBuffer(env) for env in ("fast", "slow")}
    buffers["fast"].add(make_group([1.0, 0.0], env="fast", group_id="f", completion_lens=[60, 60]))
    config = BatcherConfig(total_token_budget=256, max_seq_len=128, max_wait_s=30.0)
    late = make_group([1.0, 0.0], env="slow", group_id="s", completion_lens=[60, 60])
    threading.Timer(0.2, buffers["slow"].add, args=(late,)).start()
    batch = Batcher(buffers, {"fast": 0.5, "slow": 0.5}, config).next_batch(policy_version=0)
    assert batch.metrics["batches/slow/starved"] == 0.0
    assert batch.metrics["batches/slow/rollouts_used"] == 2
    assert batch.metrics["batch/wait_s"] < 30.0


def test_batcher_with_no_data_times_out_clearly():
    buffers = {"a": ReplayBuffer("a")}
    config = BatcherConfig(total_token_budget=128, max_seq_len=128, max_wait_s=0.0)
    with pytest.raises(TimeoutError, match="no rollouts"):
        Batcher(buffers, {"a": 1.0}, config).next_batch(policy_version=0, timeout=0.2)


def test_batcher_never_trains_on_rollouts_older_than_max_age():
    buffer = ReplayBuffer("a", ReplayBufferConfig(max_age=1))
    for version in range(5):
        buffer.add(make_group([1.0, 0.0], env="a", group_id=f"v{version}", policy_version=version))
    batch = Batcher({"a": buffer}, {"a": 1.0}, BatcherConfig(total_token_budget=256, max_seq_len=128, max_wait_s=0.0)).next_batch(4)
    assert sorted(set(batch.rollout_versions)) == [3, 4]
    assert batch.metrics["batch/staleness_max"] == 1.0


def test_padding_arrays_are_shaped_like_every_batch_and_hold_no_token():
    buffer = ReplayBuffer("a")
    buffer.add(make_group([1.0, 0.0], env="a", group_id="g", completion_lens=[60, 60]))
    batcher = Batcher({"a": buffer}, {"a": 1.0}, BatcherConfig(total_token_budget=512, max_seq_len=128, max_wait_s=0.0))
    padding, batch = batcher.config.padding_arrays(), batcher.next_batch(policy_version=0).packed
    for field in dataclasses.fields(batch):
        real, pad = getattr(batch, field.name), getattr(padding, field.name)
        assert (None if real is None else (real.shape, real.dtype)) == (None if pad is None else (pad.shape, pad.dtype)), field.name
    assert (padding.segment_ids == PADDING_SEGMENT_ID).all() and not padding.loss_mask.any()


def test_batcher_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="total_token_budget"):
        BatcherConfig(total_token_budget=10, max_seq_len=64)
    with pytest.raises(ValueError, match="overlong"):
        BatcherConfig(overlong="drop")
    with pytest.raises(ValueError, match="sum to <= 1"):
        Batcher({"a": ReplayBuffer("a"), "b": ReplayBuffer("b")}, {"a": 0.7, "b": 0.7}, BatcherConfig())


def test_batch_converts_to_named_arrays():
    buffer = ReplayBuffer("a")
    buffer.add(make_group([1.0, 0.0], env="a"))
    batch = Batcher({"a": buffer}, {"a": 1.0}, BatcherConfig(total_token_budget=128, max_seq_len=64, max_wait_s=0.0)).next_batch(0)
    example = batch.to_example()
    assert example.Batch.size == 2 and example.Pos.size == 64
    assert example.input_ids.axes == example.advantages.axes
    np.testing.assert_array_equal(np.asarray(example.loss_mask.array), batch.packed.loss_mask)


def test_waiting_batcher_can_be_cancelled():
    from marin_rl.replay import BatchCancelled

    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    config = BatcherConfig(total_token_budget=128, max_seq_len=128, max_wait_s=30.0)
    with pytest.raises(BatchCancelled):
        Batcher({"a": ReplayBuffer("a")}, {"a": 1.0}, config).next_batch(policy_version=0, cancel=cancel)
