"""Checks before a run touches its directory: the config against everything it names.

`check_run` loads the tokenizer, builds every env, renders a few of each env's problems through the
chat template and measures them against the row length, checks the model's shape and the run
directory. It writes nothing and builds no model, so a mistake costs seconds, not a model build,
and leaves no directory behind. Each mistake is a `ConfigError` naming the key, the value and what
would work.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from marin_rl.config import EnvConfig, TrainConfig
from marin_rl.errors import ConfigError, RunDirError
from marin_rl.orchestrator._memory import check_memory, device_memory
from marin_rl.runtime_config import PlacementConfig

PROBLEMS_MEASURED = 8
"""Problems of each env rendered through the chat template to measure prompt lengths."""
RUN_CONFIG = "config.yaml"


@dataclass(frozen=True)
class PromptLengths:
    """Token lengths of the first few prompts of one env, after the chat template."""

    shortest: int
    longest: int
    longest_problem: str
    measured: int
    max_tokens: int
    """The env's resolved `sampling.max_tokens` (per assistant turn)."""
    max_turns: int = 1
    truncates: bool = False
    """Whether its sampling cuts the distribution (top-p): the engine's calls have variants for that."""


@dataclass
class CheckedRun:
    """What the checks built and found; `train` uses the tokenizer and envs as they are."""

    tokenizer: Any
    envs: dict[str, Any]
    prompts: dict[str, PromptLengths]
    resume_from: Path | None
    """The checkpoint a resumed run starts from."""
    notes: list[str] = field(default_factory=list)
    """Things that work but are likely not what was meant (printed at start)."""
    seconds: float = 0.0
    """How long the checks took (a phase of start-up)."""


def check_run(config: TrainConfig, *, resume: bool) -> CheckedRun:
    """Raise `ConfigError` / `RunDirError` for anything that would fail after start-up."""
    started = time.perf_counter()
    if config.placement != PlacementConfig():
        from marin_rl.distributed import Placement

        Placement.of(config)  # every device index exists on this host
    resume_from = check_run_dir(Path(config.run_dir), resume)
    tokenizer = _load_tokenizer(config.tokenizer)
    _check_model(config, len(tokenizer))
    limits = device_memory(config)
    if limits:
        import jax

        check_memory(config, len(tokenizer), backend=jax.default_backend(), device_bytes=limits)
    if config.server.max_seq_len < config.batcher.max_seq_len:
        raise ConfigError(
            f"server.max_seq_len ({config.server.max_seq_len}) is below batcher.max_seq_len "
            f"({config.batcher.max_seq_len}): the server would refuse rollouts the rows can hold"
        )
    checked = CheckedRun(tokenizer, {}, {}, resume_from)
    if resume and resume_from is None:
        checked.notes.append(f"--resume: {config.run_dir} holds no complete checkpoint yet: the run starts at step 0")
    for index, env_config in enumerate(config.envs):
        key = f"envs.{index}"
        env = _build_env(env_config, key, tokenizer)
        settings = _resolve(env, env_config, key, config.batcher.max_seq_len)
        lengths = _measure_prompts(env, key, settings, config)
        checked.envs[env_config.name] = env
        checked.prompts[env_config.name] = lengths
        checked.notes += _check_rows(env_config, key, lengths, config)
    decoding = [name for name, prompts in checked.prompts.items() if prompts.max_tokens > 1]
    if config.server.precompile_prompt_lens and not config.server.precompile_decode and decoding:
        checked.notes.append(
            f"server.precompile_decode is off but {', '.join(decoding)} asks for more than one token: "
            "the engine compiles its decode shapes during the first steps"
        )
    checked.seconds = time.perf_counter() - started
    return checked


def holds_run(run_dir: Path) -> bool:
    """True when `run_dir` holds anything besides the config and empty folders (a start that failed)."""
    if not run_dir.is_dir():
        return False
    return any(p.is_file() and p != run_dir / RUN_CONFIG for p in run_dir.rglob("*"))


def check_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a new run, or with `resume` where there is none yet: a
    run killed before its first checkpoint, or during start-up, starts at step 0); refuses to overwrite
    a run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir {run_dir} is a file, not a directory")
    if resume:
        from marin_rl.learner import complete_checkpoints

        checkpoints = complete_checkpoints(run_dir / "checkpoints")
        return checkpoints[-1] if checkpoints else None
    if holds_run(run_dir):
        raise RunDirError(
            f"run_dir {run_dir} already holds a run; pass --resume to continue it, or choose another "
            "--run_dir (nothing was changed)"
        )
    return None


