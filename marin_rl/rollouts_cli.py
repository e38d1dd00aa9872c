"""`marin-rl rollouts summary|show|export RUN`: offline inspection of a run's rollouts on disk."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from marin_rl.errors import ConfigError
from marin_rl.storage import SegmentError, iter_run_segments, table_to_rollouts
from marin_rl.types import Rollout

ROLE_STYLES = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}


def add_parser(subparsers) -> None:
    rollouts = subparsers.add_parser("rollouts", help="inspect the rollouts a run wrote to disk")
    commands = rollouts.add_subparsers(dest="rollouts_command", required=True)

    summary = commands.add_parser("summary", help="counts, tokens and rewards per env and policy version, or per problem")
    summary.add_argument("run", type=Path)
    summary.add_argument("--env", help="only this env")
    summary.add_argument(
        "--by",
        choices=["version", "problem"],
        default="version",
        help="problem: each problem's reward over the last 10 versions, when it was first solved, its share of "
        "groups with one reward for all (no signal); failing problems first",
    )
    summary.add_argument("--top", type=int, default=20, help="--by problem: show this many problems (0: all)")
    summary.add_argument("--solved", type=float, default=1.0, help="--by problem: a rollout with this reward or more solves its problem")
    summary.set_defaults(handler=summary_command)

    show = commands.add_parser("show", help="render rollouts as conversations, newest first")
    show.add_argument("run", type=Path)
    show.add_argument("--env", help="only this env")
    show.add_argument("--min-reward", type=float)
    show.add_argument("--max-reward", type=float)
    show.add_argument("--version", type=int, help="only rollouts sampled by this policy version")
    show.add_argument("-n", type=int, default=5, help="how many to show (default 5)")
    show.set_defaults(handler=show_command)

    view = commands.add_parser(
        "view",
        help="browse rollouts in a web page: filters, conversations, tokens coloured by log-prob or advantage",
        description="Serve a viewer of RUN's rollouts on http://127.0.0.1:PORT/ (this machine only) until Ctrl-C, "
        "or write it as one self-contained HTML file with -o.",
    )
    view.add_argument("run", type=Path)
    view.add_argument(
        "-o",
        "--output",
        type=Path,
        help="write one HTML file instead of serving: at most --limit rollouts, the latest group of every problem "
        "(failing ones first), a group from each policy version, then the newest",
    )
    view.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765; 0 picks a free one)")
    view.add_argument("--limit", type=int, default=2000, help="most rollouts in an HTML file (default 2000)")
    view.add_argument("--tokenizer", help="tokenizer to show sampled tokens with (default: the run's)")
    view.set_defaults(handler=view_command)

    export = commands.add_parser("export", help="write every rollout as one JSON object per line")
    export.add_argument("run", type=Path)
    export.add_argument("--format", choices=["jsonl"], required=True)
    export.add_argument("--env", help="only this env")
    export.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    export.set_defaults(handler=export_command)


class _Reader:
    """Reads a run's segments, remembering which were skipped as corrupt."""

    def __init__(self, run: Path, env: str | None):
        self.run, self.env = run, env
        self.errors: list[SegmentError] = []

    def rollouts(self, newest_first: bool = False) -> Iterator[Rollout]:
        segments = list(iter_run_segments(self.run, self.env))
        if not segments:
            raise FileNotFoundError(f"{self.run} has no rollouts yet (no segments under {self.run}/rollouts/)")
        for segment in reversed(segments) if newest_first else segments:
            if segment.error is not None:
                self.errors.append(segment.error)
                continue
            rollouts = table_to_rollouts(segment.table)
            yield from reversed(rollouts) if newest_first else rollouts

    def report(self) -> int:
        """Name each skipped segment on stderr (stdout is the report, maybe piped); 1 if there were any."""
        errors = Console(stderr=True, soft_wrap=True)
        for error in self.errors:
            errors.print(f"[bold red]skipped corrupt segment[/] {escape(str(error))}")
        return 1 if self.errors else 0


