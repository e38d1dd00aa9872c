"""The HTTP layer of the inference server against a scripted engine (no JAX compilation).

The real engine is exercised in test_policy_server.py; here the wire format, the vLLM extensions,
stop handling, validation errors and timeouts are checked quickly.
"""

import asyncio
import json
import threading
import time
import types

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from starlette.testclient import TestClient

from marin_rl.engine import JobResult, PromptScores, Sample
from marin_rl.errors import BaseMissing
from marin_rl.server import InferenceServerConfig
from marin_rl.server._app import WeightUpdates, build_app
from marin_rl.server._handler import RequestHandler
from marin_rl.server._protocol import truncate_at_stop
from marin_rl.testing import free_port
from marin_rl.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("char")
EOS = TOKENIZER.eos_token_id
VOCAB = len(TOKENIZER)
CONFIG = InferenceServerConfig(max_seqs=4, max_seq_len=64, request_timeout_s=5.0)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedWorker:
    """Answers each job with `completions` (token id lists, cycled over the n samples). A streaming job
    gets them `chunk` tokens at a time first, as the engine reads chunks back."""

    def __init__(self, completions=(), policy_version=3, prompt_scores=None, hang=False, chunk=2):
        self.completions = [list(c) for c in completions]
        self.policy_version = policy_version
        self.prompt_scores = prompt_scores
        self.hang = hang
        self.chunk = chunk
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)
        if not self.hang:
            samples = [self._sample(self.completions[k % len(self.completions)]) for k in range(job.n)]
            for start in range(0, max(len(s.token_ids) for s in samples), self.chunk) if job.on_tokens else ():
                for i, s in enumerate(samples):
                    if start < len(s.token_ids):
                        job.on_tokens(i, s.token_ids[start : start + self.chunk], s.logprobs[start : start + self.chunk])
            job.future.set_result(JobResult(samples, self.prompt_scores if job.prompt_logprobs is not None else None, self.policy_version))
        return job.future

    @staticmethod
    def _sample(token_ids):
        return Sample(token_ids, [-0.5 - 0.01 * i for i in range(len(token_ids))])


def client_for(worker, config=CONFIG):
    app = build_app(config, TOKENIZER, worker, VOCAB)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=TestClient(app), max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
    kwargs.setdefault("model", "policy")
    return client.chat.completions.create(**kwargs)


def test_chat_response_carries_token_ids_logprobs_prompt_ids_and_policy_version():
    worker = ScriptedWorker([ids("ab") + [EOS], ids("xyz")])
    r = chat(client_for(worker), n=2, max_tokens=3)
    prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert r.prompt_token_ids == prompt == worker.jobs[0].prompt_ids
    assert r.policy_version == 3
    first, second = r.choices
    assert first.token_ids == ids("ab") + [EOS] and first.message.content == "ab"
    assert (first.finish_reason, first.stop_reason) == ("stop", None)
    assert [c.token for c in first.logprobs.content] == ["a", "b", "<|end|>"]
    assert [c.logprob for c in first.logprobs.content] == pytest.approx([-0.5, -0.51, -0.52])
    assert (second.message.content, second.finish_reason) == ("xyz", "length")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 6


def test_chat_default_max_tokens_fills_the_context_and_eos_is_a_device_stop():
    worker = ScriptedWorker([[EOS]])
    chat(client_for(worker))
    (job,) = worker.jobs
    assert job.max_tokens == CONFIG.max_seq_len - len(job.prompt_ids)
    assert job.stop_sequences == [[EOS]]
    chat(client_for(worker), max_tokens=1, extra_body={"ignore_eos": True, "stop_token_ids": [7]}, stop=["qq"])
    assert worker.jobs[-1].stop_sequences == [[7], ids("qq")]


def test_stop_string_cuts_text_and_tokens_like_vllm():
    completion = ids("abcXYZdef")
    r = chat(client_for(ScriptedWorker([completion])), stop=["Z", "XY"], max_tokens=9)
    (c,) = r.choices
    assert (c.message.content, c.finish_reason, c.stop_reason) == ("abc", "stop", "XY")
    assert c.token_ids == ids("abcXY") and len(c.logprobs.content) == 5
    r = chat(client_for(ScriptedWorker([completion])), stop="XY", max_tokens=9, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "abcXY" and r.choices[0].token_ids == ids("abcXY")


def test_stop_token_id_is_reported_as_stop_reason():
    r = chat(client_for(ScriptedWorker([ids("ab!")])), max_tokens=5, extra_body={"stop_token_ids": ids("!")})
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason, r.choices[0].token_ids) == ("stop", ids("!")[0], ids("ab!"))


