import dataclasses
import json
import threading

import numpy as np
import pytest

from marin_rl.replay import GrpoConfig, ReplayBuffer, ReplayBufferConfig
from marin_rl.storage import read_rollouts
from marin_rl.testing import make_group, make_rollout


def group_ids(buffer):
    return [c.key for c in buffer.candidates()]


def test_max_age_drops_exactly_the_stale_rollouts():
    buffer = ReplayBuffer("env", ReplayBufferConfig(max_age=1, min_group_size=1))
    for version in range(4):
        buffer.add(make_group([1.0, 0.0], group_id=f"v{version}", policy_version=version))
    dropped = buffer.set_policy_version(3)  # keeps versions >= 2
    assert dropped == 4
    assert sorted(group_ids(buffer)) == ["v2", "v3"]
    assert buffer.metrics()["replays/env/dropped_stale"] == 4


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_tokens_ahead_are_those_the_next_version_still_trains_on(max_age):
    buffer = ReplayBuffer("env", ReplayBufferConfig(max_age=max_age, min_group_size=1))
    tokens = {}
    for version in range(3):
        group = make_group([1.0, 0.0], group_id=f"v{version}", policy_version=version, seed=version)
        buffer.add(group)
        tokens[version] = sum(r.num_tokens for r in group)
    buffer.set_policy_version(2)  # holds versions >= 2 - max_age; version 3 will keep >= 3 - max_age
    assert buffer.size()[1] == sum(n for v, n in tokens.items() if v >= 2 - max_age)
    # With max_age 0 nothing held survives a version: all of it counts, as what this version trains on.
    assert buffer.tokens_ahead() == sum(n for v, n in tokens.items() if v >= 3 - max(max_age, 1))
    buffer.take({c.key: len(c.lengths) for c in buffer.candidates()})
    assert buffer.size() == (0, 0) and buffer.tokens_ahead() == 0


def test_mixed_age_group_keeps_only_fresh_members_and_respects_min_group_size():
    buffer = ReplayBuffer("env", ReplayBufferConfig(max_age=0, min_group_size=2))
    old = make_group([1.0, 0.0], group_id="g", policy_version=0)
    new = make_group([1.0], group_id="g", policy_version=1, seed=5)
    buffer.add(old + new)
    assert group_ids(buffer) == ["g"]
    buffer.set_policy_version(1)
    # One fresh member survives: below min_group_size, so not offered (but kept: it may grow).
    assert group_ids(buffer) == []
    assert buffer.size()[0] == 1
    buffer.add(make_group([0.0], group_id="g", policy_version=1, seed=9))
    assert [c.lengths for c in buffer.candidates()] == [(7, 7)]


def test_min_group_size_holds_back_small_groups():
    buffer = ReplayBuffer("env", ReplayBufferConfig(min_group_size=3))
    buffer.add(make_group([1.0, 0.0], group_id="small"))
    buffer.add(make_group([1.0, 0.0, 1.0], group_id="big"))
    assert group_ids(buffer) == ["big"]


def test_candidates_are_newest_first_and_take_scores_with_the_configured_algorithm():
    buffer = ReplayBuffer("env", algorithm=GrpoConfig(eps=0.0))
    buffer.add(make_group([1.0, 0.0], group_id="first"))
    buffer.add(make_group([2.0, 4.0, 0.0], group_id="second"))
    assert group_ids(buffer) == ["second", "first"]
    (taken,) = buffer.take({"second": 3})
    for member, signal, expected in zip(taken.members, taken.signals, [0.0, 1.0, -1.0]):
        np.testing.assert_allclose(signal.advantages, expected * member.sampled_mask, atol=1e-6)
    assert group_ids(buffer) == ["first"]
    assert buffer.metrics()["replays/env/frac_used_in_batch"] == pytest.approx(3 / 5)


def test_zero_variance_groups_are_dropped_when_configured():
    buffer = ReplayBuffer("env", ReplayBufferConfig(drop_zero_variance_groups=True))
    buffer.add(make_group([1.0, 1.0], group_id="flat"))
    buffer.add(make_group([1.0, 0.0], group_id="useful"))
    assert group_ids(buffer) == ["useful"]
    assert buffer.size()[0] == 2
    metrics = buffer.metrics()
    assert metrics["replays/env/filtered_groups"] == 1
    assert metrics["replays/env/frac_filtered"] == 0.5


@pytest.mark.parametrize(
    "breakage, field",
    [
        (lambda r: _with_assistant(r, logprobs=np.zeros(len(r.turns[1].token_ids) + 1, np.float32)), "turns[1].logprobs"),
        (lambda r: dataclasses.replace(r, reward=float("nan")), "reward"),
        (lambda r: _with_assistant(r, token_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32)), "turns[1].token_ids"),
        (lambda r: dataclasses.replace(r, rewards={"correct": float("inf")}), "rewards['correct']"),
        (lambda r: _with_assistant(r, token_ids=np.array([5, VOCAB], np.int32), logprobs=np.zeros(2, np.float32)), "turns[1].token_ids"),
    ],
)
def test_bad_rollouts_are_rejected_naming_field_and_uid_and_nothing_else_changes(tmp_path, breakage, field):
    buffer = ReplayBuffer("env", run_dir=tmp_path, config=ReplayBufferConfig(flush_every_rollouts=1), vocab_size=VOCAB)
    good = make_group([1.0, 0.0], group_id="good")
    buffer.add(good)
    bad = breakage(make_rollout(group_id="good", rollout_uid="bad-uid"))
    fine = make_rollout(group_id="other")
    assert buffer.add([bad, fine]) == 1
    assert buffer.size()[0] == 3
    assert sorted(r.rollout_uid for r in read_rollouts(tmp_path)) == sorted([*(r.rollout_uid for r in good), fine.rollout_uid])
    (reject,) = [json.loads(line) for line in (tmp_path / "rejects/env.jsonl").read_text().splitlines()]
    assert reject["rollout_uid"] == "bad-uid" and reject["field"] == field
    assert buffer.metrics()["replays/env/rejected"] == 1


