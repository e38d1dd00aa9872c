"""The page allocator and the scheduler's page accounting (host only, no JAX)."""

import concurrent.futures

import numpy as np

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marin_rl.engine import EngineConfig, GenerationJob
from marin_rl.engine._pages import SCRATCH_PAGE, OutOfPages, PageAllocator
from marin_rl.engine._scheduler import Scheduler, slots_bucket, slots_buckets


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 5), st.integers(0, 99)), max_size=60))
def test_allocator_keeps_its_counts_and_frees_everything_at_the_end(ops):
    pages = PageAllocator(17)
    held: list[list[int]] = []  # one entry per reference taken
    for op, count, pick in ops:
        if op == "alloc":
            if count > pages.num_free:
                with pytest.raises(OutOfPages):
                    pages.allocate(count)
                continue
            got = pages.allocate(count)
            assert SCRATCH_PAGE not in got and len(set(got)) == count
            assert not {p for ref in held for p in ref} & set(got)  # never hands out a referenced page
            held.append(got)
        elif held and op == "share":
            ref = held[pick % len(held)]
            pages.share(ref)
            held.append(list(ref))
        elif held:
            pages.release(held.pop(pick % len(held)))
        assert pages.num_used == len({p for ref in held for p in ref})
        assert pages.num_used + pages.num_free == pages.capacity == 16
    for ref in held:
        pages.release(ref)
    pages.check_idle()


def test_the_idle_check_fails_while_a_reference_is_held():
    pages = PageAllocator(4)
    got = pages.allocate(1)
    pages.share(got)
    pages.release(got)  # one of the two references
    assert pages.num_free == pages.capacity - 1
    with pytest.raises(AssertionError, match="1 KV page references held"):
        pages.check_idle()
    pages.release(got)
    pages.check_idle()


def test_releasing_a_page_twice_is_caught():
    pages = PageAllocator(4)
    got = pages.allocate(2)
    pages.release(got)
    with pytest.raises(AssertionError):
        pages.release(got)


def job(prompt_len, n, max_tokens):
    return GenerationJob(list(range(1, prompt_len + 1)), n, max_tokens, 1.0, 0, [])


def test_samples_share_full_prompt_pages_and_own_the_partial_one():
    config = EngineConfig(max_seqs=8, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(40), table_width=config.pages_per_seq)
    scheduler.queue.append(job(prompt_len=10, n=3, max_tokens=7))  # 2 full prompt pages + a partial one
    admission = scheduler.admit(policy_version=0, score=None)
    (running,) = admission.jobs
    # Positions 0..15 are written (the 17th token is sampled last, never cached): 4 pages per sample.
    assert len(running.shared_pages) == 2 and [len(p) for p in running.own_pages] == [2, 2, 2]
    assert scheduler.pages.num_used == 2 + 3 * 2
    tables = admission.arrays["block_tables"][admission.new_slots]
    assert all(list(t[:2]) == running.shared_pages for t in tables)
    # The prompt is written once, through sample 0's pages; its partial page's tokens (8 and 9) are
    # written again into the own first page of samples 1 and 2, and nothing else is.
    assert list(admission.arrays["write_pages"][0, :10]) == [p for p in running.shared_pages + running.own_pages[0][:1] for _ in range(4)][:10]
    used = admission.arrays["copy_pages"] < scheduler.pages.num_pages
    copies = list(zip(admission.arrays["copy_tokens"][used], admission.arrays["copy_pages"][used]))
    assert copies == [(t, running.own_pages[i][0]) for i in (1, 2) for t in (8, 9)]
    for slot in admission.new_slots:
        scheduler._finish(slot)
    scheduler.pages.check_idle()


def test_a_job_that_does_not_fit_waits_at_the_head_of_the_queue():
    config = EngineConfig(max_seqs=4, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(64), table_width=config.pages_per_seq)
    scheduler.queue.extend([job(4, 3, 4), job(4, 2, 4), job(4, 1, 4)])
    first = scheduler.admit(0, None)
    assert [r.job.n for r in first.jobs] == [3]  # n=2 does not fit the one free slot; n=1 must not overtake it
    assert [j.n for j in scheduler.queue] == [2, 1]
    for slot in first.new_slots:
        scheduler._finish(slot)
    assert [r.job.n for r in scheduler.admit(0, None).jobs] == [2, 1]


def test_cancelled_jobs_are_skipped_and_abandoned_ones_free_their_slots():
    config = EngineConfig(max_seqs=4, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(64), table_width=config.pages_per_seq)
    running_job, queued_job = job(6, 2, 4), job(6, 2, 4)
    scheduler.queue.append(running_job)
    scheduler.admit(0, None)
    queued_job.future.cancel()
    scheduler.queue.append(queued_job)
    assert scheduler.admit(0, None) is None and not scheduler.queue
    assert running_job.future.cancel()  # the request gave up (timeout)
    assert sorted(scheduler.cancel_abandoned()) == [0, 1]
    assert scheduler.idle and scheduler.num_active == 0
    scheduler.pages.check_idle()
    with pytest.raises(concurrent.futures.CancelledError):
        running_job.future.result()


