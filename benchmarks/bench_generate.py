"""Generation benchmark: the engine, engine-direct and through the HTTP API, against transformers.

A randomly initialised Llama of the 1B shape (hidden 2048, MLP 8192, 16 layers, 32/8 heads, vocab
32,000, bf16), prompts of 128 random tokens, every completion exactly `new_tokens` long (no stop), for
each number of concurrent requests (n=1 each; each client sends `--requests-per-client` requests one
after the other, so that many stay in flight). Prints generated tokens/s, the median time to first
token and the engine's milliseconds per decode step in each mode; with torch installed (another process, so its CUDA context is separate), the same shape
through transformers `generate()` (sampling, dynamic cache).

    python benchmarks/bench_generate.py                          # the 1B shape, on the GPU machine
    python benchmarks/bench_generate.py --size tiny --new-tokens 32 --concurrency 1 8   # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 256, 2, 4, 2, 1000),
    "1b": (2048, 8192, 16, 32, 8, 32000),
    "0.5b": (1024, 4096, 24, 16, 16, 128),  # bench_loop.py's model (its char vocabulary rounded up)
}


def build(size: str, seq_len: int):
    import jax

    from marin_rl.learner import ModelConfig, build_model

    hidden, mlp, layers, heads, kv, vocab = SIZES[size]
    config = ModelConfig(
        hidden_dim=hidden, intermediate_dim=mlp, num_layers=layers, num_heads=heads, num_kv_heads=kv, seq_len=seq_len
    )
    return build_model(config, vocab, key=jax.random.PRNGKey(0))


def with_lora(model, rank: int, serving: str):
    """`model` with trained-looking adapters (B not zero) on every linear layer of its blocks, in bf16 as a
    LoRA run's frozen base is on a GPU. With `serving` "apply" the engine's merge is switched off (here only),
    so its forward computes x W + scale x A B at every layer: the alternative to merging, to compare."""
    import jax.numpy as jnp

    import marin_rl.engine._weights as engine_weights
    from marin_rl.learner import LoraConfig
    from marin_rl.learner._lora import with_frozen_base_in
    from marin_rl.testing import with_trained_adapters

    if serving == "apply":
        engine_weights.merged = lambda adapted: adapted
    return with_frozen_base_in(with_trained_adapters(model, LoraConfig(rank=rank), seed=1, scale=0.01), jnp.bfloat16)


def jobs_for(concurrency: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
    from marin_rl.engine import GenerationJob

    rng = np.random.default_rng(seed)
    return [
        GenerationJob(rng.integers(0, vocab, prompt_len).tolist(), 1, new_tokens, 1.0, int(rng.integers(2**62)), [])
        for _ in range(concurrency)
    ]


def engine_load(engine, since: dict | None = None, wall: float = 0.0) -> dict:
    """The engine's counters now, or (`since`: counters from before a run of `wall` seconds) that run's
    ms per decode step, slots decoded per step, prefill calls, and the share of the wall time the device
    worked for the engine: tokens/s is slots / step time x that share."""
    s = engine.stats
    now = {"steps": s.decode_steps, "seconds": s.decode_seconds + s.prefill_seconds, "decode_s": s.decode_seconds, "tokens": s.generated_tokens, "prefills": s.prefill_calls}
    if since is None:
        return now
    delta = {k: now[k] - since[k] for k in now}
    steps = max(1, delta["steps"])
    return {
        "step_ms": 1000 * delta["decode_s"] / steps,
        "slots": (delta["tokens"] - delta["prefills"]) / steps,
        "prefills": delta["prefills"],
        "busy": delta["seconds"] / wall,
    }


def engine_run(engine, jobs, concurrency: int) -> tuple[float, float, dict]:
    """(generated tokens/s, median time to first token in s, `engine_load`) for `jobs` with `concurrency`
    in flight: each one that ends submits the next, as a client with that many workers does."""
    before = engine_load(engine)
    waiting = list(reversed(jobs[concurrency:]))
    lock, finished = threading.Lock(), threading.Semaphore(0)

    def submit_next(_future) -> None:
        with lock:
            job = waiting.pop() if waiting else None
        if job is not None:
            engine.submit(job).add_done_callback(submit_next)
        finished.release()

    start = time.perf_counter()
    for job in jobs[:concurrency]:
        engine.submit(job).add_done_callback(submit_next)
    for _ in jobs:
        finished.acquire()
    wall = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for j in jobs for s in j.future.result().samples)
    return tokens / wall, statistics.median(j.first_token_at - j.submitted_at for j in jobs), engine_load(engine, before, wall)


def prefill_run(engine, jobs) -> tuple[float, float]:
    """(ms per prefill call, ms of wall time per job) for `jobs` sent one after the other, each a group
    that ends at its first token: the pattern of env workers that each submit one group at a time."""
    calls, seconds = engine.stats.prefill_calls, engine.stats.prefill_seconds
    start = time.perf_counter()
    for job in jobs:
        engine.submit(job)
        job.future.result()
    wall = time.perf_counter() - start
    return 1000 * (engine.stats.prefill_seconds - seconds) / (engine.stats.prefill_calls - calls), 1000 * wall / len(jobs)


def http_run(server, jobs, concurrency: int, client_processes: int = 0, client: str = "aiohttp") -> tuple[float, float, dict]:
    """The same through POST /v1/completions (token-id prompts), `concurrency` requests in flight, from an
    `openai.AsyncOpenAI` client in this process (`client_processes` 0), or split among that many client
    processes, as remote env workers send them. In this process the client's Python (its connection pool,
    response parsing) holds the interpreter lock the server and the engine's host loop need; one client
    process parses the answers of a wave of equal-length requests one after the other."""
    submitted = []
    engine = server.engine
    submit = engine.submit
    before = engine_load(engine)

    def recording_submit(job):  # the engine's view of each request, for its time to first token
        submitted.append(job)
        return submit(job)

    requests = [{"prompt": j.prompt_ids, "max_tokens": j.max_tokens, "seed": j.seed} for j in jobs]
    occupancy, done = [], threading.Event()

    def watch() -> None:  # every 10 ms: requests the server holds, and of them queued in the engine
        while not done.wait(0.01):
            held = sum(not j.future.done() for j in submitted)
            if held:
                occupancy.append((held, engine.stats.queued))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    engine.submit = recording_submit
    try:
        if client_processes:
            start_at = time.time() + 5  # every client imported and connected by then
            clients = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--client-of",
                        server.base_url,
                        f"--concurrency={concurrency // client_processes}",
                        f"--start-at={start_at}",
                        f"--client={client}",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for _ in range(client_processes)
            ]
            for i, client in enumerate(clients):  # every client gets its requests before any is waited for
                client.stdin.write(json.dumps(requests[i::client_processes]))
                client.stdin.close()
            answers = [client.stdout.read() for client in clients]
            for client in clients:
                client.wait()
            if any(client.returncode for client in clients):
                raise RuntimeError(f"a client process failed: exit codes {[client.returncode for client in clients]}")
            results = [json.loads(answer.strip().splitlines()[-1]) for answer in answers]
            tokens, wall = sum(r[0] for r in results), max(r[2] for r in results) - min(r[1] for r in results)
        else:
            tokens, started, ended = asyncio.run(send_completions(server.base_url, requests, concurrency, client=client))
            wall = ended - started
    finally:
        engine.submit = submit
        done.set()
        watcher.join()
    load = engine_load(engine, before, wall)
    load["held"], load["queued"] = (statistics.mean(o[i] for o in occupancy) if occupancy else 0.0 for i in (0, 1))
    return tokens / wall, statistics.median(j.first_token_at - j.submitted_at for j in submitted), load


async def send_completions(
    base_url: str, requests: list[dict], concurrency: int, start_at: float | None = None, client: str = "openai"
) -> tuple[int, float, float]:
    """(completion tokens, start, end as `time.time()`) of `requests` sent with the `openai` client by
    `concurrency` workers, each sending its next request when its last one is answered; from `start_at`
    on. `client`: the client's HTTP backend, `aiohttp` (what env workers use) or `httpx` (the SDK's
    default, whose connection pool costs about 10 ms of CPU a request at 128 in flight on the 2-core VM);
    `raw`: aiohttp without the SDK, which shows the SDK's own cost (about 2 of its 2.7 ms of CPU a request
    on the 2-core VM)."""
    import aiohttp
    import openai

    from marin_rl.envs import token_prompt_arguments

    http = openai.DefaultAioHttpClient(timeout=3600) if client == "aiohttp" else None
    async with (
        openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600, http_client=http) as sdk,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        waiting = list(reversed(requests))
        tokens = 0

        async def send(request: dict) -> int:
            if client != "raw":
                # As `OpenAISampler` sends them: the prompt in extra_body, which the SDK does not walk.
                prompt, rest = request["prompt"], {k: v for k, v in request.items() if k != "prompt"}
                response = await sdk.completions.create(model="policy", temperature=1.0, **rest, **token_prompt_arguments(prompt, ignore_eos=True))
                return response.usage.completion_tokens
            async with session.post(f"{base_url}/completions", json={"model": "policy", "temperature": 1.0, "ignore_eos": True, **request}) as response:
                response.raise_for_status()
                return (await response.json())["usage"]["completion_tokens"]

        async def worker() -> None:
            nonlocal tokens
            while waiting:
                answered = await send(waiting.pop())  # `tokens += await ...` would read `tokens` before the await
                tokens += answered

        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens, start, time.time()


def transformers_run(size: str, concurrency: int, prompt_len: int, new_tokens: int) -> float | None:
    """transformers `generate()` tokens/s in a fresh process with the image's torch (None without torch)."""
    code = f"""
import time, torch, transformers
hidden, mlp, layers, heads, kv, vocab = {SIZES[size]}
config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings={prompt_len + new_tokens})
device = "cuda" if torch.cuda.is_available() else "cpu"
model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32).eval()
ids = torch.randint(0, vocab, ({concurrency}, {prompt_len}), device=device)
kw = dict(do_sample=True, max_new_tokens={new_tokens}, min_new_tokens={new_tokens}, attention_mask=torch.ones_like(ids), pad_token_id=0)
with torch.no_grad():
    model.generate(ids[:, :16], **{{**kw, "max_new_tokens": 8, "min_new_tokens": 8}})
    if device == "cuda": torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **kw)
    if device == "cuda": torch.cuda.synchronize()
print((out.shape[1] - {prompt_len}) * {concurrency} / (time.perf_counter() - start))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the image's own transformers
    python = os.environ.get("TORCH_PYTHON", "python3")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    except FileNotFoundError:
        return None
    if out.returncode != 0:
        print(f"  transformers: skipped ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})")
        return None
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["engine", "http", "http-process", "transformers"],
        choices=["engine", "http", "http-process", "transformers"],
        help="http: the openai client in this process; http-process: in --client-processes processes of their own",
    )
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="requests each of the concurrent clients sends, one after the other (1: one wave, where the start and the end of the wave weigh)",
    )
    parser.add_argument("--transformers-concurrency", type=int, nargs="+", default=None, help="default: --concurrency")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--max-seqs", type=int, default=None, help="engine slots; default the largest --concurrency")
    parser.add_argument("--min-decode-slots", type=int, default=None, help="fewest rows a decode call computes (default: the engine's)")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--max-seq-len", type=int, default=None, help="engine context (and KV cache per slot); default prompt + new tokens")
    parser.add_argument("--profile", default=None, help="trace one more engine run (the last row's shape) into this dir; print its top ops")
    parser.add_argument("--prefill-group", type=int, default=8, help="samples per prompt of the prefill-latency run")
    parser.add_argument("--client-of", default=None, help=argparse.SUPPRESS)  # http-process: a client, requests on stdin
    parser.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)  # a client's start (time.time())
    parser.add_argument("--client-processes", type=int, default=1, help="http-process: client processes sharing the concurrent requests")
    parser.add_argument(
        "--client", choices=["aiohttp", "httpx", "raw"], default="aiohttp", help="the openai client's HTTP backend; raw: aiohttp without the openai SDK"
    )
    parser.add_argument("--prefill-profile", default=None, help="trace the prefill-latency run into this dir; print its top ops")
    parser.add_argument("--lora-rank", type=int, default=0, help="serve the model with trained LoRA adapters of this rank (every linear layer)")
    parser.add_argument(
        "--lora-serving",
        default="merge",
        choices=["merge", "apply"],
        help="merge: the adapters merged into the engine's weights (what the engine does); apply: kept apart and "
        "applied in every forward (x W + x A B), measured for comparison",
    )
    args = parser.parse_args()
    if args.client_of:
        print(json.dumps(asyncio.run(send_completions(args.client_of, json.loads(sys.stdin.read()), args.concurrency[0], args.start_at, args.client))))
        return

    from marin_rl.compiles import prepare_process

    prepare_process()  # as `marin-rl serve` runs
    import jax

    from marin_rl._upstream import restore_jax_core_is_constant_dim
    from marin_rl.interpreter import tune_interpreter
    from marin_rl.server import InferenceServerConfig, PolicyServer
    from marin_rl.tokenizer import load_tokenizer

    restore_jax_core_is_constant_dim()
    max_len = args.max_seq_len or args.prompt_len + max(args.new_tokens)
    max_seqs = args.max_seqs or max(args.concurrency)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    start = time.perf_counter()
    model = build(args.size, max_len)
    if args.lora_rank:
        model = with_lora(model, args.lora_rank, args.lora_serving)
    built = time.perf_counter() - start
    config = InferenceServerConfig(
        max_seqs=max_seqs,
        max_seq_len=max_len,
        page_size=args.page_size,
        max_prefill_tokens=max(max_len, max_seqs * args.prompt_len),
        decode_steps=args.decode_steps,
        min_decode_slots=args.min_decode_slots,
        precompile_prompt_lens=(args.prompt_len,),
        compute_dtype=args.dtype,
        attention=args.attention,
        request_timeout_s=3600,
    )
    vocab = SIZES[args.size][-1]
    tokenizer = load_tokenizer("char")  # the HTTP layer needs one; prompts are token ids
    server = PolicyServer(config, model, tokenizer).start()
    tune_interpreter(jax.default_backend())  # as `marin-rl serve` runs
    if args.lora_rank:  # a swap of the adapted model: the engine's copy of its weights, adapters merged or not
        seconds = [server.swap_weights(model, 0).copy_seconds for _ in range(3)]
        print(f"lora rank {args.lora_rank}, {args.lora_serving}: swap copy seconds {', '.join(f'{s:.3f}' for s in seconds)}")
    del model
    engine = server.engine
    print(
        f"model {args.size} built in {built:.1f}s, engine compiled in {time.perf_counter() - start - built:.1f}s; "
        f"decode attention {engine.kernels.decode}, prefill "
        f"{engine.kernels.prefill}, KV cache {engine.cache_spec.tokens} tokens ({engine.cache_spec.gib:.2f} GiB)"
    )
    rows = []
    for new_tokens in args.new_tokens:
        for concurrency in args.concurrency:
            start = time.perf_counter()  # a short run first: the rare shapes (steps < decode_steps), Python paths
            http_run(server, jobs_for(concurrency, args.prompt_len, 2 * args.decode_steps, vocab, 0), concurrency)
            row = {"new_tokens": new_tokens, "concurrency": concurrency, "warmup_s": round(time.perf_counter() - start, 1)}
            count = concurrency * args.requests_per_client
            if "engine" in args.modes:
                jobs = jobs_for(count, args.prompt_len, new_tokens, vocab, 1)
                row["engine_tok_s"], row["engine_ttft_s"], row["engine_load"] = engine_run(engine, jobs, concurrency)
            if "http" in args.modes:
                jobs = jobs_for(count, args.prompt_len, new_tokens, vocab, 2)
                row["http_tok_s"], row["http_ttft_s"], row["http_load"] = http_run(server, jobs, concurrency, client=args.client)
            if "http-process" in args.modes:
                jobs = jobs_for(count, args.prompt_len, new_tokens, vocab, 2)
                row["http_process_tok_s"], row["http_process_ttft_s"], row["http_process_load"] = http_run(
                    server, jobs, concurrency, client_processes=args.client_processes, client=args.client
                )
            print(json.dumps(row), flush=True)
            rows.append(row)
    # Prefill latency: one prompt of --prefill-group samples at a time, as an RL env worker sends them.
    group_jobs = lambda seed: [  # noqa: E731
        dataclasses.replace(j, n=args.prefill_group, max_tokens=1) for j in jobs_for(20, args.prompt_len, 1, vocab, seed)
    ]
    prefill_run(engine, group_jobs(4))
    call_ms, job_ms = prefill_run(engine, group_jobs(5))
    print(f"prefill, one prompt of {args.prompt_len} tokens x {args.prefill_group} samples at a time: {call_ms:.2f} ms per call, {job_ms:.2f} ms per request")
    if args.prefill_profile:
        from bench_learner import print_top_ops

        with jax.profiler.trace(args.prefill_profile):
            prefill_run(engine, group_jobs(6))
        print_top_ops(args.prefill_profile)
    if args.profile:
        from bench_learner import print_top_ops

        with jax.profiler.trace(args.profile):
            engine_run(engine, jobs_for(rows[-1]["concurrency"], args.prompt_len, rows[-1]["new_tokens"], vocab, 3), rows[-1]["concurrency"])
        print_top_ops(args.profile)
    stats = engine.stats
    server.shutdown()
    assert stats.errors == 0 and stats.pages_in_use == 0, stats
    if "transformers" in args.modes:
        for row in rows:
            if args.transformers_concurrency is None or row["concurrency"] in args.transformers_concurrency:
                row["transformers_tok_s"] = transformers_run(args.size, row["concurrency"], args.prompt_len, row["new_tokens"])
                print(json.dumps(row), flush=True)

    print(f"\n{args.size}, prompts of {args.prompt_len} tokens, {jax.devices()[0].device_kind}")
    print(
        f"{'new':>5} {'conc':>5} | {'engine tok/s':>12} {'TTFT s':>7} | {'HTTP tok/s':>10} {'TTFT s':>7} | "
        f"{'HTTP, client process':>20} {'TTFT s':>7} | {'transformers':>12} {'x':>5}"
    )
    for r in rows:
        hf = r.get("transformers_tok_s")
        ratio = f"{r['engine_tok_s'] / hf:5.1f}" if hf and "engine_tok_s" in r else ""
        print(
            f"{r['new_tokens']:>5} {r['concurrency']:>5} | {r.get('engine_tok_s', 0):>12,.0f} {r.get('engine_ttft_s', 0):>7.3f} | "
            f"{r.get('http_tok_s', 0):>10,.0f} {r.get('http_ttft_s', 0):>7.3f} | "
            f"{r.get('http_process_tok_s', 0):>20,.0f} {r.get('http_process_ttft_s', 0):>7.3f} | {hf or 0:>12,.0f} {ratio:>5}"
        )
    print("the engine in each run: ms per decode step, slots decoded per step, prefill calls, share of the time the device worked")
    for r in rows:
        for mode in ("engine", "http", "http_process"):
            if f"{mode}_load" in r:
                load = r[f"{mode}_load"]
                held = f", requests held by the server {load['held']:.1f} (queued {load['queued']:.1f})" if "held" in load else ""
                print(
                    f"  {r['new_tokens']:>5} x {r['concurrency']:>4} {mode:>12}: {load['step_ms']:.2f} ms, {load['slots']:.1f} slots, "
                    f"{load['prefills']} prefills, busy {load['busy']:.2f}{held}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
