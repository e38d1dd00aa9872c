"""Weight transports: how a new policy reaches one inference server.

- `ColocatedTransport`: the server lives in the learner's process; weights are swapped in place.
- `RemoteTransport`: a `marin-rl serve` process (or any server with the same endpoint) elsewhere; the
  weights go as the body of its token-protected POST /v1/weights/upload (safetensors bytes, no file),
  or through an HF checkpoint on a shared filesystem and POST /v1/weights/update (docs/serving.md).
  With LoRA, each version is the adapters alone (megabytes); the base goes once, when a server is synced.
- `ReconnectingTransport`: what every server in another process shares (a Ray server actor too):
  confirmation of each version, and a watcher that brings a server back after it died.
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from marin_rl.errors import BaseMissing, PermanentError
from marin_rl.server import WEIGHT_TOKEN_ENV

logger = logging.getLogger(__name__)


class WeightUpdateRefused(PermanentError):
    """The server refused the weight update: a missing or wrong token (401/403), or it could not load the
    checkpoint (400). Retrying cannot help."""


class Unreachable(Exception):
    """The server did not answer (refused, reset, timed out): down or restarting."""


@dataclass(frozen=True)
class Export:
    """What a server needs to serve one version, as the exports' medium holds it (a checkpoint path, an
    object-store reference): the whole weights, or a LoRA run's adapters and the base they sit on."""

    weights: Any
    """The policy's weights; with `adapters`, the base's (sent only to a server that lacks them)."""
    adapters: Any = None
    """The adapters alone (`marin_rl.adapters` format), or None."""


