"""The embedded `PolicyServer` with the real engine, a tiny random Llama and the char tokenizer.

One server is shared by the module (its first request compiles the engine's kernels, ~20-30 s on a
2-core CPU), hence the `slow` mark. The HTTP layer alone is tested quickly in test_api.py.
"""

import asyncio
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from levanter.layers.attention import AttentionMask

from marin_rl.learner import ModelConfig, build_model
from marin_rl.server import InferenceServerConfig, PolicyServer
from marin_rl.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

TOKENIZER = load_tokenizer("char")
EOS = TOKENIZER.eos_token_id
SEQ_LEN = 128
CONFIG = InferenceServerConfig(max_seqs=4, max_seq_len=SEQ_LEN, page_size=16, decode_steps=8)
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def tiny_llama(seed: int):
    config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=SEQ_LEN)
    return build_model(config, len(TOKENIZER), key=jax.random.PRNGKey(seed))


@eqx.filter_jit
def _log_softmax_logits(model, tokens):
    logits = model(hax.named(tokens, "position"), AttentionMask.causal()).array
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def log_probs(model, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] next-token log-probs from a plain forward pass (padded to SEQ_LEN: one compile)."""
    padded = np.zeros(SEQ_LEN, np.int32)
    padded[: len(ids)] = ids
    return np.asarray(_log_softmax_logits(model, jnp.asarray(padded)))[: len(ids)]


def greedy_decode(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Argmax of the model's logits, step by step, until EOS or max_tokens."""
    ids = list(prompt)
    while len(ids) - len(prompt) < max_tokens:
        ids.append(int(np.argmax(log_probs(model, ids)[-1])))
        if ids[-1] == EOS:
            break
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def model_a():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def server(model_a):
    with PolicyServer(CONFIG, model_a, TOKENIZER, policy_version=0) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        yield client


def chat_prompt() -> list[int]:
    return TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True)


def test_chat_response_is_consistent_with_the_char_tokenizer(client, server):
    r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=24, n=2, temperature=1.0, seed=1, logprobs=True)
    assert r.prompt_token_ids == chat_prompt()
    assert r.policy_version == server.policy_version
    assert len(r.choices) == 2 and r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    for c in r.choices:
        assert TOKENIZER.decode(c.token_ids, skip_special_tokens=True) == c.message.content
        assert len(c.logprobs.content) == len(c.token_ids) > 0
        assert all(lp.logprob <= 0 for lp in c.logprobs.content)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and c.stop_reason is None
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 24


def test_greedy_output_is_deterministic_and_equals_a_direct_argmax_decode(client, model_a):
    expected = greedy_decode(model_a, chat_prompt(), 16)
    for _ in range(2):
        r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16, temperature=0)
        assert r.choices[0].token_ids == expected


def test_sampled_logprobs_are_the_models_at_the_sampling_temperature(client, model_a):
    prompt = TOKENIZER.encode("abc", add_special_tokens=False)
    for temperature in (1.0, 0.7):
        r = client.completions.create(model="policy", prompt=prompt, max_tokens=12, temperature=temperature, seed=3, logprobs=1, extra_body={"ignore_eos": True})
        sampled = r.choices[0].token_ids
        # log p(sampled[t] | prefix) under softmax(logits / temperature): the behaviour policy.
        logp = log_probs(model_a, prompt + sampled)
        scaled = jax.nn.log_softmax(logp / temperature, axis=-1)
        expected = [float(scaled[len(prompt) - 1 + t, tok]) for t, tok in enumerate(sampled)]
        np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, expected, atol=2e-4)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        r = client.completions.create(model="policy", prompt="hello", max_tokens=10, n=2, temperature=1.0, seed=seed)
        return [c.token_ids for c in r.choices]

    first = sample(11)
    assert sample(11) == first and first[0] != first[1]
    assert sample(2**62) != sample(0)  # all 63 bits of the seed count


