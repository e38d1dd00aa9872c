"""Env workers keep sampling through server failures."""

import time

import jax
import pytest

from marin_rl.envs import build_env, resolve_settings
from marin_rl.learner import ModelConfig, build_model
from marin_rl.server import InferenceServerConfig, PolicyServer
from marin_rl.workers._endpoints import Endpoint
from marin_rl.workers._workers import EnvWorkers, WorkerSpec
from marin_rl.replay import ReplayBuffer, ReplayBufferConfig
from marin_rl.testing import free_port
from marin_rl.tokenizer import load_tokenizer


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
    spec = WorkerSpec(replicas=2, group_size=2, settings=resolve_settings(env))
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


def run_workers_until_failure(env, endpoint_url, replicas=2):
    """Free-running workers against `endpoint_url`; returns the failures reported and the buffer."""
    failures = []
    buffer = ReplayBuffer(env.name, ReplayBufferConfig(min_group_size=1))
    spec = WorkerSpec(replicas=replicas, group_size=2, settings=resolve_settings(env, max_total_tokens=32))
    workers = EnvWorkers({env.name: env}, {env.name: spec}, {env.name: buffer}, [Endpoint(endpoint_url, "policy", "embedded")], on_failure=failures.append)
    workers.start()
    try:
        wait_until(lambda: failures, timeout=30, what="a permanent failure")
        time.sleep(0.3)  # a retry, if any, would come within the first backoff
    finally:
        workers.stop()
    return failures, buffer, workers


def test_a_400_is_never_retried_and_stops_the_run(serve_asgi):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    requests = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def refuse():
        requests.append(1)
        return JSONResponse({"error": {"message": "max_tokens too large", "type": "BadRequestError", "param": None, "code": 400}}, status_code=400)

    env = build_env("toy_addition", {}, tokenizer=load_tokenizer("char"), name="addition")
    failures, buffer, workers = run_workers_until_failure(env, f"{serve_asgi(app)}/v1")
    assert len(failures) == 1 and "env 'addition'" in str(failures[0]) and "400" in str(failures[0])
    assert len(requests) == 2  # one per replica, none retried
    assert buffer.size() == (0, 0)


def test_a_missing_data_file_or_a_prompt_over_the_row_stops_the_run_without_a_request(tmp_path):
    from marin_rl.errors import ProblemSourceError, PromptTooLong

    tokenizer = load_tokenizer("char")
    missing = build_env("exact_match", {"data": str(tmp_path / "nonexistent.jsonl")}, tokenizer=tokenizer, name="qa")
    (tmp_path / "long.jsonl").write_text('{"prompt": "' + "x" * 100 + '", "answer": "y"}\n')
    long = build_env("exact_match", {"data": str(tmp_path / "long.jsonl")}, tokenizer=tokenizer, name="qa")
    unreachable = f"http://127.0.0.1:{free_port()}/v1"  # never contacted
    for env, error in ((missing, ProblemSourceError), (long, PromptTooLong)):
        failures, _, workers = run_workers_until_failure(env, unreachable)
        assert len(failures) == 1 and isinstance(failures[0], error) and "env 'qa'" in str(failures[0])
        assert workers.metrics()["workers/qa/errors"] <= 2  # each replica gave up at its first try


class FlakyEngine:
    """Stands in for the engine behind the real HTTP app: the first `failures` jobs fail (HTTP 500)."""

    def __init__(self, failures):
        self.failures = failures
        self.policy_version = 0
        tokenizer = load_tokenizer("char")
        self.answer = tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id]

    def submit(self, job):
        from marin_rl.engine import JobResult, Sample

        if self.failures > 0:
            self.failures -= 1
            job.future.set_exception(RuntimeError("engine failure"))
        else:
            job.future.set_result(JobResult([Sample(self.answer, [-0.1] * len(self.answer))] * job.n, None, self.policy_version))
        return job.future


