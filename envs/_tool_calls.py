"""Tool calls in a sampled assistant turn, parsed the way the model family's chat template writes them.

- `hermes` (Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call, with `<tool_call>` / `</tool_call>` single tokens of the vocabulary.
- `llama3` (Llama 3.x): the whole reply is one JSON object `{"name": ..., "parameters": {...}}`.

The parsing itself is the `renderers` package's (the parsers verifiers' own training client uses), so
a call counts as made exactly when it would under verifiers with vLLM-style parsing. Only the parse
result is used: the turn keeps the ids the model sampled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from marin_rl.envs._chat import tokenizer_name

TOOL_CALL_FORMATS = ("hermes", "llama3")

_HERMES_TOKENS = ("<tool_call>", "</tool_call>")
_LLAMA3_TOKENS = ("<|start_header_id|>", "<|eot_id|>")
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object (as in the OpenAI wire format)."""


@dataclass(frozen=True)
class ParsedReply:
    content: str
    """The reply without its tool-call markup (and without reasoning, when split off)."""
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    malformed_calls: int
    """Tool-call attempts that did not parse (bad JSON, no name, unclosed block)."""


def _token_id(tokenizer: Any, token: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(token)
    return None if tid is None or tid == tokenizer.unk_token_id else int(tid)


def detect_tool_call_format(tokenizer: Any) -> str | None:
    """The tool-call format of the tokenizer's model family, from its special tokens; None if unknown."""
    if all(_token_id(tokenizer, t) is not None for t in _HERMES_TOKENS):
        return "hermes"
    if all(_token_id(tokenizer, t) is not None for t in _LLAMA3_TOKENS):
        return "llama3"
    return None


def resolve_tool_call_format(tokenizer: Any, name: str) -> str | None:
    """`auto` detects the format from the tokenizer; otherwise `name` must be a known format."""
    if name == "auto":
        return detect_tool_call_format(tokenizer)
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool_call_format must be 'auto' or one of {TOOL_CALL_FORMATS}, got {name!r}")
    missing = [t for t in (_HERMES_TOKENS if name == "hermes" else _LLAMA3_TOKENS) if _token_id(tokenizer, t) is None]
    if missing:
        raise ValueError(
            f"tool_call_format {name!r}: tokenizer {tokenizer_name(tokenizer)!r} has no token(s) {missing}"
        )
    return name


def parse_tool_calls(tokenizer: Any, token_ids: list[int], fmt: str) -> ParsedReply:
    """Split a sampled reply into content and tool calls, in tool-call format `fmt`."""
    from renderers import ToolCallParseStatus
    from renderers.parsing import parse_llama_3, parse_qwen3

    stop_ids = {t for t in (_token_id(tokenizer, s) for s in _STOP_TOKENS) if t is not None}
    if tokenizer.eos_token_id is not None:
        stop_ids.add(int(tokenizer.eos_token_id))
    if fmt == "hermes":
        parsed = parse_qwen3(
            tokenizer,
            list(token_ids),
            stop_ids=stop_ids,
            tool_call_id=_token_id(tokenizer, "<tool_call>"),
            tool_call_end_id=_token_id(tokenizer, "</tool_call>"),
            reasoning_end_id=_token_id(tokenizer, "</think>"),
        )
    elif fmt == "llama3":
        parsed = parse_llama_3(tokenizer, list(token_ids), stop_ids=stop_ids)
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {TOOL_CALL_FORMATS}")
    calls = tuple(
        ToolCall(c.name, c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments or {}))
        for c in parsed.tool_calls
        if c.status == ToolCallParseStatus.OK and c.name
    )
    return ParsedReply(parsed.content, parsed.reasoning_content, calls, len(parsed.tool_calls) - len(calls))
