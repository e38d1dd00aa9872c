"""Broadcast to a real `serve` process (a subprocess on 127.0.0.1) and to a colocated server.

Both compile Levanter's engine (tens of seconds each on CPU): slow.
"""

import httpx
import jax
import openai
import pytest

from marin_rl.broadcaster import Broadcaster, ColocatedTransport, RemoteTransport, WeightUpdateRefused
from marin_rl.learner import LoraConfig, ModelConfig, build_model, save_hf_model
from marin_rl.server import InferenceServerConfig, PolicyServer
from marin_rl.testing import start_serve_process, with_trained_adapters
from marin_rl.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"
SERVER = dict(max_seqs=4, max_seq_len=128, page_size=16, decode_steps=8)
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def tiny_llama(seed: int):
    config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=128)
    return build_model(config, len(load_tokenizer("char")), key=jax.random.PRNGKey(seed))


@pytest.fixture
def serve_process(tmp_path):
    """A `serve` process started from model 0's checkpoint; yields its base URL."""
    checkpoint = save_hf_model(tiny_llama(0), load_tokenizer("char"), tmp_path / "start")
    flags = [f"--server.{k}={v}" for k, v in SERVER.items()]
    process, base_url = start_serve_process(checkpoint, tmp_path, token=TOKEN, flags=flags)
    try:
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=60)


def greedy(base_url: str) -> tuple[list[int], int]:
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300) as client:
        r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16, temperature=0)
    return r.choices[0].token_ids, r.policy_version


def test_remote_server_serves_the_broadcast_weights_and_refuses_pushes_without_the_token(serve_process, tmp_path):
    tokenizer = load_tokenizer("char")
    model_b = tiny_llama(1)
    remote = RemoteTransport(serve_process, TOKEN, timeout_s=300)  # the weights in the request's body
    with PolicyServer(InferenceServerConfig(**SERVER), tiny_llama(0), tokenizer) as local:
        assert greedy(serve_process) == greedy(local.base_url)  # both start from model 0
        metrics = Broadcaster([ColocatedTransport(local), remote]).maybe_broadcast(model_b, 1)
        assert metrics["broadcast/version"] == 1.0 and remote.confirmed_version() == 1
        served_b = greedy(local.base_url)
        assert served_b[1] == 1 and greedy(serve_process) == served_b

    # Refused pushes: no token (401), wrong token (403); the remote keeps serving version 1.
    missing = httpx.post(f"{serve_process}/weights/upload", params={"policy_version": 2}, content=b"weights")
    assert missing.status_code == 401
    with pytest.raises(WeightUpdateRefused, match="403"):
        RemoteTransport(serve_process, "wrong").push(tiny_llama(0), 2)
    assert greedy(serve_process) == served_b


def test_a_lora_run_sends_the_base_once_then_adapters_alone(serve_process, tmp_path, monkeypatch):
    """The server starts without a base: the first push of adapters alone is answered 409 and resent with
    the base; later pushes are the adapters alone. The remote serves what the colocated engine serves."""
    tokenizer = load_tokenizer("char")
    sent = []
    post = httpx.post

    def recorded(url, *, json, **kwargs):
        response = post(url, json=json, **kwargs)
        sent.append((sorted(k for k in ("path", "adapters") if k in json), response.status_code))
        return response

    monkeypatch.setattr(httpx, "post", recorded)
    remote = RemoteTransport(serve_process, TOKEN, str(tmp_path / "hf"), transfer="checkpoint", tokenizer=tokenizer, timeout_s=300)
    base = tiny_llama(0)
    served = []
    with PolicyServer(InferenceServerConfig(**SERVER), base, tokenizer) as local:
        base_tokens = greedy(local.base_url)[0]
        broadcaster = Broadcaster([ColocatedTransport(local), remote])
        for version in (1, 2):
            broadcaster.maybe_broadcast(with_trained_adapters(base, LoraConfig(rank=4), seed=version, scale=0.5), version)
            served.append(greedy(local.base_url))
            assert served[-1][1] == version and greedy(serve_process) == served[-1]
    assert sent == [(["adapters"], 409), (["adapters", "path"], 200), (["adapters"], 200)]
    assert base_tokens not in (served[0][0], served[1][0])  # the adapters changed what is served
    adapters = (tmp_path / "hf" / "policy-00000002" / "adapters.safetensors").stat().st_size
    base_bytes = sum(f.stat().st_size for f in (tmp_path / "hf" / "base").glob("*.safetensors"))
    assert adapters < base_bytes / 4
