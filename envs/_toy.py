"""The quickstart's toy task: modular addition of single digits, answered with one character.

Prompt `3+1=`, answer `4` (the sum mod 10). The reward checks the first character of the
completion against the sum, so it depends on the prompt: a model that ignores the prompt scores
at most 1 / `modulus`, and a random-init model starts near 1 / vocabulary size. With the default
`addends: [1]` there are 10 prompts (a 10-way mapping of prompt to digit), which a tiny model
learns by RL in a few dozen steps on a CPU (see docs/quickstart.md). More addends make a harder
task: a tiny model tends to lock onto wrong digits for some prompts, where no sample in the group
is ever right and RL gets no signal.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from marin_rl.envs._env import Env, register_env, reward
from marin_rl.envs._problems import Problem
from marin_rl.envs._sampling import SamplingParams


@register_env("toy_addition")
class ToyAdditionEnv(Env):
    """`a+b=` -> `(a + b) mod modulus`, with a in [0, modulus) and b from `addends`."""

    sampling = SamplingParams(temperature=1.0, max_tokens=2)

    def __init__(self, addends: tuple[int, ...] = (1,), modulus: int = 10, seed: int = 0):
        if not 1 <= modulus <= 10:
            raise ValueError(f"toy_addition: modulus must be in [1, 10] (one-digit answers), got {modulus}")
        if not addends or any(not 0 <= b <= 9 for b in addends):
            raise ValueError(f"toy_addition: addends must be one-digit numbers, got {addends!r}")
        self.addends = tuple(addends)
        self.modulus = modulus
        self.seed = seed

    def _problem(self, a: int, b: int) -> Problem:
        return Problem(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=str((a + b) % self.modulus))

    def problems(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        while True:
            yield self._problem(rng.randrange(self.modulus), rng.choice(self.addends))

    def eval_problems(self) -> list[Problem]:
        return [self._problem(a, b) for a in range(self.modulus) for b in self.addends]

    @reward
    def correct(self, completion: str, answer: str) -> float:
        return float(completion.strip()[:1] == answer)