class WeightTransport(abc.ABC):
    """Delivers new weights to one server and reports the version it serves."""

    @abc.abstractmethod
    def push(self, model, policy_version: int) -> None:
        """Make the server serve `model` as `policy_version`; returns once the server confirmed it."""

    @abc.abstractmethod
    def confirmed_version(self) -> int:
        """The policy version the server reports serving now."""

    def sync(self, model, policy_version: int) -> None:
        """Before any sampling: make a server that may hold other weights (its own checkpoint, a later
        version of an abandoned run) serve `model` as `policy_version`."""
        self.push(model, policy_version)

    def close(self) -> None:
        """Stop any background work."""

    @property
    def ready(self) -> bool:
        """Whether the server serves weights of this run (env workers sample only from ready servers)."""
        return True

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Short label for logs and metrics."""


class ColocatedTransport(WeightTransport):
    """In-place swap into a `PolicyServer` in this process (no disk, no recompilation).

    The push does not wait for the server's batch in flight (which finishes, and is reported, with
    the old version): on a GPU that batch can take tens of seconds, and the learner would idle. Every
    request made after the push is served by the new weights; staleness stays bounded by max_age.
    """

    def __init__(self, server):
        self.server = server

    def push(self, model, policy_version: int) -> None:
        self.server.swap_weights(model, policy_version, wait=False)

    def sync(self, model, policy_version: int) -> None:
        if self.server.policy_version != policy_version:  # built from the learner's model: usually in sync
            self.push(model, policy_version)

    def confirmed_version(self) -> int:
        return self.server.policy_version

    @property
    def name(self) -> str:
        return "colocated"


class ReconnectingTransport(WeightTransport):
    """A server in another process that may die and come back: delivery, confirmation, and a watcher.

    Subclasses say how a version is made available (`_export`, `_prune`), how the server is asked to
    load it (`_request_update`) and how it reports what it serves (`_probe`).

    A push to a server that does not answer marks it down instead of failing the run; a watcher thread
    probes it every `probe_interval_s` (backing off to `max_backoff_s` while it stays away), notices a
    restart (another `instance` or version than the one confirmed), and pushes the newest version, with
    `reset` so that any version the restarted process reports is replaced. `sampling_window()` tells env
    workers whether the server may be sampled from: only once it confirmed weights of this run.
    """

    def __init__(
        self,
        base_url: str,
        *,
        server_id: str | None = None,
        timeout_s: float = 600.0,
        probe_interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.server_id = server_id or self.base_url
        """The server's name in rollouts' metadata and metrics."""
        self._timeout_s = timeout_s
        self._probe_interval_s = probe_interval_s
        self._max_backoff_s = max_backoff_s
        self._delivering = threading.Lock()  # one delivery at a time, pushes and the watcher's
        self._state = threading.Lock()
        self._latest: tuple[int, object] | None = None  # the newest exported version and its payload
        self._confirmed: int | None = None  # what the server confirmed serving; None: not synced
        self._down = False  # it stopped answering or restarted: only the watcher delivers until it is back
        self._instance: str | None = None  # the server process that confirmed it
        self._failure: PermanentError | None = None  # a refusal seen by the watcher, raised by the next push
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self.reconnects = 0
        """Times the server was brought back (pushed the newest weights) after being down or restarted."""

    # ---- what subclasses provide ----

    @abc.abstractmethod
    def _export(self, model, policy_version: int):
        """Make `model` available to the server as `policy_version`; returns what `_request_update` sends."""

    def _prune(self, policy_version: int) -> None:
        """Drop exports older than the ones still needed, once `policy_version` was pushed."""

    @abc.abstractmethod
    def _request_update(self, payload: Export, policy_version: int, *, reset: bool, with_base: bool) -> None:
        """Ask the server to serve `payload` as `policy_version` (with adapters: the base too if
        `with_base`). Raises `WeightUpdateRefused` when it refuses, `BaseMissing` when it needs the base,
        `Unreachable` when it does not answer; returning means it accepted (or is still loading)."""

    @abc.abstractmethod
    def _probe(self) -> tuple[int, str | None]:
        """(policy version served, instance id of the server process); raises `Unreachable`."""

    # ---- the transport ----

    @property
    def name(self) -> str:
        return self.base_url

    @property
    def ready(self) -> bool:
        """The server confirmed weights of this run and has not failed since."""
        return self.sampling_window() is not None

    def push(self, model, policy_version: int, *, reset: bool = False) -> None:
        """Export `policy_version` and deliver it; a server that does not answer is marked down and
        brought back by the watcher. `reset` lets the version go back (a resumed run). Raises
        `WeightUpdateRefused` when the server refuses."""
        if self._failure is not None:
            raise self._failure
        payload = self._export(model, policy_version)
        with self._state:
            self._latest = (policy_version, payload)
        self._start_watcher()
        with self._delivering:  # the prune too: the watcher may be delivering an export
            if not self._down:
                try:
                    self._deliver(policy_version, payload, reset=reset)
                except Unreachable as e:
                    self._mark_down(f"push of version {policy_version}: {e}")
            self._prune(policy_version)

    def confirmed_version(self) -> int:
        return self._probe()[0]

    def sync(self, model, policy_version: int) -> None:
        self.push(model, policy_version, reset=True)

    def sampling_window(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version a response of this server may report now; None while it is
        not to be sampled from (down, restarted, not yet synced)."""
        with self._state:
            if self._down or self._confirmed is None or self._latest is None:
                return None
            return self._confirmed, self._latest[0]

    def report_stale(self, reported: int) -> None:
        """A response reported a version outside the window: the server restarted from other weights."""
        self._mark_down(f"a response reported policy version {reported}, not one this run pushed")

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)  # a daemon: one still waiting on the server does not hold the exit

    # ---- delivery ----

    def _deliver(self, policy_version: int, payload, *, reset: bool) -> None:
        """Request the update and wait for the version; caller holds `_delivering`."""
        deadline = time.monotonic() + self._timeout_s
        try:  # the base goes with a sync: a server just (re)started holds none
            self._request_update(payload, policy_version, reset=reset, with_base=reset)
        except BaseMissing:
            self._request_update(payload, policy_version, reset=reset, with_base=True)
        while True:
            try:
                version, instance = self._probe()
            except Unreachable as e:
                version, instance = f"unreachable ({e})", None
            if version == policy_version:
                break
            if time.monotonic() > deadline:
                raise Unreachable(f"did not confirm policy version {policy_version} within {self._timeout_s} s (it reports {version})")
            time.sleep(0.5)
        with self._state:
            self._confirmed, self._instance, self._down = policy_version, instance, False

    def _mark_down(self, why: str) -> None:
        with self._state:
            was_up, self._down, self._confirmed = not self._down, True, None
        if was_up:
            logger.warning("%s is down or restarted (%s): not sampled from until it has the newest weights", self.base_url, why)

    # ---- the watcher ----

    def _start_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name=f"watch:{self.base_url}", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        delay = self._probe_interval_s
        while not self._closed.wait(delay):
            try:
                with self._delivering:
                    self._check_and_resync()
                delay = self._probe_interval_s
            except Unreachable as e:
                self._mark_down(str(e))
                delay = min(2 * delay, self._max_backoff_s)
            except WeightUpdateRefused as e:
                self._failure = e  # the main thread raises it at the next push
                return

    def _check_and_resync(self) -> None:
        version, instance = self._probe()
        with self._state:
            in_sync = not self._down and self._confirmed == version and self._instance == instance
            latest = self._latest
        if in_sync or latest is None:
            return
        self._mark_down(f"it reports policy version {version} (instance {instance})")
        logger.info("%s: pushing policy version %d to bring it back", self.base_url, latest[0])
        self._deliver(*latest, reset=True)
        self.reconnects += 1
        logger.warning("%s is back, serving policy version %d", self.base_url, latest[0])


