"""`RayServerTransport`: new weights to one server actor, confirmed by the actor itself."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from marin_rl.broadcaster import Export, ReconnectingTransport, Unreachable, WeightUpdateRefused
from marin_rl.errors import BaseMissing

# A dead or restarting actor: Ray raises RayActorError (ActorDiedError, ActorUnavailableError) or the wait
# times out.
_GONE = (RayActorError, GetTimeoutError)


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
