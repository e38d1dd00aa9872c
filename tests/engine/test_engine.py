"""The engine end to end on CPU: exact greedy decodes and log-probs for the three families, seeds,
stops, continuous batching under a mixed load with a weight swap, and the KV-cache invariant."""

import dataclasses
import threading
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.compiles import CompileCounter
from marin_rl.engine import DeviceLock, Engine, EngineConfig, GenerationJob
from marin_rl.engine._scheduler import rows_bucket
from marin_rl.learner import ModelConfig, build_model, sequence_logprobs
from marin_rl.rl_example import BATCH_AXIS, POS_AXIS

pytestmark = pytest.mark.slow

SEQ_LEN = 96
VOCAB = 101
CONFIG = EngineConfig(max_seqs=8, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.0)


def tiny(family: str, seed: int = 0, intermediate: int = 64):
    config = ModelConfig(
        family=family, hidden_dim=32, intermediate_dim=intermediate, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seq_len=SEQ_LEN
    )
    return build_model(config, VOCAB, key=jax.random.PRNGKey(seed))


@eqx.filter_jit
def _learner_logprobs(model, ids):
    """The learner's per-token log-probs of one sequence (index t: log p(ids[t] | ids[:t]))."""
    names = (BATCH_AXIS, POS_AXIS)
    ids = hax.named(ids[None], names)
    positions = hax.named(jnp.arange(ids.array.shape[1])[None], names)
    logp, _ = sequence_logprobs(model, ids, positions, hax.named(jnp.zeros_like(ids.array), names))
    return logp.array[0]


def learner_logprobs(model, ids: list[int]) -> np.ndarray:
    padded = np.zeros(SEQ_LEN, np.int32)  # causal: the padding after the sequence changes nothing before it
    padded[: len(ids)] = ids
    return np.asarray(_learner_logprobs(model, jnp.asarray(padded)))[: len(ids)]


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """A slow greedy decode: the whole sequence through the Levanter model at every step."""
    from levanter.layers.attention import AttentionMask

    ids = list(prompt)

    @eqx.filter_jit
    def logits(model, tokens):
        return model(hax.named(tokens, "position"), AttentionMask.causal()).array

    for _ in range(max_tokens):
        padded = np.zeros(SEQ_LEN, np.int32)
        padded[: len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(logits(model, jnp.asarray(padded)))[len(ids) - 1])))
    return ids[len(prompt) :]


def job(prompt, n=1, max_tokens=8, temperature=1.0, seed=0, stops=(), **kw):
    return GenerationJob(list(prompt), n, max_tokens, temperature, seed, [list(s) for s in stops], **kw)


def run(engine, jobs):
    for j in jobs:
        engine.submit(j)
    return [j.future.result(timeout=300) for j in jobs]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_engine(request):
    model = tiny(request.param)
    engine = Engine(CONFIG, model)
    yield request.param, model, engine
    engine.stop()


def test_greedy_equals_a_slow_reference_decode(family_engine):
    _, model, engine = family_engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, length).tolist() for length in (1, 7, 8, 9, 30)]  # within and across pages
    results = run(engine, [job(p, n=2, max_tokens=12, temperature=0.0) for p in prompts])
    for prompt, result in zip(prompts, results):
        expected = greedy_reference(model, prompt, 12)
        assert [s.token_ids for s in result.samples] == [expected, expected]
    assert engine.stats.errors == 0 and engine.stats.pages_in_use == 0


def test_sampled_logprobs_equal_the_learners(family_engine):
    _, model, engine = family_engine
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, length).tolist() for length in (5, 17)]
    results = run(engine, [job(p, n=4, max_tokens=20, seed=3) for p in prompts])
    worst = 0.0
    for prompt, result in zip(prompts, results):
        for sample in result.samples:
            expected = learner_logprobs(model, prompt + sample.token_ids)[len(prompt) :]
            worst = max(worst, float(np.max(np.abs(expected - np.asarray(sample.logprobs)))))
    assert worst <= 1e-4  # so the importance ratio starts at 1


