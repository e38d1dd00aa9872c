"""The env API: subclass `Env`, give it problems and reward functions, register it by name.

    @register_env("countdown")
    class Countdown(Env):
        system_prompt = "Answer inside <answer></answer>."

        def __init__(self, data: str):
            self.data = data

        def problems(self):
            return load_problems(self.data)

        @reward(weight=1.0)
        def correct(self, completion, answer):
            return float(xml_tag("answer")(completion).value == answer)

A reward function is a method decorated with `@reward`; it declares the arguments it needs by
name, from `problem` (the `Problem`), `answer` (`problem.answer`), `completion` (the last
assistant message's text), `messages` (the whole conversation) and `state` (the dict `interact`
kept for this rollout). It returns a number; the rollout's `reward` is the weighted sum. Sync
reward functions run on a bounded pool of threads (`verifier_threads`) so a slow one never blocks
the event loop and a hung one cannot pile up threads.

Multi-turn: set `max_turns` and override `interact`, which sees the conversation after each
assistant turn and returns the user/tool messages to add (or None to end the rollout).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from marin_rl.envs._chat import Message
from marin_rl.envs._problems import Problem
from marin_rl.envs._sampling import Sampler, SamplingParams
from marin_rl.errors import ConfigError

if TYPE_CHECKING:
    from marin_rl.envs._rewards import EnvMetrics, VerifierThreads
    from marin_rl.envs._runner import RolloutSettings
    from marin_rl.types import Rollout

REWARD_ARGUMENTS = ("problem", "answer", "completion", "messages", "state")
"""What a reward function may ask for, by parameter name."""

F = TypeVar("F", bound=Callable[..., Any])


def reward(fn: F | None = None, *, weight: float = 1.0, name: str | None = None) -> Any:
    """Mark an `Env` method as a named reward function (`@reward` or `@reward(weight=0.1)`)."""

    def mark(f: F) -> F:
        params = list(inspect.signature(f).parameters)[1:]  # drop self
        unknown = [p for p in params if p not in REWARD_ARGUMENTS]
        if unknown:
            raise TypeError(
                f"reward function {f.__qualname__}: unknown arguments {unknown}; "
                f"a reward function may take {list(REWARD_ARGUMENTS)}"
            )
        f._marin_reward = (name or f.__name__, float(weight))  # type: ignore[attr-defined]
        return f

    return mark if fn is None else mark(fn)


class Env:
    """Base class of environments. Override the class attributes and methods below."""

    max_turns: ClassVar[int] = 1
    """Most assistant turns per rollout; more than 1 needs `interact`."""
    length_ends_rollout: ClassVar[bool] = True
    """A turn cut at `max_tokens` ends the rollout, as truncated (its message is unfinished). False: the
    conversation goes on as after any turn, for answers of a fixed number of tokens (one-token moves)."""
    sampling: ClassVar[SamplingParams] = SamplingParams()
    """Default sampling; the run config's sampling replaces it, except for `stop` strings, which add up."""
    system_prompt: ClassVar[str | None] = None
    """Prepended as a system message by `build_messages` when the problem has none."""
    reward_weights: ClassVar[Mapping[str, float]] = {}
    """Overrides the `@reward(weight=...)` defaults, e.g. in a subclass; the run config overrides both."""
    verifier_timeout_s: ClassVar[float] = 30.0
    """A reward function running longer scores 0 and is recorded as timed out."""
    success_reward: ClassVar[str | None] = None
    """The reward that means "solved" (>= 1) for pass@k; None uses the total reward."""
    verifier_threads: ClassVar[int] = 8
    """Most threads running this env's sync reward functions at once."""
    max_hung_verifier_threads: ClassVar[int] = 256
    """A sync reward call that times out is interrupted if it runs Python code; one blocked in C keeps
    its thread until it returns. A fresh thread takes its place, while at most this many are stuck;
    past that, calls wait for a thread and time out."""

    _reward_specs: ClassVar[dict[str, tuple[str, float]]] = {}
    _name: str | None = None
    _tokenizer: Any = None
    _metrics: Any = None
    _verifier_pool: Any = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        specs: dict[str, tuple[str, float]] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                mark = getattr(value, "_marin_reward", None)
                if mark is not None:
                    specs[mark[0]] = (attr, mark[1])
        cls._reward_specs = specs
        unknown = set(cls.reward_weights) - set(specs)
        if unknown:
            raise TypeError(f"{cls.__name__}.reward_weights names unknown rewards {sorted(unknown)}; has {sorted(specs)}")

    # --- what a subclass provides ------------------------------------------------------------

    def problems(self) -> Iterable[Problem]:
        """The training problems (a list, or a generator for procedural sources)."""
        raise NotImplementedError(f"{type(self).__name__} must implement problems()")

    def eval_problems(self) -> Iterable[Problem] | None:
        """Held-out problems for `evaluate`; None when the env has none."""
        return None

    def build_messages(self, problem: Problem) -> list[Message]:
        """The prompt messages for `problem`."""
        if problem.messages:
            messages = [dict(m) for m in problem.messages]
        elif problem.prompt is not None:
            messages = [{"role": "user", "content": problem.prompt}]
        else:
            raise ValueError(f"problem {problem.id!r} has neither messages nor prompt; override build_messages")
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def interact(self, messages: list[Message], problem: Problem, state: dict[str, Any]) -> list[Message] | None:
        """Messages to add after an assistant turn (tool results, a user reply), or None to stop.

        `state` is a dict private to this rollout; reward functions can read it too.
        """
        return None

    async def sample_rollouts(
        self, problem: Problem, sampler: Sampler, n: int, settings: RolloutSettings, metrics: EnvMetrics
    ) -> list[Rollout]:
        """Produce one scored group (`sample_group` calls this). The default samples, calls
        `interact` until done, and scores with the reward functions; override only for a different
        loop (the verifiers adapter does)."""
        from marin_rl.envs._runner import run_turns

        return await run_turns(self, problem, sampler, n, settings, metrics)

    async def aclose(self) -> None:
        """Release what the env holds (servers, pools). Called once when the run ends."""

    def close_verifier_threads(self) -> None:
        """Let the threads of the sync reward functions end (the run calls it after `aclose`)."""
        if self._verifier_pool is not None:
            self._verifier_pool.shutdown()

    # --- wiring (set by build_env or bind) ---------------------------------------------------

    def bind(self, tokenizer: Any, *, name: str | None = None) -> Env:
        """Give the env the policy's tokenizer (an HF tokenizer, a local dir, or `char`) and its run name."""
        if isinstance(tokenizer, str):
            from marin_rl.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self._tokenizer = tokenizer
        if name is not None:
            self._name = name
        return self

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError(
                f"env {self.name!r} has no tokenizer: build it with build_env(..., tokenizer=...) "
                "or call env.bind(tokenizer)"
            )
        return self._tokenizer

    @property
    def name(self) -> str:
        """The env's name in rollouts and metrics: the run config's name, else the registered type."""
        return self._name or vars(type(self)).get("_registered_name") or type(self).__name__

    @property
    def metrics(self) -> EnvMetrics:
        """Counters for this env (verifier errors, timeouts, ...), see `EnvMetrics`."""
        if self._metrics is None:
            from marin_rl.envs._rewards import EnvMetrics

            self._metrics = EnvMetrics(self.name, self.verifier_pool)
        return self._metrics

    @property
    def verifier_pool(self) -> VerifierThreads:
        """The threads this env's sync reward functions run on, see `VerifierThreads`."""
        if self._verifier_pool is None:
            from marin_rl.envs._rewards import VerifierThreads

            self._verifier_pool = VerifierThreads(
                self.verifier_threads, name=f"verifier:{self.name}", max_hung=self.max_hung_verifier_threads
            )
        return self._verifier_pool

    def reward_functions(self) -> dict[str, tuple[Callable[..., Any], float]]:
        """Name -> (bound reward function, default weight)."""
        return {
            name: (getattr(self, attr), float(self.reward_weights.get(name, weight)))
            for name, (attr, weight) in self._reward_specs.items()
        }

    def default_reward_weights(self) -> dict[str, float]:
        """Name -> weight of every reward this env produces, before run-config overrides."""
        return {name: weight for name, (_, weight) in self.reward_functions().items()}


