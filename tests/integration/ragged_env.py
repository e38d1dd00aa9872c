"""A two-turn env with ragged prompts and multi-token answers: its requests meet many engine shapes."""

import random
from collections.abc import Iterator

from marin_rl.envs import Env, Problem, SamplingParams, reward

LETTERS = "abcdefghij"


class RaggedEcho(Env):
    """The user sends 1-30 letters, the model echoes the first; the user answers with 1-12 letters and
    the model echoes the first again. Prompts of every length up to the row, answers of 1-4 tokens."""

    max_turns = 2
    length_ends_rollout = False  # an answer cut at max_tokens still gets its second turn
    sampling = SamplingParams(temperature=1.0, max_tokens=4)

    def _problem(self, rng: random.Random, index: int) -> Problem:
        text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 30)))
        return Problem(id=f"{index}:{text}", prompt=text, answer=text[0])

    def problems(self) -> Iterator[Problem]:
        rng = random.Random(0)
        index = 0
        while True:
            yield self._problem(rng, index)
            index += 1

    async def interact(self, messages, problem, state):
        rng = random.Random(len(messages) * 7919 + len(problem.prompt))
        return [{"role": "user", "content": "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 12)))}]

    @reward
    def echoed(self, messages, answer: str) -> float:
        first = next(m["content"] for m in messages if m["role"] == "assistant")
        return float(first.strip()[:1] == answer)
