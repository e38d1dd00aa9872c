import asyncio

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from openai import AsyncOpenAI
from openai.types import Completion as OpenAICompletion

from marin_rl.envs import OpenAISampler, SamplerError, SamplingParams, ScriptedSampler
from marin_rl.envs._sampling import parse_completions


def _response(choices, **extra):
    body = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": choices, **extra}
    return OpenAICompletion.model_validate(body)


def _choice(index, ids, logprobs, finish="stop", with_ids=True, as_token_strings=True):
    choice = {
        "index": index,
        "text": "",
        "finish_reason": finish,
        "logprobs": {
            "tokens": [f"token_id:{t}" if as_token_strings else "x" for t in ids],
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": None,
        },
    }
    if with_ids:
        choice["token_ids"] = ids
    return choice


def _parse(response, prompt=(1, 2), n=2, default_version=None):
    return parse_completions(
        response,
        list(prompt),
        n,
        server_id="srv",
        model="m",
        default_policy_version=default_version,
        latency_s=0.25,
        sampling_params={"temperature": 1.0},
    )


def test_parse_completions_reads_ids_logprobs_and_metadata_in_choice_order():
    response = _response(
        [_choice(1, [7, 8], [-0.1, -0.2], "length"), _choice(0, [9], [-0.3])], policy_version=5, prompt_token_ids=[1, 2]
    )
    first, second = _parse(response)
    assert first.token_ids.tolist() == [9] and second.token_ids.tolist() == [7, 8]
    np.testing.assert_allclose(second.logprobs, [-0.1, -0.2])
    assert second.metadata.policy_version == 5 and second.finish_reason == "length"
    assert first.metadata.server_id == "srv" and first.metadata.latency_s == 0.25
    assert first.metadata.sampling_params == {"temperature": 1.0}


def test_token_ids_fall_back_to_token_id_strings_in_logprobs():
    response = _response([_choice(0, [11, 12, 13], [-1.0, -2.0, -3.0], with_ids=False)], policy_version=0)
    [completion] = _parse(response, n=1)
    assert completion.token_ids.tolist() == [11, 12, 13]


def test_unparseable_logprob_tokens_without_token_ids_is_an_error():
    response = _response([_choice(0, [11], [-1.0], with_ids=False, as_token_strings=False)], policy_version=0)
    with pytest.raises(SamplerError, match="token_id:N"):
        _parse(response, n=1)


def test_missing_policy_version_is_an_error_unless_given():
    response = _response([_choice(0, [3], [-0.5])])
    with pytest.raises(SamplerError, match="policy_version"):
        _parse(response, n=1)
    [completion] = _parse(response, n=1, default_version=7)
    assert completion.metadata.policy_version == 7


def test_reported_policy_version_wins_over_the_default():
    response = _response([_choice(0, [3], [-0.5])], policy_version=2)
    assert _parse(response, n=1, default_version=7)[0].metadata.policy_version == 2


def test_retokenized_prompt_is_an_error():
    response = _response([_choice(0, [3], [-0.5])], policy_version=0, prompt_token_ids=[1, 2, 3])
    with pytest.raises(SamplerError, match="re-tokenized"):
        _parse(response, n=1)


def test_wrong_number_of_choices_and_unknown_finish_reason_are_errors():
    with pytest.raises(SamplerError, match="n=2"):
        _parse(_response([_choice(0, [3], [-0.5])], policy_version=0), n=2)
    with pytest.raises(SamplerError, match="finish_reason"):
        _parse(_response([_choice(0, [3], [-0.5], finish="content_filter")], policy_version=0), n=1)


def test_sampling_params_merge_keeps_env_stop_strings():
    env = SamplingParams(max_tokens=64, stop=("</calc>",))
    run = SamplingParams(temperature=0.7, max_tokens=128, stop=["\n\n"])
    merged = env.merged(run)
    assert merged.temperature == 0.7 and merged.max_tokens == 128
    assert merged.stop == ("\n\n", "</calc>")
    assert env.merged(None) is env
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_scripted_sampler_stops_like_a_server(tokenizer):
    sampler = ScriptedSampler(tokenizer, ["<calc>1+1</calc> and more", "abcdef", "hi"])
    params = SamplingParams(max_tokens=4, stop=("</calc>",))
    long_params = SamplingParams(max_tokens=100, stop=("</calc>",))
    prompt = tokenizer.encode("x", add_special_tokens=False)
    [calc] = asyncio.run(sampler.sample(prompt, 1, long_params))
    assert tokenizer.decode(calc.token_ids) == "<calc>1+1</calc>" and calc.finish_reason == "stop"
    [cut] = asyncio.run(sampler.sample(prompt, 1, params))
    assert tokenizer.decode(cut.token_ids) == "abcd" and cut.finish_reason == "length"
    [done] = asyncio.run(sampler.sample(prompt, 1, params))
    assert done.token_ids[-1] == tokenizer.eos_token_id and done.finish_reason == "stop"
    assert sampler.prompts == [prompt] * 3


def _fake_vllm_app(version: int | None):
    """An OpenAI-compatible /v1/completions with vLLM's token-id extensions; samples ids 7, 8, 9, ..."""
    app = FastAPI()
    app.state.requests = []

    @app.post("/v1/completions")
    async def completions(body: dict):
        app.state.requests.append(body)
        ids = list(range(7, 7 + body["max_tokens"]))
        choices = [
            {
                "index": i,
                "text": "",
                "finish_reason": "length",
                "token_ids": ids,
                "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids)},
            }
            for i in range(body["n"])
        ]
        response = {"id": "x", "object": "text_completion", "created": 0, "model": body["model"], "choices": choices}
        response["prompt_token_ids"] = body["prompt"]
        if version is not None:
            response["policy_version"] = version
        return response

    return app


def _client(app):
    return AsyncOpenAI(base_url="http://fake/v1", api_key="x", http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))


def test_openai_sampler_sends_token_prompt_and_vllm_extensions():
    app = _fake_vllm_app(version=3)
    sampler = OpenAISampler(_client(app), "policy", server_id="fake")
    params = SamplingParams(temperature=0.5, max_tokens=3, stop=("</calc>",), seed=11)
    completions = asyncio.run(sampler.sample([4, 5, 6], 2, params))
    assert [c.token_ids.tolist() for c in completions] == [[7, 8, 9]] * 2
    assert all(c.metadata.policy_version == 3 and c.metadata.server_id == "fake" for c in completions)
    [request] = app.state.requests
    assert request["prompt"] == [4, 5, 6] and request["n"] == 2 and request["logprobs"] == 1
    assert request["temperature"] == 0.5 and request["max_tokens"] == 3 and request["seed"] == 11
    assert request["stop"] == ["</calc>"]
    assert request["return_token_ids"] is True and request["return_tokens_as_token_ids"] is True


def test_openai_sampler_for_plain_vllm_needs_an_explicit_version():
    app = _fake_vllm_app(version=None)
    with pytest.raises(SamplerError, match="policy_version"):
        asyncio.run(OpenAISampler(_client(app), "policy").sample([4], 1, SamplingParams(max_tokens=1)))
    [completion] = asyncio.run(
        OpenAISampler(_client(app), "policy", policy_version=9).sample([4], 1, SamplingParams(max_tokens=1))
    )
    assert completion.metadata.policy_version == 9
