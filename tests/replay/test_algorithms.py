import dataclasses

import numpy as np
import pytest

from marin_rl.replay import (
    Batcher,
    BatcherConfig,
    DrGrpoConfig,
    FlatRollout,
    GrpoConfig,
    OpdConfig,
    ReplayBuffer,
    ReplayBufferConfig,
    RlooConfig,
    SftConfig,
    TeacherConfig,
)
from marin_rl.testing import make_group, make_rollout

TEACHER = TeacherConfig(base_url="http://127.0.0.1:1/v1")


def with_teacher(rollout, shift=-0.25):
    turns = list(rollout.turns)
    turns[1] = dataclasses.replace(turns[1], teacher_logprobs=turns[1].logprobs + shift)
    return dataclasses.replace(rollout, turns=tuple(turns))


def flat(rollouts):
    return [FlatRollout.of(r) for r in rollouts]


def test_group_algorithms_put_the_rollout_advantage_on_sampled_tokens_only():
    members = flat(make_group([1.0, 0.0, 0.0], completion_lens=[2, 3, 4]))
    for config, expected in (
        (RlooConfig(), [1.0, -0.5, -0.5]),
        (DrGrpoConfig(), [2 / 3, -1 / 3, -1 / 3]),
        (GrpoConfig(eps=0.0), np.array([2 / 3, -1 / 3, -1 / 3]) / np.std([1.0, 0.0, 0.0], ddof=1)),
    ):
        for member, signal, advantage in zip(members, config.score_group(members), expected):
            sampled = member.sampled_mask
            np.testing.assert_allclose(signal.advantages[sampled], advantage, rtol=1e-6)
            assert (signal.advantages[~sampled] == 0).all()
            np.testing.assert_array_equal(signal.rl_weights, sampled)
            np.testing.assert_array_equal(signal.kl_weights, sampled)
            assert not signal.ce_weights.any()


def test_positive_only_and_overlong_filtering():
    group = make_group([1.0, 0.0])
    group[0] = dataclasses.replace(group[0], is_truncated=True)
    members = flat(group)
    clamped = RlooConfig(positive_only=True).score_group(members)
    assert clamped[1].advantages.min() == 0.0 and clamped[0].advantages.max() == 1.0
    filtered = RlooConfig(filter_truncated=True).score_group(members)
    assert not filtered[0].rl_weights.any(), "a truncated rollout gets no RL signal"
    np.testing.assert_array_equal(filtered[1].rl_weights, members[1].sampled_mask)
    # It still shapes the baseline: the other rollout's advantage is unchanged.
    np.testing.assert_allclose(filtered[1].advantages, RlooConfig().score_group(members)[1].advantages)


def test_sft_trains_cross_entropy_on_completion_tokens_only():
    (member,) = flat([make_rollout(completion_len=5)])
    (signal,) = SftConfig().score_group([member])
    np.testing.assert_array_equal(signal.ce_weights, member.sampled_mask)
    assert not signal.rl_weights.any() and not signal.kl_weights.any() and not signal.advantages.any()


def test_opd_advantage_is_minus_the_per_token_reverse_kl():
    rollout = with_teacher(make_rollout(completion_len=4), shift=-0.25)
    (member,) = flat([rollout])
    (signal,) = OpdConfig(teacher_server=TEACHER, coef=2.0).score_group([member])
    sampled = member.sampled_mask
    np.testing.assert_allclose(signal.advantages[sampled], 2.0 * -0.25, rtol=1e-6)
    assert (signal.advantages[~sampled] == 0).all()
    np.testing.assert_array_equal(signal.rl_weights, sampled)
    assert not signal.kl_weights.any() and not signal.ce_weights.any()


def test_opd_buffer_rejects_rollouts_without_teacher_logprobs():
    buffer = ReplayBuffer("opd", ReplayBufferConfig(min_group_size=1), algorithm=OpdConfig(teacher_server=TEACHER))
    assert buffer.add([make_rollout(env="opd"), with_teacher(make_rollout(env="opd"))]) == 1
    metrics = buffer.metrics()
    assert metrics["replays/opd/rejected"] == 1
    assert metrics["replays/opd/teacher_kl"] == pytest.approx(0.25, rel=1e-5)