def test_prompt_logprobs_equal_a_forward_pass(client, model_a):
    prompt = TOKENIZER.encode("the cat sat", add_special_tokens=False)
    r = client.completions.create(model="policy", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 3})
    entries = r.choices[0].prompt_logprobs
    logp = log_probs(model_a, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for t in range(1, len(prompt)):
        token_entry = entries[t][str(prompt[t])]
        assert token_entry["logprob"] == pytest.approx(float(logp[t - 1, prompt[t]]), abs=1e-4)
        assert token_entry["rank"] == 1 + int(np.sum(logp[t - 1] > logp[t - 1, prompt[t]]))
        top3 = {str(i) for i in np.argsort(-logp[t - 1])[:3]}
        assert top3 <= set(entries[t])


def test_stop_string_and_stop_token_end_the_completion(client):
    base = client.completions.create(model="policy", prompt="hello", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert len(base.text) >= 6  # precondition: the tiny model's greedy text has a few characters
    stop = base.text[5]
    cut = next(k for k in range(1, 21) if stop in TOKENIZER.decode(base.token_ids[:k], skip_special_tokens=True))
    r = client.completions.create(model="policy", prompt="hello", max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (base.text[: base.text.index(stop)], "stop", stop)
    assert c.token_ids == base.token_ids[:cut]
    stop_id = base.token_ids[3]
    r = client.completions.create(model="policy", prompt="hello", max_tokens=20, temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    c = r.choices[0]
    assert c.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1] and c.stop_reason == stop_id


def test_bad_request_is_a_400_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=SEQ_LEN)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="policy", messages=[{"role": "robot", "content": "x"}])
    assert client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2).choices


def test_more_concurrent_requests_than_slots_and_pages_queue_instead_of_failing(server):
    # 10 requests x n=2 = 20 sequences of up to ~40 tokens: 5x the 4 slots; every one must complete.
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
            calls = [
                client.completions.create(model="policy", prompt=f"q{i}", max_tokens=32, n=2, temperature=1.0, extra_body={"ignore_eos": True})
                for i in range(10)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(go())
    assert [len(r.choices) for r in responses] == [2] * 10
    assert all(len(c.token_ids) == 32 and c.finish_reason == "length" for r in responses for c in r.choices)


def test_an_engine_failure_is_a_500_and_the_next_request_is_served(client, server, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("device call failed")

    errors = server.engine.stats.errors
    monkeypatch.setattr(server.engine.core, "_decode", fail)
    with pytest.raises(openai.InternalServerError, match="device call failed"):
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True})
    monkeypatch.undo()
    assert server.engine.stats.errors == errors + 1
    assert len(client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True}).choices[0].token_ids) == 4
    assert server.engine.stats.pages_in_use == 0


def test_swap_weights_serves_the_new_model_without_recompiling(client, server, model_a):
    model_b = tiny_llama(1)
    prompt = chat_prompt()
    greedy_a, greedy_b = greedy_decode(model_a, prompt, 16), greedy_decode(model_b, prompt, 16)
    assert greedy_a != greedy_b  # precondition: the two random models disagree
    client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16, temperature=0)  # compile first
    compiled = server.engine.compiled_variants()

    def greedy():
        r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16, temperature=0)
        return r.choices[0].token_ids, r.policy_version

    version = server.policy_version
    first = server.swap_weights(model_b, version + 1)
    assert greedy() == (greedy_b, version + 1)
    second = server.swap_weights(model_a, version + 2)
    assert greedy() == (greedy_a, version + 2)
    assert server.policy_version == version + 2 and server.last_swap == second
    assert server.engine.compiled_variants() == compiled
    print(f"swap seconds: first {first.total_seconds:.4f}, second {second.total_seconds:.4f}")


def test_swap_without_waiting_serves_every_later_request_with_the_new_weights(client, server, model_a):
    model_b = tiny_llama(1)
    greedy_b = greedy_decode(model_b, chat_prompt(), 16)
    version = server.policy_version
    server.swap_weights(model_b, version + 1, wait=False)  # what the colocated broadcaster does
    r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16, temperature=0)
    assert (r.choices[0].token_ids, r.policy_version) == (greedy_b, version + 1)
    server.swap_weights(model_a, version + 2)


