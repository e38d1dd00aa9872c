"""`marin-rl rollouts view RUN`: a rollout viewer in the browser, straight from the Parquet store.

An index of every rollout (uid, env, policy version, reward, problem, advantage) is read with
column projection, so it stays small and quick on 100k rollouts; a rollout's conversation and
per-token log-probs are read from its segment only when it is opened. Served on 127.0.0.1 by a
small stdlib HTTP server, or written as one self-contained HTML file (`-o`, `select_for_file`). The
page is `assets/viewer.html`: filters, the list, each rollout as a conversation with tokens coloured by
log-prob or advantage (`#uid=...` links to one, and the list follows it), the problems failing first
(`#problems`, `problem_stats`), a problem's page (`#problem=...&env=...`) and a group's samples side by
side (`#group=...`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marin_rl.problem_stats import ProblemStats, problem_stats
from marin_rl.storage import iter_run_segments, read_segment, table_to_rollouts
from marin_rl.types import Rollout

logger = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "assets" / "viewer.html"
INDEX_COLUMNS = ["rollout_uid", "environment", "problem_id", "group_id", "policy_version", "reward", "is_truncated", "num_tokens"]
CACHED_SEGMENTS = 8


@dataclass
class RunIndex:
    """One row per rollout on disk, as columns; `where[i]` is (segment path, row) of rollout i."""

    run: Path
    columns: dict[str, list]
    where: list[tuple[Path, int]]
    skipped: list[str]
    """Segments that could not be read (named on the page)."""

    @property
    def size(self) -> int:
        return len(self.where)


def build_index(run: Path, algorithms: dict[str, Any] | None = None) -> RunIndex:
    """Read the index columns of every segment; add each rollout's advantage where its env's algorithm
    gives one per rollout (computed over its group as stored on disk)."""
    tables, where, skipped = [], [], []
    for segment in iter_run_segments(run, columns=INDEX_COLUMNS):
        if segment.error is not None:
            skipped.append(str(segment.error))
            continue
        table = segment.table
        tables.append(table)
        where += [(segment.path, i) for i in range(table.num_rows)]
    if not tables:
        raise FileNotFoundError(f"{run} has no readable rollouts (no segments under {run}/rollouts/)")
    columns = pa.concat_tables(tables).to_pydict()
    columns["advantage"] = rollout_advantages(columns, algorithms or {})
    return RunIndex(run, columns, where, skipped)


def rollout_advantages(columns: dict[str, list], algorithms: dict[str, Any]) -> list[float | None]:
    """Each rollout's advantage under its env's group-relative algorithm (None where it has none)."""
    from marin_rl.replay import GroupAdvantageConfig

    advantages: list[float | None] = [None] * len(columns["reward"])
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (env, group) in enumerate(zip(columns["environment"], columns["group_id"])):
        groups.setdefault((env, group), []).append(i)
    for (env, _), members in groups.items():
        algorithm = algorithms.get(env)
        if not isinstance(algorithm, GroupAdvantageConfig):
            continue
        values = algorithm.advantages(np.array([columns["reward"][i] for i in members], np.float64))
        if algorithm.positive_only:
            values = np.maximum(values, 0.0)
        for i, value in zip(members, values):
            no_signal = algorithm.filter_truncated and columns["is_truncated"][i]
            advantages[i] = 0.0 if no_signal else round(float(value), 6)
    return advantages


def run_algorithms(run: Path) -> dict[str, Any]:
    """env name -> its algorithm config, from RUN/config.yaml (empty if the config cannot be read)."""
    from marin_rl.config import load_config
    from marin_rl.errors import ConfigError

    try:
        return {env.name: env.algorithm for env in load_config(run / "config.yaml").envs}
    except ConfigError as e:
        logger.warning("no advantages: %s", e)
        return {}


class RolloutReader:
    """Opens rollouts by uid for the page: turns with their tokens as text, log-probs and advantages."""

    def __init__(self, index: RunIndex, tokenizer, algorithms: dict[str, Any]):
        self.index, self.tokenizer, self.algorithms = index, tokenizer, algorithms
        self._row = {uid: i for i, uid in enumerate(index.columns["rollout_uid"])}
        self._segments: OrderedDict[Path, pa.Table] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, uid: str) -> bool:
        return uid in self._row

    def _segment(self, path: Path) -> pa.Table:
        with self._lock:
            if path not in self._segments:
                self._segments[path] = read_segment(path)
                if len(self._segments) > CACHED_SEGMENTS:
                    self._segments.popitem(last=False)
            self._segments.move_to_end(path)
            return self._segments[path]

    def rollout(self, uid: str) -> dict:
        i = self._row[uid]
        path, row = self.index.where[i]
        (rollout,) = table_to_rollouts(self._segment(path).slice(row, 1))
        return rollout_view(rollout, self.index.columns["advantage"][i], self.algorithms.get(rollout.environment), self._tokens)

    def _tokens(self, ids: np.ndarray) -> list[str] | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.batch_decode([[int(t)] for t in ids], skip_special_tokens=False)

    def prompt(self, uid: str) -> str:
        """The text the model first answered in rollout `uid` (its turns before the first assistant turn)."""
        i = self._row[uid]
        path, row = self.index.where[i]
        (rollout,) = table_to_rollouts(self._segment(path).slice(row, 1))
        before = []
        for turn in rollout.turns:
            if turn.role == "assistant":
                break
            before.append(turn.content)
        return "\n".join(before)

    def search(self, text: str) -> list[str]:
        """uids of the rollouts whose conversation contains `text` (case-insensitive)."""
        found = []
        for path in sorted({p for p, _ in self.index.where}):
            table = pq.read_table(path, columns=["rollout_uid", "turns"])
            turns = table.column("turns").combine_chunks()
            contents = pc.struct_field(pc.list_flatten(turns), "content")
            hits = pc.match_substring(contents, text, ignore_case=True).fill_null(False)
            rows = np.unique(np.asarray(pc.list_parent_indices(turns))[np.asarray(hits)])
            found += [table.column("rollout_uid")[int(r)].as_py() for r in rows]
        return found


def rollout_view(rollout: Rollout, advantage: float | None, algorithm, tokens_of) -> dict:
    """What the page shows of one rollout. Per-token advantages: the rollout's own on each sampled token
    (group-relative algorithms), else what the env's algorithm gives each token (opd: the teacher's signal)."""
    per_token = None
    if algorithm is not None and not algorithm.group_relative:
        from marin_rl.replay import FlatRollout

        try:
            per_token = algorithm.score_group([FlatRollout.of(rollout)])[0].advantages
        except ValueError:  # e.g. opd without teacher log-probs
            per_token = None
    elif advantage is not None:
        per_token = np.where(rollout.sampled_mask(), advantage, 0.0)
    turns, start = [], 0
    for turn in rollout.turns:
        end = start + len(turn.token_ids)
        meta = turn.inference_metadata
        turns.append(
            {
                "role": turn.role,
                "content": turn.content,
                "tokens": tokens_of(turn.token_ids) if turn.is_sampled else None,
                "token_ids": turn.token_ids.tolist() if turn.is_sampled else None,
                "logprobs": None if turn.logprobs is None else np.round(turn.logprobs, 5).tolist(),
                "advantages": None if per_token is None or not turn.is_sampled else np.round(per_token[start:end], 5).tolist(),
                "policy_version": meta.policy_version if meta else None,
                "finish_reason": meta.finish_reason if meta else None,
            }
        )
        start = end
    return {
        "uid": rollout.rollout_uid,
        "env": rollout.environment,
        "problem": rollout.problem_id,
        "group": rollout.group_id,
        "version": rollout.policy_version,
        "reward": rollout.reward,
        "rewards": rollout.rewards,
        "truncated": rollout.is_truncated,
        "advantage": advantage,
        "metadata": rollout.metadata,
        "turns": turns,
    }


def page(index: RunIndex, details: dict[str, dict] | None, *, problems: list[ProblemStats], on_disk: int | None = None, kept: str = "") -> str:
    """The page with its data inlined; without `details` it asks the server for each rollout. `problems`:
    the whole run's problem statistics; `kept`: what a file holds of the run."""
    data = {
        "run": index.run.resolve().name,
        "index": index.columns,
        "on_disk": index.size if on_disk is None else on_disk,
        "skipped": index.skipped,
        "details": details,
        "problems": [dataclasses.asdict(p) for p in problems],
        "kept": kept,
    }
    # `</` cannot close the script element from inside the JSON.
    return PAGE.read_text().replace("/*DATA*/null", json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))


