"""Programs kept lowered on disk (`jax.export`), so that a warm start neither traces nor lowers them:
the engine's precompiled shapes and the learner's step.

JAX's persistent cache holds compiled programs, but JAX traces and lowers each program again to find
its key. For the engine's precompiled shapes that was most of a warm start's compile: 8.4 s of the 0.5B
loop's on the H200 host, 17 programs of 24 unrolled layers tracing and lowering one after the other
(the interpreter lock). An exported program is StableHLO in a flatbuffer (no pickle): loading one and
lowering the call to it takes milliseconds, and its compiled form is then a cache hit.

Entries are keyed by everything that shapes a program: its name and static arguments, the shapes and
dtypes of its arguments, the caller's context (a model's non-array parts), the platform, JAX's numerics
settings and the code (every source file of the packages a program is made of, the versions of JAX,
Equinox, Haliax and Levanter). An entry that cannot be read is lowered again and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
from jax import export

logger = logging.getLogger(__name__)

MAX_ENTRIES = 2000
"""Entries kept; past it the least recently written go (a code change keys every program anew)."""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_LIBRARIES = ("jax", "jaxlib", "equinox", "haliax", "levanter")
_PROGRAM_PACKAGES = ("marin_rl", "marin_rl.engine", "marin_rl.learner")
"""Where the stored programs' code lives (the learner's step calls the engine's exact passes). Every
source file in them is hashed, loaded or not: a module imported only while tracing counts too."""


@functools.cache
def code_fingerprint() -> str:
    """The library versions and the sources of the packages the programs are made of."""
    digest = hashlib.sha256()
    for name in _LIBRARIES:
        try:
            digest.update(f"{name}={importlib.metadata.version(name)};".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=?;".encode())
    for package in _PROGRAM_PACKAGES:
        for directory in importlib.util.find_spec(package).submodule_search_locations:
            for path in sorted(Path(directory).rglob("*.py")):
                digest.update(f"{package}/{path.relative_to(directory)}".encode() + path.read_bytes())
    return digest.hexdigest()


class ProgramStore:
    """Exported programs in `directory`, written atomically: concurrent runs may share it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.loaded = 0
        """Programs this store compiled from a stored entry (no tracing, no lowering)."""
        self._lock = threading.Lock()  # programs compile on several threads
        self._evicted = False  # once per store: a directory scan per written program is start-up time

    @classmethod
    def beside_compilation_cache(cls) -> ProgramStore | None:
        """A store inside JAX's persistent cache directory; None when that cache is off."""
        cache = jax.config.jax_compilation_cache_dir
        return cls(Path(cache) / "marin-rl-exported") if cache else None

    def compile(
        self,
        name: str,
        fn: Callable,
        args: Sequence,
        static: Sequence,
        *,
        donate_argnums: Sequence[int],
        context: str,
        compiler_options: dict | None = None,
        returns_like: Sequence[int] | None = None,
    ) -> Callable:
        """`fn(*args, *static)` compiled, as a function of `args` (pytrees of arrays). `fn` returns a
        tuple: new values shaped like `args[i]` for each i of `returns_like` (default: the donated
        arguments), in that order, then arrays in tuples, lists and dicts (the stored program keeps their
        structure). `context`: what shapes the program that neither `args` nor `static` shows (the
        model's non-array parts, as `describe` writes them)."""
        like = tuple(donate_argnums if returns_like is None else returns_like)
        leaves, in_tree = jax.tree.flatten(tuple(args))
        path = self._path(name, args, static, context)
        exported = self._load(path)
        if exported is None:
            blob = _export(fn, in_tree, static, leaves, len(like)).serialize()
            self._save(path, blob)
            exported = export.deserialize(blob)  # as a warm start will: one compiled program for both
        else:
            with self._lock:
                self.loaded += 1
        counts = [len(jax.tree.leaves(arg)) for arg in args]
        donated = [j for i in donate_argnums for j in range(sum(counts[:i]), sum(counts[: i + 1]))]
        compiled = jax.jit(exported.call, donate_argnums=donated).lower(*leaves).compile(compiler_options=compiler_options)
        like_tree = jax.tree.structure(tuple(args[i] for i in like))

        def run(*call_args):
            call_leaves, call_tree = jax.tree.flatten(call_args)
            if call_tree != in_tree:
                raise ValueError(f"{name}: called with arguments of structure {call_tree}, compiled for {in_tree}")
            like_leaves, rest = compiled(*call_leaves)
            return (*jax.tree.unflatten(like_tree, like_leaves), *rest)

        return run

    def holds(self, name: str, args: Sequence, static: Sequence, context: str) -> bool:
        """Whether `compile` would load this program (a warm start) rather than lower it."""
        return self._path(name, args, static, context).exists()

    def _path(self, name: str, args: Sequence, static: Sequence, context: str) -> Path:
        leaves, in_tree = jax.tree.flatten(tuple(args))
        return self.directory / f"{name}-{self._key(name, leaves, in_tree, static, context)}.exported"

    def _key(self, name: str, leaves, in_tree, static, context: str) -> str:
        config = jax.config
        parts = [
            name,
            code_fingerprint(),
            str(in_tree),
            repr([(getattr(x, "shape", ()), str(getattr(x, "dtype", type(x)))) for x in leaves]),
            describe(tuple(static)),
            context,
            jax.default_backend(),
            jax.devices()[0].device_kind,
            f"x64={config.jax_enable_x64};precision={config.jax_default_matmul_precision};prng={config.jax_default_prng_impl}",
        ]
        # A function held in a model (Levanter's MLP keeps its activation) shows its address: a new one each
        # process. Keyed by its name, with the config that chose it beside it.
        text = _ADDRESS.sub("", "\n".join(parts))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _load(self, path: Path):
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("exported programs: cannot read %s (%s); lowering it again", path, e)
            return None
        try:
            return export.deserialize(bytearray(blob))
        except Exception as e:  # a truncated or foreign file: lower again, and the write replaces it
            logger.warning("exported programs: %s is unreadable (%s); lowering it again", path.name, e)
            return None

    def _save(self, path: Path, blob: bytearray) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as f:
                f.write(blob)
            os.replace(f.name, path)
            with self._lock:
                evict, self._evicted = not self._evicted, True
            if evict:
                self._evict()
        except OSError as e:  # a full or read-only disk: the run goes on, a later start lowers again
            logger.warning("exported programs: cannot write %s (%s)", path, e)

    def _evict(self) -> None:
        entries = sorted(self.directory.glob("*.exported"), key=lambda p: p.stat().st_mtime)
        for stale in entries[: max(0, len(entries) - MAX_ENTRIES)]:
            stale.unlink(missing_ok=True)


def describe(tree) -> str:
    """A pytree without arrays as text, for a key: its structure (node types and their static fields) and
    its leaves. Equinox's `repr` of a 24-layer model's non-array parts took 0.4-0.7 s of every start."""
    leaves, structure = jax.tree.flatten(tree)
    return f"{structure}{leaves!r}"


def _export(fn: Callable, in_tree, static: Sequence, leaves: list, returns_like: int):
    """`fn` exported as a function of flat arrays: no custom pytree in its calling convention (the
    outputs shaped like arguments are returned flat; the caller knows their structure)."""

    def flat(*flat_args):
        out = fn(*jax.tree.unflatten(in_tree, flat_args), *static)
        return jax.tree.leaves(out[:returns_like]), tuple(out[returns_like:])

    # The engine's kernels (Pallas, cuDNN) are custom calls without cross-version guarantees; the key
    # holds the versions, so an entry only ever meets the JAX that wrote it.
    return export.export(jax.jit(flat), disabled_checks=[export.DisabledSafetyCheck.custom_call("ALL")])(*leaves)