def _load_tokenizer(name: str):
    from marin_rl.tokenizer import load_tokenizer

    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as e:  # a missing or unreadable tokenizer directory
        message = " ".join(str(e).split())
        raise ConfigError(message if message.startswith("tokenizer:") else f"tokenizer: {message}") from e


def _check_model(config: TrainConfig, vocab: int) -> None:
    model = config.model
    if model.hf_checkpoint is None:
        for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "seq_len"):
            if getattr(model, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(model, name)}")
        if model.head_dim is None and model.hidden_dim % model.num_heads:
            raise ConfigError(
                f"model.hidden_dim ({model.hidden_dim}) must be a multiple of model.num_heads ({model.num_heads}), "
                "or set model.head_dim"
            )
        if model.num_heads % model.num_kv_heads:
            raise ConfigError(f"model.num_heads ({model.num_heads}) must be a multiple of model.num_kv_heads ({model.num_kv_heads})")
        return
    path = Path(model.hf_checkpoint)
    try:
        hf = json.loads((path / "config.json").read_text())
    except OSError:
        raise ConfigError(f"model.hf_checkpoint: {str(path)!r} has no config.json (a local Hugging Face model directory; docs/learner.md)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.hf_checkpoint: {path / 'config.json'} is not valid JSON ({e})") from None
    if hf.get("model_type") != model.family:
        raise ConfigError(f"model.family is {model.family!r} but {path / 'config.json'} has model_type {hf.get('model_type')!r}")
    if hf.get("vocab_size", vocab) < vocab:
        raise ConfigError(
            f"tokenizer: {config.tokenizer!r} has {vocab} tokens but model.hf_checkpoint's vocab_size is {hf['vocab_size']}: "
            "use the checkpoint's own tokenizer"
        )
    context = hf.get("max_position_embeddings")
    if context is not None and context < config.batcher.max_seq_len:
        raise ConfigError(f"batcher.max_seq_len ({config.batcher.max_seq_len}) exceeds the checkpoint's max_position_embeddings ({context})")


def _build_env(env_config: EnvConfig, key: str, tokenizer):
    from marin_rl.envs import build_env, resolve_env_class

    try:
        resolve_env_class(env_config.type)
    except (ImportError, ValueError) as e:  # unknown name, module or file
        raise ConfigError(f"{key}.type: {e}") from e
    try:
        return build_env(env_config.type, env_config.args, tokenizer=tokenizer, name=env_config.name)
    except ImportError as e:  # an optional package the env needs
        raise ConfigError(f"{key}.type: {e}") from e
    except (TypeError, ValueError, OSError) as e:  # wrong arguments, a constructor's own check, a missing data file
        raise ConfigError(f"{key}.args: {e}") from e


def _resolve(env, env_config: EnvConfig, key: str, max_seq_len: int):
    try:
        settings = env_config.rollout_settings(env, max_seq_len)
        env_config.check_algorithm(settings.sampling.temperature)  # the env's own default temperature
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e
    return settings


def _measure_prompts(env, key: str, settings, config: TrainConfig) -> PromptLengths:
    from marin_rl.engine import truncates
    from marin_rl.envs import Transcript

    try:
        problems = list(itertools.islice(iter(env.problems()), PROBLEMS_MEASURED))
    except Exception as e:  # noqa: BLE001 - whatever the env's source raises, name the env
        raise ConfigError(f"{key}: env {env.name!r} could not produce problems: {type(e).__name__}: {e}") from e
    if not problems:
        raise ConfigError(f"{key}: env {env.name!r} has no problems")
    lengths = {}
    for problem in problems:
        try:
            lengths[problem.id] = len(Transcript(env.tokenizer, env.build_messages(problem)).token_ids)
        except Exception as e:  # noqa: BLE001 - a bad message or a template that cannot render it
            raise ConfigError(f"{key}: the prompt of problem {problem.id!r} does not render: {type(e).__name__}: {e}") from e
    longest = max(lengths, key=lengths.get)
    row = config.batcher.max_seq_len
    if lengths[longest] >= row:
        raise ConfigError(
            f"{key}: the prompt of problem {longest!r} is {lengths[longest]} tokens after the chat template, and "
            f"batcher.max_seq_len={row} leaves no room to sample; raise batcher.max_seq_len (with model.seq_len "
            "and server.max_seq_len) or shorten the prompt"
        )
    sampling = settings.sampling
    return PromptLengths(
        min(lengths.values()),
        lengths[longest],
        longest,
        len(lengths),
        sampling.max_tokens,
        settings.max_turns,
        truncates(sampling.temperature, sampling.top_p, 0),
    )


