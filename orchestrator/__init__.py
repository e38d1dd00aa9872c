"""The orchestrator: `train(config)`, the RL loop that starts every part from one config, and what
it keeps on disk (metrics, checkpoints, a resumed run's set-aside steps).

Importing this package is cheap: JAX/Levanter load when a run starts.
"""

from marin_rl.orchestrator._metrics import read_metrics
from marin_rl.orchestrator._preflight import CheckedRun, check_run
from marin_rl.orchestrator._train import TrainResult, train

__all__ = ["CheckedRun", "TrainResult", "check_run", "read_metrics", "train"]