# --- registry -----------------------------------------------------------------------------------

_ENV_TYPES: dict[str, type[Env]] = {}

E = TypeVar("E", bound=type[Env])


def register_env(name: str) -> Callable[[E], E]:
    """Register an `Env` subclass under a config `type` name."""

    def register(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise TypeError(f"register_env({name!r}): {cls!r} is not an Env subclass")
        old = _ENV_TYPES.get(name)
        # Re-running a definition (a notebook cell, a reloaded module) replaces it; another class may not.
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"env type {name!r} is already registered to {old.__module__}.{old.__qualname__}")
        _ENV_TYPES[name] = cls
        cls._registered_name = name
        return cls

    return register


def env_types() -> dict[str, type[Env]]:
    """Registered env types by name."""
    return dict(_ENV_TYPES)


def resolve_env_class(type_: str) -> type[Env]:
    """A registered name, an import path `package.module:ClassName`, or a file `path/to/file.py:ClassName`.

    Modules and relative paths are found from the current directory too, as `python -m` would.
    """
    if ":" not in type_:
        if type_ not in _ENV_TYPES:
            close = difflib.get_close_matches(type_, list(_ENV_TYPES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown env type {type_!r}{hint}; registered: {sorted(_ENV_TYPES)}, "
                "or give 'module:ClassName' or 'path/to/file.py:ClassName'"
            )
        return _ENV_TYPES[type_]
    source, _, attr = type_.rpartition(":")
    module = _import_file(source) if source.endswith(".py") else _import_module(source)
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Env) and v is not Env)
        raise ConfigError(f"env type {type_!r}: {source} has no Env subclass {attr!r}; its Env subclasses: {found}")
    return cls


def importable_from_cwd() -> str:
    """Put the current directory on the import path (appended, so it never shadows a package): the
    `marin-rl` script, unlike `python -m`, does not look there, and a module next to the config should
    import without PYTHONPATH. Returns the directory."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    return cwd


def _import_module(name: str) -> ModuleType:
    cwd = importable_from_cwd()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # the module exists; one of its own imports is missing: show that
        raise ConfigError(f"env type: no module {name!r} in the current directory ({cwd}) or the installed packages") from e


def _import_file(path: str) -> ModuleType:
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"env type: no file {path!r} (relative paths start at {os.getcwd()})")
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(file):
        return loaded
    if loaded is not None:
        raise ConfigError(f"env type: {path} would load as module {name!r}, which is already another module; rename the file")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look their module up
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def build_env(type_: str, args: Mapping[str, Any] | None = None, *, tokenizer: Any = None, name: str | None = None) -> Env:
    """`EnvClass(**args)` for a registered name or import path, bound to `tokenizer` and `name`."""
    cls = resolve_env_class(type_)
    args = dict(args or {})
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # some callables have no signature: let the call itself decide
        signature = None
    if signature is not None:
        try:
            signature.bind(**args)
        except TypeError as e:
            accepted = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
            raise TypeError(f"env type {type_!r}: {e} (arguments of {cls.__qualname__}: {accepted})") from None
    env = cls(**args)
    if tokenizer is not None:
        env.bind(tokenizer, name=name)
    elif name is not None:
        env._name = name
    return env
