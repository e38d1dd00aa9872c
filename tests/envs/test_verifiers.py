"""The verifiers (0.4) adapter against the real package, with scripted sampling.

The environments are installed-style packages in `verifiers_envs/`. "verifiers' own scoring" is the
same environment run by verifiers against a plain OpenAI server replaying the same completions
(`verifiers_own_trace`): our reward must equal the one its trace got. Tool tasks are in
test_verifiers_tools.py, the embedded-server run in test_server_e2e.py.
"""

import asyncio

import pytest

vf = pytest.importorskip("verifiers.v1")

from marin_rl.envs import SamplingParams, ScriptedSampler, build_env, resolve_settings, sample_group  # noqa: E402
from marin_rl.envs._verifiers import VerifiersEnv  # noqa: E402

pytestmark = pytest.mark.usefixtures("verifiers_envs")


def _group(env, texts, n=1, problem=0, **kwargs):
    problem = list(env.problems())[problem]
    return asyncio.run(sample_group(env, problem, ScriptedSampler(env.tokenizer, texts), n, resolve_settings(env, **kwargs)))


def _pairs(rollout):
    return [(t.role, t.content) for t in rollout.turns]


def _rendering(tokenizer, rollout, tools=None):
    messages = [{"role": t.role, "content": t.content} for t in rollout.turns]
    return tokenizer.apply_chat_template(messages, tools=tools)


# --- single turn: a weighted rubric -------------------------------------------------------------


def test_single_turn_taskset_is_token_exact_and_scored_by_its_weighted_rubric(tokenizer, verifiers_own_trace):
    env = VerifiersEnv("marin_vf_sum").bind(tokenizer, name="vf-sum")
    problems = list(env.problems())
    assert len(problems) == 3 and len({p.id for p in problems}) == 3
    assert env.default_reward_weights() == {"brief": 0.25, "correct": 1.0}
    by_reply = {r.turns[-1].content: r for r in _group(env, ["0", "zero, I think"], n=2)}
    right, wrong = by_reply["0"], by_reply["zero, I think"]
    for r in (right, wrong):
        r.validate()
        assert r.token_ids().tolist() == _rendering(tokenizer, r)
        assert tokenizer.decode(r.token_ids()[r.sampled_mask()]) in ("0<|end|>", "zero, I think<|end|>")
        assert r.environment == "vf-sum" and r.problem_id == problems[0].id
        assert r.metadata["verifiers"]["stop_condition"] == "agent_completed"
    assert _pairs(right) == [("system", "Digits only."), ("user", "0+0="), ("assistant", "0")]
    assert right.rewards == {"brief": 1.0, "correct": 1.0} and right.reward == 1.25
    assert wrong.rewards == {"brief": 0.0, "correct": 0.0} and wrong.reward == 0.0
    assert right.metadata["verifiers"]["metrics"] == {"reply_chars": 1.0}
    assert right.group_id == wrong.group_id and right.rollout_uid != wrong.rollout_uid
    assert [right.reward, wrong.reward] == [verifiers_own_trace(env, [t]).reward for t in ("0", "zero, I think")]


def test_run_config_weights_override_verifiers_weights(tokenizer):
    env = VerifiersEnv("marin_vf_sum").bind(tokenizer)
    [r] = _group(env, ["0"], reward_weights={"brief": 0.0})
    assert r.reward == 1.0
    with pytest.raises(ValueError, match="unknown rewards"):
        _group(env, ["0"], reward_weights={"typo": 1.0})


def test_length_cut_marks_the_rollout_truncated(tokenizer):
    env = VerifiersEnv("marin_vf_sum").bind(tokenizer)
    [r] = _group(env, ["a very long reply"], sampling=SamplingParams(max_tokens=4))
    r.validate()
    assert r.is_truncated and r.turns[-1].inference_metadata.finish_reason == "length"


def test_max_total_tokens_caps_verifiers_rollouts(tokenizer, render_ids):
    env = VerifiersEnv("marin_vf_sum").bind(tokenizer)
    prompt_len = len(render_ids([("system", "Digits only."), ("user", "0+0=")], add_generation_prompt=True))
    [r] = _group(env, ["a long reply"], max_total_tokens=prompt_len + 3)
    r.validate()
    assert r.num_tokens == prompt_len + 3 and r.is_truncated
    with pytest.raises(RuntimeError, match="does not fit under max_total_tokens"):
        _group(env, ["0"], max_total_tokens=prompt_len)