def test_completions_with_token_id_prompts_and_return_tokens_as_token_ids():
    worker = ScriptedWorker([ids("hi"), ids("yo")], policy_version=5)
    client = client_for(worker)
    r = client.completions.create(
        model="policy", prompt=[[10, 11], [12]], n=2, max_tokens=2, logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in r.choices] == [[10, 11], [10, 11], [12], [12]]
    assert r.choices[1].text == "yo" and r.choices[1].token_ids == ids("yo")
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids("hi")]
    assert r.choices[0].logprobs.text_offset == [0, 1]
    assert r.policy_version == 5 and r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 8
    r = client.completions.create(model="policy", prompt=[10, 11, 12], max_tokens=2)
    assert r.choices[0].prompt_token_ids == [10, 11, 12] and worker.jobs[-1].prompt_ids == [10, 11, 12]
    r = client.completions.create(model="policy", prompt="ab", max_tokens=2, extra_body={"return_token_ids": False})
    assert r.choices[0].token_ids is None and r.choices[0].prompt_token_ids is None


def test_prompt_logprobs_follow_vllm_layout():
    prompt = ids("abc")
    scores = PromptScores(
        logprobs=np.array([-1.0, -2.0]),
        ranks=np.array([1, 3]),
        top_ids=np.array([[prompt[1], 50], [60, 61]]),
        top_logprobs=np.array([[-1.0, -3.0], [-0.5, -1.5]]),
    )
    client = client_for(ScriptedWorker([ids("x")], prompt_scores=scores))
    r = client.completions.create(model="policy", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    assert entries[1] == {str(prompt[1]): {"logprob": -1.0, "rank": 1, "decoded_token": "b"}, "50": {"logprob": -3.0, "rank": 2, "decoded_token": TOKENIZER.decode([50])}}
    assert entries[2][str(prompt[2])] == {"logprob": -2.0, "rank": 3, "decoded_token": "c"}
    assert set(entries[2]) == {str(prompt[2]), "60", "61"}
    chat_prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    m = len(chat_prompt) - 1
    scores = PromptScores(np.full(m, -1.0), np.ones(m, int), np.zeros((m, 0), int), np.zeros((m, 0)))
    r = chat(client_for(ScriptedWorker([ids("x")], prompt_scores=scores)), max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(chat_prompt)
    assert r.prompt_logprobs[-1] == {str(chat_prompt[-1]): {"logprob": -1.0, "rank": 1, "decoded_token": "<|assistant|>"}}


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"messages": [{"role": "bogus", "content": "hi"}]}, "messages.0.role"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"n": 5}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        ({"top_logprobs": 2, "logprobs": True, "stream": True}, "top_logprobs"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_requests_get_400_with_an_openai_error(kwargs, param):
    worker = ScriptedWorker([ids("a")])
    with pytest.raises(openai.BadRequestError) as e:
        chat(client_for(worker), **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param and e.value.body["message"]
    assert worker.jobs == []


def test_too_many_sequences_in_one_request_get_400_naming_the_limit_before_any_prompt_is_checked(monkeypatch):
    worker = ScriptedWorker([ids("a")])
    config = InferenceServerConfig(max_seqs=4, max_seq_len=64, max_sequences_per_request=32)
    http = TestClient(build_app(config, TOKENIZER, worker, VOCAB))
    checked = []
    monkeypatch.setattr(RequestHandler, "check_prompt_ids", lambda self, ids, param: checked.append(ids) or ids)
    for prompt in ([[5, 6]] * 9, ["1+1="] * 9):
        response = http.post("/v1/completions", json={"prompt": prompt, "n": 4, "max_tokens": 1})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "prompt"
        assert error["message"] == "this request asks for 9 prompt(s) x n=4 = 36 sequences; the server's max_sequences_per_request is 32"
    assert checked == [] and worker.jobs == []
    # At the limit it is served.
    assert http.post("/v1/completions", json={"prompt": [[5, 6]] * 8, "n": 4, "max_tokens": 1}).status_code == 200
    assert len(worker.jobs) == 8


def test_a_flood_of_messages_is_refused_before_it_is_validated_or_rendered(monkeypatch):
    worker = ScriptedWorker([ids("a")])
    http = TestClient(build_app(CONFIG, TOKENIZER, worker, VOCAB))

    def no_rendering(*args, **kwargs):
        raise AssertionError("the messages were rendered")

    monkeypatch.setattr(TOKENIZER, "apply_chat_template", no_rendering)
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * CONFIG.max_seq_len})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages"
    assert f"the request has {CONFIG.max_seq_len} messages: every message renders as one token at least" in error["message"]
    assert worker.jobs == []


