"""The `marin-rl` command. Parses arguments first; heavy libraries load only in the command that needs them.

    marin-rl train CONFIG [--resume] [--key.sub=value ...]   train (overrides as in Levanter: --learner.optimizer.learning_rate=1e-5)
    marin-rl serve --checkpoint DIR [--key=value ...]        serve an HF checkpoint, accept token-protected weight pushes
    marin-rl plot RUN                                        PNG plots of a run's metrics
    marin-rl rollouts summary|show|export RUN                inspect the rollouts on disk
    marin-rl envs                                            list the registered env types
"""

from __future__ import annotations

import _thread
import argparse
import logging
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape

from marin_rl import rollouts_cli
from marin_rl.compiles import prepare_process
from marin_rl.errors import ConfigError, PermanentError, RunDirError

USAGE_ERROR = 2
"""Exit status of a user's mistake (argparse's too)."""
INTERRUPTED = 130
"""Exit status after a second Ctrl-C (128 + SIGINT)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marin-rl", description="Reinforcement learning of language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    subparsers = parser.add_subparsers(dest="command", required=True)

    train = subparsers.add_parser(
        "train",
        help="train a policy from a YAML config",
        description="Train from CONFIG. Any further --key=value overrides the config\n"
        "(--max_steps 5 --run_dir runs/x, --envs.NAME.group_size=8). The keys and defaults follow.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    train.add_argument("-h", "--help", action=_TrainHelp, nargs=0, help="show this help, with every config key, and exit")
    train.add_argument("config", type=Path, help="YAML run config (see configs/)")
    train.add_argument("--resume", action="store_true", help="continue RUN_DIR from its latest checkpoint")
    train.add_argument(
        "--ray_address",
        metavar="ADDRESS",
        help="run on this Ray cluster (`auto`, or HEAD_HOST:6379): the same as --runtime=ray --ray.address=ADDRESS",
    )
    train.set_defaults(handler=train_command, takes_overrides=True)

    serve = subparsers.add_parser(
        "serve",
        help="serve an HF checkpoint over the OpenAI API (a remote server for the broadcaster)",
        description="Serve a checkpoint: --checkpoint DIR [--tokenizer char] [--server.port 8000] ..., "
        "or --config_path serve.yaml (a ServeConfig) with overrides.",
    )
    serve.set_defaults(handler=serve_command, takes_overrides=True)

    plot = subparsers.add_parser("plot", help="write PNG plots of reward, loss, KL and throughput per env")
    plot.add_argument("run", type=Path)
    plot.add_argument("-o", "--output", type=Path, help="directory for the PNGs (default RUN/plots)")
    plot.set_defaults(handler=plot_command)

    envs = subparsers.add_parser("envs", help="list the registered env types")
    envs.set_defaults(handler=envs_command)

    rollouts_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    prepare_process()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    console = Console(soft_wrap=True)  # log lines stay whole in files and pipes
    errors = Console(stderr=True, soft_wrap=True)
    try:
        return args.handler(args, console)
    except (ConfigError, RunDirError, FileNotFoundError, PermanentError) as e:
        # The user's mistake (a config, a run dir, a missing file) or a failure retrying cannot fix: one
        # line, no traceback.
        if args.debug:
            raise
        errors.print(f"[bold red]error:[/] {escape(' '.join(str(e).split()))}", highlight=False)
        return USAGE_ERROR if isinstance(e, ConfigError | RunDirError) else 1
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: not an error. Keep Python from complaining at exit.
        sys.stdout = None
        return 0
    except BaseException as e:
        # A second Ctrl-C: what was pending is written (train's clean-up ran), the final checkpoint is not.
        # A library may wrap the KeyboardInterrupt (JAX turns one raised inside a pytree `__eq__` into a
        # ValueError), so its cause chain decides.
        if args.debug or not raised_by_interrupt(e):
            raise
        errors.print("[yellow]aborted[/]: the rollouts are on disk; the final checkpoint was not written")
        return INTERRUPTED


def raised_by_interrupt(error: BaseException | None) -> bool:
    """Whether `error` is a KeyboardInterrupt or was raised while handling or because of one."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def train_command(args, console: Console) -> int:
    from marin_rl.config import load_config

    joins = [] if args.ray_address is None else ["--runtime=ray", f"--ray.address={args.ray_address}"]
    config = load_config(args.config, [*joins, *args.overrides])
    from marin_rl.orchestrator import check_run

    checked = check_run(config, resume=args.resume)  # everything a user can get wrong, before the run dir is touched
    from marin_rl.orchestrator import train

    stop = threading.Event()

    def request_stop(signum, frame):
        if stop.is_set():
            abort()
        # Set before printing: a second press during the print (the user has just seen the line) aborts.
        stop.set()
        console.print(f"[yellow]{signal.Signals(signum).name}: finishing the step, saving rollouts and a checkpoint (again to abort)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    redeliver_dropped_interrupts()  # for the process's life: it ends with the run
    console.print(f"marin-rl train: {args.config} -> {config.run_dir} ({config.max_steps} steps)", highlight=False)
    if checked.resume_from is not None:
        console.print(f"resuming from {checked.resume_from}", highlight=False)
    for env in config.envs:
        p = checked.prompts[env.name]
        prompts = f"{p.shortest}" if p.shortest == p.longest else f"{p.shortest}-{p.longest}"
        console.print(
            f"  env {env.name} ({env.type}): prompts {prompts} tokens, max_tokens {p.max_tokens}, group {env.group_size}",
            highlight=False,
        )
    for note in checked.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    result = train(config, resume=args.resume, stop=stop, checked=checked)
    how = "stopped early" if result.stopped_early else "done"
    console.print(f"{how} at step {result.final_step}: checkpoint in {result.run_dir}/checkpoints", highlight=False)
    console.print(f"next: marin-rl plot {result.run_dir}", highlight=False)
    console.print(f"      marin-rl rollouts view {result.run_dir}", highlight=False)
    return 0


def abort(*_signal) -> None:
    """A second Ctrl-C: KeyboardInterrupt, and the signals ignored from here on (a third press must not
    interrupt the clean-up). Also a signal handler."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def redeliver_dropped_interrupts() -> Callable[[], None]:
    """A signal handler may run where Python cannot propagate an exception: in a garbage-collector callback
    (JAX registers one), a weakref callback, a `__del__`. Python then prints "Exception ignored in ..." and
    drops it, and an aborted run would go on. From now on a dropped KeyboardInterrupt is raised again in
    the main thread 10 ms later (until it lands). Returns what restores the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, abort)  # handlers are set from the main thread only: here
            threading.Timer(0.01, _thread.interrupt_main).start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    return lambda: setattr(sys, "unraisablehook", previous)