VOCAB = 100  # make_rollout draws ids below it


def _with_assistant(rollout, **changes):
    turns = list(rollout.turns)
    turns[1] = dataclasses.replace(turns[1], **changes)
    return dataclasses.replace(rollout, turns=tuple(turns))


def test_rollout_for_another_env_is_rejected():
    buffer = ReplayBuffer("env")
    assert buffer.add([make_rollout(env="other")]) == 0
    assert buffer.metrics()["replays/env/rejected"] == 1


def test_overlong_rollouts_are_rejected_or_truncated_and_counted():
    rejecting = ReplayBuffer("env", max_seq_len=8, overlong="reject")
    assert rejecting.add([make_rollout(prompt_len=4, completion_len=6)]) == 0
    assert rejecting.metrics()["replays/env/overlong_rejected"] == 1

    truncating = ReplayBuffer("env", ReplayBufferConfig(min_group_size=1), max_seq_len=8, overlong="truncate")
    assert truncating.add([make_rollout(prompt_len=4, completion_len=6)]) == 1
    (group,) = truncating.take({c.key: len(c.lengths) for c in truncating.candidates()})
    (member,) = group.members
    assert member.num_tokens == 8 and member.rollout.is_truncated
    assert member.rollout.metadata["overlong_truncated_from"] == 10
    assert truncating.metrics()["replays/env/overlong_truncated"] == 1
    # Nothing sampled fits: rejected even when truncating.
    assert truncating.add([make_rollout(prompt_len=9, completion_len=2)]) == 0


def test_metrics_have_exactly_the_design_names():
    buffer = ReplayBuffer("math", ReplayBufferConfig(min_group_size=1))
    rollouts = [
        make_rollout(env="math", reward=1.0, rewards={"correct": 1.0, "format": 0.5}, completion_len=3),
        make_rollout(env="math", reward=0.0, rewards={"correct": 0.0, "format": 1.0}, completion_len=5, is_truncated=True),
    ]
    rollouts[1] = dataclasses.replace(rollouts[1], metadata={"reward_errors": {"correct": "timed out after 30s"}})
    buffer.add(rollouts)
    buffer.take({c.key: len(c.lengths) for c in buffer.candidates()})
    metrics = buffer.metrics()
    design_names = [
        "rollouts_in_buffer", "tokens_in_buffer", "frac_on_policy", "new_rollouts", "new_tokens",
        "new_generated_tokens", "reward/mean", "reward/std", "frac_truncated", "rewards/correct/mean",
        "rewards/correct/std", "rewards/format/mean", "rewards/format/std", "frac_used_in_batch",
        "frac_reward_failed",
    ]  # fmt: skip
    for name in design_names:
        assert f"replays/math/{name}" in metrics, name
    assert metrics["replays/math/new_rollouts"] == 2
    assert metrics["replays/math/new_tokens"] == 4 + 3 + 4 + 5
    assert metrics["replays/math/new_generated_tokens"] == 8
    assert metrics["replays/math/reward/mean"] == 0.5
    assert metrics["replays/math/frac_truncated"] == 0.5
    assert metrics["replays/math/frac_reward_failed"] == 0.5
    assert metrics["replays/math/rewards/format/mean"] == 0.75
    assert metrics["replays/math/frac_used_in_batch"] == 1.0
    sampled_logprobs = np.concatenate([r.turns[-1].logprobs for r in rollouts])
    assert metrics["replays/math/sampled_entropy"] == pytest.approx(-sampled_logprobs.mean())
    # new_* reset once reported
    assert buffer.metrics()["replays/math/new_rollouts"] == 0


def test_concurrent_adds_from_threads_lose_nothing():
    buffer = ReplayBuffer("env", ReplayBufferConfig(min_group_size=1))

    def produce(worker):
        for i in range(50):
            buffer.add(make_group([1.0, 0.0], group_id=f"w{worker}-{i}"))

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert buffer.size()[0] == 8 * 50 * 2
    assert len(list(buffer.candidates())) == 400


def test_take_leaves_members_that_arrived_after_planning():
    buffer = ReplayBuffer("env", ReplayBufferConfig(min_group_size=1))
    buffer.add(make_group([1.0, 0.0], group_id="g"))
    (spec,) = buffer.candidates()
    buffer.add(make_group([0.5], group_id="g", seed=3))
    (taken,) = buffer.take({spec.key: len(spec.lengths)})
    assert len(taken.members) == 2
    assert buffer.size()[0] == 1


def test_size_counters_follow_adds_takes_ageing_and_filtering():
    buffer = ReplayBuffer("env", ReplayBufferConfig(max_age=0, drop_zero_variance_groups=True))
    buffer.add(make_group([1.0, 0.0], group_id="old", policy_version=0, completion_lens=[3, 4]))
    buffer.add(make_group([1.0, 1.0], group_id="flat", policy_version=1, completion_lens=[5, 6]))
    buffer.add(make_group([1.0, 0.0, 0.5], group_id="new", policy_version=1, completion_lens=[2, 2, 2]))
    assert buffer.size() == (7, (4 + 3) + (4 + 4) + (4 + 5) + (4 + 6) + 3 * (4 + 2))
    buffer.set_policy_version(1)  # "old" is stale
    list(buffer.candidates())  # "flat" is filtered
    assert buffer.size() == (3, 18)
    buffer.take({"new": 2})
    assert buffer.size() == (1, 6)
    assert buffer.metrics()["replays/env/rollouts_in_buffer"] == 1