def summary_command(args, console: Console) -> int:
    if args.by == "problem":
        return problem_summary(args, console)
    reader = _Reader(args.run, args.env)
    stats: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(list))
    for r in reader.rollouts():
        row = stats[(r.environment, r.policy_version)]
        row["reward"].append(r.reward)
        row["tokens"].append(r.num_tokens)
        row["generated"].append(r.num_generated_tokens)
        row["truncated"].append(r.is_truncated)
        for name, value in r.rewards.items():
            row[f"rewards/{name}"].append(value)
    env_width = max(len(env) for env, _ in stats)
    # Two narrow tables rather than one wide one: they fit 80 columns and never cut an env's name.
    table = Table(title=f"rollouts of {args.run.resolve().name}")
    table.add_column("env", no_wrap=True, min_width=env_width)
    # version, rollouts, tokens, generated tokens per rollout, reward mean/std, truncated fraction
    for column in ("ver", "n", "tokens", "gen/n", "reward", "std", "trunc"):
        table.add_column(column, justify="right")
    for (env, version), row in sorted(stats.items()):
        table.add_row(
            env,
            str(version),
            str(len(row["reward"])),
            str(int(np.sum(row["tokens"]))),
            f"{np.mean(row['generated']):.1f}",
            f"{np.mean(row['reward']):.3f}",
            f"{np.std(row['reward']):.3f}",
            f"{np.mean(row['truncated']):.0%}",
        )
    console.print(table)
    console.print(_named_rewards_table(stats, env_width))
    return reader.report()