def write_html(index: RunIndex, reader: RolloutReader, output: Path, limit: int) -> tuple[int, str]:
    """One self-contained file with at most `limit` rollouts, chosen by `select_for_file`; returns how many
    it holds and what they are."""
    problems = problem_stats(index.columns)
    keep, kept = select_for_file(index, limit, problems)
    keep = sorted(keep)
    subset = RunIndex(index.run, {k: [v[i] for i in keep] for k, v in index.columns.items()}, [index.where[i] for i in keep], index.skipped)
    details = {uid: reader.rollout(uid) for uid in subset.columns["rollout_uid"]}
    output.write_text(page(subset, details, problems=problems, on_disk=index.size, kept=kept))
    return subset.size, kept


def select_for_file(index: RunIndex, limit: int, problems: list[ProblemStats]) -> tuple[list[int], str]:
    """Which rollouts a file keeps, in this order until `limit`: the latest group of every problem (failing
    problems first: they are what a reader looks for), one group from each policy version (spread evenly
    when there are more versions than room), then the newest. Returns the rows and a line saying so."""
    columns = index.columns
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, key in enumerate(zip(columns["environment"], columns["group_id"])):
        groups[key].append(i)
    chosen: dict[int, None] = {}

    def take(rows: list[int]) -> int:
        before = len(chosen)
        for i in rows:
            if len(chosen) >= limit:
                break
            chosen.setdefault(i)
        return len(chosen) - before

    latest = sum(take(groups[(p.env, p.latest_group)]) for p in problems)
    per_version: dict[tuple[str, int], tuple[str, str]] = {}
    for key, rows in groups.items():
        per_version.setdefault((key[0], columns["policy_version"][rows[0]]), key)
    versions = sorted(per_version)
    room = max(0, limit - len(chosen)) // max(1, max(len(rows) for rows in groups.values()))
    spread = [versions[int(k)] for k in np.unique(np.linspace(0, len(versions) - 1, min(room, len(versions))).round())] if room else []
    across = sum(take(groups[per_version[v]]) for v in spread)
    newest = take(sorted(range(index.size), key=lambda i: columns["policy_version"][i], reverse=True))
    failing = sum(p.recent_reward is not None and p.recent_reward < 1 for p in problems)
    kept = (
        f"{len(chosen)} of {index.size} rollouts: the latest group of each of {len(problems)} problems ({latest}, "
        f"{failing} problems below a recent reward of 1, failing first), a group from each of {len(spread)} of "
        f"{len(versions)} policy versions ({across}), then the newest ({newest})"
    )
    return list(chosen), kept


