"""A remote server that dies and comes back: the transport marks it down, watches it, and re-syncs it;
weights uploaded in the request's body arrive bit for bit.

The server is the real HTTP app with a stand-in for the engine, on a real port.
"""

import functools
import time
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.broadcaster import Export, RemoteTransport, WeightUpdateRefused
from marin_rl.errors import BaseMissing
from marin_rl.learner import ModelConfig, build_model, cast_floating
from marin_rl.server import InferenceServerConfig, UpdateLoader, load_update
from marin_rl.server._app import WeightUpdates, build_app
from marin_rl.testing import free_port
from marin_rl.tokenizer import load_tokenizer

TOKEN = "s3cret"
TOKENIZER = load_tokenizer("char")


def server_process_app(own_version: int, load=lambda path, adapters: path):
    """The app of a freshly started `serve` process that serves its own checkpoint as `own_version`."""
    engine = types.SimpleNamespace(policy_version=own_version, loads=[])

    def swap(model, version):
        engine.policy_version = version
        engine.loads.append(model)
        return types.SimpleNamespace(total_seconds=0.0)

    updates = WeightUpdates(token=TOKEN, load=load, swap=swap)
    return build_app(InferenceServerConfig(), TOKENIZER, engine, len(TOKENIZER), updates), engine


def wait_until(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def transport(tmp_path, monkeypatch):
    monkeypatch.setattr(RemoteTransport, "_export", lambda self, model, version: (tmp_path / f"policy-{version:08d}").mkdir() or Export(self.export_path(version)))

    def make(url, token=TOKEN):
        return RemoteTransport(
            url, token, str(tmp_path), transfer="checkpoint", tokenizer=None, timeout_s=5, probe_interval_s=0.05, max_backoff_s=0.2
        )

    return make


def test_a_server_that_dies_is_skipped_then_resynced_when_it_returns(serve_asgi, transport):
    port = free_port()
    app, engine = server_process_app(own_version=999)
    base = serve_asgi(app, port)
    remote = transport(f"{base}/v1")
    assert remote.sampling_window() is None  # nothing pushed: not to be sampled from
    remote.sync("weights-0", 0)  # a fresh run: the server's own checkpoint is replaced, though newer
    assert engine.policy_version == 0 and remote.sampling_window() == (0, 0)
    remote.push("weights-1", 1)
    assert remote.sampling_window() == (1, 1)

    serve_asgi.stop(base)  # kill -9, as far as the transport can tell
    remote.push("weights-2", 2)  # does not raise: the run goes on
    assert not remote.ready and remote.sampling_window() is None
    remote.push("weights-3", 3)

    app, engine = server_process_app(own_version=999)  # restarted from its own checkpoint
    serve_asgi(app, port)
    wait_until(lambda: remote.ready, "the server to be re-synced")
    assert engine.policy_version == 3 and remote.sampling_window() == (3, 3) and remote.reconnects == 1
    assert engine.loads == [remote.export_path(3)]  # the newest version only

    # Restarted between two probes with a version inside the window: its instance id gives it away.
    serve_asgi.stop(base)
    app, engine = server_process_app(own_version=3)
    serve_asgi(app, port)
    wait_until(lambda: engine.loads, "the restarted server to get this run's weights")
    wait_until(lambda: remote.ready, "the server to be re-synced")
    assert remote.reconnects == 2

    # A worker saw an answer from weights this run never pushed: sampling stops until re-synced.
    remote.report_stale(999)
    assert remote.sampling_window() is None
    wait_until(lambda: remote.ready, "the server to be re-synced")
    remote.close()


def test_a_refused_push_is_a_permanent_error(serve_asgi, transport):
    app, engine = server_process_app(own_version=0)
    remote = transport(f"{serve_asgi(app)}/v1", token="wrong")
    with pytest.raises(WeightUpdateRefused, match="403"):
        remote.push("weights-1", 1)
    assert engine.policy_version == 0
    remote.close()


def tiny_model(seed: int):
    config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64)
    return build_model(config, len(TOKENIZER), key=jax.random.key(seed))


def assert_same_bits(a, b):
    leaves_a, leaves_b = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (a, b))
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint16 if x.dtype == jnp.bfloat16 else x.dtype), np.asarray(y).view(np.uint16 if y.dtype == jnp.bfloat16 else y.dtype))


def test_uploaded_bfloat16_weights_are_the_learners_cast_bit_for_bit(serve_asgi):
    """The default transfer: safetensors bytes in the body of POST /v1/weights/upload, no file; the
    server loads exactly the learner's weights cast to bfloat16."""
    template = eqx.filter_eval_shape(lambda: tiny_model(0))
    loader = UpdateLoader(functools.partial(load_update, tokenizer=TOKENIZER, template=template), "bfloat16")
    app, engine = server_process_app(own_version=0, load=loader)
    remote = RemoteTransport(f"{serve_asgi(app)}/v1", TOKEN, export_dtype="bfloat16", timeout_s=30)
    learner = tiny_model(1)
    remote.push(learner, 1)
    assert engine.policy_version == 1 and remote.confirmed_version() == 1
    assert_same_bits(engine.loads[-1], cast_floating(learner, jnp.bfloat16))
    remote.close()


def test_a_lora_upload_sends_the_base_once_then_the_adapters_alone(serve_asgi, monkeypatch):
    """Adapters alone are refused by a server without a base (409), sent again with the base, and the
    next version goes alone; the server gets each part's bytes as sent."""
    kept = {}

    def load(weights, adapters):
        if weights is None and "base" not in kept:
            raise BaseMissing("no base weights")
        kept["base"] = weights if weights is not None else kept["base"]
        return kept["base"], adapters

    monkeypatch.setattr(RemoteTransport, "_export", lambda self, model, version: Export(b"base" * 100, f"adapters-{version}".encode()))
    app, engine = server_process_app(own_version=0, load=load)
    remote = RemoteTransport(f"{serve_asgi(app)}/v1", TOKEN, timeout_s=30)
    remote.push("model-1", 1)
    remote.push("model-2", 2)
    assert engine.loads == [(b"base" * 100, b"adapters-1"), (b"base" * 100, b"adapters-2")]
    assert engine.policy_version == 2 and remote.confirmed_version() == 2
    remote.close()


def test_an_upload_with_a_wrong_token_is_refused_and_nothing_is_loaded(serve_asgi, monkeypatch):
    loads = []
    monkeypatch.setattr(RemoteTransport, "_export", lambda self, model, version: Export(b"weights"))
    app, engine = server_process_app(own_version=0, load=lambda weights, adapters: loads.append(weights))
    with pytest.raises(WeightUpdateRefused, match="403"):
        RemoteTransport(f"{serve_asgi(app)}/v1", "wrong", timeout_s=5).push("model-1", 1)
    assert loads == [] and engine.policy_version == 0
