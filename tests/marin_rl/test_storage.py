import time

import pandas as pd
import pyarrow.parquet as pq
import pytest

from marin_rl.storage import (
    ROLLOUT_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    RolloutWriter,
    SegmentError,
    iter_run_segments,
    list_segments,
    read_rollouts,
    read_segment,
)
from marin_rl.testing import make_group, make_rollout


def test_round_trip_is_exact(tmp_path):
    rollouts = make_group([1.0, 0.0, 0.5], env="math", completion_lens=[3, 1, 7]) + [
        make_rollout(env="math", rewards={"correct": 1.0, "format": 0.25}, is_truncated=True)
    ]
    writer = RolloutWriter(tmp_path / "rollouts" / "math")
    writer.append(rollouts)
    writer.close()
    assert read_rollouts(tmp_path) == rollouts


def test_segments_are_readable_with_plain_pandas(tmp_path):
    rollouts = make_group([1.0, 0.0], env="toy")
    writer = RolloutWriter(tmp_path / "rollouts" / "toy")
    writer.append(rollouts)
    writer.close()
    (segment,) = list_segments(tmp_path / "rollouts" / "toy")
    frame = pd.read_parquet(segment)
    assert list(frame["reward"]) == [1.0, 0.0]
    assert list(frame["turns"][0][1]["token_ids"]) == rollouts[0].turns[1].token_ids.tolist()
    assert pq.read_schema(segment).metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()


def test_flush_by_count_by_time_and_on_close(tmp_path):
    directory = tmp_path / "rollouts" / "e"
    writer = RolloutWriter(directory, flush_every_rollouts=3, flush_every_s=3600)
    writer.append(make_group([1.0, 0.0]))
    assert list_segments(directory) == []
    writer.append([make_rollout()])
    assert len(list_segments(directory)) == 1

    timed = RolloutWriter(directory, flush_every_rollouts=1000, flush_every_s=0.05)
    timed.append([make_rollout()])
    time.sleep(0.1)
    timed.flush_if_due()
    assert len(list_segments(directory)) == 2

    writer.append([make_rollout()])
    writer.close()
    assert len(list_segments(directory)) == 3
    assert len(read_rollouts(tmp_path)) == 5


def test_writer_continues_numbering_after_existing_segments(tmp_path):
    directory = tmp_path / "rollouts" / "e"
    for _ in range(2):
        writer = RolloutWriter(directory)
        writer.append([make_rollout()])
        writer.close()
    assert [p.name for p in list_segments(directory)] == ["segment-00000000.parquet", "segment-00000001.parquet"]


def test_half_written_temp_file_is_never_read(tmp_path):
    directory = tmp_path / "rollouts" / "e"
    writer = RolloutWriter(directory)
    writer.append([make_rollout()])
    writer.close()
    # What a crash mid-write leaves behind: a truncated dot-prefixed temp file.
    complete = list_segments(directory)[0].read_bytes()
    (directory / ".segment-00000001.parquet.tmp").write_bytes(complete[: len(complete) // 2])
    assert len(read_rollouts(tmp_path)) == 1
    assert [s.error for s in iter_run_segments(tmp_path)] == [None]


def test_corrupt_segment_is_reported_by_name(tmp_path):
    directory = tmp_path / "rollouts" / "e"
    directory.mkdir(parents=True)
    bad = directory / "segment-00000000.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(SegmentError, match="segment-00000000.parquet"):
        read_segment(bad)
    foreign = directory / "segment-00000001.parquet"
    pq.write_table(ROLLOUT_SCHEMA.empty_table().replace_schema_metadata({}), foreign)
    with pytest.raises(SegmentError, match="schema version"):
        read_segment(foreign)


def test_missing_run_and_missing_env_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rollouts(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no rollouts/ directory"):
        read_rollouts(tmp_path)
    (tmp_path / "rollouts" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="env 'b'"):
        read_rollouts(tmp_path, env="b")


def test_version_1_segments_without_teacher_logprobs_still_read(tmp_path):
    import pyarrow as pa

    from marin_rl.storage import TURN_TYPE, rollouts_to_table, write_segment_atomic

    rollouts = make_group([1.0, 0.0], env="old")
    table = rollouts_to_table(rollouts)
    v1_turn = pa.struct([f for f in TURN_TYPE if f.name != "teacher_logprobs"])
    turns = table.column("turns").cast(pa.list_(v1_turn))
    v1 = table.set_column(table.schema.get_field_index("turns"), "turns", turns)
    v1 = v1.replace_schema_metadata({SCHEMA_VERSION_KEY: b"1"})
    directory = tmp_path / "rollouts" / "old"
    directory.mkdir(parents=True)
    write_segment_atomic(directory / "segment-00000000.parquet", v1)
    assert read_rollouts(tmp_path) == rollouts


def test_teacher_logprobs_round_trip(tmp_path):
    import dataclasses

    rollout = make_rollout(env="opd")
    assistant = rollout.turns[1]
    scored = dataclasses.replace(
        rollout, turns=(rollout.turns[0], dataclasses.replace(assistant, teacher_logprobs=assistant.logprobs - 0.5))
    )
    writer = RolloutWriter(tmp_path / "rollouts" / "opd")
    writer.append([scored])
    writer.close()
    (back,) = read_rollouts(tmp_path)
    assert back == scored and back.turns[1].teacher_logprobs is not None
