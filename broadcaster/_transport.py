"""Weight transports: how a new policy reaches one inference server.

- `ColocatedTransport`: the server lives in the learner's process; weights are swapped in place.
- `RemoteTransport`: a `marin-rl serve` process (or any server with the same endpoint) elsewhere; the
  weights go through an HF safetensors checkpoint on a shared filesystem plus a call to its
  token-protected POST /v1/weights/update (docs/serving.md).
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import time

import httpx

from marin_rl.orchestrator import WEIGHT_TOKEN_ENV

logger = logging.getLogger(__name__)


class WeightUpdateRefused(PermissionError):
    """The server refused the weight update (missing or wrong token)."""


class WeightTransport(abc.ABC):
    """Delivers new weights to one server and reports the version it serves."""

    @abc.abstractmethod
    def push(self, model, policy_version: int) -> None:
        """Make the server serve `model` as `policy_version`; returns once the server confirmed it."""

    @abc.abstractmethod
    def confirmed_version(self) -> int:
        """The policy version the server reports serving now."""

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

    def confirmed_version(self) -> int:
        return self.server.policy_version

    @property
    def name(self) -> str:
        return "colocated"


class RemoteTransport(WeightTransport):
    """Export an HF checkpoint (once per version) and ask a remote server to load it.

    `export_dir` must be readable by the server at the same path. Checkpoints are written to
    `export_dir/policy-{version:08d}/` (temp dir, then rename) with the learner's `save_hf_model`, so
    transports that share `export_dir` write each version once; all but the newest `keep_exports` are
    deleted after a confirmed push. `export_dtype` (e.g. "bfloat16") halves the files; None keeps fp32.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        export_dir: str,
        *,
        tokenizer,
        timeout_s: float = 600.0,
        keep_exports: int = 2,
        export_dtype: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._token = token or os.environ.get(WEIGHT_TOKEN_ENV)
        if not self._token:
            raise ValueError(f"RemoteTransport({base_url}): no token given and {WEIGHT_TOKEN_ENV} is not set")
        if keep_exports < 1:
            raise ValueError(f"RemoteTransport.keep_exports must be >= 1, got {keep_exports}")
        self.export_dir = os.path.abspath(export_dir)
        self._tokenizer = tokenizer
        self._timeout_s = timeout_s
        self._keep_exports = keep_exports
        self._export_dtype = export_dtype

    @property
    def name(self) -> str:
        return self.base_url

    def export_path(self, policy_version: int) -> str:
        return os.path.join(self.export_dir, f"policy-{policy_version:08d}")

    def push(self, model, policy_version: int) -> None:
        path = self._export(model, policy_version)
        deadline = time.monotonic() + self._timeout_s
        try:
            response = httpx.post(
                f"{self.base_url}/weights/update",
                json={"path": path, "policy_version": policy_version},
                headers={"Authorization": f"Bearer {self._token}"},
                timeout=self._timeout_s,
            )
        except httpx.TimeoutException:
            response = None  # the server may still be loading: fall through to polling the version
        if response is not None:
            if response.status_code in (401, 403):
                raise WeightUpdateRefused(
                    f"{self.base_url} refused the weight update ({response.status_code}): {_error_message(response)}"
                )
            if response.status_code != 200:
                raise RuntimeError(
                    f"{self.base_url} failed to load policy version {policy_version} from {path} "
                    f"({response.status_code}): {_error_message(response)}"
                )
        self._wait_for(policy_version, deadline)
        self._prune(policy_version)

    def confirmed_version(self) -> int:
        response = httpx.get(f"{self.base_url}/weights/version", timeout=30)
        response.raise_for_status()
        return int(response.json()["policy_version"])

    def _wait_for(self, policy_version: int, deadline: float) -> None:
        last = None
        while True:
            try:
                last = self.confirmed_version()
            except httpx.HTTPError as e:
                last = f"unreachable ({type(e).__name__})"
            if last == policy_version:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.base_url} did not confirm policy version {policy_version} within {self._timeout_s} s "
                    f"(it reports {last})"
                )
            time.sleep(0.5)

    def _export(self, model, policy_version: int) -> str:
        import jax.numpy as jnp

        from marin_rl.learner import save_hf_model

        path = self.export_path(policy_version)
        if os.path.isdir(path):  # another transport already wrote this version (written atomically)
            return path
        start = time.perf_counter()
        dtype = None if self._export_dtype is None else jnp.dtype(self._export_dtype)
        save_hf_model(model, self._tokenizer, path, dtype=dtype)
        logger.info("exported policy version %d to %s in %.2fs", policy_version, path, time.perf_counter() - start)
        return path

    def _prune(self, policy_version: int) -> None:
        names = sorted(n for n in os.listdir(self.export_dir) if n.startswith("policy-"))
        stale = [n for n in names if int(n.removeprefix("policy-")) <= policy_version][: -self._keep_exports]
        for name in stale:
            shutil.rmtree(os.path.join(self.export_dir, name), ignore_errors=True)


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text[:500]
