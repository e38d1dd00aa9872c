"""`PolicyServer`: the embedded OpenAI-compatible server, colocated with the learner in one process.

uvicorn runs in a background thread of the caller's process; a second thread drives the generation
engine (`marin_rl.engine`). New weights are swapped in place between device calls, with no copy to
disk and no recompilation (`swap_weights`). The API, its vLLM extensions and `policy_version` are described
in docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from marin_rl.engine import DeviceLock
from marin_rl.errors import ConfigError
from marin_rl.server._config import InferenceServerConfig

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WeightSwap:
    """Timing of one `swap_weights`."""

    policy_version: int
    copy_seconds: float
    """Making the server's copy of the weights (cast to the compute dtype, one array per layer), on device."""
    wait_seconds: float
    """Waiting for the engine's device call in flight to finish, then installing the weights (about 0
    when not waiting)."""

    @property
    def total_seconds(self) -> float:
        return self.copy_seconds + self.wait_seconds


def bind_socket(config: InferenceServerConfig) -> socket.socket:
    """A socket bound to `config.host:config.port`; a port in use or a host that is not this machine's
    is a `ConfigError` naming it."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"server.port {config.port} on {config.host} is in use (another server?): choose another "
                "port, or 0 for a free one"
            ) from None
        raise ConfigError(f"server.host {config.host!r}: cannot bind port {config.port} there ({e.strerror})") from None
    return sock


class PolicyServer:
    """Serve `model` over the OpenAI chat/completions API on `config.host`.

    Usage::

        server = PolicyServer(config, model, tokenizer).start()
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none")
        ...
        server.swap_weights(new_model, policy_version=step)
        server.shutdown()

    `weight_loader` (checkpoint dir -> model) is for the `serve` process: with it and a weight-update
    token configured, POST /v1/weights/update is mounted (whole checkpoints, or LoRA adapters: `UpdateLoader`). `device_lock` and `device` are the engine's
    (see `Engine`).
    """

    def __init__(
        self,
        config: InferenceServerConfig,
        model,
        tokenizer,
        policy_version: int = 0,
        *,
        weight_loader: Callable[[str], Any] | None = None,
        device_lock: DeviceLock | None = None,
        device=None,
    ):
        # Heavy imports here, not at module level: configs and the CLI import this package.
        from marin_rl.engine import Engine
        from marin_rl.server._app import WeightUpdates, build_app
        from marin_rl.server._updates import UpdateLoader

        if config.max_seq_len > model.Pos.size:
            raise ValueError(
                f"InferenceServerConfig.max_seq_len={config.max_seq_len} exceeds the model's context length "
                f"{model.Pos.size} (its config's seq_len)"
            )
        self.config = config
        self.engine = Engine(config, model, policy_version, device_lock=device_lock, device=device)
        updates = None
        if weight_loader is not None:
            token = config.resolved_weight_token()
            if token is None:
                logger.warning("no weight_update_token and no MARIN_RL_WEIGHT_TOKEN: /v1/weights/update and /upload are disabled")
            else:
                updates = WeightUpdates(token=token, load=UpdateLoader(weight_loader, config.compute_dtype), swap=self.swap_weights)
        self.app = build_app(config, tokenizer, self.engine, model.Vocab.size, updates)
        self.last_swap: WeightSwap | None = None
        """Timing of the latest `swap_weights`."""
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self, sock: socket.socket | None = None) -> PolicyServer:
        """Serve in a background thread on `sock` (else on a socket bound now, `bind_socket`); returns
        once requests are accepted."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("PolicyServer.start() was already called")
        sock = sock or bind_socket(self.config)
        self._port = sock.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="marin-rl-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the inference server did not start on {self.config.host}:{self._port}")
            time.sleep(0.01)
        logger.info("serving %s at %s", self.config.model_name, self.base_url)
        return self

    def shutdown(self) -> None:
        """Stop accepting requests, stop the engine thread. Queued requests get HTTP 503."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        self.engine.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------------------------- properties

    @property
    def base_url(self) -> str:
        """`http://host:port/v1`, what `openai.OpenAI(base_url=...)` takes."""
        if self._port is None:
            raise RuntimeError("call PolicyServer.start() first")
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self._port}/v1"

    def metrics(self) -> dict[str, float]:
        """The engine's counters and gauges as `server/...` (errors, pages in use, busy slots, queue, tokens)."""
        return {f"server/{name}": float(value) for name, value in dataclasses.asdict(self.engine.stats).items()}

    def local_sampler(self, server_id: str = "embedded"):
        """A `Sampler` for env workers in this process: the engine without HTTP (see `LocalSampler`)."""
        from marin_rl.server._local_sampler import LocalSampler

        return LocalSampler(self.app.state.handler, server_id)

    @property
    def policy_version(self) -> int:
        """Version of the weights the next admitted request will use."""
        return self.engine.policy_version

    # ------------------------------------------------------------------------------------------- weights

    def swap_weights(self, model, policy_version: int, *, wait: bool = True) -> WeightSwap:
        """Serve `model` from the engine's next device call on, reporting `policy_version`.

        Sequences being decoded continue with the new weights; requests admitted after this returns use
        only them (or newer). `wait=True` blocks until installed (at most one decode chunk); `wait=False`
        returns after the copy. The model must have the served architecture: the compiled kernels are
        reused (no recompilation).
        """
        start = time.perf_counter()
        weights = self.engine.prepare(model)
        copied = time.perf_counter()
        self.engine.install(weights, policy_version, wait=wait)
        self.last_swap = WeightSwap(policy_version, copied - start, time.perf_counter() - copied)
        logger.info("swapped in policy version %d in %.3fs", policy_version, self.last_swap.total_seconds)
        return self.last_swap
