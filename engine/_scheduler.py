"""The host side of continuous batching: the request queue, which slot holds which sample, KV pages.

`Scheduler.admit` takes queued jobs while slots, pages and the prefill budget last, and builds the
arrays of one prefill call. Requests take turns (`FairQueue`), so one of thousands of prompts
cannot hold a small one back for more than the few decode steps it takes to free a slot; the chosen
job waits for room if it does not fit (others do not overtake it, so large jobs are not starved). `record_*` take what the device returned, and a sample that finished frees
its slot and pages at once. All pages a sample can ever need (prompt + max_tokens) are reserved when
it is admitted, so decoding never runs out of pages; the `n` samples of a prompt share its full
prompt pages and each gets its own copy of a partial last page.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from marin_rl.engine._config import EngineConfig
from marin_rl.engine._pages import SCRATCH_PAGE, PageAllocator
from marin_rl.engine._request import GenerationJob, JobResult, PromptScores, Sample
from marin_rl.engine._sampling import STOP_PAD, seed_key_data, truncates

MIN_PREFILL_TIME = 16


def bucket(size: int, minimum: int = 1) -> int:
    """The power of two >= size (at least `minimum`): padded shapes compile once per bucket."""
    return max(minimum, 1 << max(0, size - 1).bit_length())


DECODE_SLOTS_STEP = 128


def slots_bucket(slots: int, max_seqs: int, minimum: int) -> int:
    """Decode rows for slots 0..slots-1: a power of two from `minimum` up to DECODE_SLOTS_STEP, then a
    multiple of it. Powers of two all the way wasted up to half the rows: 650 sequences in flight decoded 1,024."""
    rows = bucket(slots, minimum) if slots <= DECODE_SLOTS_STEP else -(-slots // DECODE_SLOTS_STEP) * DECODE_SLOTS_STEP
    return min(rows, max_seqs)


def slots_buckets(max_seqs: int, minimum: int) -> list[int]:
    """Every `slots_bucket` an engine of `max_seqs` slots can decode."""
    return sorted({slots_bucket(n, max_seqs, minimum) for n in range(1, max_seqs + 1)})


def rows_bucket(prompts: int, time: int = 1, min_tokens: int = 1) -> int:
    """Prefill rows for `prompts` prompts padded to `time` tokens: a power of four (1, 4, 16, ...), so that
    the number of admitted prompts, which varies at every turn, compiles few shapes; and as many as make
    `min_tokens` tokens (rounded down to a power of four)."""
    rows = 1
    while rows < prompts or rows * 4 * time <= min_tokens:
        rows *= 4
    return rows


def prefill_rows_buckets(time: int, max_prompts: int, max_tokens: int, min_tokens: int) -> list[int]:
    """Every `rows_bucket` of a prefill call of prompts padded to `time` tokens: of one prompt, or of at most
    `max_prompts` in at most `max_tokens` tokens (what `Scheduler.admit` puts in one call)."""
    buckets = {rows_bucket(n, time, min_tokens) for n in range(1, max_prompts + 1)}
    return sorted(rows for rows in buckets if rows == rows_bucket(1, time, min_tokens) or rows * time <= max_tokens)


class FairQueue:
    """Queued jobs by request (`GenerationJob.request`): `next` takes from the request holding the
    fewest slots, and among those the one admitted least recently (one never admitted first, oldest
    first), so requests take turns at every slot that frees."""

    def __init__(self):
        self._requests: dict[Hashable, collections.deque[GenerationJob]] = {}  # in order of arrival
        self._last_taken: dict[Hashable, int] = {}  # request -> when `remove` last took one of its jobs
        self._taken = 0
        self._count = 0

    def append(self, job: GenerationJob) -> None:
        self._requests.setdefault(_request_of(job), collections.deque()).append(job)
        self._count += 1

    def extend(self, jobs) -> None:
        for job in jobs:
            self.append(job)

    def next(self, slots_held: Mapping[Hashable, int]) -> GenerationJob | None:
        """The oldest job of the request whose turn it is (see the class)."""
        best, best_key = None, None
        for request in self._requests:
            key = (slots_held.get(request, 0), self._last_taken.get(request, -1))
            if best_key is None or key < best_key:
                best, best_key = request, key
                if key == (0, -1):
                    break  # holds nothing, never taken: no later request goes before it
        return None if best is None else self._requests[best][0]

    def remove(self, job: GenerationJob) -> None:
        """Take out `job`, which `next` returned."""
        request = _request_of(job)
        jobs = self._requests[request]
        jobs.popleft()
        self._count -= 1
        if jobs:
            self._last_taken[request] = self._taken
            self._taken += 1
        else:
            del self._requests[request]
            self._last_taken.pop(request, None)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[GenerationJob]:
        return (job for jobs in self._requests.values() for job in jobs)


def _request_of(job: GenerationJob) -> Hashable:
    # A job without a request is one of its own (its id is unique while it is queued or running).
    return job.request if job.request is not None else id(job)


@dataclass
class RunningJob:
    job: GenerationJob
    policy_version: int
    """Version of the weights when it was admitted (the oldest that produces its tokens)."""
    prompt_scores: PromptScores | None
    shared_pages: list[int]
    """Full prompt pages, one reference per unfinished sample."""
    own_pages: list[list[int]]
    """Per sample: its copy of a partial last prompt page, then the pages its completion fills."""
    slots: list[int | None]
    """Slot of each sample; None once it finished."""
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    def result(self) -> JobResult:
        samples = [Sample(t, lp) for t, lp in zip(self.tokens, self.logprobs)]
        return JobResult(samples, self.prompt_scores, self.policy_version)


@dataclass
class Admission:
    """One prefill call: its jobs and the arrays of a `PrefillBatch`."""

    jobs: list[RunningJob]
    arrays: dict[str, np.ndarray]
    new_slots: list[int]
    truncate: bool
    """Whether any of the jobs samples with top-p/top-k."""


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator, table_width: int, min_prefill_tokens: int = 1):
        self.config = config
        self.min_prefill_tokens = min_prefill_tokens
        self.pages = allocator
        self.table_width = table_width
        self.queue = FairQueue()
        self.slots: list[tuple[RunningJob, int] | None] = [None] * config.max_seqs
        self.running: list[RunningJob] = []

    # ------------------------------------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def idle(self) -> bool:
        return not self.running

    def pages_needed(self, job: GenerationJob) -> tuple[int, int]:
        """(shared full prompt pages, pages of each sample of its own) that `job` reserves."""
        size = self.config.page_size
        prompt = len(job.prompt_ids)
        shared = prompt // size
        # The last sampled token is never written to the cache: positions up to prompt + max_tokens - 2.
        return shared, -(-(prompt + job.max_tokens - 1) // size) - shared

    @property
    def truncating(self) -> bool:
        """Whether any running job samples with top-p/top-k."""
        return any(_truncates(r.job) for r in self.running)

    def may_decode(self, steps_queued: int) -> bool:
        """Whether a running sample may still need a decode step after `steps_queued` more (queued and not
        read back yet). A sample with no token read back has its prefill's first token on the way."""
        return any(
            max(len(tokens), 1) + steps_queued < running.job.max_tokens
            for running in self.running
            for slot, tokens in zip(running.slots, running.tokens)
            if slot is not None
        )

    def highest_slot(self) -> int:
        """The highest slot index in use (-1 when none)."""
        return max((i for i, s in enumerate(self.slots) if s is not None), default=-1)

    # -------------------------------------------------------------------------------------- admission

    def admit(self, policy_version: int, score) -> Admission | None:
        """Admit queued jobs into free slots, fairly across requests (`FairQueue`); None when nothing
        can be admitted now.

        `score(job) -> PromptScores` is called for jobs that ask for prompt logprobs."""
        config = self.config
        free_slots = [i for i, s in enumerate(self.slots) if s is None]
        chosen: list[GenerationJob] = []
        free_pages = self.pages.num_free
        longest = 0
        slots_held = collections.Counter()
        for running in self.running:
            slots_held[_request_of(running.job)] += sum(slot is not None for slot in running.slots)
        while (job := self.queue.next(slots_held)) is not None:
            if job.future.cancelled():
                self.queue.remove(job)
                continue
            shared, own = self.pages_needed(job)
            if job.n > len(free_slots) - sum(j.n for j in chosen) or shared + job.n * own > free_pages:
                break
            time = bucket(max(longest, len(job.prompt_ids)), MIN_PREFILL_TIME)
            rows = rows_bucket(len(chosen) + 1, time, self.min_prefill_tokens)
            if chosen and (rows * time > config.prefill_tokens or len(chosen) == config.prefill_rows):
                break
            self.queue.remove(job)
            slots_held[_request_of(job)] += job.n
            chosen.append(job)
            free_pages -= shared + job.n * own
            longest = max(longest, len(job.prompt_ids))
        if not chosen:
            return None
        try:
            return self._build(chosen, free_slots, policy_version, score)
        except Exception as e:  # taken from the queue: answered here (those already running, again by fail_all)
            for job in chosen:
                complete(job.future, error=e)
            raise

    def empty_batch(self, rows: int, time: int) -> dict[str, np.ndarray]:
        """The arrays of a `PrefillBatch` that changes nothing: no prompt token written, no slot new."""
        config, slots, num_pages = self.config, self.config.max_seqs, self.pages.num_pages
        return {
            "token_ids": np.zeros((rows, time), np.int32),
            "lengths": np.zeros(rows, np.int32),
            "write_pages": np.full((rows, time), num_pages, np.int32),
            "copy_tokens": np.zeros(slots * (config.page_size - 1), np.int32),
            "copy_pages": np.full(slots * (config.page_size - 1), num_pages, np.int32),
            "is_new": np.zeros(slots, bool),
            "prompt_row": np.zeros(slots, np.int32),
            "block_tables": np.full((slots, self.table_width), SCRATCH_PAGE, np.int32),
            "seed_keys": np.zeros((slots, 2), np.uint32),
            "sample_index": np.zeros(slots, np.int32),
            "temperature": np.ones(slots, np.float32),
            "top_p": np.ones(slots, np.float32),
            "top_k": np.zeros(slots, np.int32),
            "end_position": np.zeros(slots, np.int32),
            "stops": np.full((slots, config.max_stop_sequences, config.max_stop_tokens), STOP_PAD, np.int32),
        }

    def _build(self, chosen: list[GenerationJob], free_slots: list[int], policy_version: int, score) -> Admission:
        config, size = self.config, self.config.page_size
        time = bucket(max(len(j.prompt_ids) for j in chosen), MIN_PREFILL_TIME)
        rows = rows_bucket(len(chosen), time, self.min_prefill_tokens)
        a = self.empty_batch(rows, time)
        admitted, new_slots, copies = [], [], 0
        slot_iter = iter(free_slots)
        for row, job in enumerate(chosen):
            prompt = len(job.prompt_ids)
            scores = score(job) if job.prompt_logprobs is not None else None  # a device call: before any page is taken
            shared_count, own_count = self.pages_needed(job)
            shared = self.pages.allocate(shared_count)
            self.pages.share(shared, job.n - 1)
            own = [self.pages.allocate(own_count) for _ in range(job.n)]
            running = RunningJob(job, policy_version, scores, shared, own, [None] * job.n, [[] for _ in range(job.n)], [[] for _ in range(job.n)])
            a["token_ids"][row, :prompt] = job.prompt_ids
            a["lengths"][row] = prompt
            a["write_pages"][row, :prompt] = np.repeat(shared + own[0], size)[:prompt]
            stops = np.full((config.max_stop_sequences, config.max_stop_tokens), STOP_PAD, np.int32)
            for k, seq in enumerate(job.stop_sequences):
                stops[k, config.max_stop_tokens - len(seq) :] = seq
            slots = [next(slot_iter) for _ in range(job.n)]
            for i, slot in enumerate(slots):
                running.slots[i] = slot
                self.slots[slot] = (running, i)
                table = shared + own[i]
                a["block_tables"][slot, : len(table)] = table
            new_slots += slots
            # Whole-job assignments (one numpy write per field for the n samples).
            a["is_new"][slots] = True
            a["prompt_row"][slots] = row
            a["seed_keys"][slots] = seed_key_data(job.seed)
            a["sample_index"][slots] = np.arange(job.n)
            a["temperature"][slots] = job.temperature
            a["top_p"][slots] = job.top_p
            a["top_k"][slots] = job.top_k
            a["end_position"][slots] = prompt + job.max_tokens - 1
            a["stops"][slots] = stops
            partial = prompt % size
            if job.n > 1 and partial:  # each other sample gets its own copy of the partial prompt page
                count = (job.n - 1) * partial
                a["copy_tokens"][copies : copies + count] = np.tile(row * time + np.arange(prompt - partial, prompt), job.n - 1)
                a["copy_pages"][copies : copies + count] = np.repeat([own[i][0] for i in range(1, job.n)], partial)
                copies += count
            self.running.append(running)
            admitted.append(running)
        return Admission(admitted, a, new_slots, any(_truncates(j) for j in chosen))

    # ---------------------------------------------------------------------------------------- results

    def record_first(self, admission: Admission, tokens: np.ndarray, logprobs: np.ndarray, finished: np.ndarray) -> list[RunningJob]:
        """The first token of each new sample; returns the jobs that completed."""
        now = time.perf_counter()
        for running in admission.jobs:
            running.job.first_token_at = now
        done = []
        for slot in admission.new_slots:
            running, i = self.slots[slot]
            running.tokens[i].append(int(tokens[slot]))
            running.logprobs[i].append(float(logprobs[slot]))
            if running.job.on_tokens is not None:
                running.job.on_tokens(i, running.tokens[i][-1:], running.logprobs[i][-1:])
            if finished[slot] and self._finish(slot):
                done.append(running)
        return done

    def record_chunk(self, tokens: np.ndarray, logprobs: np.ndarray, active: np.ndarray, owners: list) -> list[RunningJob]:
        """A decode chunk's tokens `[slots_used, steps]` (-1 where inactive) and which of those slots are
        still active, for `owners`: what `slots` held when the chunk was queued. A slot that was freed
        (and maybe taken again) since gets nothing from it."""
        done = []
        # A slot emits a token at each step until it finishes (-1 after): a prefix of its row.
        emitted = (tokens >= 0).sum(axis=1).tolist()
        token_rows, logprob_rows = tokens.tolist(), logprobs.tolist()
        for slot, entry in enumerate(owners):
            if entry is None or self.slots[slot] is not entry:
                continue
            running, i = entry
            new_tokens, new_logprobs = token_rows[slot][: emitted[slot]], logprob_rows[slot][: emitted[slot]]
            running.tokens[i].extend(new_tokens)
            running.logprobs[i].extend(new_logprobs)
            if running.job.on_tokens is not None and new_tokens:
                running.job.on_tokens(i, new_tokens, new_logprobs)
            if not active[slot] and self._finish(slot):
                done.append(running)
        return done

    def _finish(self, slot: int) -> bool:
        """Free a finished sample's slot and pages; True when its job has no unfinished sample left."""
        running, i = self.slots[slot]
        self.slots[slot] = None
        running.slots[i] = None
        self.pages.release(running.shared_pages + running.own_pages[i])
        if any(s is not None for s in running.slots):
            return False
        self.running.remove(running)
        return True

    def cancel_abandoned(self) -> list[int]:
        """Stop the samples of running jobs whose futures were cancelled (request timed out); returns
        their slots, which the device must deactivate."""
        freed = []
        for running in [r for r in self.running if r.job.future.cancelled()]:
            for slot in [s for s in running.slots if s is not None]:
                self._finish(slot)
                freed.append(slot)
        return freed

    def fail_all(self, error: BaseException | None) -> None:
        """Answer every running job with `error` (None: cancel them) and free everything they held."""
        for running in list(self.running):
            for slot in [s for s in running.slots if s is not None]:
                self._finish(slot)
            if error is None:
                running.job.future.cancel()
            else:
                complete(running.job.future, error=error)


def _truncates(job: GenerationJob) -> bool:
    return truncates(job.temperature, job.top_p, job.top_k)


def complete(future: concurrent.futures.Future, result: JobResult | None = None, error: BaseException | None = None) -> None:
    """Set a job's outcome unless it was cancelled meanwhile (its request gave up)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
