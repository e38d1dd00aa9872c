"""Weight broadcasting from the learner to the inference servers (design.md section 6)."""

from marin_rl.broadcaster._broadcaster import Broadcaster, BroadcasterConfig
from marin_rl.broadcaster._transport import (
    BytesExports,
    CheckpointExports,
    ColocatedTransport,
    Export,
    ReconnectingTransport,
    RemoteTransport,
    Unreachable,
    WeightTransport,
    WeightUpdateRefused,
)

__all__ = [
    "Broadcaster",
    "BroadcasterConfig",
    "BytesExports",
    "CheckpointExports",
    "ColocatedTransport",
    "Export",
    "ReconnectingTransport",
    "RemoteTransport",
    "Unreachable",
    "WeightTransport",
    "WeightUpdateRefused",
]
