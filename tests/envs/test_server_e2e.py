"""Envs against the real embedded server (a tiny random Llama): structure, not rewards."""

import asyncio

import pytest

pytest.importorskip("marin_rl.server._policy_server")

from marin_rl.envs import Env, OpenAISampler, Problem, SamplingParams, resolve_settings, reward, sample_group  # noqa: E402

pytestmark = pytest.mark.slow


class Chat(Env):
    """Two assistant turns with a tool message between them."""

    max_turns = 2
    sampling = SamplingParams(max_tokens=12)

    def problems(self):
        return [Problem(id="hi", messages=({"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}))]

    async def interact(self, messages, problem, state):
        return [{"role": "tool", "content": "ok"}]

    @reward
    def length(self, completion):
        return float(len(completion))


@pytest.fixture(scope="module")
def server(tokenizer):
    import haliax as hax
    import jax
    from levanter.models.llama import LlamaConfig

    from marin_rl.server._policy_server import PolicyServer
    from marin_rl.server._config import InferenceServerConfig

    config = LlamaConfig(seq_len=256, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2)
    model = config.build(hax.Axis("vocab", len(tokenizer)), key=jax.random.PRNGKey(0))
    server = PolicyServer(InferenceServerConfig(max_seq_len=256, max_seqs=8), model, tokenizer, policy_version=4).start()
    yield server
    server.shutdown()


def _sample(server, env, problem, n, sampling=None):
    async def run():
        sampler = OpenAISampler.from_url(server.base_url, "policy")
        try:
            return await sample_group(env, problem, sampler, n, resolve_settings(env, sampling))
        finally:
            await sampler.aclose()

    return asyncio.run(run())


def _check_structure(rollouts, n, version):
    assert len(rollouts) == n and len({r.group_id for r in rollouts}) == 1
    assert len({r.rollout_uid for r in rollouts}) == n
    for r in rollouts:
        r.validate()
        for turn in r.turns:
            if turn.role == "assistant":
                assert turn.inference_metadata.policy_version == version
                assert len(turn.logprobs) == len(turn.token_ids) > 0


def test_multi_turn_env_against_the_embedded_server(server, tokenizer, render_ids):
    env = Chat().bind(tokenizer, name="chat")
    # The sampler checks every prompt the server echoes against the ids sent: a mismatch raises.
    rollouts = _sample(server, env, env.problems()[0], 3)
    _check_structure(rollouts, 3, version=4)
    prompt = render_ids([("system", "Be kind."), ("user", "Hi!")], add_generation_prompt=True)
    for r in rollouts:
        assert r.token_ids()[: len(prompt)].tolist() == prompt
        assert [t.role for t in r.turns][:3] == ["system", "user", "assistant"]
        mask = r.sampled_mask()
        assert mask.sum() == sum(len(t.token_ids) for t in r.turns if t.role == "assistant")
        if not r.is_truncated:
            assert r.metadata["num_turns"] == 2 and r.turns[3].role == "tool"


def test_verifiers_env_against_the_embedded_server(server, tokenizer, verifiers_envs):
    pytest.importorskip("verifiers.v1")
    from marin_rl.envs import VerifiersEnv

    env = VerifiersEnv("marin_vf_sum").bind(tokenizer, name="vf-sum")
    rollouts = _sample(server, env, next(iter(env.problems())), 2, SamplingParams(max_tokens=8))
    _check_structure(rollouts, 2, version=4)
    for r in rollouts:
        assert [t.role for t in r.turns] == ["system", "user", "assistant"]
        assert set(r.rewards) == {"brief", "correct"} and "reward_errors" not in r.metadata
