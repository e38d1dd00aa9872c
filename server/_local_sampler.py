"""`LocalSampler`: env workers in the learner's process sample from the embedded server's engine directly.

The request goes through the same handling as POST /v1/completions (`RequestHandler`: checks, stop
sequences, truncation at stop strings, finish reasons) and gets the same answer, without HTTP and JSON:
for short completions on a CPU those cost more than generating, and on a GPU they cap throughput
(docs/performance.md). The embedded server still serves HTTP for everyone else (verifiers envs,
`curl`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from marin_rl.envs import Completion, Sampler, SamplingParams
from marin_rl.server._handler import RequestHandler, completion_prompts
from marin_rl.server._protocol import CompletionRequest
from marin_rl.types import InferenceMetadata


class LocalSampler(Sampler):
    def __init__(self, handler: RequestHandler, server_id: str = "embedded"):
        self.handler = handler
        self.server_id = server_id

    async def sample(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> list[Completion]:
        start = time.perf_counter()
        handler = self.handler
        request = CompletionRequest(
            prompt=[int(t) for t in prompt_ids],
            n=n,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop=list(params.stop) or None,
            seed=params.seed,
        )
        (job,) = handler.jobs(request, completion_prompts(handler, request.prompt), request.max_tokens, "prompt")
        (result,) = await handler.run([job])
        latency_s = time.perf_counter() - start
        sampling_params = params.to_dict()
        return [
            Completion(
                choice.token_ids,
                choice.logprobs,
                InferenceMetadata(
                    server_id=self.server_id,
                    model=handler.config.model_name,
                    policy_version=result.policy_version,
                    finish_reason=choice.finish_reason,
                    latency_s=latency_s,
                    sampling_params=sampling_params,
                ),
            )
            for choice in handler.choices(request, job, result)
        ]
