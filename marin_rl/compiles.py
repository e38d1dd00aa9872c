"""XLA compilations counted from JAX's monitoring events, and the persistent compilation cache."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

# Recorded around every backend compilation, a persistent-cache hit included (it still traces and lowers).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MAX_BYTES = 16 * 2**30
"""The persistent cache's size, least recently used entries evicted past it (a 0.5B model's programs
on a GPU are tens of MB each)."""


DEFAULT_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=2")
"""XLA options of every run. Triton GEMM fusions off: while compiling, XLA:GPU autotunes dozens of Triton
kernels for each matmul of each program, and cuBLAS runs the learner's as fast (docs/performance.md).
The engine's decode executables turn them back on (`engine_compiler_options`). Autotuning at level 2
(XLA's default is 4): each candidate kernel is still timed on initialised buffers, but they are not
initialised again for each candidate nor its results compared with a reference's (at level 4 a mismatch
is only logged). On an H200 the 0.5B loop's engine compiled in 16.9 s against 32.7 s at the same decode
step and learner step (docs/performance.md)."""

CPU_ONLY_XLA_FLAGS = ("--xla_backend_optimization_level=1",)
"""Added where JAX can only run on the CPU (no GPU or TPU plugin installed). LLVM at level 1, not XLA's
default: the quickstart's cold start-up on the 2-core VM went from 30.8-31.2 to 27.9-29.9 s (compile
19.5 -> 16.3-17.4 s; 62-79 -> 47-60 s under load) at the same step time and reward curve. Level 0
compiled faster still (12.3 s) but made the learner's step 2x slower. On a GPU the flag would also
lower the optimisation of the generated kernels, so it is left alone there."""

_ADDED_FLAGS_ENV = "MARIN_RL_ADDED_XLA_FLAGS"
"""The flags `set_default_xla_flags` added to XLA_FLAGS (inherited with them by child processes), so that
what the user set can be told from them."""

ENGINE_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": True}
"""The engine's decode executables compiled at start keep Triton GEMM fusions (XLA's default). On an H200 they
decode 17% faster for 1B and 7% for 0.5B (50,429 against 43,150 tok/s). Prefill does without them: its
matmuls have a row per prompt token, where cuBLAS does well, and their autotuning made the 1B engine's cold
compile 26.6-28.4 s instead of 19.3 s (one prompt's prefill 3.4-3.6 ms against 4.0 ms without them)."""

TRITON_DECODE_MAX_ROWS = 128
"""Decode calls of more rows than this use cuBLAS too: their matmuls are large enough for it (on an H200 a 0.5B
step of 1,024 rows took 5.08 ms against 5.05 with Triton, of 256 rows 1.87 against 1.79), and each of those
programs autotuned Triton GEMMs at a cold start: the 0.5B loop's engine (1,024 slots, seven programs above
128 rows) compiled in 29.7 s against 36.3 s."""


GPU_MEMORY_FRACTION = "0.95"
"""The share of a GPU's memory JAX's allocator may take (`XLA_PYTHON_CLIENT_MEM_FRACTION`). JAX's own 0.75
leaves 20 GB of an 80 GB card unused, and the colocated 8B LoRA loop peaks at 60.8 GiB (docs/learner.md)."""


def set_default_xla_flags() -> None:
    """Add `DEFAULT_XLA_FLAGS` (and `CPU_ONLY_XLA_FLAGS` where only the CPU is there) to `XLA_FLAGS` and set
    `GPU_MEMORY_FRACTION`, both read when JAX starts its backend (so: before the first computation). What
    the user set already is left as they set it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    flags, added = with_xla_flags(os.environ.get("XLA_FLAGS", ""), DEFAULT_XLA_FLAGS + (CPU_ONLY_XLA_FLAGS if only_cpu_available() else ()))
    os.environ["XLA_FLAGS"] = flags
    os.environ[_ADDED_FLAGS_ENV] = " ".join([*os.environ.get(_ADDED_FLAGS_ENV, "").split(), *added])


def with_xla_flags(flags: str, wanted: tuple[str, ...]) -> tuple[str, list[str]]:
    """`flags` (an XLA_FLAGS value) with each flag of `wanted` whose name it does not hold appended, and
    those appended: a value already set is left as it was."""
    added = [flag for flag in wanted if flag.split("=")[0] not in flags]
    return " ".join([flags, *added]).strip(), added


def only_cpu_available() -> bool:
    """Whether JAX can only use the CPU: `JAX_PLATFORMS=cpu`, or no GPU/TPU plugin installed (they live in
    the `jax_plugins` namespace, TPUs' in `libtpu`)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any(importlib.util.find_spec(name) is not None for name in ("jax_plugins", "libtpu"))


def prepare_process() -> None:
    """What every marin-rl process does first (the CLI, `serve`, Ray actors, the benchmarks): the XLA
    defaults before JAX starts its backend, and torch kept out of transformers before it is imported (on
    the GPU image, 10 s of a start-up)."""
    from marin_rl._upstream import transformers_without_torch

    set_default_xla_flags()
    transformers_without_torch()


def engine_compiler_options(exact: bool, call: str, rows: int) -> dict[str, bool]:
    """`ENGINE_COMPILER_OPTIONS` for the engine's decode `call` of `rows` rows (up to TRITON_DECODE_MAX_ROWS),
    unless the user's own XLA_FLAGS set Triton GEMMs or the engine's passes must give the learner's bits
    (`exact`: the same kernels on both sides)."""
    added = os.environ.get(_ADDED_FLAGS_ENV, "").split()
    user_set = any(flag.split("=")[0].lstrip("-") in ENGINE_COMPILER_OPTIONS and flag not in added for flag in os.environ.get("XLA_FLAGS", "").split())
    wanted = call == "decode" and rows <= TRITON_DECODE_MAX_ROWS
    return dict(ENGINE_COMPILER_OPTIONS) if wanted and not exact and not user_set else {}


class CompileCounter:
    """Counts the compilations of this process while entered (every thread's): how many, their seconds
    (XLA's, and the tracing and lowering to MLIR before it, which hold the interpreter lock),
    persistent-cache hits among them, and which functions (`compiled`, in order)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self.trace_seconds = 0.0
        self.lower_seconds = 0.0
        self.cache_hits = 0
        self.compiled: list[tuple[str, float]] = []

    def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
        with self._lock:
            if event == BACKEND_COMPILE_EVENT:
                self.count += 1
                self.seconds += seconds
                self.compiled.append((str(kwargs.get("fun_name", "?")), seconds))
            elif event == TRACE_EVENT:
                self.trace_seconds += seconds
            elif event == LOWER_EVENT:
                self.lower_seconds += seconds

    def _on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def metrics(self) -> dict[str, float]:
        """Totals since entered: `compile/count`, `compile/seconds` (XLA), `compile/trace_seconds`,
        `compile/lower_seconds`, `compile/cache_hits`."""
        with self._lock:
            return {
                "compile/count": self.count,
                "compile/seconds": self.seconds,
                "compile/trace_seconds": self.trace_seconds,
                "compile/lower_seconds": self.lower_seconds,
                "compile/cache_hits": self.cache_hits,
            }


CACHE_ENV = "MARIN_RL_COMPILATION_CACHE"
"""What `compilation_cache: auto` means where it is set: a directory, or `off`."""


def default_cache_dir() -> Path:
    """One per user: `$XDG_CACHE_HOME/marin-rl/jax` (`~/.cache/marin-rl/jax`)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "marin-rl" / "jax"


def enable_compilation_cache(setting: str) -> Path | None:
    """Point JAX's persistent compilation cache at `setting` ("auto": `$MARIN_RL_COMPILATION_CACHE` if
    set, else `default_cache_dir()`; "off": none; else a directory).

    JAX keys each entry by the program, the compile options, the device and the JAX/XLA versions, so
    runs and versions can share one directory; with a size bound it reads and writes under a file lock
    (concurrent runs never see a partial entry) and an unreadable entry is compiled again. Every
    compilation is kept, small ones too: a run's start-up is many of them."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if setting == "auto":
        setting = os.environ.get(CACHE_ENV) or str(default_cache_dir())
    if setting == "off":
        return None
    path = Path(setting).expanduser()
    if jax.config.jax_compilation_cache_dir == str(path):
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: run without it
        logger.warning("compilation cache: cannot create %s (%s); compiling without it", path, e.strerror)
        return None
    mend_entries_without_access_time(path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    compilation_cache.set_cache_dir(str(path))
    compilation_cache.reset_cache()  # JAX decides once whether to use a cache: decide again
    return path


def mend_entries_without_access_time(path: Path) -> int:
    """Give each cache entry without its access-time file one (the oldest time: evicted first); returns how
    many. A process killed between JAX's two writes of an entry leaves such an orphan, and JAX's eviction
    scan then fails on it at every later write (a warning each time): nothing new was cached again. Seen
    after runs killed on this VM: the quickstart's start-up went from 11 to 22 s."""
    import filelock

    mended = 0
    try:
        with filelock.FileLock(path / ".lockfile", timeout=10):  # JAX's own lock on the directory
            names = os.listdir(path)  # one listing, not a lookup per entry
            keys = {name.removesuffix("-cache") for name in names if name.endswith("-cache")}
            for key in keys - {name.removesuffix("-atime") for name in names if name.endswith("-atime")}:
                (path / f"{key}-atime").write_bytes(bytes(8))
                mended += 1
    except (filelock.Timeout, OSError) as e:
        logger.warning("compilation cache: could not check %s for broken entries (%s)", path, e)
    if mended:
        logger.info("compilation cache: %d entries without an access time mended in %s", mended, path)
    return mended
