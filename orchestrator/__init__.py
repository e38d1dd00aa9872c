"""."""

# Inference serving (docs/serving.md). Importing these is cheap: JAX/Levanter load when a server is built.
from marin_rl.orchestrator._inference_server import PolicyServer, WeightSwap
from marin_rl.orchestrator._server_config import WEIGHT_TOKEN_ENV, InferenceServerConfig, ServeConfig
from marin_rl.orchestrator._server_process import serve_main
