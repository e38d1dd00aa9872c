"""Problems and where they come from: JSONL / Parquet files, Python iterables.

A record is `{"messages": [...], "answer": ...}` (the data contract of
seeds/infinite-rl-execution-guide.md); `{"prompt": "...", "answer": ...}` is accepted too. An `id`
field, when present, is the problem id; otherwise it is `<file name>:<row>`, stable as long as the
file is. Every other field lands in `Problem.extras`.

A file spec takes query options: `data/train.jsonl?limit=100&offset=10&shuffle=true&seed=0`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from marin_rl.errors import ProblemSourceError


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


class ProblemStream:
    """An env's problems forever, in a reproducible order, with a position a checkpoint can save.

    A finite `problems()` (a sequence) is replayed epoch after epoch, each epoch shuffled by a seed
    derived from (`seed`, epoch), so any position can be reached again without replaying the RNG; a
    generator is restarted when it runs out. `position` counts the problems drawn;
    `ProblemStream(source, seed=s, position=p)` continues exactly where a stream at `p` stopped.

    A source that fails (its file is missing, it raises, an epoch is empty) raises
    `ProblemSourceError` now and for every later draw: retrying cannot fix it. `source` is an env or
    a callable returning the problems.
    """

    def __init__(self, source: Any, *, seed: int = 0, shuffle: bool = True, position: int = 0):
        self._make = source.problems if hasattr(source, "problems") else source
        self._label = f"env {source.name!r}" if hasattr(source, "name") else repr(source)
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._index = 0  # problems drawn in this epoch
        self._items: Sequence[Problem] | Iterator[Problem] | None = None
        self._error: ProblemSourceError | None = None
        self.position = 0
        """Problems drawn so far, over all epochs."""
        self._guarded(self._skip, position)

    def __iter__(self) -> ProblemStream:
        return self

    def __next__(self) -> Problem:
        return self._guarded(self._draw)

    def _guarded(self, fn, *args):
        if self._error is not None:
            raise self._error
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - whatever the source raised, drawing again cannot succeed
            self._error = ProblemSourceError(
                f"{self._label}: the problem source failed at problem {self.position}: {type(e).__name__}: {e}"
            )
            raise self._error from e

    def _open_epoch(self) -> None:
        problems = self._make()
        if isinstance(problems, Sequence):
            if self._shuffle:
                problems = list(problems)
                random.Random(f"{self._seed}/{self._epoch}").shuffle(problems)
            self._items = problems
        else:
            self._items = iter(problems)

    def _draw(self) -> Problem:
        while True:
            if self._items is None:
                self._open_epoch()
            if isinstance(self._items, Sequence):
                problem = self._items[self._index] if self._index < len(self._items) else None
            else:
                problem = next(self._items, None)
            if problem is not None:
                self._index += 1
                self.position += 1
                return problem
            if self._index == 0:
                raise ValueError(f"problems() yielded nothing (epoch {self._epoch})")
            self._epoch, self._index, self._items = self._epoch + 1, 0, None

    def _skip(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"position must be >= 0, got {count}")
        while count > 0:
            if self._items is None:
                self._open_epoch()
            if isinstance(self._items, Sequence) and self._items:
                # A whole or partial epoch of a sequence: jump, no replay.
                step = min(count, len(self._items) - self._index)
                self._index += step
                self.position += step
                count -= step
                if self._index == len(self._items):
                    self._epoch, self._index, self._items = self._epoch + 1, 0, None
                continue
            self._draw()
            count -= 1
