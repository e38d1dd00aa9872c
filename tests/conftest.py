"""Fixtures shared by the test folders."""

import os
from pathlib import Path

import pytest

VERIFIERS_ENVS = Path(__file__).parent / "verifiers_envs"


@pytest.fixture(scope="session")
def verifiers_envs():
    """The verifiers environment packages of `verifiers_envs/`, importable as if installed.

    Also on PYTHONPATH: verifiers starts a task's tool server as `python -m <its module>`."""
    path = str(VERIFIERS_ENVS)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(path)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
        yield path