def test_a_seeded_request_samples_the_same_alone_or_in_a_crowd(family_engine):
    _, _, engine = family_engine
    prompt = list(range(3, 14))
    (alone,) = run(engine, [job(prompt, n=3, max_tokens=10, seed=99)])
    # Some of the crowd sample with top-p/top-k: the steps they share compile the truncation in, and it
    # must leave the other rows' draws alone.
    crowd = [job(list(range(20, 20 + k)), n=1, max_tokens=10, seed=k, top_p=0.9 if k % 2 else 1.0, top_k=5 * (k % 3)) for k in range(1, 6)]
    crowded = run(engine, crowd + [job(prompt, n=3, max_tokens=10, seed=99)])
    assert [s.token_ids for s in crowded[-1].samples] == [s.token_ids for s in alone.samples]
    np.testing.assert_allclose([s.logprobs for s in crowded[-1].samples], [s.logprobs for s in alone.samples], atol=1e-5)
    assert len({tuple(s.token_ids) for s in alone.samples}) == 3  # the samples of one request differ
    (truncated_alone,) = run(engine, [job([20], n=1, max_tokens=10, seed=1, top_p=0.9, top_k=5)])
    assert truncated_alone.samples[0].token_ids == crowded[0].samples[0].token_ids


def test_stop_sequences_and_max_tokens_end_completions(family_engine):
    _, model, engine = family_engine
    prompt = [5, 6, 7]
    greedy = greedy_reference(model, prompt, 12)
    cut = next(k for k in range(2, 12) if greedy[k - 2 : k] not in [greedy[j : j + 2] for j in range(k - 2)])
    (stopped,) = run(engine, [job(prompt, max_tokens=12, temperature=0.0, stops=[greedy[cut - 2 : cut]])])
    assert stopped.samples[0].token_ids == greedy[:cut]  # ends with the stop sequence, nothing after
    (single,) = run(engine, [job(prompt, n=3, max_tokens=1)])
    assert [len(s.token_ids) for s in single.samples] == [1, 1, 1]


def test_mixed_load_with_a_weight_swap_finishes_everything_and_frees_every_page():
    """500 requests: prompts across several pages, n from 1 to 16, multi-turn continuations, a swap."""
    model_a, model_b = tiny("llama", 0), tiny("llama", 1)
    engine = Engine(EngineConfig(max_seqs=16, max_seq_len=SEQ_LEN, page_size=8, decode_steps=8, kv_cache_tokens=700), model_a)
    rng = np.random.default_rng(5)
    jobs, conversations = [], []
    for i in range(500):
        if conversations and rng.random() < 0.3:  # a later turn: the earlier turn, its answer, a new message
            prompt, answer = conversations[rng.integers(len(conversations))]
            prompt = (prompt + answer + rng.integers(0, VOCAB, 3).tolist())[: SEQ_LEN - 20]
        else:
            prompt = rng.integers(0, VOCAB, rng.integers(1, 40)).tolist()
        n = int(rng.choice([1, 2, 4, 8, 16]))
        max_tokens = int(rng.integers(1, SEQ_LEN - len(prompt)))
        candidate = job(prompt, n=n, max_tokens=max_tokens, seed=i, stops=[[int(rng.integers(VOCAB))]])
        shared, own = engine.core.scheduler.pages_needed(candidate)
        while shared + candidate.n * own > engine.core.pages.capacity:  # the cache is small on purpose: pages run out
            candidate.n //= 2
        jobs.append(candidate)
    swapped, abort = threading.Event(), threading.Event()

    def swap_when_half_done():
        while sum(j.future.done() for j in jobs) < 250:
            if abort.wait(0.05):
                return
        engine.swap(model_b, policy_version=1)
        swapped.set()

    swapper = threading.Thread(target=swap_when_half_done, daemon=True)
    swapper.start()
    assert sum(j.n for j in jobs) > 1000
    try:
        for j in jobs:
            engine.submit(j)
            if rng.random() < 0.1:
                conversations.append((j.prompt_ids, j.future.result(timeout=300).samples[0].token_ids))
        results = [j.future.result(timeout=600) for j in jobs]
    finally:
        abort.set()
        swapper.join()
        engine.stop()
    assert swapped.is_set()
    for j, r in zip(jobs, results):
        assert len(r.samples) == j.n
        for s in r.samples:
            assert 1 <= len(s.token_ids) <= j.max_tokens and len(s.logprobs) == len(s.token_ids)
            ended_by_stop = s.token_ids[-1] == j.stop_sequences[0][0]
            assert ended_by_stop or len(s.token_ids) == j.max_tokens
            assert j.stop_sequences[0][0] not in s.token_ids[:-1]
    assert {r.policy_version for r in results} == {0, 1}
    stats = engine.stats
    assert stats.completed == 500 and stats.errors == 0
    assert stats.pages_in_use == 0 and engine.core.pages.num_free == engine.core.pages.capacity


