"""The chat endpoint verifiers rollouts sample through: sessions that only grow, its guard and routing."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("aiohttp")

from marin_rl.envs import ScriptedSampler, SamplingParams  # noqa: E402
from marin_rl.envs._runner import RolloutSettings  # noqa: E402
from marin_rl.envs._verifiers_endpoint import SESSION_HEADER, TOKEN_HEADER, ChatEndpoint, ChatSessions, RequestError  # noqa: E402

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def _sessions(tokenizer, texts, tool_call_format=None, **settings):
    defaults = dict(sampling=SamplingParams(max_tokens=8), reward_weights={}, verifier_timeout_s=1.0, max_turns=4)
    settings = RolloutSettings(**{**defaults, **settings})
    return ChatSessions(tokenizer, ScriptedSampler(tokenizer, texts), settings, tool_call_format)


def test_a_session_grows_turn_by_turn_and_refuses_a_rewritten_history(tokenizer):
    sessions = _sessions(tokenizer, ["4", "yes"], tool_call_format="hermes")  # the format is not used: no tools

    async def run():
        first = await sessions.complete("s", {"messages": PROMPT})
        reply = first["choices"][0]["message"]
        assert reply == {"role": "assistant", "content": "4"} and first["usage"]["completion_tokens"] == 2
        follow_up = [*PROMPT, reply, {"role": "user", "content": "sure?"}]
        second = await sessions.complete("s", {"messages": follow_up})
        assert second["choices"][0]["message"]["content"] == "yes"
        rewritten = [PROMPT[0], {"role": "user", "content": "3+3?"}, reply, {"role": "user", "content": "sure?"}]
        with pytest.raises(RequestError, match="earlier messages of the conversation were rewritten"):
            await sessions.complete("s", {"messages": rewritten})
        with pytest.raises(RequestError, match="tools changed"):
            await sessions.complete("s", {"messages": follow_up, "tools": [{"type": "function", "function": {"name": "f"}}]})

    asyncio.run(run())
    transcript = sessions.sessions["s"].transcript
    assert [m["content"] for m in transcript.messages] == ["Be brief.", "2+2?", "4", "sure?", "yes"]


def test_max_turns_ends_the_session_on_its_last_turn(tokenizer):
    sessions = _sessions(tokenizer, ["4"], max_turns=1)

    async def run():
        first = await sessions.complete("s", {"messages": PROMPT})
        with pytest.raises(RequestError, match="rollout ends here: max_turns=1"):
            await sessions.complete("s", {"messages": [*PROMPT, first["choices"][0]["message"], {"role": "user", "content": "?"}]})

    asyncio.run(run())
    assert sessions.sessions["s"].stop_reason == "max_turns" and sessions.sessions["s"].transcript.num_assistant_turns == 1


def test_the_http_endpoint_wants_its_token_and_routes_each_rollout_to_its_group(tokenizer):
    async def run():
        async with ChatEndpoint() as endpoint:
            assert endpoint.base_url.startswith("http://127.0.0.1:")
            url, body = f"{endpoint.base_url}/chat/completions", {"messages": PROMPT}
            token = {TOKEN_HEADER: endpoint.token}
            async with httpx.AsyncClient() as client, endpoint.group(_sessions(tokenizer, ["4"])) as on_trace:
                on_trace(SimpleNamespace(id="trace-1"))  # verifiers calls it as each rollout's trace is minted
                unauthorized = await client.post(url, json=body, headers={SESSION_HEADER: "trace-1"})
                unknown = await client.post(url, json=body, headers={**token, SESSION_HEADER: "trace-2"})
                ok = await client.post(url, json=body, headers={**token, SESSION_HEADER: "trace-1"})
            async with httpx.AsyncClient() as client:
                ended = await client.post(url, json=body, headers={**token, SESSION_HEADER: "trace-1"})
        return unauthorized, unknown, ok, ended

    unauthorized, unknown, ok, ended = asyncio.run(run())
    assert unauthorized.status_code == 401
    assert unknown.status_code == 400 and "unknown rollout" in unknown.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "4"
    assert ended.status_code == 400  # the group is over: its rollouts are no longer routed