class RemoteTransport(ReconnectingTransport):
    """Send each version to a remote server over HTTP, once exported.

    `transfer="upload"`: the weights are the body of POST /v1/weights/upload, as safetensors bytes
    (`BytesExports`, made once per version and shared by the transports given the same `exports`): no
    file, no shared storage. `transfer="checkpoint"`: an HF checkpoint in `export_dir`, which the server
    must read at the same path (`CheckpointExports`), named in POST /v1/weights/update. `export_dtype`
    (e.g. "bfloat16") halves either; None keeps fp32. The newest `keep_exports` versions are kept.
    Deaths and restarts of the server are handled as `ReconnectingTransport` says.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        export_dir: str | None = None,
        *,
        tokenizer=None,
        transfer: str = "upload",
        exports=None,
        timeout_s: float = 600.0,
        keep_exports: int = 2,
        export_dtype: str | None = None,
        probe_interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        server_id: str | None = None,
    ):
        super().__init__(
            base_url, server_id=server_id, timeout_s=timeout_s, probe_interval_s=probe_interval_s, max_backoff_s=max_backoff_s
        )
        self._token = token or os.environ.get(WEIGHT_TOKEN_ENV)
        if not self._token:
            raise ValueError(f"RemoteTransport({base_url}): no token given and {WEIGHT_TOKEN_ENV} is not set")
        if transfer not in TRANSFERS:
            raise ValueError(f"RemoteTransport({base_url}): transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.transfer = transfer
        if exports is None and transfer == "upload":
            exports = BytesExports(export_dtype, keep=keep_exports)
        elif exports is None:
            if export_dir is None:
                raise ValueError(f"RemoteTransport({base_url}): transfer 'checkpoint' needs export_dir")
            exports = CheckpointExports(export_dir, tokenizer, export_dtype=export_dtype, keep=keep_exports)
        self._exports = exports

    def export_path(self, policy_version: int) -> str:
        return self._exports.path(policy_version)

    def _export(self, model, policy_version: int) -> Export:
        return self._exports.export(model, policy_version)

    def _prune(self, policy_version: int) -> None:
        self._exports.prune(policy_version)

    def _request_update(self, payload: Export, policy_version: int, *, reset: bool, with_base: bool) -> None:
        weights = payload.weights if payload.adapters is None or with_base else None
        headers = {"Authorization": f"Bearer {self._token}"}
        if self.transfer == "upload":  # the body: the weights' bytes, then the adapters'
            parts = [weights or b"", payload.adapters or b""]
            params = {"policy_version": policy_version, "reset": reset, "weights_bytes": len(parts[0])}
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Length"] = str(sum(len(part) for part in parts))
            request = dict(url=f"{self.base_url}/weights/upload", params=params, content=body_pieces(parts))
        else:
            body = {"policy_version": policy_version, "reset": reset}
            body |= {"adapters": payload.adapters} if payload.adapters is not None else {}
            body |= {"path": weights} if weights is not None else {}
            request = dict(url=f"{self.base_url}/weights/update", json=body)
        try:
            response = httpx.post(**request, headers=headers, timeout=self._timeout_s)
        except httpx.TimeoutException:
            return  # the server may still be loading: the caller polls the version
        except httpx.TransportError as e:
            raise Unreachable(f"{type(e).__name__}: {e}") from e
        if response.status_code == 409 and weights is None and _error_field(response, "param") in ("path", "weights_bytes"):
            raise BaseMissing(_error_message(response))
        if response.status_code != 200:
            raise WeightUpdateRefused(
                f"{self.base_url} refused policy version {policy_version} ({response.status_code}): {_error_message(response)}"
            )

    def _probe(self) -> tuple[int, str | None]:
        try:
            response = httpx.get(f"{self.base_url}/weights/version", timeout=min(30.0, self._timeout_s))
            response.raise_for_status()
        except httpx.HTTPError as e:
            raise Unreachable(f"{type(e).__name__}: {e}") from e
        body = response.json()
        return int(body["policy_version"]), body.get("instance")


UPLOAD_PIECE_BYTES = 1 << 20


def body_pieces(parts: list[bytes]):
    """`parts` one after the other, in pieces of a MiB: httpx's socket writer copies what a send left of
    its piece, so a 769 MiB body in one piece went at 40 MB/s (a second per 40 MB) and in pieces at
    GB/s."""
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(view), UPLOAD_PIECE_BYTES):
            yield bytes(view[start : start + UPLOAD_PIECE_BYTES])


ADAPTERS_FILE = "adapters.safetensors"
"""A LoRA version's file in its export directory."""


