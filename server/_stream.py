"""`stream: true`: each choice's text, token ids and log-probs as the engine reads them back, ending with
exactly what the same request answers without streaming (its text, tokens and finish reason).

Text is held back where it could still change: the last `len(longest stop string) - 1` characters (a
stop string may be completing there, and the answer's text ends before it) and an incomplete UTF-8
character. Tokens and their log-probs go out as they arrive; a stop string's cut never removes a token
that was already sent (the answer keeps the token that completed the stop string).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from marin_rl.engine import GenerationJob
from marin_rl.server._handler import RequestHandler, _Choice
from marin_rl.server._protocol import ApiError

INCOMPLETE_CHARACTER = "\ufffd"
"""What decoding gives for the first bytes of a multi-byte character whose last byte is not sampled yet."""


@dataclass
class Delta:
    """What one choice adds in one event."""

    index: int
    """The choice's index in the response (prompt index x n + sample index)."""
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    policy_version: int | None = None
    """Set on a choice's last delta."""


@dataclass
class _SampleStream:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    """The text of `ids[:read_offset]`, decoded a chunk at a time (vLLM's incremental detokenization)."""
    prefix_offset: int = 0
    """Decoding starts here, the chunk before `read_offset`: a tokenizer that drops a word's leading space at
    the start of a decode drops it from both texts compared, not from the new one."""
    read_offset: int = 0
    sent_text: str = ""
    sent_tokens: int = 0
    stopped: bool = False
    """A stop string is in its text: the rest comes from the result."""

    def advance(self, index: int, ids: list[int], logprobs: list[float], decode, stops: list[str], holdback: int) -> Delta | None:
        if self.stopped:
            return None
        self.ids += ids
        self.logprobs += logprobs
        searched_from = max(0, len(self.text) - holdback)  # a stop string may end in the new text
        self._decode_new_tokens(decode)
        if any(stop in self.text[searched_from:] for stop in stops):
            self.stopped = True
            return None
        safe = self.text[: len(self.text) - holdback]
        new_text = safe[len(self.sent_text) :] if safe.startswith(self.sent_text) else ""
        return self._send(index, new_text, self.ids[self.sent_tokens :], self.logprobs[self.sent_tokens :])

    def _decode_new_tokens(self, decode) -> None:
        """Extend `text` by the new tokens' text, decoding them with the previous chunk only (the whole
        text at every chunk was quadratic in a long completion); wait while a character is incomplete."""
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(INCOMPLETE_CHARACTER):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def finish(self, index: int, choice: _Choice, policy_version: int) -> Delta:
        if not choice.text.startswith(self.sent_text):
            raise ApiError(500, "streaming: the sent text is not a prefix of the answer's (a tokenizer whose decoding changes earlier text)")
        rest = self._send(index, choice.text[len(self.sent_text) :], choice.token_ids[self.sent_tokens :], choice.logprobs[self.sent_tokens :])
        rest.finish_reason, rest.stop_reason, rest.policy_version = choice.finish_reason, choice.stop_reason, policy_version
        return rest

    def _send(self, index, text, token_ids, logprobs) -> Delta:
        delta = Delta(index, text, list(token_ids), list(logprobs))
        self.sent_text += text
        self.sent_tokens += len(token_ids)
        return delta


async def stream_deltas(handler: RequestHandler, request, jobs: list[GenerationJob]) -> AsyncIterator[Delta]:
    """The deltas of every choice of `jobs` (one job per prompt, `request.n` samples each) as they are
    generated; a choice's last delta carries its finish reason. Stopping the iteration (a client that
    went away) cancels the jobs."""
    loop = asyncio.get_running_loop()
    arrivals: asyncio.Queue = asyncio.Queue()

    def post(item):
        try:
            loop.call_soon_threadsafe(arrivals.put_nowait, item)
        except RuntimeError:  # the event loop closed (the server stopped): nobody is listening
            pass

    for j, job in enumerate(jobs):
        job.on_tokens = lambda i, ids, logprobs, j=j: post((j, i, ids, logprobs))
    samples = {(j, i): _SampleStream() for j in range(len(jobs)) for i in range(request.n)}
    stops = request.stop_strings()
    holdback = max((len(s) for s in stops), default=1) - 1

    def decode(ids):
        return handler.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)

    results = asyncio.ensure_future(handler.run(jobs))
    try:
        while not results.done():
            arrival = asyncio.ensure_future(arrivals.get())
            await asyncio.wait({arrival, results}, return_when=asyncio.FIRST_COMPLETED)
            if not arrival.done():
                arrival.cancel()
                break
            batch = [arrival.result()]
            while not arrivals.empty():
                batch.append(arrivals.get_nowait())
            for j, i, ids, logprobs in batch:
                delta = samples[j, i].advance(j * request.n + i, ids, logprobs, decode, stops, holdback)
                if delta is not None and (delta.text or delta.token_ids):
                    yield delta
        for j, (job, result) in enumerate(zip(jobs, await results, strict=True)):
            for i, choice in enumerate(handler.choices(request, job, result)):
                yield samples[j, i].finish(j * request.n + i, choice, result.policy_version)
    finally:
        results.cancel()  # a no-op once answered; else the jobs stop (handler.run cancels them)


async def server_sent_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """`data: {json}` per event and `data: [DONE]` at the end, as OpenAI streams. An error once the
    stream has begun (the status line is sent) goes out as an event with the error body."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"
