"""Envs with different algorithms in one batch: the learner stays algorithm-blind and the mixed
batch's loss and gradient are the sum of each env's part (docs/algorithms.md, "Mixing algorithms")."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from marin_rl.learner import LearnerConfig, LossConfig, ModelConfig, TokenMean, TokenSum, build_model, loss_and_gradients
from marin_rl.replay import (
    Batcher,
    BatcherConfig,
    OpdConfig,
    ReplayBuffer,
    ReplayBufferConfig,
    RlooConfig,
    SftConfig,
    TeacherConfig,
)
from marin_rl.testing import make_group, make_rollout

ALGORITHMS = {
    "rl": RlooConfig(),
    "sft": SftConfig(),
    "opd": OpdConfig(teacher_server=TeacherConfig(base_url="http://127.0.0.1:1/v1")),
}


def env_rollouts(env):
    if env == "rl":
        return make_group([1.0, 0.0, 0.5], env="rl", group_id="r", completion_lens=[5, 7, 3], seed=1)
    if env == "sft":
        return [make_rollout(env="sft", completion_len=9, seed=2, group_id="s")]
    rollout = make_rollout(env="opd", completion_len=6, seed=3, group_id="o")
    assistant = rollout.turns[1]
    scored = dataclasses.replace(assistant, teacher_logprobs=assistant.logprobs - np.linspace(0.1, 0.6, 6, dtype=np.float32))
    return [dataclasses.replace(rollout, turns=(rollout.turns[0], scored))]


def batch_of(envs):
    buffers = {
        env: ReplayBuffer(env, ReplayBufferConfig(min_group_size=1), algorithm=ALGORITHMS[env]) for env in envs
    }
    for env in envs:
        buffers[env].add(env_rollouts(env))
    config = BatcherConfig(total_token_budget=128, max_seq_len=32, max_wait_s=0.0)
    batch = Batcher(buffers, {env: 1 / len(envs) for env in envs}, config).next_batch(policy_version=0)
    assert sum(len(g.members) for g in batch.groups) == sum(len(env_rollouts(e)) for e in envs)
    return batch.to_example()


def test_mixed_batch_equals_the_sum_of_each_envs_part():
    model = build_model(ModelConfig(hidden_dim=32, intermediate_dim=64, seq_len=32, compute_dtype="float32"), 104, key=jax.random.key(0))
    mixed = batch_of(["rl", "sft", "opd"])
    total_loss_tokens = float(jnp.sum(mixed.loss_mask.array))

    step = eqx.filter_jit(loss_and_gradients)

    def run(example, aggregation):
        config = LearnerConfig(loss=LossConfig(aggregation=aggregation))
        loss, grads, _, _ = step(model, example, config=config, compute_dtype=jnp.float32)
        return float(loss), grads

    mixed_loss, mixed_grads = run(mixed, TokenMean())
    # Each env alone, normalised by the mixed batch's loss-token count (token-mean's normaliser).
    parts = [run(batch_of([env]), TokenSum(constant=total_loss_tokens)) for env in ALGORITHMS]
    assert abs(mixed_loss - sum(loss for loss, _ in parts)) < 1e-5
    summed = jax.tree.map(lambda *g: sum(g), *(grads for _, grads in parts))
    for a, b in zip(jax.tree.leaves(mixed_grads), jax.tree.leaves(summed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert all(abs(loss) > 0 for loss, _ in parts), "each env's part contributes"