def test_precompiled_shapes_serve_and_swap_without_compiling_and_other_shapes_are_counted():
    config = EngineConfig(max_seqs=8, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.0, precompile_prompt_lens=(10,))
    engine = Engine(config, tiny("llama", 0), device=jax.devices()[0])  # placed, as a training run's engine is
    swapped_in = tiny("llama", 1)
    try:
        # JAX's own count: serving a precompiled shape neither compiles nor loads it again (the jit's first
        # call of a shape compiled ahead of time used to trace it and fetch it from the cache again).
        with CompileCounter() as compiles:
            run(engine, [job(range(1, 11), n=n, max_tokens=9, seed=n) for n in (1, 3, 8)])  # prompts of the precompiled bucket
            engine.swap(swapped_in, policy_version=1)
            run(engine, [job(range(5, 14), n=2, max_tokens=5)])
        assert compiles.count == 0 and compiles.trace_seconds == 0, compiles.compiled
        assert engine.stats.compilations == 0
        run(engine, [job(range(1, 41), max_tokens=3)])  # 40 tokens: a prefill bucket that was not precompiled
        assert engine.stats.compilations == 1
    finally:
        engine.stop()


def test_the_shapes_run_at_start_change_nothing_the_first_requests_see():
    """Each precompiled shape runs once at start (a GPU loads its kernels then, not in the first steps): no
    page taken, no slot active, and the first requests sample the bits of an engine that ran none."""
    model = tiny("llama", 0)
    warmed = Engine(dataclasses.replace(CONFIG, precompile_prompt_lens=(10,)), model)
    plain = Engine(CONFIG, model)
    try:
        core = warmed.core
        assert core.pages.num_free == core.pages.capacity and core.scheduler.num_active == 0
        assert not np.asarray(core._state.active).any()

        def jobs():
            return [job(range(1, 11), n=3, max_tokens=9, seed=7), job(range(2, 9), max_tokens=12, seed=8)]

        for ours, theirs in zip(run(warmed, jobs()), run(plain, jobs())):
            assert [s.token_ids for s in ours.samples] == [s.token_ids for s in theirs.samples]
            assert [s.logprobs for s in ours.samples] == [s.logprobs for s in theirs.samples]
    finally:
        warmed.stop()
        plain.stop()


