"""Placement and Ray settings: mistakes are one line naming the key, before anything starts."""

import pytest

from marin_rl.cli import main
from marin_rl.config import load_config
from marin_rl.errors import ConfigError

QUICKSTART = "configs/quickstart.yaml"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--placement.learner_devices=[0,1,2]"], "40 rows per batch do not split evenly over the 3 placement.learner_devices"),
        (["--placement.learner_devices=[0,1]", "--learner.microbatch_rows=5"], "microbatch_rows \\(5\\) must be a multiple of the 2"),
        (["--placement.learner_devices=[1,1]"], "placement.learner_devices must be distinct"),
        (["--placement.learner_devices=[]"], "placement.learner_devices must name at least one device"),
        (["--placement.server_devices=[]"], "no server to sample from"),
        (["--runtime=ray", "--placement.server_devices=[1]"], "placement.server_devices: with runtime ray"),
        (["--runtime=ray", "--deterministic=true"], "deterministic: true needs runtime local"),
        (["--runtime=ray", "--ray.num_servers=0"], "ray.num_servers must be >= 1"),
        (["--runtime=ray", "--ray.weight_transfer=nfs"], "ray.weight_transfer must be one of"),
        (["--runtime=ray", "--ray.server_port=65535", "--ray.num_servers=2"], "ray.server_port must leave room for 2 ports"),
        (["--runtime=cluster"], "runtime must be one of"),
    ],
)
def test_bad_placement_and_ray_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, overrides)


def test_remote_servers_alone_need_no_embedded_server():
    config = load_config(QUICKSTART, ["--placement.server_devices=[]", "--broadcaster.remote_servers=[http://127.0.0.1:8001/v1]"])
    assert config.embedded_devices == []


def test_the_ray_runtime_embeds_no_server_and_the_local_one_colocates_by_default():
    assert load_config(QUICKSTART, []).embedded_devices == [0]
    assert load_config(QUICKSTART, ["--placement.learner_devices=[2,3]"]).embedded_devices == [2]
    assert load_config(QUICKSTART, ["--runtime=ray"]).embedded_devices == []


def test_a_device_the_host_lacks_is_refused_before_the_run_dir_exists(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", QUICKSTART, f"--run_dir={run_dir}", "--placement.server_devices=[7]"])
    assert code == 2
    assert "placement.server_devices: no device [7] on this host" in capsys.readouterr().err
    assert not run_dir.exists()


def test_ray_address_joins_a_cluster(tmp_path, monkeypatch):
    seen = {}

    def check_run(config, *, resume):
        seen["config"] = config
        raise ConfigError("stop here")

    monkeypatch.setattr("marin_rl.orchestrator.check_run", check_run)
    assert main(["train", QUICKSTART, f"--run_dir={tmp_path / 'run'}", "--ray_address", "10.0.0.1:6379"]) == 2
    assert seen["config"].runtime == "ray" and seen["config"].ray.address == "10.0.0.1:6379"
