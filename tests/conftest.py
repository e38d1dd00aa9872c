"""Fixtures shared by the test folders."""

import gc
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from marin_rl.compiles import with_xla_flags

VERIFIERS_ENVS = Path(__file__).parent / "verifiers_envs"


def _pin_worker_to_its_cores() -> None:
    """Each xdist worker (and the runs it starts) gets its own share of the cores. Unpinned, two workers'
    XLA, Eigen and OpenMP thread pools, each sized for every core, fought over CI's two: the same tests
    took a fifth more CPU time, and a TRL side-by-side 1.6x as long. Before JAX sizes its pools."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker and 1 < count <= len(cores):
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) :: count])


_pin_worker_to_its_cores()


TEST_XLA_FLAGS = ("--xla_backend_optimization_level=1", "--xla_cpu_use_fusion_emitters=false")
"""XLA:CPU options of every process of the session (the runs tests start inherit them): the tests' tiny
models spend more time compiling than running.

- LLVM at level 1, not 2: alone on 2 cores, the placement check took 77 s against 132 s, and the pinned
  learning curve with the multi-turn test 109 s against 142 s, with the same rewards.
- XLA's older fusion emitters: they compile faster. The exact-numerics test for one family took 24.3 s
  against 33.6 s, the LoRA quickstart test 65.5 s against 74.2 s; the quickstart's step time is the same.
  Not a default of runs (`marin_rl.compiles`): at 256 hidden the learner's step is 14% slower."""


os.environ["XLA_FLAGS"] = with_xla_flags(os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS)[0]  # before JAX reads it


def pytest_configure(config):
    """One persistent compilation cache for the whole test session, shared by its workers and the runs they
    start (the quickstart's programs compile once, not in every test that trains). A directory of this
    session only, removed at its end; the tests of the cache name directories of their own."""
    if not hasattr(config, "workerinput") and "MARIN_RL_COMPILATION_CACHE" not in os.environ:
        config._session_compilation_cache = tempfile.mkdtemp(prefix="marin-rl-test-jax-cache-")
        os.environ["MARIN_RL_COMPILATION_CACHE"] = config._session_compilation_cache


@pytest.fixture(autouse=True, scope="session")
def compilation_cache():
    """Every test process reads and fills the session's cache, not only the runs `train` starts: tests that
    build the same tiny models and learners load each other's programs."""
    from marin_rl.compiles import CACHE_ENV, enable_compilation_cache

    return enable_compilation_cache(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else None


def pytest_collection_modifyitems(items):
    """Files holding slow tests first. xdist hands out whole files in collection order, so slow files
    collected last (reliability/, after the quick ones) ran alone on one core while the other idled."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_unconfigure(config):
    path = getattr(config, "_session_compilation_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


MAX_MAPPINGS = 65530
"""Linux's default vm.max_map_count: memory mappings one process may hold."""
_peak_mappings = {"count": 0, "after": "", "clears": 0}


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs(request):
    """Compiled programs are released after a test module once the process holds half its mappings.
    XLA's CPU executables hold about 9 each, and JAX's caches keep them alive: CI's one pytest process,
    running every module, reached the kernel's 65,530 mappings per process, where the next compilation
    failed and the process died (a segfault unwinding its error, or an abort). Released only then:
    later modules would compile again what they share."""
    yield
    count = _mappings()
    if count > MAX_MAPPINGS // 2 and "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()
        _peak_mappings["clears"] += 1
    if count > _peak_mappings["count"]:
        _peak_mappings.update(count=count, after=request.module.__name__)


def pytest_terminal_summary(terminalreporter):
    if _peak_mappings["count"]:
        terminalreporter.write_line(
            f"memory mappings: at most {_peak_mappings['count']} of {MAX_MAPPINGS} after a test module ({_peak_mappings['after']}), "
            f"JAX's caches cleared {_peak_mappings['clears']} times"
        )


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


@pytest.fixture
def program_stores(tmp_path, monkeypatch):
    """Every `ProgramStore` asked for in the test is one in tmp_path, recorded in order (`made`); setting
    `directory["path"]` to None gives none (the jitted programs)."""
    from marin_rl.programs import ProgramStore

    made, directory = [], {"path": tmp_path / "programs"}

    def beside_compilation_cache(cls):
        made.append(None if directory["path"] is None else ProgramStore(directory["path"]))
        return made[-1]

    monkeypatch.setattr(ProgramStore, "beside_compilation_cache", classmethod(beside_compilation_cache))
    return made, directory