TRANSFERS = ("upload", "checkpoint")
"""How `RemoteTransport` sends weights: in the request's body, or as a checkpoint on shared storage."""


class BytesExports:
    """Each version's weights made once into safetensors bytes (`marin_rl.weight_bytes`) and handed to
    `put` (Ray's `ray.put`: the object store; by default kept as bytes). With LoRA a version is its
    adapters alone, and the base is made once. The newest `keep` versions are kept."""

    def __init__(self, dtype: str | None = None, keep: int = 2, put: Callable[[bytes], Any] = lambda data: data):
        self._dtype = dtype
        self._keep = keep
        self._put = put
        self._exports: dict[int, Export] = {}
        self._base = None
        self._lock = threading.Lock()  # transports that share these exports push from their own threads

    def export(self, model, policy_version: int) -> Export:
        from marin_rl.adapters import adapters_to_bytes, has_adapters, without_adapters
        from marin_rl.weight_bytes import weights_to_bytes

        with self._lock:
            if policy_version not in self._exports:
                start = time.perf_counter()
                if has_adapters(model):
                    if self._base is None:
                        self._base = self._put(weights_to_bytes(without_adapters(model), self._dtype))
                    self._exports[policy_version] = Export(self._base, self._put(adapters_to_bytes(model)))
                else:
                    self._exports[policy_version] = Export(self._put(weights_to_bytes(model, self._dtype)))
                logger.info("made policy version %d into bytes in %.2fs", policy_version, time.perf_counter() - start)
            return self._exports[policy_version]

    def prune(self, policy_version: int) -> None:
        with self._lock:
            for version in sorted(self._exports)[: -self._keep]:
                if version <= policy_version:
                    del self._exports[version]  # with Ray, the object is freed once no reference is left


class CheckpointExports:
    """Each pushed version under `directory/policy-{version:08d}/`, written once per version
    (atomically, so several transports can share the directory); the newest `keep` survive.

    A version is an HF checkpoint; with LoRA, the adapters alone (`adapters.safetensors`), and the base
    they sit on is one HF checkpoint, `directory/base/`, written at the first export of this process.
    """

    _bases_written: set[str] = set()  # directories whose base this process wrote (shared by transports)
    _base_lock = threading.Lock()

    def __init__(self, directory: str, tokenizer, *, export_dtype: str | None = None, keep: int = 2):
        if keep < 1:
            raise ValueError(f"RemoteTransport.keep_exports must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self._tokenizer = tokenizer
        self._dtype = export_dtype
        self._keep = keep

    def path(self, policy_version: int) -> str:
        return os.path.join(self.directory, f"policy-{policy_version:08d}")

    def export(self, model, policy_version: int) -> Export:
        from marin_rl.adapters import adapters_to_bytes, has_adapters, without_adapters
        from marin_rl.learner import directory_written_atomically

        path = self.path(policy_version)
        adapted = has_adapters(model)
        if adapted:
            base = os.path.join(self.directory, "base")
            with self._base_lock:
                if self.directory not in self._bases_written:
                    self._save_hf(without_adapters(model), base, "the base")
                    self._bases_written.add(self.directory)
        if not os.path.isdir(path):  # else another transport already wrote this version (written atomically)
            start = time.perf_counter()
            if adapted:
                with directory_written_atomically(Path(path)) as tmp:
                    (tmp / ADAPTERS_FILE).write_bytes(adapters_to_bytes(model))
                logger.info("exported the adapters of policy version %d to %s in %.2fs", policy_version, path, time.perf_counter() - start)
            else:
                self._save_hf(model, path, f"policy version {policy_version}")
        return Export(base, os.path.join(path, ADAPTERS_FILE)) if adapted else Export(path)

    def _save_hf(self, model, path: str, what: str) -> None:
        import jax.numpy as jnp

        from marin_rl.learner import save_hf_model

        start = time.perf_counter()
        dtype = None if self._dtype is None else jnp.dtype(self._dtype)
        save_hf_model(model, self._tokenizer, path, dtype=dtype)
        logger.info("exported %s to %s in %.2fs", what, path, time.perf_counter() - start)

    def prune(self, policy_version: int) -> None:
        names = sorted(n for n in os.listdir(self.directory) if n.startswith("policy-"))
        stale = [n for n in names if int(n.removeprefix("policy-")) <= policy_version][: -self._keep]
        for name in stale:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)


def _error_message(response: httpx.Response) -> str:
    return _error_field(response, "message") or response.text[:500]


def _error_field(response: httpx.Response, field: str) -> str | None:
    """A field of the OpenAI-style error body (`{"error": {"message", "param", ...}}`), None if absent."""
    try:
        return response.json()["error"][field]
    except Exception:
        return None
