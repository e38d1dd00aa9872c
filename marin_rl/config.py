"""The run config: one YAML file (draccus) for everything `marin-rl train` starts.

Each component owns its config dataclass; this module composes them. It imports no JAX, so a bad
key is reported in a second, before any model is built.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus
import yaml

from marin_rl.broadcaster import BroadcasterConfig
from marin_rl.envs import RolloutSettings, SamplingParams, resolve_settings
from marin_rl.errors import ConfigError
from marin_rl.learner import LearnerConfig, ModelConfig
from marin_rl.replay import AlgorithmConfig, BatcherConfig, ReplayBufferConfig, RlooConfig
from marin_rl.runtime_config import RUNTIMES, PlacementConfig, RayConfig
from marin_rl.schema import SchemaError, normalize
from marin_rl.server import InferenceServerConfig


@dataclass(frozen=True)
class EvalConfig:
    """How an env's held-out problems (`Env.eval_problems()`) are evaluated every `eval_every` steps."""

    greedy: bool = True
    """One greedy (temperature 0) sample per problem: `eval/{env}/greedy/reward/mean`, `.../pass@1`."""
    pass_at_k: list[int] = field(default_factory=list)
    """Also sample `samples` completions per problem and report `eval/{env}/sampled/pass@k` for these k."""
    samples: int | None = None
    """Samples per problem for pass@k; None: the largest k."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples."""
    max_problems: int | None = None
    """Evaluate only the first this many held-out problems; None: all."""

    def __post_init__(self):
        if self.pass_at_k and min(self.pass_at_k) < 1:
            raise ValueError(f"eval.pass_at_k must be >= 1, got {self.pass_at_k}")
        if self.pass_at_k and self.samples is not None and self.samples < max(self.pass_at_k):
            raise ValueError(f"eval.samples ({self.samples}) must be >= the largest pass_at_k ({max(self.pass_at_k)})")