def test_a_rendered_chat_too_long_for_the_context_is_refused_before_tokenizing(monkeypatch):
    worker = ScriptedWorker([ids("a")])
    http = TestClient(build_app(CONFIG, TOKENIZER, worker, VOCAB))
    rendered = []
    render = TOKENIZER.apply_chat_template

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the rendered chat was tokenized")

    monkeypatch.setattr(TOKENIZER, "apply_chat_template", lambda *a, **k: rendered.append(render(*a, **k)) or rendered[-1])
    monkeypatch.setattr(type(TOKENIZER), "__call__", no_tokenizing)
    # 60 empty messages (fewer than max_seq_len): no content, but 900 characters of role markers rendered.
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * 60})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert f"the prompt has {len(rendered[0])} characters" in response.json()["error"]["message"]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["Infinity", "NaN", "-Infinity"])
def test_non_finite_floats_get_400(field, value):
    worker = ScriptedWorker([ids("a")])
    http = TestClient(build_app(CONFIG, TOKENIZER, worker, VOCAB))
    body = '{"prompt": "1+1=", "max_tokens": 1, "%s": %s}' % (field, value)
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and "finite" in response.json()["error"]["message"]
    assert worker.jobs == []


def test_top_p_and_top_k_reach_the_engine():
    worker = ScriptedWorker([ids("a")])
    chat(client_for(worker), max_tokens=1, top_p=0.5, extra_body={"top_k": 5})
    chat(client_for(worker), max_tokens=1, extra_body={"top_k": -1})
    chat(client_for(worker), max_tokens=1, extra_body={"top_k": 2**40})  # past the vocabulary: keep every token
    assert [(j.top_p, j.top_k) for j in worker.jobs] == [(0.5, 5), (1.0, 0), (1.0, VOCAB)]


def test_a_prompt_filling_the_context_is_refused():
    client = client_for(ScriptedWorker([ids("a")]))
    with pytest.raises(openai.BadRequestError, match="no room for a completion token") as e:
        client.completions.create(model="policy", prompt=list(range(10, 10 + CONFIG.max_seq_len)), max_tokens=1)
    assert e.value.body["param"] == "prompt"


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing(monkeypatch):
    worker = ScriptedWorker([ids("a")])
    http = TestClient(build_app(CONFIG, TOKENIZER, worker, VOCAB))

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(TOKENIZER, "encode", no_tokenizing)
    monkeypatch.setattr(TOKENIZER, "apply_chat_template", no_tokenizing)
    long_text = "1" * 1_000_000
    completion = http.post("/v1/completions", json={"prompt": long_text})
    chat_ = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]})
    for response, param in ((completion, "prompt"), (chat_, "messages")):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and "1000000 characters" in error["message"]
    assert worker.jobs == []


def test_a_body_over_the_limit_gets_413_and_the_server_goes_on():
    worker = ScriptedWorker([ids("a")])
    http = TestClient(build_app(InferenceServerConfig(max_seq_len=64, max_request_bytes=1000), TOKENIZER, worker, VOCAB))
    declared = http.post("/v1/completions", json={"prompt": "1" * 2000})
    streamed = http.post("/v1/completions", content=iter([b'{"prompt": "', b"1" * 600, b"1" * 600, b'"}']))  # chunked
    assert declared.status_code == streamed.status_code == 413
    assert "Too Large" in declared.text and streamed.json()["error"]["code"] == 413
    assert worker.jobs == []
    assert http.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 1}).status_code == 200


def test_unknown_model_is_404_and_error_body_is_openai_shaped():
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        chat(client_for(ScriptedWorker([ids("a")])), model="gpt-9")
    http = TestClient(build_app(CONFIG, TOKENIZER, ScriptedWorker([ids("a")]), VOCAB))
    response = http.post("/v1/completions", json={"prompt": [VOCAB + 3], "max_tokens": 1})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert http.post("/v1/completions", content=b"{not json").status_code == 400
    assert http.post("/v1/weights/update", json={"path": "/x", "policy_version": 1}).status_code == 404


