"""One host, several devices, one process: 4 host devices stand in for GPUs (XLA_FLAGS, so the check
runs in a fresh process). The learner on a 2-device mesh trains as on one device; engines on devices 2
and 3 get the weights device to device and sample what an engine on the default device samples."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("_placement_check.py")


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    work = tmp_path_factory.mktemp("placement")
    done = subprocess.run([sys.executable, str(CHECK), str(work)], capture_output=True, text=True, env=env, timeout=900, cwd=CHECK.parents[2])
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("mode", ["fsdp", "data"])
def test_learner_on_two_devices_matches_one_device(findings, mode):
    sharded = findings[mode]
    assert sharded["param_devices"] == [0, 1]
    assert (sharded["sharded_leaves"] > 0) == (mode == "fsdp")  # FSDP splits the weights, data parallel copies them
    for one, two in zip(findings["single_losses"], sharded["losses"], strict=True):
        assert abs(one - two) <= 1e-5
    assert sharded["max_param_diff"] <= 1e-5


def test_engines_on_their_own_devices_get_the_weights_device_to_device(findings):
    engines = findings["engines"]
    assert engines["weight_devices_after_swap"] == [[2], [3]]
    assert engines["cache_devices"] == [[2], [3]]
    assert engines["versions_after"] == [v + 1 for v in engines["versions_before"]]
    # Greedy decodes of the swapped-in weights equal those of an engine on the default device.
    assert engines["tokens_after"] == [engines["tokens_default_device"]] * 2


def test_a_run_placed_on_four_devices_trains_and_samples_from_both_engines(findings):
    run = findings["train"]
    assert run["final_step"] == 3
    assert run["servers"] == ["embedded0", "embedded1"]
    assert all(seconds > 0 for seconds in run["swap_seconds"])