def prompts_in_flight(config: TrainConfig, envs: Mapping[str, Any], prompts: Mapping[str, PromptLengths]) -> int | None:
    """The most prompts the run's env workers can have at a server at once: each worker samples one group
    at a time, in one request of `group_size` samples where the env samples one turn as `Env` does, else
    up to a request per rollout. None where held-out evaluation runs (it sends every eval problem at once)."""
    from marin_rl.envs import Env

    if config.eval_every is not None and any(env_config.eval is not None for env_config in config.envs):
        return None
    total = 0
    for env_config in config.envs:
        one_request = prompts[env_config.name].max_turns == 1 and type(envs[env_config.name]).sample_rollouts is Env.sample_rollouts
        total += env_config.replicas * (1 if one_request else env_config.group_size)
    return total


CPU_PREFILL_ROWS = 4
"""On a CPU, an embedded engine's prefill call takes at most this many prompts. There prefill costs about
the same split into calls (the cores are busy either way), while each larger shape is one more program
to compile at start: the quickstart's 16-prompt shape took 1.8 s of its cold start's XLA on 2 cores."""


def prefill_rows(config: TrainConfig, envs: Mapping[str, Any], prompts: Mapping[str, PromptLengths], backend: str) -> int | None:
    """The most prompts an embedded engine's prefill call takes: as many as can be in flight
    (`prompts_in_flight`), and on a CPU at most `CPU_PREFILL_ROWS`."""
    in_flight = prompts_in_flight(config, envs, prompts)
    if backend != "cpu":
        return in_flight
    return CPU_PREFILL_ROWS if in_flight is None else min(in_flight, CPU_PREFILL_ROWS)


def engine_shapes(prompts: Mapping[str, PromptLengths], max_seq_len: int, in_flight: int | None = None) -> dict[str, Any]:
    """What an embedded engine compiles at start so that no step waits on a compilation (the
    `EngineConfig.precompile_*` fields): prefill for prompts from the shortest measured to twice the
    longest (problems not measured may be longer), and up to `max_seq_len` for multi-turn envs (a later
    turn's prompt holds the conversation so far), for up to `in_flight` prompts at once (`prompts_in_flight`;
    a prefill call takes no more); decode where an env asks for more than one token; top-p's variants
    where an env samples with it."""
    lens = set()
    for p in prompts.values():
        longest = max_seq_len - 1 if p.max_turns > 1 else min(2 * p.longest, max_seq_len - 1)
        length = p.shortest
        while length <= longest:
            lens.add(length)
            length *= 2
        lens.add(longest)
    return {
        "max_prefill_rows": in_flight,
        "precompile_prompt_lens": tuple(sorted(lens)),
        "precompile_decode": any(p.max_tokens > 1 for p in prompts.values()),
        "precompile_truncated": any(p.truncates for p in prompts.values()),
    }


def _check_rows(env_config: EnvConfig, key: str, lengths: PromptLengths, config: TrainConfig) -> list[str]:
    """A group must fit in one batch (groups are never split); say when rollouts will be cut."""
    from marin_rl.replay import RowPacker

    batcher, n = config.batcher, env_config.group_size
    budget = f"batcher.total_token_budget={batcher.total_token_budget} ({batcher.num_rows} rows of {batcher.max_seq_len})"
    if RowPacker(batcher.num_rows, batcher.max_seq_len).place_group([lengths.shortest + 1] * n) is None:
        raise ConfigError(
            f"{key}.group_size: a group of {n} rollouts of at least {lengths.shortest + 1} tokens does not fit in "
            f"one batch of {budget}, so nothing would be trained on; raise the budget or lower group_size"
        )
    notes = []
    full = min(lengths.longest + lengths.max_tokens, batcher.max_seq_len)
    if RowPacker(batcher.num_rows, batcher.max_seq_len).place_group([full] * n) is None:
        notes.append(
            f"{env_config.name}: a group of {n} rollouts of {full} tokens does not fit in {budget}; "
            "only groups of shorter rollouts will be trained on"
        )
    if lengths.longest + lengths.max_tokens > batcher.max_seq_len:
        notes.append(
            f"{env_config.name}: prompts of up to {lengths.longest} tokens + max_tokens {lengths.max_tokens} exceed "
            f"the {batcher.max_seq_len}-token rows; completions are cut to the room left"
        )
    return notes
