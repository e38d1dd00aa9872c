"""The quickstart's toy task: modular addition of single digits, answered with one character.

Prompt `3+4=`, answer `7` (the sum mod 10). The reward checks the first character of the
completion against the sum, so it depends on the prompt: a model that ignores the prompt scores
about 1 / `modulus` at best, and a random-init model starts near 1 / vocabulary size. With
`max_addend: 1` there are 20 prompts (a 20-way mapping of prompt to digit), which a tiny model
learns by RL in a few dozen steps on a CPU (see docs/quickstart.md).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from marin_rl.envs._env import Env, register_env, reward
from marin_rl.envs._problems import Problem
from marin_rl.envs._sampling import SamplingParams


@register_env("toy_addition")
class ToyAdditionEnv(Env):
    """`a+b=` -> `(a + b) mod modulus`, with a in [0, modulus) and b in [0, max_addend]."""

    sampling = SamplingParams(temperature=1.0, max_tokens=2)

    def __init__(self, max_addend: int = 1, modulus: int = 10, seed: int = 0):
        if not 1 <= modulus <= 10:
            raise ValueError(f"toy_addition: modulus must be in [1, 10] (one-digit answers), got {modulus}")
        if max_addend < 0:
            raise ValueError(f"toy_addition: max_addend must be >= 0, got {max_addend}")
        self.max_addend = max_addend
        self.modulus = modulus
        self.seed = seed

    def _problem(self, a: int, b: int) -> Problem:
        return Problem(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=str((a + b) % self.modulus))

    def problems(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        while True:
            yield self._problem(rng.randrange(self.modulus), rng.randrange(self.max_addend + 1))

    def eval_problems(self) -> list[Problem]:
        return [self._problem(a, b) for a in range(self.modulus) for b in range(self.max_addend + 1)]

    @reward
    def correct(self, completion: str, answer: str) -> float:
        return float(completion.strip()[:1] == answer)
