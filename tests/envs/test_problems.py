import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marin_rl.envs import Problem, ProblemStream, load_problems, problems_from
from marin_rl.errors import ProblemSourceError

RECORDS = [
    {"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "level": i % 2} for i in range(10)
] + [{"id": "named", "prompt": "p", "answer": ["a", "b"]}]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    return path


def test_jsonl_records_become_problems_with_stable_ids(jsonl):
    problems = load_problems(jsonl)
    assert len(problems) == 11
    first = problems[0]
    assert first.id == "train.jsonl:0" and first.answer == "0" and first.extras == {"level": 0}
    assert first.messages == ({"role": "user", "content": "q0"},)
    last = problems[-1]
    assert last.id == "named" and last.prompt == "p" and last.answer == ["a", "b"]


def test_spec_options_limit_offset_shuffle(jsonl):
    assert [p.id for p in load_problems(f"{jsonl}?limit=2&offset=3")] == ["train.jsonl:3", "train.jsonl:4"]
    shuffled = load_problems(f"{jsonl}?shuffle=true&seed=1")
    assert sorted(p.id for p in shuffled) == sorted(p.id for p in load_problems(jsonl))
    assert [p.id for p in shuffled] != [p.id for p in load_problems(jsonl)]
    assert shuffled == load_problems(f"{jsonl}?shuffle=true&seed=1")  # ids survive shuffling
    with pytest.raises(ValueError, match="unknown options"):
        load_problems(f"{jsonl}?limt=2")


def test_parquet_matches_jsonl(tmp_path, jsonl):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS[:10]), path)
    from_parquet = load_problems(f"{path}?limit=3")
    assert [(p.answer, p.messages) for p in from_parquet] == [(p.answer, p.messages) for p in load_problems(f"{jsonl}?limit=3")]


def test_bad_records_and_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"answer": 1}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:0.*messages"):
        load_problems(bad)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_problems(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match=".csv"):
        load_problems(tmp_path / "x.csv")


def test_python_iterables_and_cycling():
    problems = list(problems_from([{"prompt": "a"}, Problem(id="b", prompt="b")], prefix="mine"))
    assert [p.id for p in problems] == ["mine:0", "b"]
    stream = ProblemStream(lambda: problems, shuffle=False)
    assert [next(stream).id for _ in range(5)] == ["mine:0", "b", "mine:0", "b", "mine:0"]
    assert stream.position == 5

    def generate():
        yield from problems_from([{"prompt": "x"}])

    assert [next(s).id for s in [ProblemStream(generate)] for _ in range(3)] == ["problem:0"] * 3


def test_a_stream_continues_from_its_position():
    problems = [Problem(id=str(i), prompt=str(i)) for i in range(7)]

    def ids(stream, n):
        return [next(stream).id for _ in range(n)]

    whole = ids(ProblemStream(lambda: problems, seed=3), 30)
    assert sorted(whole[:7]) == sorted(whole[7:14]) == [p.id for p in problems]
    assert whole[:7] != whole[7:14], "each epoch is reshuffled"
    for position in (0, 5, 7, 19):
        assert ids(ProblemStream(lambda: problems, seed=3, position=position), 30 - position) == whole[position:]

    def generate():  # a procedural source: its own RNG, restarted each epoch
        rng = random.Random(0)
        for i in range(5):
            yield Problem(id=f"{i}:{rng.random()}", prompt="x")

    stream = ProblemStream(generate)
    whole = ids(stream, 12)
    assert ids(ProblemStream(generate, position=8), 4) == whole[8:]


def test_a_failing_source_fails_every_draw_with_a_permanent_error(tmp_path):
    from marin_rl.envs import ExactMatchEnv

    stream = ProblemStream(ExactMatchEnv(data=str(tmp_path / "missing.jsonl")).bind("char", name="qa"))
    for _ in range(2):  # every replica sharing the stream sees the same error, not a StopIteration
        with pytest.raises(ProblemSourceError, match=r"env 'qa': the problem source failed .*missing.jsonl"):
            next(stream)
    with pytest.raises(ProblemSourceError, match="yielded nothing"):
        next(ProblemStream(lambda: []))
    with pytest.raises(ProblemSourceError, match="yielded nothing"):
        ProblemStream(lambda: iter(()), position=3)
