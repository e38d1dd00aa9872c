"""A multi-turn tool env: the model calls a calculator with `<calc>expr</calc>`, results come back as
tool messages, and the final answer goes in `<answer></answer>`."""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from marin_rl.envs._chat import Message
from marin_rl.envs._env import Env, register_env, reward
from marin_rl.envs._parsers import xml_tag
from marin_rl.envs._problems import Problem, load_problems
from marin_rl.envs._sampling import SamplingParams

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_BITS = 4096


def calculate(expression: str) -> str:
    """Evaluate arithmetic (numbers, + - * / // % **, parentheses) safely; errors come back as text."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and left.bit_length() * right > MAX_BITS:
            raise ValueError("result too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")


_CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)


def find_call(text: str) -> str | None:
    """The expression of the last `<calc>` call, unless the text already gives an answer.

    The closing tag may be missing: servers differ on whether a stop string stays in the output.
    """
    if "<answer>" in text:
        return None
    calls = _CALL.findall(text)
    return calls[-1].strip() if calls else None


def arithmetic_problems(seed: int, count: int, prefix: str) -> list[Problem]:
    """`count` random problems like `What is 347 * 29 - 1183?` with exact integer answers."""
    rng = random.Random(seed)
    problems = []
    for i in range(count):
        a, b, c = rng.randint(10, 999), rng.randint(2, 99), rng.randint(10, 9999)
        op = rng.choice(["+", "-"])
        expression = f"{a} * {b} {op} {c}"
        problems.append(Problem(id=f"{prefix}:{i}", prompt=f"What is {expression}?", answer=str(calculate(expression))))
    return problems


@register_env("calculator")
class CalculatorEnv(Env):
    """Arithmetic with a calculator tool. Problems from a file spec, or generated from `seed`."""

    max_turns = 4
    sampling = SamplingParams(stop=("</calc>",))
    system_prompt = (
        "You have a calculator. To use it, write <calc>expression</calc> and stop; the result comes back "
        "in a tool message. Expressions may use numbers, + - * / // % ** and parentheses. "
        "Give the final answer as <answer>number</answer>."
    )
    success_reward = "correct"

    def __init__(
        self,
        data: str | None = None,
        eval_data: str | None = None,
        seed: int = 0,
        num_problems: int = 10_000,
        num_eval_problems: int = 100,
    ):
        self._problems = load_problems(data) if data else arithmetic_problems(seed, num_problems, f"arith{seed}")
        self._eval = (
            load_problems(eval_data)
            if eval_data
            else arithmetic_problems(seed + 1_000_003, num_eval_problems, f"arith{seed + 1_000_003}")
        )
        self._parse = xml_tag("answer", reward=1.0)

    def problems(self) -> list[Problem]:
        return self._problems

    def eval_problems(self) -> list[Problem]:
        return self._eval

    async def interact(self, messages: list[Message], problem: Problem, state: dict[str, Any]) -> list[Message] | None:
        expression = find_call(messages[-1]["content"])
        if expression is None:
            return None
        state["calls"] = state.get("calls", 0) + 1
        return [{"role": "tool", "content": calculate(expression)}]

    @reward
    def correct(self, completion: str, answer: Any) -> float:
        value = self._parse(completion).value
        try:
            return float(value is not None and abs(float(value) - float(answer)) < 1e-6)
        except ValueError:
            return 0.0  # not a number

    @reward(weight=0.0)
    def format(self, completion: str) -> float:
        return self._parse(completion).reward

    @reward(weight=0.0)
    def used_calculator(self, state: dict[str, Any]) -> float:
        return float(state.get("calls", 0) > 0)
