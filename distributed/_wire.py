"""What crosses process boundaries in the Ray runtime, as bytes of documented formats (not pickles):
rollouts as Arrow IPC streams of the rollout table (`marin_rl.storage`, the Parquet segments' schema),
weights as safetensors (`marin_rl.weight_bytes`)."""

from __future__ import annotations

import pyarrow as pa

from marin_rl.storage import rollouts_to_table, table_to_rollouts
from marin_rl.types import Rollout


def rollouts_to_bytes(rollouts: list[Rollout]) -> bytes:
    table = rollouts_to_table(rollouts)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def rollouts_from_bytes(data: bytes) -> list[Rollout]:
    return table_to_rollouts(pa.ipc.open_stream(data).read_all())
