"""Toy tasks a tiny random-init model learns by RL on a CPU.

`toy_addition`, the quickstart's: modular addition of single digits, answered with one character.

Prompt `3+1=`, answer `4` (the sum mod 10). The reward checks the first character of the
completion against the sum, so it depends on the prompt: a model that ignores the prompt scores
at most 1 / `modulus`, and a random-init model starts near 1 / vocabulary size. With the default
`addends: [1]` there are 10 prompts (a 10-way mapping of prompt to digit), which a tiny model
learns by RL in a few dozen steps on a CPU (see docs/quickstart.md). More addends make a harder
task: a tiny model tends to lock onto wrong digits for some prompts, where no sample in the group
is ever right and RL gets no signal.

`toy_next_letter`: the same kind of mapping over two turns, the smallest multi-turn task.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from typing import Any

from marin_rl.envs._chat import Message
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


ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@register_env("toy_next_letter")
class ToyNextLetterEnv(Env):
    """Two turns of one character: the user sends a letter and the model answers the next one
    (`c` -> `d`); the user sends `+` and the model answers the letter after that (`e`). Each turn is
    scored (`first`, `second`: 1 when right, weighted 0.5 each). Once the first turn is learned, a
    group's conversations coincide at their second turn, where they must still sample apart."""

    max_turns = 2
    length_ends_rollout = False  # every turn is one token long
    sampling = SamplingParams(temperature=1.0, max_tokens=1)

    def __init__(self, letters: int = 10, seed: int = 0):
        if not 1 <= letters <= len(ALPHABET) - 2:
            raise ValueError(f"toy_next_letter: letters must be in [1, {len(ALPHABET) - 2}], got {letters}")
        self.letters = letters
        self.seed = seed

    def _problem(self, index: int) -> Problem:
        return Problem(id=ALPHABET[index], prompt=ALPHABET[index], answer=ALPHABET[index + 1 : index + 3])

    def problems(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        while True:
            yield self._problem(rng.randrange(self.letters))

    def eval_problems(self) -> list[Problem]:
        return [self._problem(i) for i in range(self.letters)]

    async def interact(self, messages: list[Message], problem: Problem, state: dict[str, Any]) -> list[Message] | None:
        return [{"role": "user", "content": "+"}]

    @staticmethod
    def _answers(messages: list[Message]) -> list[str]:
        return [m["content"].strip()[:1] for m in messages if m["role"] == "assistant"]

    @reward(weight=0.5)
    def first(self, messages: list[Message], answer: str) -> float:
        return float(self._answers(messages)[0] == answer[0])

    @reward(weight=0.5)
    def second(self, messages: list[Message], answer: str) -> float:
        answers = self._answers(messages)
        return float(len(answers) > 1 and answers[1] == answer[1])