def test_a_groups_first_turns_go_to_the_server_as_one_request(tokenizer):
    env = VerifiersEnv("marin_vf_sum").bind(tokenizer)
    sampler = ScriptedSampler(tokenizer, ["0"])
    requests = []
    original = sampler.sample

    async def sample(prompt_ids, n, params):
        requests.append((n, params.seed))
        return await original(prompt_ids, n, params)

    sampler.sample = sample
    problem = next(iter(env.problems()))
    rollouts = asyncio.run(sample_group(env, problem, sampler, 3, resolve_settings(env, SamplingParams(seed=7))))
    assert requests == [(3, 7)] and len(rollouts) == 3  # one request with n choices, like a native group


def test_concurrent_groups_share_verifiers_serving_and_keep_their_own_samplers(tokenizer):
    env = VerifiersEnv("marin_vf_sum").bind(tokenizer)
    problems = list(env.problems())

    async def groups():
        # As the orchestrator's workers do: several groups of one env in flight on one event loop.
        return await asyncio.gather(*(sample_group(env, p, ScriptedSampler(tokenizer, [f"{i}"]), 3) for i, p in enumerate(problems)))

    for i, group in enumerate(asyncio.run(groups())):
        assert [r.turns[-1].content for r in group] == [str(i)] * 3  # each reply came from its group's sampler
        assert all(r.problem_id == problems[i].id for r in group)


# --- single-turn tasks without an episode --------------------------------------------------------


def _comparable(rollout):
    meta = {k: v for k, v in rollout.metadata.items() if k != "verifiers"}
    verifiers = {k: v for k, v in rollout.metadata["verifiers"].items() if k != "trace_id"}
    turns = [(t.role, t.content, t.token_ids.tolist(), t.logprobs.tolist() if t.logprobs is not None else None) for t in rollout.turns]
    return turns, rollout.rewards, rollout.reward, rollout.is_truncated, meta, verifiers


@pytest.mark.parametrize(
    ("taskset", "args", "texts"),
    [
        ("marin_vf_sum", {}, ["0", "zero, I think", " 0"]),
        ("marin_vf_addition", {}, ["1", "2", "<|end|>"]),
        ("marin_vf_faulty", {"failure": "raise"}, ["2"]),
        ("marin_vf_faulty", {"failure": "nan"}, ["2", "3"]),
    ],
)
def test_single_turn_tasks_score_without_an_episode_as_the_episode_does(tokenizer, taskset, args, texts):
    direct = VerifiersEnv(taskset, args).bind(tokenizer, name="vf")
    episodes = VerifiersEnv(taskset, args, direct=False).bind(tokenizer, name="vf")
    assert direct.episode_needed is None and episodes.episode_needed == "direct: false"
    for problem in range(len(list(direct.problems()))):
        ours, theirs = (_group(env, texts, n=len(texts), problem=problem) for env in (direct, episodes))
        assert [_comparable(r) for r in ours] == [_comparable(r) for r in theirs]
    assert direct.metrics.as_dict() == episodes.metrics.as_dict()  # the same failures counted


def test_tasks_that_need_their_episode_run_it(tokenizer):
    assert "tools" in VerifiersEnv("marin_vf_calc").bind(tokenizer).episode_needed
    assert "GuessEnv" in VerifiersEnv("marin_vf_guess").bind(tokenizer).episode_needed


# --- scoring failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "counter", "message"),
    [("raise", "reward_errors", "KeyError: 'missing field'"), ("slow", "reward_timeouts", "scoring timed out")],
)
def test_failed_verifiers_scoring_gives_zero_with_the_error_recorded(tokenizer, failure, counter, message):
    env = VerifiersEnv("marin_vf_faulty", {"failure": failure}).bind(tokenizer, name="vf")
    rollouts = _group(env, ["2"], n=2, verifier_timeout_s=0.5)
    for r in rollouts:
        r.validate()
        # verifiers scores a task's rewards together: one failure leaves all of them unscored.
        assert r.reward == 0.0 and r.rewards == {"correct": 0.0, "faulty": 0.0}
        errors = r.metadata["reward_errors"]
        assert set(errors) == {"correct", "faulty"} and all(message in e for e in errors.values())
    assert env.metrics.as_dict()[f"envs/vf/{counter}"] == 4


