"""The `marin-rl` command. Parses arguments first; heavy libraries load only in the command that needs them."""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console
from rich.markup import escape

from marin_rl import rollouts_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marin-rl", description="Reinforcement learning of language models.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    rollouts_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return args.handler(args, console)
    except FileNotFoundError as e:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(e))}")
        return 1
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: not an error. Keep Python from complaining at exit.
        sys.stdout = None
        return 0


if __name__ == "__main__":
    sys.exit(main())