def test_without_precompiled_decode_one_token_requests_compile_nothing_and_a_longer_one_compiles_decode():
    config = EngineConfig(
        max_seqs=8, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.0, precompile_prompt_lens=(10,), precompile_decode=False
    )
    engine = Engine(config, tiny("llama", 0))
    try:
        assert engine.compiled_variants()["decode"] == 0 and engine.compiled_variants()["prefill"] > 0
        run(engine, [job(range(1, 11), n=n, max_tokens=1, seed=n) for n in (1, 3, 8)])  # the token comes from the prefill
        assert engine.stats.compilations == 0 and engine.compiled_variants()["decode"] == 0
        run(engine, [job(range(1, 11), max_tokens=3)])
        assert engine.stats.compilations == 1 and engine.compiled_variants()["decode"] == 1
        assert engine.stats.errors == 0 and engine.stats.pages_in_use == 0
    finally:
        engine.stop()


def test_decode_calls_compute_at_least_min_decode_slots_rows_32_by_default_on_a_gpu(monkeypatch):
    """Each decode bucket is a program compiled at start: from `min_decode_slots` rows up (8 on a CPU,
    32 on a GPU, where each autotunes its matmuls for seconds), so fewer of them."""
    base = EngineConfig(max_seqs=16, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.0, precompile_prompt_lens=(10,), max_prefill_rows=1)
    model = tiny("llama", 0)

    def decode_programs(config) -> list[int]:
        engine = Engine(config, model)
        try:
            return sorted(key[1] for key in engine.core._executables if key[0] == "decode")
        finally:
            engine.stop()

    assert decode_programs(base) == [8, 16]  # this CPU
    engine = Engine(dataclasses.replace(base, min_decode_slots=16), model)
    try:
        assert sorted(key[1] for key in engine.core._executables if key[0] == "decode") == [16]
        result = run(engine, [job(range(1, 11), max_tokens=9, seed=3)])[0]  # one slot busy: decoded in 16 rows
        assert len(result.samples[0].token_ids) == 9
        assert engine.stats.compilations == 0 and engine.stats.errors == 0 and engine.stats.pages_in_use == 0
    finally:
        engine.stop()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # float32 weights: the same kernels as on a CPU
    assert decode_programs(dataclasses.replace(base, max_seqs=128)) == [32, 64, 128]
    with pytest.raises(ValueError, match="min_decode_slots must be >= 1"):
        EngineConfig(min_decode_slots=0)


def test_prefill_calls_compute_at_least_min_prefill_tokens_256_by_default_on_a_gpu(monkeypatch):
    """Each prefill bucket is a program compiled at start: a call of fewer prompts is padded to as many rows
    (powers of four) as make `min_prefill_tokens` (1 on a CPU, 256 on a GPU), so fewer of them."""
    assert [rows_bucket(n, 16, 256) for n in (1, 16, 17, 65)] == [16, 16, 64, 256]
    assert [rows_bucket(1, time, 256) for time in (32, 64, 128, 512)] == [4, 4, 1, 1]  # powers of four, rounded down
    base = EngineConfig(max_seqs=16, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.0, precompile_prompt_lens=(10,), precompile_decode=False)
    model = tiny("llama", 0)

    def prefill_programs(config) -> list[tuple[int, int]]:
        engine = Engine(config, model)
        try:
            return sorted(key[1:3] for key in engine.core._executables if key[0] == "prefill")
        finally:
            engine.stop()

    assert prefill_programs(base) == [(1, 16), (4, 16), (16, 16)]  # this CPU
    prompts = [job(range(1, 11), n=2, max_tokens=6, seed=5)]
    engine = Engine(base, model)
    try:
        unpadded = run(engine, prompts)[0]
    finally:
        engine.stop()
    engine = Engine(dataclasses.replace(base, min_prefill_tokens=64), model)
    try:
        assert sorted(key[1] for key in engine.core._executables if key[0] == "prefill") == [4, 16]
        padded = run(engine, prompts)[0]  # one prompt: prefilled in 4 rows, the same samples
        assert [s.token_ids for s in padded.samples] == [s.token_ids for s in unpadded.samples]
        np.testing.assert_allclose([s.logprobs for s in padded.samples], [s.logprobs for s in unpadded.samples], atol=1e-5)
        assert engine.stats.compilations == 0 and engine.stats.errors == 0 and engine.stats.pages_in_use == 0
    finally:
        engine.stop()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # float32 weights: the same kernels as on a CPU
    assert prefill_programs(dataclasses.replace(base, max_seqs=128)) == [(16, 16), (64, 16), (256, 16)]
    assert prefill_programs(dataclasses.replace(base, precompile_prompt_lens=(40,))) == [(4, 64), (16, 64)]
    with pytest.raises(ValueError, match="min_prefill_tokens must be >= 1"):
        EngineConfig(min_prefill_tokens=0)


