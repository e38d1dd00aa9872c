"""The orchestrator: the RL loop (`train`), env workers, the embedded inference server, `serve`.

Importing this package is cheap: JAX/Levanter load when a server or a run is built.
"""

from marin_rl.orchestrator._inference_server import PolicyServer, WeightSwap
from marin_rl.orchestrator._server_config import WEIGHT_TOKEN_ENV, InferenceServerConfig, ServeConfig
from marin_rl.orchestrator._server_process import serve_main

__all__ = [
    "WEIGHT_TOKEN_ENV",
    "InferenceServerConfig",
    "PolicyServer",
    "ServeConfig",
    "TrainResult",
    "WeightSwap",
    "serve_main",
    "train",
]


def __getattr__(name: str):
    # The loop imports marin_rl.config, which imports this package's server config: load it lazily.
    if name in ("train", "TrainResult"):
        from marin_rl.orchestrator import _train

        return getattr(_train, name)
    raise AttributeError(f"module 'marin_rl.orchestrator' has no attribute {name!r}")
