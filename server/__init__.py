"""The OpenAI-compatible inference server over the engine (docs/serving.md).

One file per concept: `_config` (its settings), `_protocol` (the API's request and response models),
`_app` (the FastAPI routes and the request handler), `_policy_server` (the embedded server: uvicorn and
the engine in threads of the caller's process), `_local_sampler` (in-process sampling, no HTTP),
`_updates` (what a weight update brings, turned into the model to serve), and `_process` (`marin-rl
serve`). Importing it is cheap: the engine (JAX, Levanter) loads when a server is built.
"""

from marin_rl.server._config import WEIGHT_TOKEN_ENV, InferenceServerConfig, ServeConfig
from marin_rl.server._policy_server import PolicyServer, WeightSwap, bind_socket
from marin_rl.server._process import load_checkpoint, load_update, serve_main
from marin_rl.server._protocol import ApiError
from marin_rl.server._updates import UpdateLoader

__all__ = [
    "WEIGHT_TOKEN_ENV",
    "ApiError",
    "InferenceServerConfig",
    "PolicyServer",
    "ServeConfig",
    "UpdateLoader",
    "WeightSwap",
    "bind_socket",
    "load_checkpoint",
    "load_update",
    "serve_main",
]