def test_a_request_that_is_not_answered_in_time_gets_504_and_leaves_the_queue():
    worker = ScriptedWorker(hang=True)
    client = client_for(worker, InferenceServerConfig(max_seqs=4, max_seq_len=64, request_timeout_s=0.2))
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, max_tokens=2)
    assert e.value.status_code == 504 and "request_timeout_s" in e.value.message
    assert worker.jobs[0].future.cancelled()


class StoppingWorker(ScriptedWorker):
    """An engine that is shutting down: it cancels every job it is given."""

    def submit(self, job):
        job.future.cancel()
        return job.future


def test_requests_in_flight_when_the_engine_stops_get_503_without_a_logged_error(caplog):
    client = client_for(StoppingWorker())
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, max_tokens=2)
    assert e.value.status_code == 503 and "shutting down" in e.value.message
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


def test_async_client_models_and_health():
    app = build_app(CONFIG, TOKENIZER, ScriptedWorker([ids("ok")]), VOCAB)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
            rs = await asyncio.gather(*(chat(client, max_tokens=2) for _ in range(3)))
            models = await client.models.list()
            health = (await http.get("/health")).json()
            version = (await http.get("/v1/weights/version")).json()
        return rs, models, health, version

    rs, models, health, version = asyncio.run(go())
    assert [r.choices[0].message.content for r in rs] == ["ok"] * 3
    assert [m.id for m in models.data] == ["policy"]
    assert health["status"] == "ok" and health["policy_version"] == version["policy_version"] == 3
    assert health["instance"] == version["instance"]  # a restarted process has another


def test_truncate_at_stop_keeps_the_token_that_completed_the_stop():
    tokens = ["ab", "c", "de", "f"]

    def decode(ts):
        return "".join(ts)

    assert truncate_at_stop(tokens, decode, ["cd"], False) == (3, "ab", "cd")
    assert truncate_at_stop(tokens, decode, ["cd"], True) == (3, "abcd", "cd")
    assert truncate_at_stop(tokens, decode, ["f", "b"], False) == (1, "a", "b")
    assert truncate_at_stop(tokens, decode, ["zz"], False) == (4, "abcdef", None)
    assert truncate_at_stop(tokens, decode, [], False) == (4, "abcdef", None)



class SwappableWorker(ScriptedWorker):
    def __init__(self):
        super().__init__([ids("a")], policy_version=1)
        self.model = "weights-v1"


def weight_update_app(worker, tmp_path, load=None):
    def swap(model, version):
        worker.model, worker.policy_version = model, version
        return types.SimpleNamespace(total_seconds=0.01)

    updates = WeightUpdates(token="s3cret", load=load or (lambda path, adapters: f"weights@{path}"), swap=swap)
    return TestClient(build_app(CONFIG, TOKENIZER, worker, VOCAB, updates))


