"""Problems and where they come from: JSONL / Parquet files, Python iterables.

A record is `{"messages": [...], "answer": ...}` (the data contract of
seeds/infinite-rl-execution-guide.md); `{"prompt": "...", "answer": ...}` is accepted too. An `id`
field, when present, is the problem id; otherwise it is `<file name>:<row>`, stable as long as the
file is. Every other field lands in `Problem.extras`.

A file spec takes query options: `data/train.jsonl?limit=100&offset=10&shuffle=true&seed=0`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl


@dataclass(frozen=True)
class Problem:
    """One prompt an env samples rollouts for, with what its verifier needs."""

    id: str
    """Stable across runs: rollouts and evals of the same problem share it."""
    messages: tuple[Mapping[str, Any], ...] = ()
    """The prompt as chat messages; empty when `prompt` is used."""
    prompt: str | None = None
    """A single user message, for problems without `messages`."""
    answer: Any = None
    """Reference answer for the verifier."""
    extras: Mapping[str, Any] = field(default_factory=dict)
    """Anything else the env or its verifier needs."""

    def __post_init__(self):
        object.__setattr__(self, "messages", tuple(self.messages))
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Problem.id must be a non-empty string, got {self.id!r}")


_OPTIONS = {"limit", "offset", "shuffle", "seed"}


def load_problems(spec: str | Path) -> list[Problem]:
    """Problems from a `.jsonl` / `.json` (one record per line) or `.parquet` file spec."""
    path_text, _, query = str(spec).partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"problem spec {spec!r}: unknown options {sorted(unknown)}; allowed: {sorted(_OPTIONS)}")
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"problem spec {spec!r}: no file {path}")
    rows = _read_rows(path)
    problems = [problem_from_record(row, default_id=f"{path.name}:{i}") for i, row in enumerate(rows)]
    if _flag(options.get("shuffle", "false"), spec):
        random.Random(int(options.get("seed", 0))).shuffle(problems)
    offset = int(options.get("offset", 0))
    limit = options.get("limit")
    end = None if limit is None else offset + int(limit)
    return problems[offset:end]


def _flag(value: str, spec: Any) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"problem spec {spec!r}: shuffle must be true or false, got {value!r}")


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"problem file {path}: expected .jsonl, .json or .parquet, got {path.suffix!r}")


def problem_from_record(record: Mapping[str, Any] | Problem, *, default_id: str) -> Problem:
    """A `Problem` from a data record (or the problem itself)."""
    if isinstance(record, Problem):
        return record
    rest = dict(record)
    messages = rest.pop("messages", None) or ()
    prompt = rest.pop("prompt", None)
    if not messages and prompt is None:
        raise ValueError(f"record {default_id}: needs `messages` or `prompt`, has keys {sorted(record)}")
    return Problem(
        id=str(rest.pop("id", default_id)),
        messages=tuple(dict(m) for m in messages),
        prompt=prompt,
        answer=rest.pop("answer", None),
        extras=rest,
    )


def problems_from(records: Iterable[Mapping[str, Any] | Problem], *, prefix: str = "problem") -> Iterator[Problem]:
    """Problems from a Python iterable of records or `Problem`s (ids `<prefix>:<index>` when missing)."""
    for i, record in enumerate(records):
        yield problem_from_record(record, default_id=f"{prefix}:{i}")


def cycle_problems(source: Any, *, seed: int = 0, shuffle: bool = True) -> Iterator[Problem]:
    """Problems forever: a finite `problems()` is replayed epoch after epoch (reshuffled when it is a
    sequence); a generator is restarted when it runs out. `source` is an env or a callable."""
    make = source.problems if hasattr(source, "problems") else source
    rng = random.Random(seed)
    for epoch in itertools.count():
        problems = make()
        if shuffle and isinstance(problems, Sequence):
            problems = list(problems)
            rng.shuffle(problems)
        yielded = False
        for problem in problems:
            yielded = True
            yield problem
        if not yielded:
            raise ValueError(f"{source!r}: problems() yielded nothing (epoch {epoch})")
