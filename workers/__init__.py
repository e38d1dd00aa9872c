"""Env workers: they draw problems, sample groups from the inference endpoints (retrying what is
transient, stopping the run on what is not) and push the scored rollouts into the replay buffers.

`_workers` (the workers and their per-env specs), `_endpoints` (samplers over the servers: seeded,
gated on the policy version, retried, least loaded), `_faults` (what is transient, what stops a run),
`_sources` (demonstrations and teacher scores instead of the policy's samples). Used by the loop in
this process and by the Ray runtime's actors.
"""

from marin_rl.workers._endpoints import Endpoint, derive_seed
from marin_rl.workers._workers import PROBLEM_POSITION_KEY, EnvWorkers, WorkerSpec, worker_specs

__all__ = ["PROBLEM_POSITION_KEY", "Endpoint", "EnvWorkers", "WorkerSpec", "derive_seed", "worker_specs"]