def test_nan_verifiers_reward_scores_zero_alone(tokenizer):
    env = VerifiersEnv("marin_vf_faulty", {"failure": "nan"}).bind(tokenizer, name="vf")
    [r] = _group(env, ["2"])
    r.validate()
    assert r.rewards == {"correct": 1.0, "faulty": 0.0} and r.reward == 1.0
    assert r.metadata["reward_errors"] == {"faulty": "returned nan, expected a finite number"}
    assert env.metrics.as_dict()["envs/vf/reward_errors"] == 1


# --- multi-turn: the env speaks several times ---------------------------------------------------


def test_multi_turn_env_keeps_every_assistant_turn_sampled(tokenizer, verifiers_own_trace):
    env = VerifiersEnv("marin_vf_guess").bind(tokenizer, name="vf-guess")
    assert type(env.vf_env).__name__ == "GuessEnv"  # the taskset package's own env
    seven = list(env.problems())[1]
    sampler = ScriptedSampler(tokenizer, ["5", "8", "7"], logprob=-0.25)
    [r] = asyncio.run(sample_group(env, seven, sampler, 1))
    r.validate()
    assert _pairs(r)[1:] == [
        ("user", "Guess my number (1-9)."),
        ("assistant", "5"),
        ("user", "higher"),
        ("assistant", "8"),
        ("user", "lower"),
        ("assistant", "7"),
    ]
    assert r.token_ids().tolist() == _rendering(tokenizer, r)
    assistant = [t for t in r.turns if t.role == "assistant"]
    assert [tokenizer.decode(t.token_ids) for t in assistant] == ["5<|end|>", "8<|end|>", "7<|end|>"]
    assert all(t.logprobs.tolist() == [-0.25] * len(t.token_ids) for t in assistant)
    assert r.sampled_mask().sum() == sum(len(t.token_ids) for t in assistant)
    assert r.rewards == {"guesses": 3.0, "solved": 1.0} and r.reward == pytest.approx(0.7)
    assert r.metadata["num_turns"] == 3
    assert r.reward == pytest.approx(verifiers_own_trace(env, ["5", "8", "7"], problem=1).reward)


def test_max_turns_ends_a_multi_turn_rollout_on_its_last_assistant_turn(tokenizer):
    env = VerifiersEnv("marin_vf_guess").bind(tokenizer)
    [r] = _group(env, ["5", "8", "7"], problem=1, max_turns=2)
    r.validate()
    assert [t.content for t in r.turns if t.role == "assistant"] == ["5", "8"]
    assert r.metadata["stop_reason"] == "max_turns" and r.rewards["solved"] == 0.0


def test_a_template_that_re_renders_past_turns_is_refused_with_its_name(qwen3_tokenizer):
    # Qwen3's template drops the <think> block of turns before the last user message.
    env = VerifiersEnv("marin_vf_guess").bind(qwen3_tokenizer)
    with pytest.raises(RuntimeError, match="'qwen3-chars' is not prefix stable: adding a 'user' message"):
        _group(env, ["<think>\nMiddle.\n</think>\n\n5", "7"], problem=1)


# --- configuration the adapter refuses ----------------------------------------------------------


def test_harnesses_and_runtimes_that_run_outside_the_process_are_refused(tokenizer):
    with pytest.raises(ValueError, match="seat 'agent' uses harness 'bash'"):
        VerifiersEnv("marin_vf_sum", env_args={"agent": {"harness": {"id": "bash"}}})
    with pytest.raises(ValueError, match="seat 'agent' uses harness 'marin_vf_bundled'"):
        VerifiersEnv("marin_vf_bundled")  # the taskset's own harness would be the seat's default
    with pytest.raises(ValueError, match="'docker' runtime; marin-rl runs verifiers agents locally"):
        VerifiersEnv("marin_vf_sum", env_args={"agent": {"runtime": {"type": "docker"}}})
    null = VerifiersEnv("marin_vf_sum", env_args={"agent": {"harness": {"id": "null"}}}).bind(tokenizer)
    [r] = _group(null, ["0"])
    assert r.reward == 1.25


def test_taskset_resolution_errors_are_clear():
    with pytest.raises(ModuleNotFoundError, match="no-such-taskset"):
        build_env("verifiers", {"taskset": "no-such-taskset"})
