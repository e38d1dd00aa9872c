import asyncio
import json

import pytest

from marin_rl.envs import (
    CalculatorEnv,
    ExactMatchEnv,
    MathEnv,
    Problem,
    ReasoningGymEnv,
    ScriptedSampler,
    calculate,
    exact_match,
    normalize_answer,
    sample_group,
)
from marin_rl.envs._calculator import find_call


def _score(env, problem, completion):
    """The rollout of `problem` whose assistant writes `completion`."""
    sampler = ScriptedSampler(env.tokenizer, [completion])
    [rollout] = asyncio.run(sample_group(env, problem, sampler, 1))
    rollout.validate()
    return rollout


def _data(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


def test_normalize_answer_keeps_numbers_intact():
    assert normalize_answer("  The Eiffel   Tower. ") == "eiffel tower"
    assert normalize_answer("1,000") == "1000" and normalize_answer("-3.5") == "-3.5"
    assert normalize_answer("3.5") != normalize_answer("35")
    assert exact_match("paris!", ["Lyon", "Paris"]) and not exact_match("paris", "lyon")


def test_exact_match_env(tokenizer, tmp_path):
    data = _data(tmp_path, [{"prompt": "Capital of France?", "answer": "Paris"}])
    env = ExactMatchEnv(data).bind(tokenizer)
    [problem] = env.problems()
    right = _score(env, problem, "It is... <answer>paris.</answer>")
    assert right.rewards == {"correct": 1.0, "format": 1.0} and right.reward == 1.0
    wrong = _score(env, problem, "<answer>Lyon</answer>")
    assert wrong.rewards == {"correct": 0.0, "format": 1.0} and wrong.reward == 0.0
    untagged = _score(env, problem, "Paris")
    assert untagged.rewards == {"correct": 0.0, "format": 0.0}
    lenient = ExactMatchEnv(data, parser="none").bind(tokenizer)
    assert _score(lenient, problem, "Paris").rewards["correct"] == 1.0


@pytest.mark.parametrize(
    ("answer", "completion", "correct"),
    [
        ("1/2", "so \\boxed{0.5}", True),
        ("0.5", "The answer is $\\frac{1}{2}$.", True),
        ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", True),
        ("1/2", "\\boxed{2/4}", True),
        ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
        ("1/2", "\\boxed{0.6}", False),
        ("3", "\\boxed{-3}", False),
        ("3", "no idea", False),
    ],
)
def test_math_env_grades_equivalent_forms(tokenizer, tmp_path, answer, completion, correct):
    env = MathEnv(_data(tmp_path, [{"prompt": "q", "answer": answer}])).bind(tokenizer)
    [problem] = env.problems()
    rollout = _score(env, problem, completion)
    assert rollout.rewards["correct"] == float(correct)
    assert "reward_errors" not in rollout.metadata


def test_math_env_unparseable_reference_is_a_recorded_verifier_error(tokenizer, tmp_path):
    env = MathEnv(_data(tmp_path, [{"prompt": "q", "answer": ""}])).bind(tokenizer)
    rollout = _score(env, env.problems()[0], "\\boxed{1}")
    assert rollout.rewards["correct"] == 0.0
    assert "cannot parse the reference" in rollout.metadata["reward_errors"]["correct"]


@pytest.mark.parametrize("task", ["basic_arithmetic", "leg_counting", "word_sorting", "spell_backward"])
def test_reasoning_gym_env_agrees_with_its_scorer(tokenizer, task):
    import reasoning_gym

    env = ReasoningGymEnv(task, seed=3, size=3, eval_size=2).bind(tokenizer)
    reference = reasoning_gym.create_dataset(task, seed=3, size=3)
    problems = list(env.problems())
    assert [p.id for p in problems] == [f"{task}/train/seed3/{i}" for i in range(3)]
    assert len(env.eval_problems()) == 2 and env.eval_problems()[0].id.startswith(f"{task}/eval/")
    for problem, entry in zip(problems, reference):
        assert problem.prompt == entry["question"] and problem.answer == entry["answer"]
        right = _score(env, problem, f"Thinking... <answer>{entry['answer']}</answer>")
        assert right.rewards["correct"] == reference.score_answer(entry["answer"], entry) == 1.0
        assert right.rewards["format"] == 1.0
        wrong = _score(env, problem, "<answer>definitely wrong</answer>")
        assert wrong.rewards["correct"] == reference.score_answer("definitely wrong", entry) < 1.0
    assert env.system_prompt.startswith("Given a problem")


def test_calculate_is_safe_arithmetic():
    assert calculate("874 * 51 + 6900") == "51474"
    assert calculate("(2 + 3) * -4 ** 2") == "-80"
    assert calculate("7 / 2") == "3.5" and calculate("7 // 2") == "3" and calculate("2 ** 0.5") == "1.414213562"
    assert calculate("1 / 0").startswith("error")
    assert calculate("__import__('os')").startswith("error: unsupported")
    assert calculate("2 ** 1000").startswith("error")
    assert calculate("(9 ** 60) ** 60").startswith("error: result too large")
    assert calculate("1 +").startswith("error")


def test_find_call_tolerates_a_missing_closing_tag():
    assert find_call("let me compute <calc> 2*3 </calc>") == "2*3"
    assert find_call("<calc>1</calc> then <calc>4-1") == "4-1"
    assert find_call("<calc>1</calc> so <answer>1</answer>") is None
    assert find_call("no tool") is None


def test_calculator_env_round_trip(tokenizer):
    env = CalculatorEnv(num_problems=2).bind(tokenizer)
    problem = Problem(id="c", prompt="What is 12 * 12?", answer="144")

    def script(prompt):
        if "<|tool|>" not in prompt:
            return "<calc>12*12</calc> (stop string cuts this)"
        result = prompt.rsplit("<|tool|>", 1)[1].split("<|end|>")[0]
        return f"<answer>{result}</answer>"

    [right] = asyncio.run(sample_group(env, problem, ScriptedSampler(tokenizer, script), 1))
    right.validate()
    assert [(t.role, t.content) for t in right.turns[2:]] == [
        ("assistant", "<calc>12*12</calc>"),
        ("tool", "144"),
        ("assistant", "<answer>144</answer>"),
    ]
    assert right.rewards == {"correct": 1.0, "format": 1.0, "used_calculator": 1.0}
    wrong = _score(env, problem, "<answer>143</answer>")
    assert wrong.rewards == {"correct": 0.0, "format": 1.0, "used_calculator": 0.0}
    assert _score(env, problem, "<answer>twelve</answer>").rewards["correct"] == 0.0
    generated = env.problems()[0]
    assert generated.answer == calculate(generated.prompt.removeprefix("What is ").removesuffix("?"))