def test_swap_weights_refuses_another_architecture(server, model_a):
    wider = ModelConfig(hidden_dim=32, intermediate_dim=96, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=SEQ_LEN)
    version = server.policy_version
    with pytest.raises(ValueError, match="new weights"):
        server.swap_weights(build_model(wider, len(TOKENIZER), key=jax.random.PRNGKey(0)), version + 1)
    assert server.policy_version == version


def test_the_local_sampler_answers_like_the_http_api(server):
    from marin_rl.envs import OpenAISampler, SamplingParams
    from marin_rl.workers._faults import classify

    prompt = TOKENIZER.encode("hello", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_tokens=12, stop=("e",), seed=5)

    async def both():
        remote = OpenAISampler.from_url(server.base_url, "policy", server_id="embedded")
        try:
            return await server.local_sampler().sample(prompt, 3, params), await remote.sample(prompt, 3, params)
        finally:
            await remote.aclose()

    local, http = asyncio.run(both())
    assert [(c.token_ids.tolist(), c.finish_reason, c.metadata.policy_version) for c in local] == [
        (c.token_ids.tolist(), c.finish_reason, c.metadata.policy_version) for c in http
    ]
    for a, b in zip(local, http):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6)
    with pytest.raises(Exception) as error:  # a prompt that fills the context: the same 400, never retried
        asyncio.run(server.local_sampler().sample([5] * SEQ_LEN, 1, params))
    assert getattr(error.value, "status", None) == 400 and classify(error.value) == "permanent"


def test_streaming_sends_tokens_as_they_are_decoded_and_adds_up_to_the_answer(client):
    kwargs = dict(model="policy", prompt="hello", max_tokens=24, n=2, temperature=1.0, seed=5, logprobs=0, extra_body={"ignore_eos": True})
    expected = {c.index: c for c in client.completions.create(**kwargs).choices}
    texts, token_ids, logprobs, events = {}, {}, {}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        token_ids[c.index] = token_ids.get(c.index, []) + c.model_extra["token_ids"]
        logprobs[c.index] = logprobs.get(c.index, []) + c.logprobs.token_logprobs
        events[c.index] = events.get(c.index, 0) + bool(c.model_extra["token_ids"])
    for i, c in expected.items():
        assert (texts[i], token_ids[i]) == (c.text, c.token_ids) and len(c.token_ids) == 24
        np.testing.assert_allclose(logprobs[i], c.logprobs.token_logprobs, atol=1e-6)
        # the first token (drawn by the prefill), then the decode chunks of CONFIG.decode_steps
        assert events[i] >= 1 + (24 - 1) // CONFIG.decode_steps


def test_a_client_that_leaves_a_stream_frees_its_slots(client, server):
    errors = server.engine.stats.errors
    stream = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=SEQ_LEN // 2, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the role: the request is in the engine
    stream.close()
    deadline = time.monotonic() + 60
    while (server.engine.stats.active_slots or server.engine.stats.pages_in_use) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.stats.active_slots == 0 and server.engine.stats.pages_in_use == 0
    assert server.engine.stats.errors == errors
    r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
    assert len(r.choices[0].token_ids) > 0


def test_top_logprobs_are_the_models_most_likely_tokens_at_each_position(client, model_a):
    prompt = TOKENIZER.encode("abc", add_special_tokens=False)
    r = client.completions.create(
        model="policy", prompt=prompt, max_tokens=8, temperature=1.0, seed=4, logprobs=5, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
    )
    c = r.choices[0]
    logp = log_probs(model_a, prompt + c.token_ids)
    assert len(c.logprobs.top_logprobs) == len(c.token_ids) == 8
    for t, alternatives in enumerate(c.logprobs.top_logprobs):
        row = logp[len(prompt) - 1 + t]
        best = np.argsort(-row)[:5]
        assert list(alternatives) == [f"token_id:{i}" for i in best]
        np.testing.assert_allclose(list(alternatives.values()), row[best], atol=2e-4)
    # greedy: the sampled token is the first alternative, with the same log-prob
    r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    for token in r.choices[0].logprobs.content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert abs(token.top_logprobs[0].logprob - token.logprob) < 2e-4
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