def test_decode_slot_buckets_cover_every_count_with_little_padding():
    buckets = slots_buckets(1024, 8)
    assert buckets == [8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    for used in range(1, 1025):
        rows = slots_bucket(used, 1024, 8)
        assert rows in buckets and rows >= used
        assert used <= 128 or rows - used < 128  # above 128 rows, under one step of padding
    assert slots_buckets(64, 8) == [8, 16, 32, 64] and slots_bucket(3, 6, 8) == 6  # never past max_seqs
    assert slots_buckets(1024, 32) == [32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]  # a GPU's default minimum
    assert slots_buckets(128, 32) == [32, 64, 128] and slots_buckets(16, 32) == [16]


def test_a_chunk_read_back_late_gives_nothing_to_a_slot_freed_and_taken_again_since():
    config = EngineConfig(max_seqs=2, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(64), table_width=config.pages_per_seq)
    first, second = job(3, 2, 8), job(3, 2, 8)
    scheduler.queue.append(first)
    scheduler.admit(0, None)
    stale_owners = list(scheduler.slots)  # a chunk queued now, read back after the slots changed hands
    assert first.future.cancel() and sorted(scheduler.cancel_abandoned()) == [0, 1]
    scheduler.queue.append(second)
    scheduler.admit(0, None)
    tokens = np.full((2, 4), 7, np.int32)
    done = scheduler.record_chunk(tokens, np.zeros((2, 4), np.float32), np.zeros(2, bool), stale_owners)
    assert done == [] and scheduler.num_active == 2  # the new job neither got tokens nor was finished
    assert all(tokens == [] for running in scheduler.running for tokens in running.tokens)
    assert scheduler.may_decode(0) and not scheduler.may_decode(7)  # 1 token from prefill + 7 queued = max_tokens


def test_a_small_request_behind_a_large_one_is_admitted_as_soon_as_a_slot_frees():
    config = EngineConfig(max_seqs=8, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(256), table_width=config.pages_per_seq)
    large = [GenerationJob([1, 2, 3], 2, 4, 1.0, 0, [], request="large") for _ in range(100)]
    small = GenerationJob([4, 5, 6], 2, 4, 1.0, 0, [], request="small")
    scheduler.queue.extend(large)
    first = scheduler.admit(0, None)
    assert [r.job for r in first.jobs] == large[:4]  # 8 slots, 2 samples each
    scheduler.queue.append(small)  # arrives behind 96 queued jobs of the large request
    assert scheduler.admit(0, None) is None  # no free slot
    for slot in first.jobs[0].slots:  # one job of the large request finishes
        scheduler._finish(slot)
    # The small request holds no slot, the large one 6: the small one goes first.
    assert [r.job for r in scheduler.admit(0, None).jobs] == [small]
    for slot in first.jobs[1].slots:
        scheduler._finish(slot)
    assert [r.job for r in scheduler.admit(0, None).jobs] == [large[4]]
    assert len(scheduler.queue) == 95 and list(scheduler.queue)[0] is large[5]


def test_requests_share_the_slots_evenly_and_keep_their_own_order():
    config = EngineConfig(max_seqs=6, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(256), table_width=config.pages_per_seq)
    a = [GenerationJob([1, 2], 1, 4, 1.0, 0, [], request="a") for _ in range(10)]
    b = [GenerationJob([3, 4], 1, 4, 1.0, 0, [], request="b") for _ in range(10)]
    c = GenerationJob([5, 6], 1, 4, 1.0, 0, [])  # no request: one of its own
    scheduler.queue.extend([*a, *b, c])
    admitted = [r.job for r in scheduler.admit(0, None).jobs]
    assert admitted == [a[0], b[0], c, a[1], b[1], a[2]]


def test_a_request_that_just_freed_every_slot_lets_a_waiting_one_go_first():
    config = EngineConfig(max_seqs=8, max_seq_len=64, page_size=4)
    scheduler = Scheduler(config, PageAllocator(256), table_width=config.pages_per_seq)
    large = [GenerationJob([1, 2, 3], 8, 4, 1.0, 0, [], request="large") for _ in range(10)]
    scheduler.queue.extend(large)
    first = scheduler.admit(0, None)
    scheduler.queue.append(small := GenerationJob([4, 5], 1, 4, 1.0, 0, [], request="small"))
    for slot in first.jobs[0].slots:
        scheduler._finish(slot)
    # Both hold no slot now; the large request was served last, so the small one goes first (and the
    # large job, needing all 8 slots, waits for room).
    assert [r.job for r in scheduler.admit(0, None).jobs] == [small]
