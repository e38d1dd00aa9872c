"""Env workers keep sampling through server failures."""

import socket
import time

import jax
import pytest

from marin_rl.envs import build_env
from marin_rl.learner import ModelConfig, build_model
from marin_rl.orchestrator import InferenceServerConfig, PolicyServer
from marin_rl.orchestrator._endpoints import Endpoint
from marin_rl.orchestrator._workers import EnvWorkers, WorkerSpec
from marin_rl.replay import ReplayBuffer, ReplayBufferConfig
from marin_rl.tokenizer import load_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_workers_report_errors_while_the_server_is_down_and_resume_when_it_is_back():
    tokenizer = load_tokenizer("char")
    model = build_model(ModelConfig(seq_len=64), len(tokenizer), key=jax.random.key(0))
    config = InferenceServerConfig(port=free_port(), max_seqs=8, max_seq_len=64)
    server = PolicyServer(config, model, tokenizer).start()
    env = build_env("toy_addition", {}, tokenizer=tokenizer, name="addition")
    buffer = ReplayBuffer("addition", ReplayBufferConfig(min_group_size=1))
    spec = WorkerSpec(replicas=2, group_size=2)
    endpoint = Endpoint(server.base_url, config.model_name, "embedded", request_timeout_s=60)
    workers = EnvWorkers({"addition": env}, {"addition": spec}, {"addition": buffer}, [endpoint], max_backoff_s=0.5)
    workers.start()
    try:
        wait_until(lambda: buffer.size()[0] >= 4, what="rollouts from the first server")
        server.shutdown()
        wait_until(lambda: workers.metrics()["workers/addition/errors"] >= 2, what="workers to report errors")
        before = buffer.size()[0]
        server = PolicyServer(config, model, tokenizer, policy_version=1).start()  # back on the same port
        wait_until(lambda: buffer.size()[0] > before + 2, what="rollouts after the server came back")
        assert workers._thread.is_alive()
        fresh = [g for g in buffer.take({c.key: len(c.lengths) for c in buffer.candidates()})]
        assert any(m.policy_version == 1 for g in fresh for m in g.members)
    finally:
        workers.stop()
        server.shutdown()
