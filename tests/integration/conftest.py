"""A quickstart run through the real `marin-rl` command, shared by the integration tests."""

from pathlib import Path

import pytest

from marin_rl.testing import QUICK_RUN, run_command

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """`marin-rl train configs/quickstart.yaml`, shrunk to 3 steps: (run dir, the finished process)."""
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    return run_dir, run_command(["train", QUICKSTART, f"--run_dir={run_dir}", "--max_steps=3", *QUICK_RUN])
