"""Built-in single-turn envs over problem files: exact match, and math graded by math-verify."""

from __future__ import annotations

import re
import string
import unicodedata
from typing import Any

from marin_rl.envs._env import Env, register_env, reward
from marin_rl.envs._optional import import_optional
from marin_rl.envs._parsers import Parser, get_parser, last_boxed
from marin_rl.envs._problems import Problem, load_problems


class _FileEnv(Env):
    """Problems from a file spec (`load_problems`), loaded once."""

    def __init__(self, data: str, eval_data: str | None = None, system_prompt: str | None = None):
        self.data = data
        self.eval_data = eval_data
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self._cache: dict[str, list[Problem]] = {}

    def _load(self, spec: str) -> list[Problem]:
        if spec not in self._cache:
            self._cache[spec] = load_problems(spec)
        return self._cache[spec]

    def problems(self) -> list[Problem]:
        return self._load(self.data)

    def eval_problems(self) -> list[Problem] | None:
        return None if self.eval_data is None else self._load(self.eval_data)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
# Punctuation inside a number (3.5, -4, 1/2) is meaning, not noise.
_NUMERIC_PUNCT = re.compile(r"(?<=\d)[.,/](?=\d)|-(?=\d)")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation that keeps numbers intact: case, articles, punctuation, spaces."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # thousands separators
    kept = {m.start() for m in _NUMERIC_PUNCT.finditer(text)}
    text = "".join(" " if (ch in string.punctuation and i not in kept) else ch for i, ch in enumerate(text))
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answer: Any) -> bool:
    """Whether `prediction` equals `answer` (or any of a list of answers) after `normalize_answer`."""
    answers = answer if isinstance(answer, (list, tuple)) else [answer]
    normalized = normalize_answer(prediction)
    return any(normalized == normalize_answer(str(a)) for a in answers)


@register_env("exact_match")
class ExactMatchEnv(_FileEnv):
    """Reward 1 when the parsed answer equals the reference after normalisation."""

    system_prompt = "Think step by step, then give only the final answer inside <answer></answer>."
    success_reward = "correct"

    def __init__(
        self, data: str, eval_data: str | None = None, parser: str | Parser = "answer_tag", system_prompt: str | None = None
    ):
        super().__init__(data, eval_data, system_prompt)
        self.parser = get_parser(parser)

    @reward
    def correct(self, completion: str, answer: Any) -> float:
        value = self.parser(completion).value
        return float(value is not None and exact_match(value, answer))

    @reward(weight=0.0)
    def format(self, completion: str) -> float:
        return self.parser(completion).reward


def math_equal(completion: str, answer: Any) -> bool:
    """Whether `completion`'s final answer equals `answer` per math-verify (1/2 == 0.5 == \\frac{1}{2}).

    math-verify's own timeouts use SIGALRM, which only works on the main thread; they are off here
    and the runner's verifier timeout bounds the call instead.
    """
    math_verify = import_optional("math_verify", "math-verify", "math")
    gold = str(answer)
    if "$" not in gold and "\\boxed" not in gold:
        gold = f"${gold}$"  # parse the reference as LaTeX: \sqrt{2}, (1,2), \frac12 ...
    parsed_gold = math_verify.parse(gold, parsing_timeout=None)
    if not parsed_gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    prediction = math_verify.parse(completion, parsing_timeout=None)
    return bool(math_verify.verify(parsed_gold, prediction, timeout_seconds=None))


@register_env("math")
class MathEnv(_FileEnv):
    """Math problems graded by math-verify on the completion's final (preferably boxed) answer."""

    system_prompt = "Solve the problem step by step. Put your final answer within \\boxed{}."
    success_reward = "correct"

    @reward
    def correct(self, completion: str, answer: Any) -> float:
        return float(math_equal(completion, answer))

    @reward(weight=0.0)
    def format(self, completion: str) -> float:
        return last_boxed(reward=1.0)(completion).reward