def test_a_failed_evaluation_is_retried_then_recorded_and_never_ends_the_run(serve_asgi):
    from marin_rl.config import EvalConfig
    from marin_rl.server._app import build_app

    tokenizer = load_tokenizer("char")
    engine = FlakyEngine(failures=3)
    url = serve_asgi(build_app(InferenceServerConfig(max_seq_len=64), tokenizer, engine, len(tokenizer)))
    env = build_env("toy_addition", {}, tokenizer=tokenizer, name="addition")
    spec = WorkerSpec(replicas=1, group_size=2, settings=resolve_settings(env), eval=EvalConfig())
    buffer = ReplayBuffer("addition")
    workers = EnvWorkers({"addition": env}, {"addition": spec}, {"addition": buffer}, [Endpoint(f"{url}/v1", "policy", "embedded")], max_backoff_s=0.05)
    workers.start(free_running=False)
    try:
        retried = workers.evaluate(step=0)
        assert retried["eval/addition/failed"] == 0 and engine.failures == 0  # three 500s, each retried
        assert "eval/addition/greedy/reward/mean" in retried
        engine.failures = 10**9  # down for good
        failed = workers.evaluate(step=1)
        assert failed == {"eval/addition/failed": 1.0}
    finally:
        workers.stop()


def test_stop_ends_workers_whose_await_swallowed_the_cancellation():
    """Python 3.11's `asyncio.wait_for` returns a result that races a cancellation instead of raising it."""
    import asyncio

    from marin_rl.envs import Completion, Sampler
    from marin_rl.types import InferenceMetadata

    class AnswersThroughCancellation(Sampler):
        async def sample(self, prompt_ids, n, params):
            try:
                await asyncio.sleep(0.005)
            except asyncio.CancelledError:
                pass  # swallowed, as the racing wait_for does
            metadata = InferenceMetadata(server_id="embedded", model="policy", policy_version=0, finish_reason="length")
            return [Completion([20], [-0.1], metadata) for _ in range(n)]

    tokenizer = load_tokenizer("char")
    env = build_env("toy_addition", {}, tokenizer=tokenizer, name="addition")
    buffer = ReplayBuffer("addition", ReplayBufferConfig(min_group_size=1))
    endpoint = Endpoint("http://unused/v1", "policy", "embedded", local=AnswersThroughCancellation())
    workers = EnvWorkers({"addition": env}, {"addition": WorkerSpec(replicas=4, group_size=2, settings=resolve_settings(env))}, {"addition": buffer}, [endpoint])
    workers.start()
    wait_until(lambda: buffer.size()[0] >= 8, what="rollouts")
    workers.stop(timeout=10)
    assert not workers._thread.is_alive()


def test_workers_paused_by_a_full_buffer_resume_when_what_it_holds_is_about_to_age_out():
    """max_age 1: at version 1 the version-0 rollouts are still trained on, but not at version 2, so
    they no longer pause the workers, which sample with version 1 (pausing on them starved the
    learner once they aged out)."""
    from marin_rl.envs import Completion, Sampler
    from marin_rl.types import InferenceMetadata

    served = {"version": 0}

    class Policy(Sampler):
        async def sample(self, prompt_ids, n, params):
            metadata = InferenceMetadata(server_id="embedded", model="policy", policy_version=served["version"], finish_reason="length")
            return [Completion([20], [-0.1], metadata) for _ in range(n)]

    tokenizer = load_tokenizer("char")
    env = build_env("toy_addition", {}, tokenizer=tokenizer, name="addition")
    buffer = ReplayBuffer("addition", ReplayBufferConfig(max_age=1, min_group_size=1))
    spec = WorkerSpec(replicas=1, group_size=2, settings=resolve_settings(env), max_buffered_tokens=40)
    workers = EnvWorkers({"addition": env}, {"addition": spec}, {"addition": buffer}, [Endpoint("http://unused/v1", "policy", "embedded", local=Policy())])
    workers.start()
    try:
        wait_until(lambda: buffer.size()[1] >= 40, what="a full buffer")
        time.sleep(0.3)
        paused_at = buffer.size()
        assert paused_at[1] < 40 + 2 * 16  # it paused: at most the group in flight went past the limit
        served["version"] = 1
        buffer.set_policy_version(1)
        assert buffer.size() == paused_at  # version 0 is still trained on at version 1
        wait_until(lambda: buffer.tokens_ahead() >= 40, what="version-1 rollouts")
        versions = [m.policy_version for g in buffer.take({c.key: len(c.lengths) for c in buffer.candidates()}) for m in g.members]
        assert versions.count(0) == paused_at[0] and versions.count(1) > 0
    finally:
        workers.stop()
