"""`Engine`: one thread that steps an `EngineCore` (the weights, the KV cache, the decode slots) for
callers on any thread.

Callers `submit` jobs to an inbox and `swap` weights into a queue; before each step the thread installs
the swapped-in weights and hands the submitted jobs to the core, and it sleeps while neither has work.
"""

from __future__ import annotations

import collections
import threading
import time

import jax

from marin_rl.engine._config import EngineConfig
from marin_rl.engine._core import EngineCore
from marin_rl.engine._device_lock import DeviceLock
from marin_rl.engine._request import GenerationJob
from marin_rl.engine._weights import ServingWeights


class Engine:
    """Generate for `GenerationJob`s on a Levanter LM: `submit`, `swap`, `stop`.

    `device_lock` and `device`: see `EngineCore`, which `core` holds and the engine's thread steps.
    """

    def __init__(
        self,
        config: EngineConfig,
        model,
        policy_version: int = 0,
        *,
        device_lock: DeviceLock | None = None,
        device: jax.Device | None = None,
    ):
        self._inbox: collections.deque[GenerationJob] = collections.deque()
        self.core = EngineCore(config, model, policy_version, device_lock=device_lock, device=device, inbox=self._inbox)
        self.config, self.device = config, device
        self.kernels, self.cache_spec, self.stats = self.core.kernels, self.core.cache_spec, self.core.stats
        self._swaps: collections.deque[tuple[ServingWeights, int, threading.Event]] = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="marin-rl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- API

    @property
    def policy_version(self) -> int:
        return self.core.policy_version

    def compiled_variants(self) -> dict[str, int]:
        """How many shapes each device call was compiled for (a weight swap must not add any)."""
        return self.core.compiled_variants()

    def check_job(self, job: GenerationJob) -> None:
        """ValueError naming what makes `job` impossible for this engine."""
        self.core.check_job(job)

    def submit(self, job: GenerationJob):
        """Queue `job`; its future gets a `JobResult` (or the error of a failed device call)."""
        self.check_job(job)
        with self._cv:
            if self._stopped:
                raise RuntimeError("the inference engine is shut down")
            job.submitted_at = time.perf_counter()
            self._inbox.append(job)
            self.stats.requests += 1
            self._cv.notify()
        return job.future

    def swap(self, model, policy_version: int, wait: bool = True) -> None:
        """Serve `model` (same architecture) from the next device call on; `wait` blocks until installed.
        Requests admitted after this returns use only the new weights (or newer)."""
        self.install(self.prepare(model), policy_version, wait)

    def prepare(self, model, *, check: bool = True) -> ServingWeights:
        """The engine's own copy of `model`'s weights, on its device; ValueError unless it has the served
        architecture (`check`)."""
        return self.core.prepare(model, check=check)

    def install(self, weights: ServingWeights, policy_version: int, wait: bool = True) -> None:
        """Serve `weights` (from `prepare`) from the next device call on."""
        installed = threading.Event()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the inference engine is shut down")
            self._swaps.append((weights, policy_version, installed))
            self._cv.notify()
        if wait:
            installed.wait()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    # --------------------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        with self.core.on_device():
            self._serve()

    def _serve(self) -> None:
        core = self.core
        while True:
            with self._cv:
                while not (self._stopped or self._inbox or self._swaps or core.busy):
                    self._cv.wait()
                if self._stopped:
                    break
                if not core.busy and self.config.batch_wait_s > 0:
                    # The first request after a quiet spell: let the others sent with it arrive, so that
                    # their prompts are prefilled together.
                    self._cv.wait(self.config.batch_wait_s)
                swaps, self._swaps = list(self._swaps), collections.deque()
                core.add(self._inbox)
                self._inbox.clear()
            for weights, version, installed in swaps:
                core.install(weights, version)
                installed.set()
            core.step()
        core.shut_down()
        with self._cv:
            pending, swaps = list(self._inbox), list(self._swaps)
        for job in pending:  # their requests answer 503 (shutting down)
            job.future.cancel()
        for _, _, installed in swaps:
            installed.set()