def test_weight_update_needs_the_bearer_token_and_keeps_old_weights_when_refused(tmp_path):
    worker = SwappableWorker()
    http = weight_update_app(worker, tmp_path)
    body = {"path": str(tmp_path), "policy_version": 2}
    missing = http.post("/v1/weights/update", json=body)
    wrong = http.post("/v1/weights/update", json=body, headers={"Authorization": "Bearer nope"})
    not_bearer = http.post("/v1/weights/update", json=body, headers={"Authorization": "s3cret"})
    assert (missing.status_code, wrong.status_code, not_bearer.status_code) == (401, 403, 401)
    assert missing.json()["error"]["type"] == "AuthenticationError"
    assert (worker.model, worker.policy_version) == ("weights-v1", 1)
    ok = http.post("/v1/weights/update", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["policy_version"] == 2
    assert (worker.model, worker.policy_version) == (f"weights@{tmp_path}", 2)
    assert http.get("/v1/weights/version").json()["policy_version"] == 2


def test_weight_update_refuses_stale_versions_missing_dirs_and_unloadable_checkpoints(tmp_path):
    def broken(path, adapters):
        raise OSError("no model.safetensors")

    def no_base(path, adapters):
        raise BaseMissing("no base weights")

    worker = SwappableWorker()
    auth = {"Authorization": "Bearer s3cret"}
    http = weight_update_app(worker, tmp_path)
    assert http.post("/v1/weights/update", json={"path": str(tmp_path), "policy_version": 0}, headers=auth).status_code == 409
    missing = http.post("/v1/weights/update", json={"path": str(tmp_path / "nope"), "policy_version": 2}, headers=auth)
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    failed = weight_update_app(worker, tmp_path, load=broken).post("/v1/weights/update", json={"path": str(tmp_path), "policy_version": 2}, headers=auth)
    assert failed.status_code == 400 and "no model.safetensors" in failed.json()["error"]["message"]
    # LoRA adapters: a file that is not there, nothing to load, and adapters alone on a server with no base.
    adapters = tmp_path / "adapters.safetensors"
    gone = http.post("/v1/weights/update", json={"adapters": str(adapters), "policy_version": 2}, headers=auth)
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "adapters"
    empty = http.post("/v1/weights/update", json={"policy_version": 2}, headers=auth)
    assert empty.status_code == 400 and "path" in empty.json()["error"]["message"]
    adapters.write_bytes(b"")
    baseless = weight_update_app(worker, tmp_path, load=no_base).post("/v1/weights/update", json={"adapters": str(adapters), "policy_version": 2}, headers=auth)
    assert baseless.status_code == 409 and baseless.json()["error"]["param"] == "path"
    assert worker.policy_version == 1
    # A resumed run rolls its servers back to its checkpoint.
    rolled_back = http.post("/v1/weights/update", json={"path": str(tmp_path), "policy_version": 0, "reset": True}, headers=auth)
    assert rolled_back.status_code == 200 and worker.policy_version == 0


def test_weight_upload_needs_the_token_and_splits_its_body_into_weights_and_adapters(tmp_path):
    loaded = []

    def load(weights, adapters):
        loaded.append((weights, adapters))
        if weights is None:
            raise BaseMissing("no base weights")
        return f"weights@{len(weights)}"

    worker = SwappableWorker()
    http = weight_update_app(worker, tmp_path, load=load)
    auth = {"Authorization": "Bearer s3cret"}

    def upload(body: bytes, headers=auth, **params):
        return http.post("/v1/weights/upload", params={"policy_version": 2, **params}, content=body, headers=headers)

    assert (upload(b"w" * 10, headers={}).status_code, upload(b"w" * 10, headers={"Authorization": "Bearer no"}).status_code) == (401, 403)
    assert upload(b"w" * 10, policy_version=0).status_code == 409  # older than the served version 1
    too_long = upload(b"w" * 10, weights_bytes=11)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "weights_bytes"
    assert upload(b"").status_code == 400
    baseless = upload(b"adapters", weights_bytes=0)
    assert baseless.status_code == 409 and baseless.json()["error"]["param"] == "weights_bytes"
    assert loaded == [(None, b"adapters")] and (worker.model, worker.policy_version) == ("weights-v1", 1)
    ok = upload(b"w" * 10 + b"adapters", weights_bytes=10)
    assert ok.status_code == 200 and ok.json()["policy_version"] == 2
    assert loaded[-1] == (b"w" * 10, b"adapters") and (worker.model, worker.policy_version) == ("weights@10", 2)
    whole = upload(b"w" * 12, policy_version=3)  # no weights_bytes: the whole body is the weights
    assert whole.status_code == 200 and loaded[-1] == (b"w" * 12, None) and worker.policy_version == 3
    large = b"w" * (CONFIG.max_request_bytes + 1)  # weights are larger than any API request may be
    assert upload(large, policy_version=4).status_code == 200 and loaded[-1] == (large, None)
    assert http.post("/v1/completions", content=large).status_code == 413  # the API's limit holds elsewhere


# ------------------------------------------------------------------------------------------ streaming
# `stream: true`: the deltas of each choice add up to exactly the answer without streaming (text, token
# ids, log-probs, finish and stop reasons), and text that a stop string may still cut is never sent.


def streamed_chat(client, **kwargs):
    """{choice index: (text, token ids, logprobs, finish_reason, stop_reason)} and the chunks."""
    chunks = list(chat(client, stream=True, **kwargs))
    choices = {}
    for chunk in chunks:
        for c in chunk.choices:
            text, token_ids, logprobs, _, _ = choices.get(c.index, ("", [], [], None, None))
            token_ids = token_ids + (c.model_extra.get("token_ids") or [])
            logprobs = logprobs + [lp.logprob for lp in (c.logprobs.content if c.logprobs else [])]
            choices[c.index] = (text + (c.delta.content or ""), token_ids, logprobs, c.finish_reason, c.model_extra.get("stop_reason"))
    return choices, chunks


def answer(client, **kwargs):
    r = chat(client, **kwargs)
    return {c.index: (c.message.content, c.token_ids, [lp.logprob for lp in c.logprobs.content], c.finish_reason, c.stop_reason) for c in r.choices}


@pytest.mark.parametrize("chunk", [1, 3, 20])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 9},
        {"max_tokens": 9, "n": 2},
        {"max_tokens": 9, "stop": ["Z", "XY"]},
        {"max_tokens": 9, "stop": "XY", "extra_body": {"include_stop_str_in_output": True}},
        {"max_tokens": 9, "extra_body": {"stop_token_ids": ids("Y")}},
    ],
)
def test_streamed_chat_adds_up_to_the_answer(kwargs, chunk):
    completions = [ids("abcXYZdef"), ids("uvw") + [TOKENIZER.eos_token_id]]
    streamed, chunks = streamed_chat(client_for(ScriptedWorker(completions, chunk=chunk)), **kwargs)
    assert streamed == answer(client_for(ScriptedWorker(completions)), **kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if any(choice.finish_reason for choice in c.choices)]
    assert len(finishing) == kwargs.get("n", 1) and all(c.model_extra["policy_version"] == 3 for c in finishing)


