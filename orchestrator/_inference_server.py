"""`PolicyServer`: the embedded OpenAI-compatible server, colocated with the learner in one process.

uvicorn runs in a background thread of the caller's process; a second thread drives Levanter's JAX
engine (`_server_engine.py`). New weights are swapped in place between batches, with no copy to disk
and no recompilation (`swap_weights`). The API, its vLLM extensions and `policy_version` are described
in docs/serving.md.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from marin_rl.orchestrator._server_config import InferenceServerConfig

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WeightSwap:
    """Timing of one `swap_weights`."""

    policy_version: int
    copy_seconds: float
    """Making the server's copy of the weights (cast to the compute dtype), on device."""
    wait_seconds: float
    """Waiting for the batch in flight to finish, then installing the weights (about 0 when not waiting)."""

    @property
    def total_seconds(self) -> float:
        return self.copy_seconds + self.wait_seconds


class PolicyServer:
    """Serve `model` over the OpenAI chat/completions API on `config.host`.

    Usage::

        server = PolicyServer(config, model, tokenizer).start()
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none")
        ...
        server.swap_weights(new_model, policy_version=step)
        server.shutdown()

    `weight_loader` (checkpoint dir -> model) is for the `serve` process: with it and a weight-update
    token configured, POST /v1/weights/update is mounted.
    """

    def __init__(
        self,
        config: InferenceServerConfig,
        model,
        tokenizer,
        policy_version: int = 0,
        *,
        weight_loader: Callable[[str], Any] | None = None,
    ):
        # Heavy imports here, not at module level: configs and the CLI import this package.
        from marin_rl.orchestrator._server_app import WeightUpdates, build_app
        from marin_rl.orchestrator._server_engine import EngineWorker, serving_copy

        if config.max_seq_len > model.Pos.size:
            raise ValueError(
                f"InferenceServerConfig.max_seq_len={config.max_seq_len} exceeds the model's context length "
                f"{model.Pos.size} (its config's seq_len)"
            )
        self.config = config
        self._serving_copy = serving_copy
        self._worker = EngineWorker(config, serving_copy(model, config.compute_dtype), tokenizer, policy_version)
        updates = None
        if weight_loader is not None:
            token = config.resolved_weight_token()
            if token is None:
                logger.warning("no weight_update_token and no MARIN_RL_WEIGHT_TOKEN: /v1/weights/update is disabled")
            else:
                # A loaded checkpoint is nobody else's: no need for the server's own copy.
                updates = WeightUpdates(token=token, load=weight_loader, swap=functools.partial(self.swap_weights, copy=False))
        self.app = build_app(config, tokenizer, self._worker, model.Vocab.size, updates)
        self.last_swap: WeightSwap | None = None
        """Timing of the latest `swap_weights`."""
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self) -> PolicyServer:
        """Bind the port and serve in a background thread; returns once requests are accepted."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("PolicyServer.start() was already called")
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
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
        self._worker.stop()
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

    @property
    def policy_version(self) -> int:
        """Version of the weights the next batch will use."""
        return self._worker.policy_version

    # ------------------------------------------------------------------------------------------- weights

    def swap_weights(self, model, policy_version: int, *, copy: bool = True, wait: bool = True) -> WeightSwap:
        """Serve `model` from the next batch on, reporting `policy_version`.

        The batch in flight finishes with the old weights. `wait=True` blocks until the new weights are
        installed (after that batch); `wait=False` returns at once, and any request made after it is
        served by the new weights (or newer). The model must have the served architecture; its compiled
        kernels are reused (no recompilation). `copy=False` skips making the server's own copy: only for
        models nobody else holds (a freshly loaded checkpoint in the compute dtype).
        """
        start = time.perf_counter()
        if copy:
            model = self._serving_copy(model, self.config.compute_dtype)
        copied = time.perf_counter()
        self._worker.swap(model, policy_version, wait=wait)
        self.last_swap = WeightSwap(policy_version, copied - start, time.perf_counter() - copied)
        logger.info("swapped in policy version %d in %.3fs", policy_version, self.last_swap.total_seconds)
        return self.last_swap
