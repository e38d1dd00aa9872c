"""On-policy distillation against a real teacher server (a second PolicyServer with the same weights)."""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.envs import build_env, resolve_settings
from marin_rl.learner import LearnerConfig, ModelConfig, build_model, loss_and_gradients
from marin_rl.server import InferenceServerConfig, PolicyServer
from marin_rl.workers._endpoints import Endpoint
from marin_rl.workers._workers import EnvWorkers, WorkerSpec
from marin_rl.replay import Batcher, BatcherConfig, OpdConfig, ReplayBuffer, ReplayBufferConfig, TeacherConfig
from marin_rl.tokenizer import load_tokenizer


@pytest.mark.slow
def test_opd_with_a_teacher_equal_to_the_student_gives_zero_kl_and_zero_gradient():
    tokenizer = load_tokenizer("char")
    model = build_model(ModelConfig(seq_len=64, compute_dtype="float32"), len(tokenizer), key=jax.random.key(0))
    server_config = InferenceServerConfig(max_seqs=8, max_seq_len=64)
    student = PolicyServer(server_config, model, tokenizer).start()
    teacher = PolicyServer(server_config, model, tokenizer).start()
    algorithm = OpdConfig(teacher_server=TeacherConfig(base_url=teacher.base_url))
    env = build_env("toy_addition", {}, tokenizer=tokenizer, name="distill")
    buffer = ReplayBuffer("distill", ReplayBufferConfig(min_group_size=1), algorithm=algorithm)
    spec = WorkerSpec.for_algorithm(algorithm, replicas=2, group_size=2, settings=resolve_settings(env))
    endpoint = Endpoint(student.base_url, server_config.model_name, "embedded", request_timeout_s=120)
    workers = EnvWorkers({"distill": env}, {"distill": spec}, {"distill": buffer}, [endpoint]).start()
    try:
        deadline = time.monotonic() + 180
        while buffer.size()[0] < 8:
            assert time.monotonic() < deadline, f"no rollouts: {workers.metrics()}"
            time.sleep(0.1)
    finally:
        workers.stop()
        student.shutdown()
        teacher.shutdown()

    metrics = buffer.metrics()
    assert metrics["replays/distill/teacher_kl"] == pytest.approx(0.0, abs=1e-4)
    batch = Batcher({"distill": buffer}, {"distill": 1.0}, BatcherConfig(128, 64, max_wait_s=0.0)).next_batch(0)
    packed = batch.packed
    assert packed.rl_weights.sum() > 0
    np.testing.assert_allclose(packed.advantages, 0.0, atol=1e-4)

    loss, grads, _, _ = eqx.filter_jit(loss_and_gradients)(model, batch.to_example(), config=LearnerConfig(), compute_dtype=jnp.float32)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
    assert abs(float(loss)) < 1e-4 and grad_norm < 1e-3