def problem_summary(args, console: Console) -> int:
    from marin_rl import viewer
    from marin_rl.problem_stats import RECENT_VERSIONS, problem_stats

    index = viewer.build_index(args.run)
    reader = viewer.RolloutReader(index, None, {})
    if args.env is not None and args.env not in set(index.columns["environment"]):
        raise ConfigError(f"--env {args.env!r}: no such env in {args.run}; envs: {sorted(set(index.columns['environment']))}")
    rows = [s for s in problem_stats(index.columns, solved=args.solved) if args.env is None or s.env == args.env]
    shown = rows[: args.top] if args.top else rows
    table = Table(title=f"problems of {args.run.resolve().name} (failing first)")
    table.add_column("env", no_wrap=True, max_width=14, overflow="ellipsis")
    table.add_column("problem", no_wrap=True, max_width=18, overflow="ellipsis")
    for column in ("recent", "solved", "0-var"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("prompt", no_wrap=True, overflow="ellipsis")
    for row in shown:
        table.add_row(
            row.env,
            row.problem_id,
            "-" if row.recent_reward is None else f"{row.recent_reward:.2f}",
            "never" if row.first_solved is None else f"v{row.first_solved}",
            "-" if row.zero_variance is None else f"{row.zero_variance:.0%}",
            " ".join(reader.prompt(row.example_uid).split()),
        )
    console.print(table)
    console.print(
        f"recent: mean reward over the env's last {RECENT_VERSIONS} versions\n"
        f"solved: the first version with a reward >= {args.solved:g}\n"
        "0-var: share of recent groups whose rollouts all got one reward (no signal)"
        + (f"\n{len(rows) - len(shown)} more problems (--top 0 shows all)" if len(shown) < len(rows) else ""),
        style="dim",
        highlight=False,
    )
    return 0


def _named_rewards_table(stats: dict[tuple[str, int], dict], env_width: int) -> Table:
    """Each env's named rewards: mean at its first and latest policy version, and over all rollouts."""
    table = Table(title="named rewards", caption="mean at the env's first and latest policy version, and overall")
    table.add_column("env", no_wrap=True, min_width=env_width)
    table.add_column("reward")
    for column in ("first", "latest", "all"):
        table.add_column(column, justify="right", no_wrap=True)
    for env in sorted({env for env, _ in stats}):
        versions = sorted(v for e, v in stats if e == env)
        names = sorted({k for v in versions for k in stats[(env, v)] if k.startswith("rewards/")})
        for name in names:
            first, latest = stats[(env, versions[0])], stats[(env, versions[-1])]
            everything = [x for v in versions for x in stats[(env, v)].get(name, [])]
            table.add_row(
                env,
                name.removeprefix("rewards/"),
                f"{np.mean(first[name]):.3f}" if name in first else "-",
                f"{np.mean(latest[name]):.3f}" if name in latest else "-",
                f"{np.mean(everything):.3f}",
            )
    return table


def show_command(args, console: Console) -> int:
    reader = _Reader(args.run, args.env)
    shown: list[list] = []  # [rollout, copies]
    index: dict[tuple, int] = {}  # a group's identical samples -> their panel
    groups: set[str] = set()
    for r in reader.rollouts(newest_first=True):
        if args.min_reward is not None and r.reward < args.min_reward:
            continue
        if args.max_reward is not None and r.reward > args.max_reward:
            continue
        if args.version is not None and r.policy_version != args.version:
            continue
        key = (r.group_id, r.reward, tuple(t.token_ids.tobytes() for t in r.turns))
        if key in index:
            shown[index[key]][1] += 1
            continue
        if len(shown) >= args.n and r.group_id not in groups:
            break  # past the last group shown: its copies were counted
        if len(shown) < args.n:
            index[key] = len(shown)
            shown.append([r, 1])
            groups.add(r.group_id)
    for r, copies in shown:
        console.print(render_rollout(r, copies))
    if not shown:
        console.print("no rollout matches the filters")
    return reader.report()


def render_rollout(r: Rollout, copies: int = 1) -> Panel:
    """A rollout as a panel; `copies`: how many samples of its group were the same (shown once). The title
    stays short and the ids go in the body, which wraps: the panel fits the terminal (80 columns)."""
    body = Text()
    named = " ".join(f"{k}={v:g}" for k, v in r.rewards.items())
    body.append(f"problem {r.problem_id}\nrewards {named}\ngroup {r.group_id} · uid {r.rollout_uid}\n", style="dim")
    if r.metadata:
        body.append(f"metadata {json.dumps(r.metadata, default=str)[:200]}\n", style="dim")
    body.append("\n")
    for turn in r.turns:
        body.append(f"{turn.role}", style=f"bold {ROLE_STYLES.get(turn.role, 'white')}")
        detail = f"  [{len(turn.token_ids)} tokens"
        if turn.inference_metadata is not None:
            meta = turn.inference_metadata
            detail += f", finish={meta.finish_reason}, v{meta.policy_version}"
            if turn.logprobs is not None and len(turn.logprobs):
                detail += f", mean logprob {float(np.mean(turn.logprobs)):.3f}"
        body.append(detail + "]\n", style="dim")
        body.append(turn.content + "\n\n")
    body.rstrip()
    title = f"{r.environment} · reward {r.reward:g} · v{r.policy_version}"
    if r.is_truncated:
        title += " · truncated"
    if copies > 1:
        title += f" · x{copies} identical in its group"
    return Panel(body, title=escape(title), title_align="left")


def view_command(args, console: Console) -> int:
    from marin_rl import viewer

    index, reader = viewer.open_run(args.run, args.tokenizer)
    if args.output is not None:
        _, kept = viewer.write_html(index, reader, args.output, args.limit)
        console.print(f"wrote {args.output}: {kept}", highlight=False)
        return 0
    try:
        server = viewer.make_server(index, reader, args.port)
    except OSError as e:
        raise ConfigError(f"--port {args.port}: {e.strerror}; pass another --port (0 picks a free one)") from e
    console.print(f"{index.size} rollouts of {args.run} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def rollout_to_json(r: Rollout) -> dict:
    return {
        "environment": r.environment,
        "problem_id": r.problem_id,
        "rollout_uid": r.rollout_uid,
        "group_id": r.group_id,
        "policy_version": r.policy_version,
        "reward": r.reward,
        "rewards": r.rewards,
        "is_truncated": r.is_truncated,
        "metadata": r.metadata,
        "turns": [
            {
                "role": t.role,
                "content": t.content,
                "token_ids": t.token_ids.tolist(),
                "logprobs": None if t.logprobs is None else t.logprobs.tolist(),
                "timestamp": t.timestamp,
                "inference_metadata": None
                if t.inference_metadata is None
                else {
                    "server_id": t.inference_metadata.server_id,
                    "model": t.inference_metadata.model,
                    "policy_version": t.inference_metadata.policy_version,
                    "finish_reason": t.inference_metadata.finish_reason,
                    "latency_s": t.inference_metadata.latency_s,
                    "sampling_params": t.inference_metadata.sampling_params,
                },
            }
            for t in r.turns
        ],
    }


def export_command(args, console: Console) -> int:
    reader = _Reader(args.run, args.env)
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        for r in reader.rollouts():
            out.write(json.dumps(rollout_to_json(r), default=str) + "\n")
    finally:
        if args.output:
            out.close()
    return reader.report()