class _Handler(BaseHTTPRequestHandler):
    def __init__(self, *args, html: str, reader: RolloutReader, **kwargs):
        self.html, self.reader = html, reader
        super().__init__(*args, **kwargs)

    def do_GET(self):  # noqa: N802 - the stdlib's name
        url = urlparse(self.path)
        if url.path == "/":
            self._send(HTTPStatus.OK, self.html.encode(), "text/html; charset=utf-8")
        elif url.path.startswith("/api/rollout/"):
            uid = unquote(url.path.removeprefix("/api/rollout/"))
            if uid not in self.reader:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no rollout {uid!r} in this run"})
            else:
                self._json(HTTPStatus.OK, self.reader.rollout(uid))
        elif url.path == "/api/search":
            query = parse_qs(url.query).get("q", [""])[0]
            self._json(HTTPStatus.OK, {"uids": self.reader.search(query) if query else []})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path}"})

    def _json(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        logger.debug("viewer: " + format, *args)


def make_server(index: RunIndex, reader: RolloutReader, port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 (only this machine can read the run); `serve_forever()` to run it."""
    handler = functools.partial(_Handler, html=page(index, None, problems=problem_stats(index.columns)), reader=reader)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


def open_run(run: Path, tokenizer: str | None = None) -> tuple[RunIndex, RolloutReader]:
    """The index and reader of a run; the tokenizer (to show sampled tokens) is the run's own unless given."""
    from marin_rl.tokenizer import load_tokenizer

    algorithms = run_algorithms(run) if (run / "config.yaml").is_file() else {}
    index = build_index(run, algorithms)
    name = tokenizer or _run_tokenizer(run)
    try:
        loaded = load_tokenizer(name) if name else None
    except (OSError, ValueError) as e:
        logger.warning("tokens shown as text only: %s", e)
        loaded = None
    return index, RolloutReader(index, loaded, algorithms)


def _run_tokenizer(run: Path) -> str | None:
    import yaml

    try:
        return (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("tokenizer")
    except (OSError, yaml.YAMLError, AttributeError):
        return None