def test_max_prefill_rows_caps_each_prefill_call_and_the_shapes_compiled_at_start():
    config = EngineConfig(
        max_seqs=8, max_seq_len=SEQ_LEN, page_size=8, batch_wait_s=0.5, precompile_prompt_lens=(10,),
        precompile_decode=False, max_prefill_rows=2,
    )
    engine = Engine(config, tiny("llama", 0))
    try:
        # 1 and 4 rows, not 16 (8 slots' worth of prompts): no call holds more than 2 prompts.
        assert engine.compiled_variants()["prefill"] == 2
        results = run(engine, [job(range(1, 11), max_tokens=1, seed=i) for i in range(6)])  # queued within the batch wait
        assert all(len(r.samples[0].token_ids) == 1 for r in results)
        stats = engine.stats
        assert stats.prefill_calls >= 3 and stats.compilations == 0, stats  # 6 prompts, 2 a call
        assert stats.errors == 0 and stats.pages_in_use == 0
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="max_prefill_rows must be >= 1"):
        EngineConfig(max_prefill_rows=0)


def test_swapped_weights_must_match_the_served_ones_leaf_for_leaf():
    from marin_rl.engine._weights import check_same_architecture, serving_weights, weight_leaves

    served = serving_weights(tiny("llama", 0), None)
    check_same_architecture(served, serving_weights(tiny("llama", 1), None))
    with pytest.raises(ValueError, match=r"leaf \d+ is bfloat16"):
        check_same_architecture(served, serving_weights(tiny("llama", 1), "bfloat16"))
    # The compiled calls take non-array parts from the first model: a differing one is refused.
    as_constant = lambda w, value: eqx.tree_at(lambda w: w.lm_head.array, w, value)  # noqa: E731
    check_same_architecture(as_constant(served, 2.0), as_constant(served, 2.0))
    with pytest.raises(ValueError, match="leaf"):
        check_same_architecture(as_constant(served, 2.0), as_constant(served, 3.0))
    assert len(weight_leaves(as_constant(served, 2.0))) == len(weight_leaves(served)) - 1


def test_a_cache_that_cannot_hold_one_sequence_is_refused_at_start():
    with pytest.raises(ValueError, match=r"holds 50 tokens, less than one max_seq_len=96"):
        Engine(EngineConfig(max_seqs=4, max_seq_len=SEQ_LEN, page_size=8, kv_cache_tokens=50), tiny("llama"))


def test_the_default_cache_holds_max_seqs_sequences_of_max_seq_len_in_whole_pages():
    """max_seq_len need not be a multiple of the page size: one slot of 20 tokens takes 3 pages of 8."""
    engine = Engine(EngineConfig(max_seqs=1, max_seq_len=20, page_size=8, decode_steps=4), tiny("llama"))
    try:
        assert engine.core.cache_spec.tokens == 24
        result = run(engine, [job([3, 1, 4, 1, 5], max_tokens=15, temperature=0.0)])[0]
        assert len(result.samples[0].token_ids) == 15
        assert engine.core.stats.errors == 0 and engine.core.stats.pages_in_use == 0
    finally:
        engine.stop()


