"""Broadcaster scheduling and transport wiring (no servers; see test_remote_broadcast.py for real ones)."""

import pytest

from marin_rl.broadcaster import Broadcaster, BroadcasterConfig, ColocatedTransport, RemoteTransport, WeightTransport


class RecordingTransport(WeightTransport):
    def __init__(self, fail_at=None):
        self.pushed = []
        self.fail_at = fail_at

    def push(self, model, policy_version):
        if policy_version == self.fail_at:
            raise TimeoutError("server did not confirm")
        self.pushed.append((model, policy_version))

    def confirmed_version(self):
        return self.pushed[-1][1] if self.pushed else 0

    @property
    def name(self):
        return "recording"


def test_broadcasts_every_k_steps_to_every_transport():
    a, b = RecordingTransport(), RecordingTransport()
    broadcaster = Broadcaster([a, b], every_k_steps=2)
    metrics = [broadcaster.maybe_broadcast(f"model{v}", v) for v in range(1, 6)]
    assert a.pushed == b.pushed == [("model2", 2), ("model4", 4)]
    assert metrics[0] == metrics[2] == metrics[4] == {}
    assert metrics[1]["broadcast/version"] == 2.0 and metrics[3]["broadcast/version"] == 4.0
    assert set(metrics[1]) == {
        "broadcast/seconds", "broadcast/version", "broadcast/server0_seconds", "broadcast/server1_seconds", "broadcast/servers_down",
        "broadcast/reconnects",
    }  # fmt: skip
    assert metrics[1]["broadcast/servers_down"] == metrics[1]["broadcast/reconnects"] == 0
    assert a.confirmed_version() == 4


def test_a_failed_push_is_an_error_not_a_silent_skip():
    broadcaster = Broadcaster([RecordingTransport(fail_at=3)])
    broadcaster.maybe_broadcast("m", 2)
    with pytest.raises(TimeoutError):
        broadcaster.maybe_broadcast("m", 3)


def test_config_builds_colocated_and_remote_transports(tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_RL_WEIGHT_TOKEN", "from-env")
    server = object()
    urls = ("http://10.0.0.2:8000/v1/", "http://10.0.0.3:8000/v1")
    broadcaster = BroadcasterConfig(every_k_steps=3, remote_servers=urls).build(colocated=server, tokenizer="tok", run_dir=None)
    colocated, first, second = broadcaster.transports
    assert isinstance(colocated, ColocatedTransport) and colocated.server is server
    assert isinstance(first, RemoteTransport) and first.base_url == "http://10.0.0.2:8000/v1" and first.transfer == "upload"
    assert first._exports is second._exports  # each version is made into bytes once for all servers
    assert broadcaster.every_k_steps == 3
    config = BroadcasterConfig(remote_servers=urls[:1], remote_transfer="checkpoint")
    (remote,) = config.build(colocated=None, tokenizer="tok", run_dir=str(tmp_path)).transports
    assert remote.transfer == "checkpoint" and remote.export_path(7) == str(tmp_path / "hf" / "policy-00000007")
    with pytest.raises(ValueError, match="export_dir"):
        config.build(colocated=None, tokenizer="tok", run_dir=None)
    with pytest.raises(ValueError, match="remote_transfer"):
        BroadcasterConfig(remote_transfer="nfs")


def test_remote_transport_needs_a_token(monkeypatch, tmp_path):
    monkeypatch.delenv("MARIN_RL_WEIGHT_TOKEN", raising=False)
    with pytest.raises(ValueError, match="MARIN_RL_WEIGHT_TOKEN"):
        RemoteTransport("http://127.0.0.1:1/v1", None, str(tmp_path), tokenizer=None)
    with pytest.raises(ValueError, match="every_k_steps"):
        BroadcasterConfig(every_k_steps=0)
