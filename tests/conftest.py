"""Fixtures shared by the test folders."""

import os
import threading
import time
from pathlib import Path

import pytest

VERIFIERS_ENVS = Path(__file__).parent / "verifiers_envs"

# No persistent compilation cache for runs in the test process (the tests of the cache name its directory).
# CI's one pytest process segfaults with or without it (the cause is still open, see docs/training.md).
os.environ.setdefault("MARIN_RL_COMPILATION_CACHE", "off")


@pytest.fixture
def serve_asgi():
    """`serve_asgi(app, port=0) -> base URL`: an ASGI app on 127.0.0.1 under uvicorn in a thread, for tests
    that need a real HTTP server without a model; `.stop(url)` stops one early (a server that dies)."""
    import uvicorn

    servers = {}

    def serve(app, port: int = 0) -> str:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        servers[url] = (server, thread)
        return url

    def stop(url: str) -> None:
        server, thread = servers.pop(url)
        server.should_exit = True
        thread.join(timeout=30)

    serve.stop = stop
    yield serve
    for url in list(servers):
        stop(url)



@pytest.fixture(scope="session")
def verifiers_envs():
    """The verifiers environment packages of `verifiers_envs/`, importable as if installed.

    Also on PYTHONPATH: verifiers starts a task's tool server as `python -m <its module>`."""
    path = str(VERIFIERS_ENVS)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(path)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
        yield path