@dataclass(frozen=True)
class EnvConfig:
    """One environment of the run: what it is, how much of each batch it gets, how it samples."""

    name: str
    """Name in rollouts, metrics and `RUN/rollouts/{name}/`; unique within the run."""
    type: str
    """A registered env type (`marin-rl envs` lists them) or an import path `package.module:ClassName`."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env's constructor."""
    replicas: int = 1
    """Concurrent asyncio workers sampling groups for this env."""
    fraction: float = 1.0
    """Share of each batch's token budget. Fractions sum to <= 1; the rest goes to envs with data."""
    group_size: int = 8
    """Rollouts sampled per problem (the group advantages are computed over)."""
    sampling: SamplingParams | None = None
    """Sampling parameters; None keeps the env's defaults (an env's own stop strings are always kept)."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weights of the env's named rewards in the scalar reward; unnamed rewards keep the env's default."""
    max_turns: int | None = None
    """Most assistant turns per rollout; None keeps the env's default."""
    verifier_timeout_s: float | None = None
    """A reward function running longer scores 0 and is recorded; None keeps the env's default."""
    max_reward_failures: float = 0.5
    """Share of rollouts whose reward failed (raised, timed out, not a number), over windows of 64,
    that stops the run with an error: training on zeros teaches nothing. 1 never stops. Past 1% a
    warning is printed."""
    algorithm: AlgorithmConfig = field(default_factory=RlooConfig)
    """How this env's rollouts become training signal: `type: rloo | grpo | dr_grpo | sft | opd`
    (docs/algorithms.md)."""
    buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    """This env's replay buffer: max age (staleness cap), min group size, zero-variance filtering."""
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    """Held-out evaluation every `eval_every` steps (envs without `eval_problems()` are skipped); None: off."""

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ValueError(f"envs[].name must be letters, digits, '_', '.', '-' (it names a directory), got {self.name!r}")
        if self.replicas < 1:
            raise ValueError(f"envs[{self.name}].replicas must be >= 1, got {self.replicas}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"envs[{self.name}].fraction must be in [0, 1], got {self.fraction}")
        if not 0.0 <= self.max_reward_failures <= 1.0:
            raise ValueError(f"envs[{self.name}].max_reward_failures must be in [0, 1], got {self.max_reward_failures}")
        if self.group_size < self.buffer.min_group_size:
            raise ValueError(
                f"envs[{self.name}].group_size ({self.group_size}) is below buffer.min_group_size "
                f"({self.buffer.min_group_size}): no group would ever be trained on"
            )
        self.check_algorithm(self.sampling.temperature if self.sampling is not None else 1.0)

    def check_algorithm(self, temperature: float) -> None:
        """Reject algorithm settings that cannot work (the env's own default temperature is checked
        again once the env is built)."""
        self.algorithm.check(self.name, self.group_size, temperature, self.buffer.drop_zero_variance_groups)

    def rollout_settings(self, env, max_total_tokens: int | None) -> RolloutSettings:
        """What `env` (built from this entry) samples and scores with: these overrides on its defaults."""
        return resolve_settings(
            env,
            self.sampling,
            reward_weights=self.reward_weights,
            verifier_timeout_s=self.verifier_timeout_s,
            max_turns=self.max_turns,
            max_total_tokens=max_total_tokens,
        )


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (off unless a project is set)."""

    project: str | None = None
    """W&B project; None disables W&B."""
    entity: str | None = None
    """W&B entity (team or user)."""
    name: str | None = None
    """Run name; None uses the run directory's name."""
    mode: str = "online"
    """`online`, `offline` or `disabled`."""


@dataclass(frozen=True)
class TrainConfig:
    """`marin-rl train CONFIG`: everything a run needs, written back fully resolved to RUN/config.yaml."""

    run_dir: str = "runs/run"
    """Where the run writes config.yaml, metrics.jsonl, rollouts/, checkpoints/, hf/."""
    max_steps: int = 100
    """Learner steps (policy versions) to train for."""
    seed: int = 0
    """Seeds model init, the learner's RNG and the order problems are drawn in."""
    tokenizer: str = "char"
    """A local Hugging Face tokenizer directory, or `char` for the shipped character tokenizer."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: a Levanter Llama/Qwen built from sizes or loaded from a local HF checkpoint."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Loss, optimizer, microbatching, checkpoints."""
    envs: list[EnvConfig] = field(default_factory=list)
    """The environments trained on, each with its share of the batch."""
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    """Token budget per batch and row length."""
    server: InferenceServerConfig = field(default_factory=InferenceServerConfig)
    """The inference servers' settings: the embedded ones (`placement.server_devices`) and Ray's server actors."""
    runtime: str = "local"
    """`local`: everything in this process (learner, embedded servers, env workers on an event loop);
    `ray`: inference servers and env workers as Ray actors (`ray`), the learner in this process."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which of this host's devices the learner's mesh and the embedded engines use (docs/distributed.md)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray runtime's actors and cluster (used when `runtime: ray`)."""
    broadcaster: BroadcasterConfig = field(default_factory=BroadcasterConfig)
    """How often new weights reach the servers, and which remote servers there are."""
    checkpoint_every: int = 50
    """Save a learner checkpoint every this many steps (and always on exit)."""
    eval_every: int | None = None
    """Evaluate every env's held-out problems every this many steps (and before the first step);
    None: never. Metrics `eval/{env}/...` go to metrics.jsonl and the plots."""
    export_hf_every: int | None = None
    """Also export Hugging Face weights to RUN/hf/step-N/ (and with LoRA the PEFT adapter to
    RUN/peft/step-N/) every this many steps; None: only at the end."""
    max_buffered_batches: float = 2.0
    """Env workers pause while their buffer holds this many batches' worth of the env's share that the
    next policy version still trains on (`ReplayBuffer.tokens_ahead`): rollouts generated further ahead
    would only grow stale."""
    worker_max_backoff_s: float = 30.0
    """Longest wait between retries of a failing env worker (it starts at 1 s and doubles)."""
    deterministic: bool = False
    """Reproducible runs: the same seed gives the same metrics and parameters, and a run killed and
    resumed gives the parameters of one that was not. Generation for step k starts once policy k is
    served and stops when the batch is full (no overlap with training: slower, see
    docs/reliability.md). Requests are always seeded from (seed, env, the problem's position in the
    env's stream). Holds on one kind of device while no remote server that takes part fails over to
    another kind."""
    exact_numerics: bool | None = None
    """The embedded engines sample and the learner scores with the exact passes: a sequence's log-probs
    are the same bits whatever is batched with it, and the learner's equal the engine's at the same
    weights (mismatch 0, docs/algorithms.md). Slower. None: on when `deterministic` is."""
    compilation_cache: str | bool = "auto"
    """JAX's persistent compilation cache: a second start of a run (any run of the same shapes) loads
    what the first compiled. `auto` (or true): `$MARIN_RL_COMPILATION_CACHE` where set, else one per
    user, `$XDG_CACHE_HOME/marin-rl/jax` (~/.cache/...); a directory; or `off` (YAML's false). Safe to
    share between runs and versions (entries are keyed by program, device and versions)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Optional Weights & Biases logging."""

    def __post_init__(self):
        if self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if not self.envs:
            raise ValueError("envs: a run needs at least one env")
        names = [e.name for e in self.envs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"envs[].name must be unique, repeated: {duplicates}")
        total = sum(e.fraction for e in self.envs)
        if total > 1.0 + 1e-9:
            raise ValueError(f"envs[].fraction must sum to <= 1, got {total:.4f} ({dict(zip(names, (e.fraction for e in self.envs)))})")
        if self.batcher.max_seq_len > self.model.seq_len:
            raise ValueError(
                f"batcher.max_seq_len ({self.batcher.max_seq_len}) exceeds model.seq_len ({self.model.seq_len}): "
                "the learner could not take the rows"
            )
        if self.server.max_seq_len > self.model.seq_len and self.model.hf_checkpoint is None:
            raise ValueError(f"server.max_seq_len ({self.server.max_seq_len}) exceeds model.seq_len ({self.model.seq_len})")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1 or null, got {self.eval_every}")
        # YAML reads `off` as false (`on` as true), which reaches here as a bool or its name.
        named = {False: "off", "False": "off", True: "auto", "True": "auto"}.get(self.compilation_cache, self.compilation_cache)
        object.__setattr__(self, "compilation_cache", named)
        if self.compilation_cache == "":
            raise ValueError("compilation_cache must be auto, off or a directory, got an empty string")
        if self.max_buffered_batches <= 0:
            raise ValueError(f"max_buffered_batches must be > 0, got {self.max_buffered_batches}")
        self._check_distribution()

    def _check_distribution(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        shards = self.placement.data_parallel
        if self.batcher.num_rows % shards:
            raise ValueError(
                f"batcher: {self.batcher.num_rows} rows per batch do not split evenly over the "
                f"{shards} placement.learner_devices; make total_token_budget / max_seq_len a multiple of {shards}"
            )
        if self.learner.microbatch_rows is not None and self.learner.microbatch_rows % shards:
            raise ValueError(f"learner.microbatch_rows ({self.learner.microbatch_rows}) must be a multiple of the {shards} placement.learner_devices")
        if self.runtime == "ray":
            if self.placement.server_devices:
                raise ValueError("placement.server_devices: with runtime ray the servers are ray.num_servers actors; leave it unset")
            if self.deterministic:
                raise ValueError("deterministic: true needs runtime local (Ray's actors sample concurrently)")
            if self.exact_numerics:
                raise ValueError("exact_numerics: true needs runtime local (its engines are the embedded ones)")
        elif not self.placement.engines and not self.broadcaster.remote_servers:
            raise ValueError("placement.server_devices is [] and broadcaster.remote_servers is empty: no server to sample from")
        if self.learner.lora.rank and self.exact:
            raise ValueError(
                "learner.lora.rank > 0 with exact numerics (deterministic: true turns them on) is not supported: the "
                "engines serve the merged weights, whose bits differ from the adapted model's; set exact_numerics: false"
            )

    @property
    def embedded_devices(self) -> list[int]:
        """Device index of each embedded engine (none in the Ray runtime, whose servers are actors)."""
        return [] if self.runtime == "ray" else self.placement.engines

    @property
    def exact(self) -> bool:
        """Whether the run uses the exact passes (`exact_numerics`, by default `deterministic`)."""
        return self.deterministic if self.exact_numerics is None else self.exact_numerics

    @property
    def fractions(self) -> dict[str, float]:
        return {e.name: e.fraction for e in self.envs}


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML) with command-line overrides (`--learner.optimizer.learning_rate=1e-5`,
    `--max_steps 5`, and `--envs.<name or index>.<key>=<value>` for one env).

    Every mistake raises `ConfigError` naming the key, the value and what is allowed, and whether it
    came from the file or the command line.
    """
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(Path(path).read_text()) if path else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from e
    if not isinstance(raw, dict | None):
        raise ConfigError(f"{path}: a config is a mapping of keys to values, got {type(raw).__name__}")
    raw = raw or {}
    from_command_line = apply_overrides(raw, list(overrides))
    try:
        checked = normalize(TrainConfig, raw)
    except SchemaError as e:
        overridden = any(k[: len(e.path)] == e.path[: len(k)] for k in from_command_line)  # one within the other
        where = "command line" if overridden else str(path or "config")
        raise ConfigError(f"{where}: {e}") from e
    try:
        return draccus.decode(TrainConfig, checked)
    except Exception as e:  # noqa: BLE001 - a config class's own check or a draccus decoding error
        raise ConfigError(f"{path or 'config'}: {_reason(e)}") from e


def apply_overrides(raw: dict, args: list[str]) -> list[tuple[str, ...]]:
    """Set each `--a.b.c=value` / `--a.b.c value` in `raw` (values read as YAML); `envs.<name>`
    addresses the env of that name. Returns the key paths set."""
    paths = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"command line: {arg!r} is not an override; overrides look like --key.sub=value")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"command line: --{key} needs a value (--{key}=VALUE)")
            i += 1
            value = args[i]
        parts = key.split(".")
        if parts[0] == "envs" and len(parts) > 2:
            parts[1] = _env_index(raw, parts[1], key)
        target = raw
        for depth, part in enumerate(parts):
            if not isinstance(target, dict | list):
                raise ConfigError(f"command line: --{key}: {'.'.join(parts[:depth])} is not a section")
            if isinstance(target, list) and not (part.isdigit() and int(part) < len(target)):
                raise ConfigError(f"command line: --{key}: {'.'.join(parts[:depth])} has {len(target)} items, no item {part!r}")
            if depth == len(parts) - 1:
                target[int(part) if isinstance(target, list) else part] = yaml.safe_load(value) if value.strip() else value
            else:
                target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
        paths.append(tuple(parts))
        i += 1
    return paths


def _env_index(raw: dict, env: str, key: str) -> str:
    envs = raw.get("envs") or []
    names = [e.get("name") if isinstance(e, dict) else None for e in envs]
    if env.isdigit() and int(env) < len(envs):
        return env
    if env in names:
        return str(names.index(env))
    raise ConfigError(f"command line: --{key}: no env named {env!r}; envs: {names}")


def _reason(error: Exception) -> str:
    """The message of a config class's own check (draccus wraps it), else draccus's, on one line."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ValueError | TypeError) and not isinstance(cause, draccus.ParsingError):
            break
        cause = cause.__cause__ or cause.__context__
    return " ".join(str(cause or error).split())


def dump_config(config: TrainConfig) -> str:
    """The fully resolved config as YAML (what RUN/config.yaml holds), without the weight-update tokens:
    a resumed or copied run reads them from MARIN_RL_WEIGHT_TOKEN (or the command line) again."""
    config = dataclasses.replace(
        config,
        server=dataclasses.replace(config.server, weight_update_token=None),
        broadcaster=dataclasses.replace(config.broadcaster, weight_update_token=None),
    )
    return draccus.dump(config)
