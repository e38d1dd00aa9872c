"""The HTTP layer's own cost: the server's app in uvicorn, over an engine that answers every job at once
(so no device and no generation), and `--concurrency` completion requests of `--tokens` tokens sent at
once by an `openai` client in a process of its own. Prints completion tokens/s and requests/s of the
HTTP path, and the server's CPU milliseconds per request: what the path costs next to a real engine.

    python benchmarks/bench_http.py --concurrency 128 --tokens 256 --rounds 5

With `--latency S` the engine answers each job S seconds after it came (a GPU engine's time for a
completion, without its device), and each of the `--concurrency` clients sends `--requests-per-client`
requests one after the other, through the `openai` client over `--client` (aiohttp, as env workers
send them, or httpx, the SDK's default). Prints requests/s against the ideal (concurrency / latency),
how many requests the engine held on average, and the CPU seconds of the server and the client:

    python benchmarks/bench_http.py --latency 0.25 --requests-per-client 4 --client httpx
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import importlib.util
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


class InstantEngine:
    """Answers each job with `tokens` token ids (and log-probs) as soon as it is submitted."""

    def __init__(self, tokens: int, vocab: int):
        from marin_rl.engine import JobResult, Sample

        rng = np.random.default_rng(0)
        self.sample = lambda: Sample(rng.integers(0, vocab, tokens).tolist(), (-rng.random(tokens)).tolist())
        self.result = JobResult
        self.policy_version = 0

    def submit(self, job):
        job.future.set_result(self.result([self.sample() for _ in range(job.n)], None, self.policy_version))
        return job.future


class DelayedEngine(InstantEngine):
    """Answers each job `latency` seconds after it was submitted; `held`: the jobs not answered yet."""

    def __init__(self, tokens: int, vocab: int, latency: float):
        super().__init__(tokens, vocab)
        self.latency, self.held, self._due, self._cv = latency, 0, [], threading.Condition()
        threading.Thread(target=self._answer, daemon=True).start()

    def submit(self, job):
        with self._cv:
            heapq.heappush(self._due, (time.perf_counter() + self.latency, id(job), job))
            self.held += 1
            self._cv.notify()
        return job.future

    def _answer(self) -> None:
        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.perf_counter():
                    self._cv.wait(self._due[0][0] - time.perf_counter() if self._due else None)
                job = heapq.heappop(self._due)[2]
                self.held -= 1
            super().submit(job)


async def send(base_url: str, concurrency: int, tokens: int) -> float:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        calls = [client.completions.create(model="policy", prompt=[1, 2, 3], max_tokens=tokens, logprobs=0) for _ in range(concurrency)]
        await asyncio.gather(*calls)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--client-of", default=None, help=argparse.SUPPRESS)  # the client process
    parser.add_argument("--latency", type=float, default=0.0, help="seconds the engine takes per job (0: it answers at once)")
    parser.add_argument("--requests-per-client", type=int, default=4, help="with --latency")
    parser.add_argument(
        "--client", choices=["aiohttp", "httpx", "raw"], default="aiohttp", help="with --latency: the openai client's HTTP backend; raw: aiohttp without the SDK"
    )
    args = parser.parse_args()
    if args.client_of:
        print(json.dumps([asyncio.run(send(args.client_of, args.concurrency, args.tokens)) for _ in range(args.rounds)]))
        return

    import uvicorn

    from marin_rl.server import InferenceServerConfig
    from marin_rl.server._app import build_app
    from marin_rl.testing import free_port
    from marin_rl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("char")
    config = InferenceServerConfig(max_seqs=args.concurrency, max_seq_len=args.tokens + 8)
    engine = DelayedEngine(args.tokens, len(tokenizer), args.latency) if args.latency else InstantEngine(args.tokens, len(tokenizer))
    app = build_app(config, tokenizer, engine, len(tokenizer))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    if args.latency:
        closed_loop(server, engine, args)
        return
    command = [sys.executable, __file__, f"--client-of=http://127.0.0.1:{server.config.port}/v1", f"--concurrency={args.concurrency}"]
    command += [f"--tokens={args.tokens}", f"--rounds={args.rounds + 1}"]
    process_cpu = time.process_time()
    seconds = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])[1:]
    process_cpu = time.process_time() - process_cpu
    server.should_exit = True
    thread.join()
    wall = min(seconds)
    parser_name = "httptools" if importlib.util.find_spec("httptools") else "h11"
    print(f"uvicorn with {parser_name}; {args.concurrency} requests of {args.tokens} tokens at once, best of {args.rounds} rounds")
    print(
        f"  {args.concurrency * args.tokens / wall:,.0f} completion tokens/s, {args.concurrency / wall:,.0f} requests/s; "
        f"server CPU {1000 * process_cpu / (args.concurrency * (args.rounds + 1)):.2f} ms per request"
    )


def closed_loop(server, engine: DelayedEngine, args) -> None:
    """`--latency`: the clients (bench_generate.py's, in a process of their own) keep `--concurrency`
    requests in flight; the engine's held jobs are sampled every 10 ms."""
    from marin_rl.interpreter import tune_interpreter

    tune_interpreter("gpu")  # as a server on a GPU runs
    held, done = [], threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            held.append(engine.held)

    threading.Thread(target=watch, daemon=True).start()
    count = args.concurrency * args.requests_per_client
    requests = [{"prompt": [1, 2, 3], "max_tokens": args.tokens, "seed": i} for i in range(count)]
    client = str(Path(__file__).with_name("bench_generate.py"))
    start_at = time.time() + 5  # the client imported and connected by then
    server_cpu, client_cpu = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, client, f"--client-of=http://127.0.0.1:{server.config.port}/v1", f"--concurrency={args.concurrency}"]
    command += [f"--start-at={start_at}", f"--client={args.client}"]
    out = subprocess.run(command, input=json.dumps(requests), capture_output=True, text=True, check=True)
    _, started, ended = json.loads(out.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu, client_cpu = time.process_time() - server_cpu, after.ru_utime + after.ru_stime - client_cpu.ru_utime - client_cpu.ru_stime
    done.set()
    server.should_exit = True
    busy = [h for h in held if h]
    print(
        f"engine latency {args.latency} s, {args.concurrency} clients x {args.requests_per_client} requests over {args.client}: "
        f"{count / (ended - started):,.0f} requests/s (ideal {args.concurrency / args.latency:,.0f}); the engine held "
        f"{sum(busy) / max(1, len(busy)):.1f} requests on average; CPU seconds: server {server_cpu:.1f}, client {client_cpu:.1f} "
        f"(its imports included), wall {ended - started:.1f}"
    )


if __name__ == "__main__":
    main()
