import numpy as np

from marin_rl.replay import Batcher, BatcherConfig, ReplayBuffer, ReplayBufferConfig, mismatch_metrics
from marin_rl.testing import make_group

CAP = 2.0


def batch_of(groups_by_env, version):
    buffers = {env: ReplayBuffer(env, ReplayBufferConfig(max_age=5)) for env in groups_by_env}
    for env, groups in groups_by_env.items():
        for group in groups:
            buffers[env].add(group)
    batcher = Batcher(buffers, {env: 1 / len(buffers) for env in buffers}, BatcherConfig(total_token_budget=640, max_seq_len=64, max_wait_s=0))
    return batcher.next_batch(version)


def learner_logprobs_at(batch, shift):
    """What a learner would score: the behaviour log-probs plus `shift(env, version)` on sampled tokens."""
    logprobs = np.zeros(batch.packed.input_ids.shape, np.float32)
    for group in batch.groups:
        for member, (row, offset) in zip(group.members, batch.plan.placements[group.env][group.group_id]):
            span = slice(offset, offset + member.num_tokens)
            logprobs[row, span] = member.behaviour_logprobs + member.sampled_mask * shift(group.env, member.policy_version)
    return logprobs


def test_same_version_tokens_measure_numerics_and_older_ones_are_kept_apart():
    groups = {
        "a": [make_group([1, 0, 1], env="a", group_id="a-now", policy_version=3), make_group([0, 1], env="a", group_id="a-old", policy_version=2)],
        "b": [make_group([1, 0], env="b", group_id="b-now", policy_version=3, completion_lens=[5, 2])],
        "teacher": [make_group([1, 0], env="teacher", group_id="t", policy_version=0)],  # not the policy's samples
    }
    batch = batch_of(groups, version=3)
    shifts = {("a", 3): 0.0, ("a", 2): -1.5, ("b", 3): 1.0, ("teacher", 0): 5.0}  # log(pi / mu) per token
    metrics = mismatch_metrics(batch, learner_logprobs_at(batch, lambda env, v: shifts[(env, v)]), ["a", "b"], CAP)

    assert metrics["mismatch/a/tokens"] == 9 and metrics["mismatch/a/stale_tokens"] == 6
    assert metrics["mismatch/a/kl"] == 0 and metrics["mismatch/a/max_abs_diff"] == 0 and metrics["mismatch/a/frac_capped"] == 0
    np.testing.assert_allclose(metrics["mismatch/a/stale_kl"], np.exp(-1.5) - 1 + 1.5, rtol=1e-6)
    assert metrics["mismatch/b/tokens"] == 7 and metrics["mismatch/b/stale_tokens"] == 0 and "mismatch/b/stale_kl" not in metrics
    np.testing.assert_allclose(metrics["mismatch/b/kl"], np.e - 2, rtol=1e-6)  # exp(1) - 1 - 1
    np.testing.assert_allclose(metrics["mismatch/b/max_abs_diff"], 1.0, rtol=1e-6)
    assert metrics["mismatch/b/frac_capped"] == 1  # ratio e > the cap of 2
    assert not [k for k in metrics if k.startswith("mismatch/teacher/")]
