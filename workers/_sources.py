"""Where an env's completions come from, and how a frozen teacher scores them (per-env algorithms).

- the policy (the servers the broadcaster updates): rloo, grpo, dr_grpo, opd;
- a frozen teacher server (`sft` with `source: teacher`);
- the env's own demonstrations (`sft` with `source: dataset`): `DemonstrationSampler`.
For `opd`, `TeacherScorer` asks the teacher for the logprob of every sampled token with one
prompt-logprobs request per rollout (vLLM's `prompt_logprobs`, which our servers implement too).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import numpy as np

from marin_rl.envs import Completion, Problem, Sampler, SamplingParams, token_prompt_arguments
from marin_rl.types import InferenceMetadata, Rollout


class DemonstrationSampler(Sampler):
    """Returns one problem's demonstration as its completion: the text in `problem.extras["completion"]`,
    else `problem.answer`, then the end-of-turn token. Logprobs are 0 (no policy sampled them)."""

    def __init__(self, problem: Problem, tokenizer):
        text = problem.extras.get("completion", problem.answer)
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"sft with source: dataset: problem {problem.id!r} has no demonstration "
                "(a non-empty string `answer` or `completion` field)"
            )
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self._ids = np.asarray(ids, np.int32)

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        metadata = InferenceMetadata(
            server_id="demonstrations", model="dataset", policy_version=0, finish_reason="stop", sampling_params={}
        )
        return [Completion(self._ids, np.zeros(len(self._ids), np.float32), metadata) for _ in range(n)]


class TeacherScorer:
    """Adds a frozen teacher's logprob of every sampled token to each assistant turn."""

    def __init__(self, client, model: str):
        self.client = client
        self.model = model

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        return list(await asyncio.gather(*(self._score(r) for r in rollouts)))

    async def _score(self, rollout: Rollout) -> Rollout:
        ids = rollout.token_ids().tolist()
        response = await self.client.completions.create(
            model=self.model,
            max_tokens=1,  # the forward pass over the prompt is what we want; one token is the minimum
            temperature=1.0,
            **token_prompt_arguments(ids, prompt_logprobs=0, return_token_ids=True),
        )
        choice = response.choices[0]
        prompt_logprobs = getattr(choice, "prompt_logprobs", None) or (choice.model_extra or {}).get("prompt_logprobs")
        if prompt_logprobs is None or len(prompt_logprobs) != len(ids):
            raise ValueError(
                f"teacher {self.model!r} at {self.client.base_url}: expected prompt_logprobs for {len(ids)} tokens, "
                f"got {None if prompt_logprobs is None else len(prompt_logprobs)} (does the server support prompt_logprobs?)"
            )
        logprobs = np.zeros(len(ids), np.float32)
        for position in range(1, len(ids)):
            entries = prompt_logprobs[position]
            entry = entries.get(str(ids[position]), entries.get(ids[position]))
            logprobs[position] = entry["logprob"] if isinstance(entry, dict) else entry.logprob
        turns, offset = [], 0
        for turn in rollout.turns:
            end = offset + len(turn.token_ids)
            if turn.is_sampled:
                turn = dataclasses.replace(turn, teacher_logprobs=logprobs[offset:end])
            turns.append(turn)
            offset = end
        return dataclasses.replace(rollout, turns=tuple(turns))
