"""A remote server that dies and comes back: the transport marks it down, watches it, and re-syncs it.

The server is the real HTTP app with a stand-in for the engine (no model), on a real port.
"""

import time
import types

import pytest

from marin_rl.broadcaster import Export, RemoteTransport, WeightUpdateRefused
from marin_rl.server import InferenceServerConfig
from marin_rl.server._app import WeightUpdates, build_app
from marin_rl.testing import free_port
from marin_rl.tokenizer import load_tokenizer

TOKEN = "s3cret"
TOKENIZER = load_tokenizer("char")


def server_process_app(own_version: int):
    """The app of a freshly started `serve` process that serves its own checkpoint as `own_version`."""
    engine = types.SimpleNamespace(policy_version=own_version, loads=[])

    def swap(model, version):
        engine.policy_version = version
        engine.loads.append(model)
        return types.SimpleNamespace(total_seconds=0.0)

    updates = WeightUpdates(token=TOKEN, load=lambda path, adapters: path, swap=swap)
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
        return RemoteTransport(url, token, str(tmp_path), tokenizer=None, timeout_s=5, probe_interval_s=0.05, max_backoff_s=0.2)

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
