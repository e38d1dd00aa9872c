"""`EngineCore`: the weights, the KV cache, the decode slots and the compiled device calls, driven one
`step` at a time from one thread; it has no thread of its own (`Engine` runs it on one).

Each step: queue a chunk of decode steps for every active slot, read back the calls queued before it
(tokens, finished completions handed back) while the device runs it, stop abandoned requests, and
admit queued jobs (one batched prefill that also draws their first tokens, queued behind the chunk).
The host's work thus overlaps the device's. Weights installed while sequences are decoding serve their
remaining tokens; a request admitted after an install sees only the new weights.
"""

from __future__ import annotations

import collections
import dataclasses
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass

import equinox as eqx
import jax
import numpy as np

from marin_rl._upstream import jit_cache_size
from marin_rl.compiles import engine_compiler_options
from marin_rl.engine._attention import choose_kernels
from marin_rl.engine._config import EngineConfig
from marin_rl.engine._device_lock import DeviceLock
from marin_rl.engine._decode import PrefillBatch, SlotState, deactivate, decode_chunk, prefill_insert, score_prompt
from marin_rl.engine._kv_cache import KvCache, plan_kv_cache
from marin_rl.engine._pages import PageAllocator
from marin_rl.engine._request import GenerationJob, PromptScores, Sample
from marin_rl.engine._scheduler import MIN_PREFILL_TIME, Admission, Scheduler, bucket, complete, prefill_rows_buckets, slots_bucket, slots_buckets
from marin_rl.engine._weights import ModelToCome, ServingWeights, check_same_architecture, is_weight, jit_on_leaves, serving_weights, shapes_only, weight_leaves
from marin_rl.programs import ProgramStore, describe

logger = logging.getLogger(__name__)

MIN_DECODE_SLOTS = 8
GPU_MIN_DECODE_SLOTS = 32
"""`EngineConfig.min_decode_slots` unset, on a GPU and elsewhere."""
GPU_MIN_PREFILL_TOKENS = 256
"""`EngineConfig.min_prefill_tokens` unset, on a GPU (elsewhere 1)."""