def test_text_a_stop_string_may_still_cut_is_never_sent():
    client = client_for(ScriptedWorker([ids("abcXYZdef")], chunk=1))
    _, chunks = streamed_chat(client, max_tokens=9, stop=["XYZ"])
    sent = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(sent) == "abc" and len(sent) > 1  # several deltas, none with "X" or "XY"


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(monkeypatch):
    """Each chunk's text comes from decoding it with the chunk before, not the whole completion again:
    400 tokens in chunks of 2 decoded 80,000 tokens when every chunk decoded everything so far."""
    decoded = []
    decode = TOKENIZER.decode
    monkeypatch.setattr(TOKENIZER, "decode", lambda token_ids, **kwargs: decoded.append(len(token_ids)) or decode(token_ids, **kwargs))
    completion = ids("ab" * 200)
    config = InferenceServerConfig(max_seqs=4, max_seq_len=512)
    streamed, _ = streamed_chat(client_for(ScriptedWorker([completion], chunk=2), config), max_tokens=400, stop=["ba!"])
    assert streamed[0][0] == "ab" * 200 and streamed[0][1] == completion
    assert 400 <= sum(decoded) <= 8 * 400


def test_usage_comes_last_when_asked():
    client = client_for(ScriptedWorker([ids("abc")]))
    chunks = list(chat(client, stream=True, max_tokens=3, n=2, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completions_add_up_to_the_answer_for_several_prompts():
    worker = ScriptedWorker([ids("hello"), ids("yo!")], chunk=2)
    client = client_for(worker)
    kwargs = {"model": "policy", "prompt": [[10, 11], [12]], "n": 2, "max_tokens": 5, "logprobs": 0, "stop": ["!"]}
    expected = client_for(ScriptedWorker([ids("hello"), ids("yo!")])).completions.create(**kwargs)
    texts, offsets, token_ids = {}, {}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        offsets[c.index] = offsets.get(c.index, []) + c.logprobs.text_offset
        token_ids[c.index] = token_ids.get(c.index, []) + c.model_extra["token_ids"]
    for c in expected.choices:
        assert (texts[c.index], offsets[c.index], token_ids[c.index]) == (c.text, c.logprobs.text_offset, c.token_ids)


def test_an_error_after_the_stream_began_is_an_event_then_done():
    """A request the engine does not answer in time: the status line (200) is sent, so the 504 comes as
    an event with the error body, and the stream still ends with [DONE]."""
    config = CONFIG.__class__(**{**CONFIG.__dict__, "request_timeout_s": 0.2})
    http = TestClient(build_app(config, TOKENIZER, ScriptedWorker(hang=True), VOCAB))
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    response = http.post("/v1/chat/completions", json=body)
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 504


def test_a_bad_streaming_request_is_still_a_400_before_any_event():
    http = TestClient(build_app(CONFIG, TOKENIZER, ScriptedWorker([ids("a")]), VOCAB))
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_a_client_that_closes_the_stream_cancels_its_job():
    """Through uvicorn (the test client does not tell the app that the client left)."""
    worker = ScriptedWorker(hang=True)
    app = build_app(InferenceServerConfig(max_seqs=4, max_seq_len=64, request_timeout_s=60), TOKENIZER, worker, VOCAB)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{server.config.port}/v1/chat/completions", json=body, timeout=30) as response:
            assert next(response.iter_lines()).startswith("data: ")  # the role, sent before the job is submitted
            deadline = time.monotonic() + 30
            while not worker.jobs and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(worker.jobs) == 1
        while not worker.jobs[0].future.cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.jobs[0].future.cancelled()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
