"""`RayServerTransport`: new weights to one server actor, confirmed by the actor itself."""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from marin_rl.broadcaster import Export, ReconnectingTransport, Unreachable, WeightUpdateRefused
from marin_rl.distributed._wire import weights_to_bytes
from marin_rl.errors import BaseMissing

logger = logging.getLogger(__name__)

# A dead or restarting actor: Ray raises RayActorError (ActorDiedError, ActorUnavailableError) or the wait
# times out.
_GONE = (RayActorError, GetTimeoutError)


class ObjectStoreExports:
    """Each version's weights put once into Ray's object store as safetensors bytes; every server
    actor fetches them from there (over the network from the driver's node, once per node). With LoRA a
    version is its adapters alone, and the base is put once."""

    def __init__(self, dtype: str | None = None, keep: int = 2):
        self._dtype = dtype
        self._keep = keep
        self._exports: dict[int, Export] = {}
        self._base: ray.ObjectRef | None = None

    def export(self, model, policy_version: int) -> Export:
        from marin_rl.adapters import adapters_to_bytes, has_adapters, without_adapters

        if policy_version not in self._exports:
            start = time.perf_counter()
            if has_adapters(model):
                if self._base is None:
                    self._base = ray.put(weights_to_bytes(without_adapters(model), self._dtype))
                self._exports[policy_version] = Export(self._base, ray.put(adapters_to_bytes(model)))
            else:
                self._exports[policy_version] = Export(ray.put(weights_to_bytes(model, self._dtype)))
            logger.info("put policy version %d into the object store in %.2fs", policy_version, time.perf_counter() - start)
        return self._exports[policy_version]

    def prune(self, policy_version: int) -> None:
        for version in sorted(self._exports)[: -self._keep]:
            if version <= policy_version:
                del self._exports[version]  # Ray frees the object once no reference is left


class RayServerTransport(ReconnectingTransport):
    """A `ServerActor`: `load` brings it a version (an object-store reference or a checkpoint path from
    `exports`, shared by all the run's server transports), `status` reports what it serves. An actor
    that died is down until Ray restarted it and the watcher brought it the newest version."""

    def __init__(self, actor, base_url: str, exports, *, server_id: str, **timing):
        super().__init__(base_url, server_id=server_id, **timing)
        self.actor = actor
        self._exports = exports

    def _export(self, model, policy_version: int):
        return self._exports.export(model, policy_version)

    def _prune(self, policy_version: int) -> None:
        self._exports.prune(policy_version)

    def _request_update(self, payload: Export, policy_version: int, *, reset: bool, with_base: bool) -> None:
        # References as arguments of their own: Ray hands the actor their bytes (a path stays a path).
        weights = payload.weights if payload.adapters is None or with_base else None
        try:
            ray.get(self.actor.load.remote(weights, policy_version, reset, payload.adapters), timeout=self._timeout_s)
        except _GONE as e:
            raise Unreachable(f"{type(e).__name__}: {e}") from e
        except RayTaskError as e:  # load raised: a version it refuses, weights that do not fit
            if isinstance(e.cause, BaseMissing):
                raise BaseMissing(str(e.cause)) from e
            raise WeightUpdateRefused(f"{self.server_id} refused policy version {policy_version}: {e.cause}") from e

    def _probe(self) -> tuple[int, str | None]:
        try:
            version, instance = ray.get(self.actor.status.remote(), timeout=min(30.0, self._timeout_s))
        except _GONE as e:
            raise Unreachable(f"{type(e).__name__}: {e}") from e
        return version, instance