@dataclass
class EngineStats:
    """Counters since start (read them from any thread)."""

    requests: int = 0
    completed: int = 0
    errors: int = 0
    """Device calls that failed (their requests were answered with the error)."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    """Seconds from each call's dispatch (or the previous call's results, if later) to its results: with
    calls queued back to back, the time the device works for the engine."""
    compilations: int = 0
    """Device calls that compiled a shape while serving (not precompiled at start): each takes seconds."""
    pages_in_use: int = 0
    pages_total: int = 0
    active_slots: int = 0
    queued: int = 0


@dataclass
class _InFlight:
    """A device call queued but not read back yet; its outputs are already on their way to the host."""

    kind: str  # "prefill" or "decode"
    outputs: tuple
    dispatched_at: float
    admission: Admission | None = None
    owners: list | None = None
    """decode: what each slot held when the chunk was queued (a slot freed and taken again since gets
    nothing from it)."""


def _copy_to_host(arrays: tuple) -> tuple:
    for array in arrays:
        array.copy_to_host_async()
    return arrays


class EngineCore:
    """Generate for `GenerationJob`s on a Levanter LM, from one thread: `add` jobs, then `step` while
    `busy`; each job's future gets a `JobResult` (or the error of a failed device call).

    `device_lock`, when given, is held from a device call until its results are back, across the turns
    of a run of pipelined calls, and let go as soon as another thread wants it: a learner training on
    the same GPU holds it around its steps, so the two never run kernels at once (cuDNN's CUDA-graph
    capture fails if another thread launches work meanwhile).

    `device`: where the weights and the KV cache live, so every compiled call runs there (None: JAX's
    default device). Weights handed over from another device are copied device to device. Steps run
    inside `on_device()`.

    `inbox`: jobs submitted but not added yet (the `Engine`'s), which `stats.queued` counts.
    """

    def __init__(
        self,
        config: EngineConfig,
        model,
        policy_version: int = 0,
        *,
        device_lock: DeviceLock | None = None,
        device: jax.Device | None = None,
        inbox: Sized = (),
    ):
        if config.max_seq_len > model.Pos.size:
            raise ValueError(
                f"max_seq_len={config.max_seq_len} exceeds the model's context length {model.Pos.size} (its config's seq_len)"
            )
        self.config = config
        self.device = device
        self._shared_lock = device_lock
        self._lock = device_lock or contextlib.nullcontext()
        self._holding_lock = False
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._inbox = inbox
        self._last_ready = 0.0
        self.policy_version = policy_version
        # Started on a model to come: programs compile from its shapes, the first device call waits for it.
        self._arrival = model.arrival if isinstance(model, ModelToCome) else None
        self._arrival_lock = threading.Lock()
        self._weights = self.prepare(model.shapes if self._arrival is not None else model, check=False)
        self._leaves = weight_leaves(self._weights)
        attention = self._weights.attention_config
        self.kernels = choose_kernels(config.attention, self._weights.dtype, exact=config.exact_layout)
        self.cache_spec = plan_kv_cache(
            config,
            num_layers=len(self._weights.layers),
            kv_heads=attention.num_kv_heads,
            head_dim=attention.head_size,
            dtype=self._weights.dtype,
            device=device,
        )
        self.table_width = self.kernels.table_width(config.pages_per_seq)
        platform = device.platform if device is not None else jax.default_backend()
        self.min_decode_slots = config.min_decode_slots or (GPU_MIN_DECODE_SLOTS if platform == "gpu" else MIN_DECODE_SLOTS)
        min_prefill_tokens = config.min_prefill_tokens or (GPU_MIN_PREFILL_TOKENS if platform == "gpu" else 1)
        self.min_prefill_tokens = min(min_prefill_tokens, config.prefill_tokens)
        self._top_k = max(1, min(config.max_logprobs, self._weights.Vocab.size))
        # Host inputs go in as numpy arrays: the jit's C++ dispatch transfers them (one `jnp.asarray`
        # each took 0.2 ms on the GPU machine, 3.6 ms for a prefill call's arrays).
        self._prefill = jit_on_leaves(prefill_insert, self._weights, static_argnums=(4, 5), donate_argnums=(1, 2))
        self._decode = jit_on_leaves(decode_chunk, self._weights, static_argnums=(3, 4, 5, 6), donate_argnums=(1, 2))
        self._deactivate = jax.jit(deactivate, donate_argnums=0)
        self._score = jit_on_leaves(score_prompt, self._weights, static_argnums=(1, 4))
        self._compiled_calls = {"prefill": self._prefill, "decode": self._decode, "deactivate": self._deactivate, "score": self._score}
        self._executables: dict[tuple, Callable] = {}
        """Prefill and decode executables compiled at start, by (call, shape and static arguments)."""
        self._new_allocator()
        self._reset_device_state()
        if config.precompile_prompt_lens:
            self._precompile(config.precompile_prompt_lens)
        self._receive_model()
        self.stats = EngineStats(pages_total=self.pages.capacity)
        logger.info(
            "engine: %d slots, KV cache %d tokens (%.2f GiB, pages of %d), decode attention %s, prefill %s",
            config.max_seqs,
            self.cache_spec.tokens,
            self.cache_spec.gib,
            config.page_size,
            self.kernels.decode,
            self.kernels.prefill,
        )

    def _receive_model(self) -> None:
        """Serve the model to come once it has arrived (waits for it; then nothing to do)."""
        with self._arrival_lock:
            if self._arrival is None:
                return
            holder = self._arrival.result()
            weights = self.prepare(holder.model)
            self._weights, self._leaves, self.policy_version = weights, weight_leaves(weights), holder.policy_version
            self._arrival = None

    def on_device(self):
        """Arrays made inside this context (KV cache, slot state, host inputs) go to the engine's device."""
        return contextlib.nullcontext() if self.device is None else jax.default_device(self.device)

    def _reset_device_state(self) -> None:
        """A fresh KV cache and empty slots (after a failed device call its donated buffers may be gone)."""
        with self._lock, self.on_device():
            self._cache = KvCache.zeros(self.cache_spec)
            self._state = SlotState.empty(self.config.max_seqs, self.table_width, self.config.max_stop_sequences, self.config.max_stop_tokens)
            if self.device is not None:  # committed, as every later call's are (the previous call's outputs): one compiled variant per shape
                self._cache, self._state = jax.device_put((self._cache, self._state), self.device)

    def _precompile(self, prompt_lens) -> None:
        """Run every prefill (rows x time bucket) and decode (slots bucket, unless `precompile_decode` is off)
        shape once, changing nothing."""
        with self.on_device():
            self._compile_shapes(prompt_lens)

    def _compile_shapes(self, prompt_lens) -> None:
        start = time.perf_counter()
        config, calls = self.config, []
        for truncate in (False, True) if config.precompile_truncated else (False,):
            for time_bucket in sorted({bucket(n, MIN_PREFILL_TIME) for n in prompt_lens}):
                for rows in prefill_rows_buckets(time_bucket, config.prefill_rows, config.prefill_tokens, self.min_prefill_tokens):
                    batch = PrefillBatch(**self.scheduler.empty_batch(rows, time_bucket))
                    calls.append((("prefill", rows, time_bucket, truncate), self._prefill, (batch,), (self.kernels, truncate)))
            for slots_used in slots_buckets(config.max_seqs, self.min_decode_slots) if config.precompile_decode else ():
                static = (self.kernels, config.decode_steps, slots_used, truncate)
                calls.append((("decode", slots_used, truncate), self._decode, (), static))

        store = ProgramStore.beside_compilation_cache()
        model_parts = describe(eqx.partition(self._weights, is_weight)[1])  # once: every program's key holds it
        # Compiled from their shapes: a first run elsewhere may have donated the arrays themselves, and
        # the weights may be still to come (placed on the engine's device then).
        placed = jax.sharding.SingleDeviceSharding(self.device) if self.device is not None else None
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding or placed) for x in self._leaves]
        cache_and_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), (self._cache, self._state))
        # Each then runs once, changing nothing (no prompt written, no slot active): a GPU loads a program's
        # kernels at its first run, which fell in the first steps (an H200's step 3 took 1.7x the median).
        # On a warm start beside the other programs' loading (one after the other, the runs took 1.6 s of
        # the 0.5B loop's start on an H200); on a cold one after the compilations, whose GPU autotuning they
        # slowed (the 1B engine's compile 0.6-0.8 s longer).
        warm = store is not None and all(store.holds(key[0], (leaves, *cache_and_state, *dynamic), static, model_parts) for key, _, dynamic, static in calls)
        seconds: dict[tuple, float] = {}
        first_runs = threading.Lock()  # the first runs take the engine's cache and state in turn

        def run_once(executable, dynamic) -> None:
            self._receive_model()
            with self._lock, first_runs, self.on_device():
                self._cache, self._state, *_ = executable(self._leaves, self._cache, self._state, *dynamic)
                jax.block_until_ready(self._state)

        def compile_call(call):
            key, fn, dynamic, static = call
            started = time.perf_counter()
            options = engine_compiler_options(exact=config.exact_layout is not None, call=key[0], rows=key[1])
            args = (leaves, *cache_and_state, *dynamic)
            if store is None:
                executable = fn.lower(*args, *static).compile(compiler_options=options)
            else:
                executable = store.compile(key[0], fn, args, static, donate_argnums=(1, 2), context=model_parts, compiler_options=options)
            if warm:
                run_once(executable, dynamic)
            seconds[key] = time.perf_counter() - started
            logger.debug("engine: %s ready in %.1fs", key, seconds[key])
            return key, executable

        # XLA compiles without the interpreter lock: the shapes compile side by side. All cores but four,
        # which the learner's compile beside it and the interpreter keep: on the H100 host (16 cores) 12
        # threads took the 0.5B run's start-up compile from 98 to 68 s; on 2 CPU cores one thread (two
        # took 7.0 s where one took 6.1). The engine then calls these executables: on jax 0.11 the jit's
        # own first call of a shape traced it again and loaded it from the cache again (0.5 s a shape).
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(calls), (os.cpu_count() or 1) - 4))) as pool:
            self._executables.update(pool.map(compile_call, calls))
        if not warm:
            for key, _, dynamic, _ in calls:
                run_once(self._executables[key], dynamic)
        loaded = f" ({store.loaded} loaded lowered from {store.directory})" if store and store.loaded else ""
        slowest = max(seconds, key=seconds.get, default=None)
        slowest_text = f"; slowest {slowest}: {seconds[slowest]:.1f}s" if slowest else ""
        logger.info("engine: compiled and ran %d shapes in %.1fs%s%s", len(calls), time.perf_counter() - start, loaded, slowest_text)

    def _call(self, key: tuple, fn, dynamic: tuple, static: tuple):
        """`fn(weights, cache, state, *dynamic, *static)`, through its executable compiled at start if any."""
        executable = self._executables.get(key)
        if executable is not None:
            return executable(self._leaves, self._cache, self._state, *dynamic)
        return fn(self._leaves, self._cache, self._state, *dynamic, *static)

    # ------------------------------------------------------------------------------------------- API

    def compiled_variants(self) -> dict[str, int]:
        """How many shapes each device call was compiled for (a weight swap must not add any)."""
        precompiled = collections.Counter(key[0] for key in self._executables)
        return {name: jit_cache_size(fn) + precompiled[name] for name, fn in self._compiled_calls.items()}

    def check_job(self, job: GenerationJob) -> None:
        """ValueError naming what makes `job` impossible for this engine."""
        config = self.config
        if not job.prompt_ids:
            raise ValueError("the prompt is empty")
        if job.n < 1 or job.n > config.max_seqs:
            raise ValueError(f"n={job.n} must be in [1, max_seqs={config.max_seqs}]")
        if job.max_tokens < 1 or len(job.prompt_ids) + job.max_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({job.max_tokens}) exceeds max_seq_len={config.max_seq_len}"
            )
        vocab = self._weights.Vocab.size
        if min(job.prompt_ids) < 0 or max(job.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not 0 <= job.top_k <= vocab:
            raise ValueError(f"top_k={job.top_k} must be in [0, {vocab}] (0: no top-k)")
        if not 0 < job.top_p <= 1 or not 0 <= job.temperature < float("inf"):
            raise ValueError(f"top_p={job.top_p} must be in (0, 1] and temperature={job.temperature} finite and >= 0")
        if len(job.stop_sequences) > config.max_stop_sequences or any(
            not 0 < len(s) <= config.max_stop_tokens for s in job.stop_sequences
        ):
            raise ValueError(f"at most {config.max_stop_sequences} stop sequences of 1 to {config.max_stop_tokens} tokens")
        shared, own = self.scheduler.pages_needed(job)
        if shared + job.n * own > self.pages.capacity:
            raise ValueError(f"the request needs {shared + job.n * own} KV pages, the cache has {self.pages.capacity}")

    def prepare(self, model, *, check: bool = True) -> ServingWeights:
        """The engine's own copy of `model`'s weights, on its device; ValueError unless it has the served
        architecture (`check`)."""
        with self._lock:
            weights = serving_weights(model, self.config.compute_dtype)
        if self.device is not None and not shapes_only(weights):  # cast where the model lives, then one copy device to device
            weights = jax.block_until_ready(jax.device_put(weights, self.device))
        if check:
            check_same_architecture(self._weights, weights)
        return weights

    def install(self, weights: ServingWeights, policy_version: int) -> None:
        """Serve `weights` (from `prepare`) from the next device call on."""
        leaves = weight_leaves(weights)
        if any(new.sharding != old.sharding for new, old in zip(leaves, self._leaves)):
            self._executables.clear()  # compiled for the old placement: the jit compiles for the new one
        self._weights, self._leaves, self.policy_version = weights, leaves, policy_version

    def add(self, jobs: Iterable[GenerationJob]) -> None:
        """Queue `jobs` (checked with `check_job`) for the next steps to admit."""
        self.scheduler.queue.extend(jobs)

    @property
    def busy(self) -> bool:
        """Whether a step has work: queued or running jobs, or device calls not read back yet."""
        return bool(self.scheduler.queue) or not self.scheduler.idle or bool(self._in_flight)

    def step(self) -> None:
        """One turn (see the module): a failed device call answers every request in flight with its
        error and resets the device state; queued requests are served by the next steps."""
        scheduler = self.scheduler
        try:
            self._turn(scheduler)
        except Exception as e:  # every request in flight gets the error; queued ones are served after
            logger.exception("inference engine failure; its requests get the error and the engine is reset")
            self.stats.errors += 1
            self._in_flight.clear()
            scheduler.fail_all(e)
            self._check_idle_after_failure()
            self._reset_device_state()
            self._let_go_of_device()
        self._publish()

    def shut_down(self) -> None:
        """Drop the calls in flight, let go of the device, and cancel every queued and running job."""
        self._in_flight.clear()
        self._let_go_of_device()
        for job in self.scheduler.queue:  # their requests answer 503 (shutting down)
            job.future.cancel()
        self.scheduler.fail_all(None)

    # --------------------------------------------------------------------------------------- the turn

    def _turn(self, scheduler: Scheduler) -> None:
        # Queue the next chunk first: the device runs it while the host reads back the calls before it and
        # admits. Slots that finished in the chunk still running idle through this one; none is queued
        # when every running sample reaches max_tokens in the chunks already queued.
        steps_queued = self.config.decode_steps * sum(call.kind == "decode" for call in self._in_flight)
        decoding = scheduler.may_decode(steps_queued)  # False with no sample running
        if decoding:
            self._dispatch_decode(scheduler)
        while len(self._in_flight) > decoding:
            self._read_back(scheduler, self._in_flight.popleft())
        abandoned = scheduler.cancel_abandoned()
        if abandoned:
            mask = np.zeros(self.config.max_seqs, bool)
            mask[abandoned] = True
            self._hold_device()
            self._state = self._deactivate(self._state, mask)
        admission = scheduler.admit(self.policy_version, self._score_job)
        if admission is not None:
            self._dispatch_prefill(admission)
        if not decoding or (self._shared_lock is not None and self._shared_lock.wanted):
            # Nothing to overlap the read-back with, or the learner waits for the device: drain.
            while self._in_flight:
                self._read_back(scheduler, self._in_flight.popleft())
        if not self._in_flight:
            self._let_go_of_device()
            if scheduler.idle:
                self.pages.check_idle()

    def _hold_device(self) -> None:
        if not self._holding_lock:
            self._lock.__enter__()
            self._holding_lock = True

    def _let_go_of_device(self) -> None:
        if self._holding_lock:
            self._holding_lock = False
            self._lock.__exit__(None, None, None)

    def _dispatch_prefill(self, admission: Admission) -> None:
        self._hold_device()
        dispatched = time.perf_counter()
        variants = jit_cache_size(self._compiled_calls["prefill"])
        rows, time_bucket = admission.arrays["token_ids"].shape
        self._cache, self._state, tokens, logprobs, finished = self._call(
            ("prefill", rows, time_bucket, admission.truncate), self._prefill, (PrefillBatch(**admission.arrays),), (self.kernels, admission.truncate)
        )
        self._count_compilation("prefill", variants, dispatched, "prefill of %d x %d prompt tokens" % admission.arrays["token_ids"].shape)
        self._in_flight.append(_InFlight("prefill", _copy_to_host((tokens, logprobs, finished)), dispatched, admission=admission))

    def _dispatch_decode(self, scheduler: Scheduler) -> None:
        # Only the slots up to the highest one in use, rounded up to few shapes (each compiled once).
        slots_used = slots_bucket(scheduler.highest_slot() + 1, self.config.max_seqs, self.min_decode_slots)
        self._hold_device()
        dispatched = time.perf_counter()
        variants = jit_cache_size(self._compiled_calls["decode"])
        truncate = scheduler.truncating
        self._cache, self._state, *outputs = self._call(
            ("decode", slots_used, truncate), self._decode, (), (self.kernels, self.config.decode_steps, slots_used, truncate)
        )
        self._count_compilation("decode", variants, dispatched, f"decode of {slots_used} slots")
        self._in_flight.append(_InFlight("decode", _copy_to_host(outputs), dispatched, owners=list(scheduler.slots[:slots_used])))

    def _read_back(self, scheduler: Scheduler, call: _InFlight) -> None:
        outputs = jax.device_get(call.outputs)
        ready = time.perf_counter()
        seconds = ready - max(call.dispatched_at, self._last_ready)
        self._last_ready = ready
        if call.kind == "prefill":
            admission = call.admission
            self.stats.prefill_seconds += seconds
            self.stats.prefill_calls += 1
            self.stats.prompt_tokens += int(admission.arrays["lengths"].sum())
            self.stats.generated_tokens += len(admission.new_slots)
            done = scheduler.record_first(admission, *outputs)
        else:
            tokens, logprobs, active = outputs
            self.stats.decode_seconds += seconds
            self.stats.decode_calls += 1
            self.stats.decode_steps += self.config.decode_steps
            self.stats.generated_tokens += int((tokens >= 0).sum())
            done = scheduler.record_chunk(tokens, logprobs, active, call.owners)
        self._publish()  # before answering: a caller that reads the stats then sees its pages freed
        self._complete(done)

    def _count_compilation(self, call: str, variants_before: int, started: float, shape: str) -> None:
        if jit_cache_size(self._compiled_calls[call]) > variants_before:
            self.stats.compilations += 1
            logger.info(
                "engine: %s compiled on first use (%.1fs); `precompile_prompt_lens` compiles such shapes at start",
                shape,
                time.perf_counter() - started,
            )

    def _check_idle_after_failure(self) -> None:
        """Every page is free once the failed requests are answered; if not (a bug), the engine starts over
        with a fresh allocator rather than letting its thread die with the requests still queued."""
        try:
            self.pages.check_idle()
        except AssertionError:
            logger.exception("KV pages still referenced after a failure; the page allocator is reset")
            queued = self.scheduler.queue
            self._new_allocator()
            self.scheduler.queue = queued

    def _new_allocator(self) -> None:
        """Every KV page free, every slot empty."""
        self.pages = PageAllocator(self.cache_spec.num_pages)
        self.scheduler = Scheduler(self.config, self.pages, self.table_width, self.min_prefill_tokens)

    def _complete(self, jobs) -> None:
        for running in jobs:
            result = running.result()
            if running.job.top_logprobs and not running.job.future.done():
                result.samples[:] = [self._with_alternatives(running.job, sample) for sample in result.samples]
            complete(running.job.future, result)
            self.stats.completed += 1

    def _with_alternatives(self, job: GenerationJob, sample: Sample) -> Sample:
        start, k = len(job.prompt_ids) - 1, job.top_logprobs  # position p scores token p + 1
        _, _, top_ids, top_logprobs = self._score_tokens(job.prompt_ids + sample.token_ids)
        end = start + len(sample.token_ids)
        return dataclasses.replace(sample, top_ids=top_ids[start:end, :k], top_logprobs=top_logprobs[start:end, :k])

    def _publish(self) -> None:
        self.stats.pages_in_use = self.pages.num_used
        self.stats.active_slots = self.scheduler.num_active
        self.stats.queued = len(self.scheduler.queue) + len(self._inbox)

    def _score_job(self, job: GenerationJob) -> PromptScores:
        n, k = len(job.prompt_ids), job.prompt_logprobs
        logp, ranks, top_ids, top_logp = self._score_tokens(job.prompt_ids)
        return PromptScores(logp[: n - 1], ranks[: n - 1], top_ids[: n - 1, :k], top_logp[: n - 1, :k])

    def _score_tokens(self, ids: list[int]) -> tuple[np.ndarray, ...]:
        """One forward pass over `ids`: (log-prob of each next token, its rank, the top `max_logprobs`
        ids and their log-probs) at each position."""
        tokens = np.zeros((1, bucket(len(ids), MIN_PREFILL_TIME)), np.int32)
        tokens[0, : len(ids)] = ids
        with self._lock:
            out = self._score(self._leaves, self.kernels, tokens, np.asarray([len(ids)], np.int32), self._top_k)
            return jax.device_get(out)