def test_impossible_requests_are_refused_at_submit(family_engine):
    _, _, engine = family_engine
    for bad, match in [
        (job([1] * 90, max_tokens=10), "exceeds max_seq_len"),
        (job([1, 2], n=9), "max_seqs"),
        (job([VOCAB]), "token ids"),
        (job([]), "empty"),
        (job([1, 2], top_k=2**40), "top_k"),  # would not fit the device's int32 (it once killed the engine)
        (job([1, 2], top_p=0.0), "top_p"),
        (job([1, 2], temperature=float("inf")), "temperature"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(bad)


def test_a_failed_device_call_answers_its_requests_and_the_queued_ones_are_served_after():
    # batch_wait_s: both requests are in the engine's queue before its first turn.
    engine = Engine(EngineConfig(max_seqs=2, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4, batch_wait_s=0.5), tiny("llama"))
    decode, failures = engine.core._decode, []

    def fails_once(*args):
        if not failures:
            failures.append(1)
            raise RuntimeError("device call failed")
        return decode(*args)

    engine.core._decode = fails_once
    try:
        running, queued = job([1, 2, 3], n=2, max_tokens=12), job([4, 5, 6], n=2, max_tokens=12)
        engine.submit(running)
        engine.submit(queued)  # waits for the two slots the first one holds
        with pytest.raises(RuntimeError, match="device call failed"):
            running.future.result(timeout=120)
        assert [len(s.token_ids) for s in queued.future.result(timeout=120).samples] == [12, 12]
        assert engine.stats.errors == 1 and engine.stats.pages_in_use == 0
    finally:
        engine.stop()


def test_a_failed_admission_answers_its_requests_frees_their_pages_and_the_engine_serves_on():
    engine = Engine(EngineConfig(max_seqs=4, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4), tiny("llama"))
    score = engine.core._score_job

    def scoring_fails(job):
        raise RuntimeError("scoring the prompt failed")

    engine.core._score_job = scoring_fails
    try:
        failed = job([1, 2, 3] * 7, n=2, max_tokens=4, prompt_logprobs=1)  # full prompt pages to share
        engine.submit(failed)
        with pytest.raises(RuntimeError, match="scoring the prompt failed"):
            failed.future.result(timeout=120)
        engine.core._score_job = score
        served = job([4, 5, 6] * 7, n=2, max_tokens=4, prompt_logprobs=1)
        engine.submit(served)
        result = served.future.result(timeout=120)
        assert [len(s.token_ids) for s in result.samples] == [4, 4] and result.prompt_scores is not None
        assert engine.stats.errors == 1 and engine.stats.pages_in_use == 0
    finally:
        engine.stop()


def test_pages_leaked_by_a_failure_reset_the_allocator_instead_of_stopping_the_engine():
    engine = Engine(EngineConfig(max_seqs=4, max_seq_len=SEQ_LEN, page_size=8, decode_steps=4), tiny("llama"))

    def leaks_then_fails(chosen, *args):
        engine.core.pages.allocate(3)  # as a bug between taking pages and recording them would
        raise RuntimeError("admission failed")

    engine.core.scheduler._build = leaks_then_fails
    try:
        failed = job([1, 2, 3], max_tokens=4)
        engine.submit(failed)
        with pytest.raises(RuntimeError, match="admission failed"):
            failed.future.result(timeout=120)
        served = job([4, 5, 6], n=2, max_tokens=4)  # served by a fresh scheduler (the patched one fails all)
        engine.submit(served)
        assert [len(s.token_ids) for s in served.future.result(timeout=120).samples] == [4, 4]
        assert engine.stats.errors == 1 and engine.stats.pages_in_use == 0
        assert engine._thread.is_alive()
    finally:
        engine.stop()


def test_the_engine_lets_go_of_a_shared_device_lock_when_asked_and_calls_nothing_while_it_is_held():
    lock = DeviceLock()
    engine = Engine(dataclasses.replace(CONFIG, decode_steps=2), tiny("llama"), device_lock=lock)
    try:
        long = job([1, 2, 3], n=4, max_tokens=80)  # many pipelined decode chunks
        engine.submit(long)
        while engine.stats.decode_calls < 3:
            time.sleep(0.01)
        for turn in range(5):  # the learner's turns, between the engine's
            with lock:
                assert turn > 0 or not long.future.done()  # given while the engine still had work
                calls = engine.stats.decode_calls + engine.stats.prefill_calls
                time.sleep(0.05)
                assert engine.stats.decode_calls + engine.stats.prefill_calls == calls
                assert not engine.core._in_flight  # drained before letting go
        assert [len(s.token_ids) for s in long.future.result(timeout=120).samples] == [80] * 4
        assert engine.stats.errors == 0 and engine.stats.pages_in_use == 0
    finally:
        engine.stop()


def test_the_core_stepped_by_hand_serves_what_the_threaded_engine_serves():
    from marin_rl.engine._core import EngineCore

    def jobs():  # greedy, and seeded samples with top-p/top-k
        return [job([1, 2, 3], n=2, max_tokens=12, temperature=0.0), job(range(5, 25), n=3, max_tokens=9, seed=7, top_p=0.9, top_k=5)]

    model = tiny("llama")
    core, stepped = EngineCore(CONFIG, model), jobs()
    for j in stepped:
        core.check_job(j)
    core.add(stepped)
    steps = 0
    while core.busy:
        core.step()
        steps += 1
    assert steps > 1 and all(j.future.done() for j in stepped)
    assert core.stats.completed == 2 and core.stats.errors == 0
    assert core.stats.pages_in_use == 0 and core.pages.num_used == 0
    engine = Engine(CONFIG, model)
    try:
        threaded = run(engine, jobs())
    finally:
        engine.stop()
    for by_hand, by_thread in zip([j.future.result() for j in stepped], threaded):
        assert [s.token_ids for s in by_hand.samples] == [s.token_ids for s in by_thread.samples]
        np.testing.assert_allclose([s.logprobs for s in by_hand.samples], [s.logprobs for s in by_thread.samples], atol=1e-5)


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_each_compiled_shape_traces_one_layer_whatever_the_depth(monkeypatch, exact):
    """The layers are one jitted function: tracing a decode or prefill shape runs a layer's Python as
    often for 3 layers as for 1 (tracing each of 24 layers cost seconds per shape on the GPU host)."""
    from marin_rl.engine import _exact, _forward
    from marin_rl.engine._core import EngineCore
    from marin_rl.engine._decode import PrefillBatch

    traced = []

    def counting(original):
        return lambda *args, **kw: traced.append(1) or original(*args, **kw)

    monkeypatch.setattr(_forward, "attention_qkv", counting(_forward.attention_qkv))
    monkeypatch.setattr(_exact, "attention_qkv", counting(_exact.attention_qkv))
    engine_config = dataclasses.replace(CONFIG, exact_numerics=exact)

    def layer_traces(num_layers: int):
        config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, seq_len=SEQ_LEN)
        model = build_model(config, VOCAB, key=jax.random.PRNGKey(0))
        core = EngineCore(engine_config, model)
        traced.clear()
        core._decode.trace(core._leaves, core._cache, core._state, core.kernels, CONFIG.decode_steps, 8, False)
        decode = len(traced)
        core._prefill.trace(core._leaves, core._cache, core._state, PrefillBatch(**core.scheduler.empty_batch(4, 16)), core.kernels, False)
        return model, (decode, len(traced) - decode)

    _, shallow = layer_traces(1)
    model, deep = layer_traces(3)
    assert deep == shallow and min(deep) >= 1
    # The program still runs every layer: greedy decoding equals the whole-sequence reference.
    engine = Engine(engine_config, model)
    try:
        result = run(engine, [job([3, 1, 4, 1, 5], max_tokens=6, temperature=0.0)])[0]
    finally:
        engine.stop()
    assert result.samples[0].token_ids == greedy_reference(model, [3, 1, 4, 1, 5], 6)