def test_sft_rollouts_from_a_frozen_source_never_age():
    buffer = ReplayBuffer("sft", ReplayBufferConfig(min_group_size=1, max_age=0), algorithm=SftConfig())
    buffer.add([make_rollout(env="sft", policy_version=0)])
    assert buffer.set_policy_version(50) == 0
    assert len(list(buffer.candidates())) == 1


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (RlooConfig(), dict(group_size=1), "group_size must be >= 2"),
        (GrpoConfig(), dict(temperature=0.7), "temperature"),
        (OpdConfig(teacher_server=TEACHER), dict(temperature=0.5), "temperature"),
        (SftConfig(), dict(drop_zero_variance_groups=True), "drop every group"),
    ],
)
def test_impossible_combinations_are_rejected_with_the_reason(config, kwargs, message):
    settings = dict(group_size=8, temperature=1.0, drop_zero_variance_groups=False) | kwargs
    with pytest.raises(ValueError, match=message):
        config.check("env", **settings)


def test_sft_and_opd_configs_need_their_source():
    with pytest.raises(ValueError, match="needs teacher_server"):
        OpdConfig()
    with pytest.raises(ValueError, match="needs teacher_server"):
        SftConfig(source="teacher")
    SftConfig(source="teacher", teacher_server=TEACHER).check("env", 1, 0.3, False)  # frozen source: any temperature


def test_mixed_algorithms_pack_into_one_batch_with_aligned_arrays():
    buffers = {
        "rl": ReplayBuffer("rl", algorithm=RlooConfig()),
        "sft": ReplayBuffer("sft", ReplayBufferConfig(min_group_size=1), algorithm=SftConfig()),
        "opd": ReplayBuffer("opd", ReplayBufferConfig(min_group_size=1), algorithm=OpdConfig(teacher_server=TEACHER)),
    }
    buffers["rl"].add(make_group([1.0, 0.0], env="rl", group_id="r", completion_lens=[3, 5]))
    buffers["sft"].add([make_rollout(env="sft", completion_len=6, seed=3)])
    buffers["opd"].add([with_teacher(make_rollout(env="opd", completion_len=4, seed=4), shift=-0.5)])
    config = BatcherConfig(total_token_budget=64, max_seq_len=32, max_wait_s=0.0)
    packed = Batcher(buffers, {"rl": 0.4, "sft": 0.3, "opd": 0.3}, config).next_batch(0).packed
    mask = packed.loss_mask
    # Every weighted token is a sampled token, and each sampled token belongs to exactly one algorithm.
    for weights in (packed.rl_weights, packed.ce_weights, packed.kl_weights):
        assert not weights[~mask].any()
    assert ((packed.rl_weights > 0) & (packed.ce_weights > 0)).sum() == 0
    assert (packed.ce_weights > 0).sum() == 6
    assert (packed.rl_weights > 0).sum() == 3 + 5 + 4
    # opd tokens (rl without kl): the teacher is 0.5 nats less likely on each sampled token.
    np.testing.assert_allclose(packed.advantages[(packed.rl_weights > 0) & (packed.kl_weights == 0)], -0.5, rtol=1e-6)


def test_the_docs_example_algorithm_registers_and_scores():
    import re
    from pathlib import Path

    from marin_rl.replay import AlgorithmConfig

    doc = (Path(__file__).parents[2] / "docs" / "algorithms.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if "register_subclass" in block]
    if "max_baseline" not in AlgorithmConfig.get_known_choices():
        exec(compile(example, "docs/algorithms.md", "exec"), {"__name__": "docs_example"})
    config = AlgorithmConfig.get_choice_class("max_baseline")()
    members = flat(make_group([1.0, 0.0, 0.5]))
    advantages = [signal.advantages[m.sampled_mask][0] for m, signal in zip(members, config.score_group(members))]
    np.testing.assert_allclose(advantages, [0.0, -1.0, -0.5])
