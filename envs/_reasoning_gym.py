"""Procedural problems from the `reasoning-gym` package, scored by each task's own scorer."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from marin_rl.envs._env import Env, register_env, reward
from marin_rl.envs._optional import import_optional
from marin_rl.envs._parsers import xml_tag
from marin_rl.envs._problems import Problem


@register_env("reasoning_gym")
class ReasoningGymEnv(Env):
    """Any reasoning-gym task by name (`task: basic_arithmetic`), seeded; its `score_answer` is the verifier.

    Training problems are items `0..size-1` of the dataset built with `seed`; held-out problems come
    from `eval_seed`. Items are generated on demand, so a large `size` costs nothing up front.
    """

    success_reward = "correct"

    def __init__(
        self,
        task: str,
        seed: int = 0,
        size: int = 100_000,
        eval_seed: int = 1_000_003,
        eval_size: int = 100,
        config: Mapping[str, Any] | None = None,
        system_prompt: str | None = "default",
    ):
        rg = import_optional("reasoning_gym", "reasoning-gym", "reasoning_gym")
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.task = task
        self._train = rg.create_dataset(task, seed=seed, size=size, **dict(config or {}))
        self._eval = rg.create_dataset(task, seed=eval_seed, size=eval_size, **dict(config or {}))
        # A reasoning-gym prompt style by name ("default", "DeepSeekZero", ...) or literal text.
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None
        self._parse = xml_tag("answer", reward=1.0)

    def _problems(self, dataset: Any, split: str) -> Iterator[Problem]:
        for idx in range(len(dataset)):
            entry = dataset[idx]
            yield Problem(
                id=f"{self.task}/{split}/seed{dataset.seed}/{idx}",
                prompt=entry["question"],
                answer=entry["answer"],
                extras={"entry": entry},
            )

    def problems(self) -> Iterator[Problem]:
        return self._problems(self._train, "train")

    def eval_problems(self) -> list[Problem]:
        return list(self._problems(self._eval, "eval"))

    @reward
    def correct(self, problem: Problem, completion: str) -> float:
        # The scorer depends on the task's config only, which both splits share.
        return float(self._train.score_answer(self._parse(completion).value, problem.extras["entry"]))

    @reward(weight=0.0)
    def format(self, completion: str) -> float:
        return self._parse(completion).reward
