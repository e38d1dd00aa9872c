"""Answer extractors that compose, after Ludic's parser composition (seeds/picorl-architecture.md).

A parser maps text to a `ParseResult`: the extracted value (None when parsing failed) and a
reward for the format (`reward` on success, `penalty` on failure). `compose` runs parsers as a
pipeline, each on the previous value: it stops at the first failure and adds up the rewards
along the way, so a format reward falls out of the same code that extracts the answer.
`first_of` tries alternatives and keeps the first success.

    parse = compose(xml_tag("answer", reward=0.1), last_number())
    parse("... <answer>x = 42</answer>")  # ParseResult(value="42", reward=0.1)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ParseResult:
    value: str | None
    """The extracted text; None when the parser failed."""
    reward: float = 0.0
    """Format reward accumulated by the parsers that ran."""

    @property
    def ok(self) -> bool:
        return self.value is not None


Parser = Callable[[str], ParseResult]


def _result(value: str | None, reward: float, penalty: float) -> ParseResult:
    return ParseResult(value, reward if value is not None else penalty)


def xml_tag(tag: str = "answer", *, reward: float = 0.0, penalty: float = 0.0, strip: bool = True) -> Parser:
    """The content of the last `<tag>...</tag>`."""
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)

    def parse(text: str) -> ParseResult:
        matches = pattern.findall(text)
        value = matches[-1] if matches else None
        if value is not None and strip:
            value = value.strip()
        return _result(value, reward, penalty)

    return parse


def last_boxed(*, reward: float = 0.0, penalty: float = 0.0) -> Parser:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced."""

    def parse(text: str) -> ParseResult:
        return _result(_last_boxed(text), reward, penalty)

    return parse


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1 : i].strip()
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def last_number(*, reward: float = 0.0, penalty: float = 0.0) -> Parser:
    """The last number in the text, thousands separators removed (`1,000` -> `1000`)."""

    def parse(text: str) -> ParseResult:
        matches = _NUMBER.findall(text)
        value = matches[-1].replace(",", "") if matches else None
        return _result(value, reward, penalty)

    return parse


def identity(text: str) -> ParseResult:
    """The whole text, stripped; never fails."""
    return ParseResult(text.strip())


def compose(*parsers: Parser) -> Parser:
    """Run `parsers` in turn, each on the previous value; stop at the first failure; add rewards."""
    if not parsers:
        raise ValueError("compose needs at least one parser")

    def parse(text: str) -> ParseResult:
        value, reward = text, 0.0
        for parser in parsers:
            result = parser(value)
            reward += result.reward
            if result.value is None:
                return ParseResult(None, reward)
            value = result.value
        return ParseResult(value, reward)

    return parse


def first_of(*parsers: Parser) -> Parser:
    """The first parser that succeeds (with its reward); the last failure if none does."""
    if not parsers:
        raise ValueError("first_of needs at least one parser")

    def parse(text: str) -> ParseResult:
        for parser in parsers:
            result = parser(text)
            if result.ok:
                return result
        return result

    return parse


PARSERS: dict[str, Callable[[], Parser]] = {
    "answer_tag": lambda: xml_tag("answer", reward=1.0),
    "boxed": lambda: last_boxed(reward=1.0),
    "last_number": lambda: last_number(reward=1.0),
    "none": lambda: identity,
}
"""Parsers a config can name (`parser: boxed`); each gives reward 1 when it finds an answer."""


def get_parser(parser: str | Parser) -> Parser:
    """A parser by config name, or the parser itself."""
    if callable(parser):
        return parser
    if parser not in PARSERS:
        raise ValueError(f"unknown parser {parser!r}; known parsers: {sorted(PARSERS)}")
    return PARSERS[parser]()
