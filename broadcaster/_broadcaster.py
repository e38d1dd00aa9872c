"""`Broadcaster`: after a learner step, push the new policy to every inference server and wait for them."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from marin_rl.broadcaster._transport import (
    TRANSFERS,
    BytesExports,
    CheckpointExports,
    ColocatedTransport,
    ReconnectingTransport,
    RemoteTransport,
    WeightTransport,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BroadcasterConfig:
    """Which servers get new weights, and how often."""

    every_k_steps: int = 1
    """Broadcast when `policy_version % every_k_steps == 0`; larger values trade freshness for time."""
    remote_servers: tuple[str, ...] = ()
    """Base URLs (`http://host:port/v1`) of `marin-rl serve` processes to update over HTTP."""
    weight_update_token: str | None = None
    """Bearer token of the remote servers' weight-update endpoint; None reads MARIN_RL_WEIGHT_TOKEN."""
    remote_transfer: str = "upload"
    """How remote servers get weights: `upload`, as safetensors bytes in the body of their
    POST /v1/weights/upload (made once per version, no file); `checkpoint`, as an HF checkpoint in
    `export_dir` that they read (shared storage) when POST /v1/weights/update names it."""
    export_dir: str | None = None
    """With `remote_transfer: checkpoint`: where the HF checkpoints are written (a path the remote
    servers can read); None: RUN_DIR/hf."""
    confirm_timeout_s: float = 600.0
    """How long a remote server may take to load and confirm a version; one that does not is marked down
    (not sampled from) until it is back with the newest weights."""
    reconnect_max_backoff_s: float = 30.0
    """Longest wait between probes of a remote server that is down (they start at 1 s and double)."""
    keep_exports: int = 2
    """Exported versions kept (older ones are dropped, and their checkpoints deleted, after a confirmed push)."""
    export_dtype: str | None = None
    """dtype of the weights sent to servers in other processes ("bfloat16" halves them; a server that
    computes in bfloat16 serves the same bits); None keeps float32."""

    def __post_init__(self):
        if self.every_k_steps < 1:
            raise ValueError(f"BroadcasterConfig.every_k_steps must be >= 1, got {self.every_k_steps}")
        if self.remote_transfer not in TRANSFERS:
            raise ValueError(f"broadcaster.remote_transfer must be one of {TRANSFERS}, got {self.remote_transfer!r}")

    def build(self, *, colocated=(), tokenizer=None, run_dir: str | None = None, extra=()) -> Broadcaster:
        """Transports for the in-process `PolicyServer`s (`colocated`: one, or a sequence), each remote
        server, and the `extra` transports given (a Ray runtime's server actors)."""
        servers = colocated if isinstance(colocated, (list, tuple)) else [] if colocated is None else [colocated]
        transports: list[WeightTransport] = [ColocatedTransport(server) for server in servers]
        if self.remote_servers:
            if self.remote_transfer == "upload":  # one set of bytes per version for all of them
                exports = BytesExports(self.export_dtype, keep=self.keep_exports)
            else:
                export_dir = self.export_dir or (os.path.join(run_dir, "hf") if run_dir else None)
                if export_dir is None or tokenizer is None:
                    raise ValueError("BroadcasterConfig: remote_transfer 'checkpoint' needs export_dir (or a run_dir) and the tokenizer")
                exports = CheckpointExports(export_dir, tokenizer, export_dtype=self.export_dtype, keep=self.keep_exports)
            transports += [
                RemoteTransport(
                    url,
                    self.weight_update_token,
                    transfer=self.remote_transfer,
                    exports=exports,
                    timeout_s=self.confirm_timeout_s,
                    max_backoff_s=self.reconnect_max_backoff_s,
                    server_id=f"remote{i}",
                )
                for i, url in enumerate(self.remote_servers)
            ]
        return Broadcaster(transports + list(extra), every_k_steps=self.every_k_steps)


class Broadcaster:
    """Pushes each k-th policy version through every transport, in order, and reports timings."""

    def __init__(self, transports: list[WeightTransport], every_k_steps: int = 1):
        if every_k_steps < 1:
            raise ValueError(f"every_k_steps must be >= 1, got {every_k_steps}")
        self.transports = list(transports)
        self.every_k_steps = every_k_steps

    def start(self, model, policy_version: int) -> None:
        """Bring every server to `policy_version` before sampling starts: a remote server serves its own
        checkpoint until then (a fresh run), or a later version of an abandoned run (a resumed one)."""
        for transport in self.transports:
            transport.sync(model, policy_version)

    def close(self) -> None:
        for transport in self.transports:
            transport.close()

    def maybe_broadcast(self, model, policy_version: int) -> dict[str, float]:
        """Push `model` as `policy_version` if it is a k-th step. Metrics are empty when skipped.

        Raises if a server refuses the update. A remote server that does not answer is marked down
        (`broadcast/servers_down`) and not sampled from until it is back with the newest weights.
        """
        if policy_version % self.every_k_steps != 0:
            return {}
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        for i, transport in enumerate(self.transports):
            t = time.perf_counter()
            transport.push(model, policy_version)
            metrics[f"broadcast/server{i}_seconds"] = time.perf_counter() - t
        metrics["broadcast/seconds"] = time.perf_counter() - start
        metrics["broadcast/servers_down"] = float(sum(not t.ready for t in self.transports))
        metrics["broadcast/reconnects"] = float(sum(t.reconnects for t in self.transports if isinstance(t, ReconnectingTransport)))
        metrics["broadcast/version"] = float(policy_version)
        logger.info("broadcast policy version %d to %d server(s) in %.2fs", policy_version, len(self.transports), metrics["broadcast/seconds"])
        return metrics