class _TrainHelp(argparse.Action):
    """`train --help` lists every config key; built only when asked for (it imports the configs)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.epilog = _config_keys_help()
        parser.print_help()
        parser.exit()


def _config_keys_help() -> str:
    from marin_rl.config import TrainConfig
    from marin_rl.schema import config_keys

    lines = []
    for key in config_keys(TrainConfig):
        lines.append(f"  {key.path} = {key.default}")
        if key.doc:
            lines += textwrap.wrap(key.doc, 78, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def serve_command(args, console: Console) -> int:
    import draccus

    from marin_rl.server import ServeConfig

    try:
        config = draccus.parse(ServeConfig, args=args.overrides)
    except Exception as e:  # noqa: BLE001 - draccus raises several types for a bad config
        raise ConfigError(f"serve config: {e}") from e
    from marin_rl.server import serve_main

    serve_main(config)
    return 0


def plot_command(args, console: Console) -> int:
    from marin_rl.plot import plot_run

    for path in plot_run(args.run, args.output):
        console.print(f"wrote {path}")
    return 0


def envs_command(args, console: Console) -> int:
    from marin_rl.envs import env_types

    for name, cls in sorted(env_types().items()):
        doc = (cls.__doc__ or "").strip().splitlines()
        console.print(f"[bold]{name}[/]  {cls.__module__}.{cls.__qualname__}  {doc[0] if doc else ''}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
