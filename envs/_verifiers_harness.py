"""The harness marin-rl plays verifiers agents with: verifiers' `null` chat loop, run in-process.

A verifiers harness is the agent's program; it reaches the model only through the rollout's
interception endpoint, and the task's tool servers through MCP. verifiers' own `null` harness (a chat
loop with the task's MCP tools) is a script it installs and runs with `uv`; this is the same loop as a
coroutine in our process (no `uv`, no network), so every model call still goes through the
interception endpoint and verifiers' limits, stops, hooks and trace see each turn.

verifiers loads harnesses by top-level module name (`--env.agent.harness.id`), so this module is
also importable as `HARNESS_ID`.
"""

from __future__ import annotations

import functools
import json
import ssl
import sys
from contextlib import AsyncExitStack
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI, omit
from verifiers.v1.dialects.chat import message_to_wire

from marin_rl.envs._verifiers_endpoint import ROLLOUT_ENDS

__all__ = ["ChatHarness"]

HARNESS_ID = "marin_rl_chat"

sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])

# One SSL context for every rollout's client: building one loads the CA bundle (~40 ms a rollout).
_ssl_context = functools.cache(ssl.create_default_context)


def initial_messages(data: vf.TaskData) -> list[dict[str, Any]]:
    """The chat request's messages for a task: its system prompt as a system message
    (`APPENDS_SYSTEM_PROMPT`, as `Harness.resolve_prompt` gives it), then its prompt."""
    system, prompt = data.system_prompt, data.prompt
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages.extend(message_to_wire(m) for m in prompt or [])
    return messages


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """Chat with the model; run each tool call it makes on the task's MCP servers; stop at a reply
    without tool calls (or one cut at `max_tokens`)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        messages = initial_messages(data)
        async with AsyncExitStack() as stack:
            tools, servers = await self._connect_tools(stack, mcp_urls)
            http = httpx.AsyncClient(verify=_ssl_context(), timeout=None)
            client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http))
            while True:
                try:
                    completion = await client.chat.completions.create(
                        model=ctx.model, messages=messages, tools=tools or omit
                    )
                except APIStatusError as e:
                    # The endpoint's end of the rollout (max_turns, no room left) ends the conversation
                    # cleanly, as verifiers' chat loop ends on context overflow; a turn verifiers
                    # refused (a limit, a @stop) is on the trace.
                    return vf.ProgramResult(exit_code=0 if ROLLOUT_ENDS in e.message else 1, stdout="", stderr=e.message)
                choice = completion.choices[0]
                messages.append(choice.message.model_dump(exclude_none=True))
                if not choice.message.tool_calls or choice.finish_reason == "length":
                    return vf.ProgramResult(exit_code=0, stdout="", stderr="")
                for call in choice.message.tool_calls:
                    content = await self._call_tool(servers, call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content})

    async def _connect_tools(self, stack: AsyncExitStack, mcp_urls: dict[str, str]) -> tuple[list[dict], dict]:
        """OpenAI tool schemas for every MCP tool, named `{server}_{tool}` as verifiers' chat loop names them."""
        from mcp import Client

        tools, servers = [], {}
        disabled = set(self.config.disabled_tools or ())
        for server, url in mcp_urls.items():
            client = await stack.enter_async_context(Client(url, read_timeout_seconds=self.config.tool_timeout))
            for tool in (await client.list_tools()).tools:
                name = f"{server}_{tool.name}" if server else tool.name
                if name in disabled:
                    continue
                servers[name] = (client, tool.name)
                function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
                tools.append({"type": "function", "function": function})
        return tools, servers

    @staticmethod
    async def _call_tool(servers: dict, name: str, arguments: str) -> str:
        """The tool's text result; a call the model got wrong gets an error message back, as in verifiers."""
        if name not in servers:
            return f"error: unknown tool {name!r}"
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            return f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
        if not isinstance(args, dict):
            return f"error: tool arguments must be a JSON object, got {type(args).__name__}; resend as an object"
        client, tool = servers[name]
        result = await client.call_tool(tool, args)
        return "\n".join(block.text if block.type == "text" else str(block) for block in result.content)
