"""A conversation with the exact token ids the model saw, built turn by turn.

The env renders prompts with the policy tokenizer's chat template and samples from token ids, so
earlier assistant turns keep the ids that were sampled (never re-tokenized text). New user/tool
messages are rendered incrementally: `render(messages[:k+1])` minus `render(messages[:k])`, plus
the generation prompt. That only works for a template that is prefix stable (rendering a longer
conversation only appends tokens); anything else raises `ChatTemplateError` naming the tokenizer.
Tools (OpenAI function schemas) are passed to the template with every rendering, as the model's
chat template expects them.

Token ownership, so that concatenating all turns gives the sequence the model saw:
- a non-assistant turn owns its rendering plus the generation prompt that follows it (prompt,
  never sampled), and any closing scaffold (e.g. `<|end|>`) the template puts after the previous
  assistant's content that the model did not sample itself (a turn cut at `max_tokens` or at a
  stop string);
- an assistant turn owns exactly the sampled ids.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_rl.envs._sampling import Completion
from marin_rl.types import InferenceMetadata, Turn

Message = dict[str, Any]
"""A chat message: `{"role": "system" | "user" | "assistant" | "tool", "content": str, ...}`."""

_PROMPT_ROLES = ("system", "user", "tool")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered incrementally."""


def tokenizer_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def render(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The chat template's token ids for `messages` (and `tools`, OpenAI function schemas)."""
    if not messages and not add_generation_prompt:
        return []  # many templates index messages[0]
    try:
        key = json.dumps([list(messages), list(tools) if tools else None])  # key order kept: templates show it
    except TypeError:  # not plain JSON (rare): render without the cache
        return _apply_template(tokenizer, list(messages), list(tools) if tools else None, add_generation_prompt)
    return list(_render_cached(tokenizer, key, add_generation_prompt))


@functools.lru_cache(maxsize=4096)
def _render_cached(tokenizer: Any, key: str, add_generation_prompt: bool) -> tuple[int, ...]:
    # Templates are slow (Jinja, then the tokenizer), and the same prompts recur: every group of a
    # problem, every epoch over a dataset.
    messages, tools = json.loads(key)
    return tuple(_apply_template(tokenizer, messages, tools, add_generation_prompt))


def _apply_template(tokenizer: Any, messages: list, tools: list | None, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt)
    return [int(t) for t in ids]


def _check_message(message: Mapping[str, Any], where: str, roles: tuple[str, ...]) -> Message:
    role = message.get("role")
    if role not in roles:
        raise ValueError(f"{where}: role must be one of {roles}, got {role!r}")
    if not isinstance(message.get("content"), str):
        raise ValueError(f"{where}: content must be a string, got {type(message.get('content')).__name__}")
    return dict(message)


def _copied(value: Any) -> Any:
    # Message fields are mostly strings: deepcopy's bookkeeping for them cost more than sampling here.
    return value if isinstance(value, (str, int, float, bool, type(None))) else copy.deepcopy(value)


@dataclass
class _Segment:
    role: str
    content: str
    token_ids: list[int]
    logprobs: np.ndarray | None = None
    metadata: InferenceMetadata | None = None
    closing_len: int = 0
    """Leading ids that close the previous assistant turn (template scaffold, not sampled)."""
    generation_len: int = 0
    """Trailing ids that are the generation prompt for the next assistant turn."""
    timestamp: float = 0.0


class Transcript:
    """A conversation and its token ids; ends with a generation prompt whenever it awaits the model.

    `tools`: OpenAI function schemas the template renders (into the system or first user message).
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ):
        if not messages:
            raise ValueError("a conversation needs at least one prompt message")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self._messages: list[Message] = []
        self._segments: list[_Segment] = []
        checked = [_check_message(m, f"prompt message {i}", _PROMPT_ROLES) for i, m in enumerate(messages)]
        self._append_prompt(checked, closing=[])

    # --- reading ------------------------------------------------------------------------------

    @property
    def messages(self) -> list[Message]:
        """The conversation so far (a copy; assistant content is the decoded sampled ids)."""
        return [{key: _copied(value) for key, value in message.items()} for message in self._messages]

    @property
    def token_ids(self) -> list[int]:
        """Every id so far, in order: the next prompt when the last turn is not the assistant's."""
        return [t for seg in self._segments for t in seg.token_ids]

    @property
    def num_assistant_turns(self) -> int:
        return sum(seg.role == "assistant" for seg in self._segments)

    def turns(self) -> tuple[Turn, ...]:
        return tuple(
            Turn(
                role=seg.role,
                content=seg.content,
                token_ids=np.asarray(seg.token_ids, np.int32),
                logprobs=seg.logprobs,
                inference_metadata=seg.metadata,
                timestamp=seg.timestamp,
            )
            for seg in self._segments
        )

    def message_spans(self) -> list[tuple[int, int]]:
        """Per message, its own ids' `[start, end)` in `token_ids` (generation prompts excluded)."""
        spans, offset = [], 0
        for seg in self._segments:
            spans.append((offset, offset + len(seg.token_ids) - seg.generation_len))
            offset += len(seg.token_ids)
        return spans

    def copy(self) -> Transcript:
        other = copy.copy(self)
        other._messages = list(self._messages)  # the messages themselves are never changed in place
        other._segments = [dataclasses.replace(seg, token_ids=list(seg.token_ids)) for seg in self._segments]
        return other

    # --- growing ------------------------------------------------------------------------------

    def add_completion(self, completion: Completion) -> str:
        """Append a sampled assistant turn; returns its text (the sampled ids, decoded)."""
        if self._segments[-1].role == "assistant":
            raise ValueError("two assistant turns in a row: add the user/tool messages in between first")
        ids = [int(t) for t in completion.token_ids]
        content = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._messages.append({"role": "assistant", "content": content})
        self._segments.append(
            _Segment(
                "assistant", content, ids, completion.logprobs, completion.metadata, timestamp=time.time()
            )
        )
        return content

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Append user/tool/system messages after an assistant turn, rendered incrementally."""
        if not messages:
            raise ValueError("add_messages needs at least one message")
        if self._segments[-1].role != "assistant":
            raise ValueError("add_messages follows an assistant turn")
        checked = [_check_message(m, f"message {i}", _PROMPT_ROLES) for i, m in enumerate(messages)]
        self._append_prompt(checked, closing=self._closing_scaffold())

    def _closing_scaffold(self) -> list[int]:
        """Template ids after the last assistant turn's content that the model did not sample."""
        before = self._render(self._messages[:-1], add_generation_prompt=True)
        with_reply = self._render(self._messages)
        if with_reply[: len(before)] != before:
            raise self._error("an assistant turn is not rendered after the generation prompt")
        rendered = with_reply[len(before) :]
        sampled = self._segments[-1].token_ids
        if rendered[: len(sampled)] == sampled:
            return rendered[len(sampled) :]
        # The sampled ids are not how the template renders their text (non-canonical sampling, or a
        # template that trims whitespace): find its closing scaffold after the content instead.
        text = self._messages[-1]["content"]
        for candidate in dict.fromkeys((text, text.strip())):
            content = self.tokenizer.encode(candidate, add_special_tokens=False)
            if rendered[: len(content)] == content:
                break
        else:
            raise self._error("an earlier assistant turn is re-rendered differently from its content")
        closing = rendered[len(content) :]
        # The model may have sampled the start of the scaffold itself (EOS): add only the rest.
        done = max((j for j in range(1, len(closing) + 1) if sampled[-j:] == closing[:j]), default=0)
        return closing[done:]

    def _append_prompt(self, messages: list[Message], closing: list[int]) -> None:
        previous = self._render(self._messages)
        final = self._render([*self._messages, *messages])
        if final[: len(previous)] != previous:
            raise self._error(f"adding a {messages[0]['role']!r} message changes the earlier tokens")
        start, lead = len(previous), closing
        for i, message in enumerate(messages):
            self._messages.append(message)
            end = len(final) if i + 1 == len(messages) else self._boundary(final, start)
            ids = final[start:end]
            self._segments.append(
                _Segment(message["role"], message["content"], [*lead, *ids], closing_len=len(lead), timestamp=time.time())
            )
            start, lead = end, []
        prompt = self._render(self._messages, add_generation_prompt=True)
        if prompt[: len(final)] != final:
            raise self._error("the generation prompt changes the earlier tokens")
        generation = prompt[len(final) :]
        last = self._segments[-1]
        last.token_ids.extend(generation)
        last.generation_len = len(generation)

    def _boundary(self, final: list[int], start: int) -> int:
        """Where the messages so far end in `final`, the rendering of the whole batch.

        A template may render consecutive messages as one block (Qwen wraps parallel tool results
        in one user turn) or refuse a partial conversation (Llama 3 with tools needs the first user
        message): then there is no boundary here, and the block's ids go to its last message.
        """
        try:
            current = self._render(self._messages)
        except Exception:  # noqa: BLE001 - any template error means the same: no boundary here
            return start
        return len(current) if final[: len(current)] == current else start

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
        return render(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=self.tools)

    def _error(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(
            f"chat template of tokenizer {tokenizer_name(self.tokenizer)!r} is not prefix stable: {what}. "
            "Multi-turn rollouts render new messages incrementally after the sampled ids; use a tokenizer "
            "whose template only appends tokens as the conversation grows"
        )
