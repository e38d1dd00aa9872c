"""The HTTP layer's own cost: the server's app in uvicorn, over an engine that answers every job at once
(so no device and no generation), and `--concurrency` completion requests of `--tokens` tokens sent at
once by an `openai` client in a process of its own. Prints completion tokens/s and requests/s of the
HTTP path, and the server's CPU milliseconds per request: what the path costs next to a real engine.

    python benchmarks/bench_http.py --concurrency 128 --tokens 256 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time

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
    app = build_app(config, tokenizer, InstantEngine(args.tokens, len(tokenizer)), len(tokenizer))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
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


if __name__ == "__main__":
    main()
