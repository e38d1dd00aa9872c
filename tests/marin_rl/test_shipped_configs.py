"""Every env of every shipped config can be learned: a correct answer fits its max_tokens and the row,
and scores 1 (a scripted sampler stands in for the model)."""

import asyncio
import itertools
from pathlib import Path

import pytest

from marin_rl.config import load_config
from marin_rl.envs import ScriptedSampler, sample_group
from marin_rl.orchestrator._preflight import check_run

CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))
CORRECT = {  # env type -> correct completions of a problem, turn by turn
    "toy_addition": ["{answer}"],
    "toy_next_letter": ["{answer[0]}", "{answer[1]}"],
    "reasoning_gym": ["<answer>{answer}</answer>"],
    "calculator": ["<answer>{answer}</answer>"],
}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_correct_answer_fits_and_scores_1(path, tmp_path):
    config = load_config(path, [f"--run_dir={tmp_path / 'run'}"])
    checked = check_run(config, resume=False)
    assert checked.notes == []  # no rollout is cut short by the row, no group too big for a batch
    for env_config in config.envs:
        assert env_config.type in CORRECT, f"add a correct answer for env type {env_config.type!r} to this test"
        env = checked.envs[env_config.name]
        for problem in itertools.islice(iter(env.problems()), 8):
            answers = [turn.format(answer=problem.answer) for turn in CORRECT[env_config.type]]
            sampler = ScriptedSampler(env.tokenizer, answers)
            [rollout] = asyncio.run(
                sample_group(env, problem, sampler, n=1, settings=env_config.rollout_settings(env, config.batcher.max_seq_len))
            )
            where = f"{path.name}: env {env_config.name}, problem {problem.id}, answers {answers!r}"
            sampled = [turn.content for turn in rollout.turns if turn.is_sampled]
            assert len(sampled) == len(answers), f"{where}: {len(sampled)} turns"
            assert all(text.startswith(answer) for text, answer in zip(sampled, answers)), f"{where}: cut at max_tokens"
            assert rollout.reward == 1.0, f"{where}: scored {rollout.rewards}"
