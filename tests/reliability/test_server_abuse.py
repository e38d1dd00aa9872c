"""A `marin-rl serve` process under bad input: huge bodies, huge prompts, 60k prompts in one request,
floods of empty messages, non-finite floats, a request at the sequence limit beside small ones, 200
concurrent requests, and requests generated from its own OpenAPI schema (schemathesis). No 500, and
it keeps serving.

Memory bound stated and checked: a 200 MB body (declared or chunked), a prompt just under the body
limit, 60k prompts and 200k empty messages each grow the server's resident memory by less than
`MEMORY_BOUND`.
"""

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from urllib.parse import urlparse

import httpx
import jax
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from marin_rl.learner import ModelConfig, build_model, save_hf_model
from marin_rl.testing import start_serve_process
from marin_rl.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"
MEMORY_BOUND = 64 * 2**20
HUGE = 200 * 2**20
JSON = {"content-type": "application/json"}


class Server:
    def __init__(self, process, base_url):
        self.process, self.base_url = process, base_url
        parsed = urlparse(base_url)
        self.host, self.port, self.root = parsed.hostname, parsed.port, f"{parsed.scheme}://{parsed.netloc}"

    def rss(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve")
    tokenizer = load_tokenizer("char")
    config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64)
    checkpoint = save_hf_model(build_model(config, len(tokenizer), key=jax.random.key(0)), tokenizer, workdir / "model")
    flags = ["--tokenizer=char", "--server.max_seqs=8", "--server.max_seq_len=64", "--server.page_size=16", "--server.decode_steps=8"]
    process, base_url = start_serve_process(checkpoint, workdir, token=TOKEN, flags=flags)
    server = Server(process, base_url)
    completion(server)  # compiled before anything is measured
    yield server
    process.terminate()
    process.wait(timeout=60)


def completion(server, **body):
    response = httpx.post(f"{server.base_url}/completions", json={"prompt": "1+1=", "max_tokens": 4, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


class PeakMemory:
    """The server's highest resident memory while the block runs (sampled every 5 ms)."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        self.before = self.peak = self.server.rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)
        self._thread.start()
        return self

    def _watch(self):
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self.server.rss())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.before


def post_raw(server, total: int, chunked: bool) -> tuple[bytes, int]:
    """POST a `total`-byte body to /v1/completions while reading the answer; returns the answer's
    first bytes and how many body bytes were sent before it came (or the server hung up)."""
    sock = socket.create_connection((server.host, server.port), timeout=60)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode())
    answer = {}
    reader = threading.Thread(target=lambda: answer.setdefault("head", sock.recv(4096)))
    reader.start()
    chunk, sent = b'{"prompt": "' + b"1" * (2**20 - 12), 0
    try:
        while sent < total and reader.is_alive():
            data = chunk[: total - sent]
            sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n" if chunked else data)
            sent += len(data)
    except OSError:
        pass  # the server answered and closed the connection: what it should do
    reader.join(60)
    sock.close()
    return answer.get("head", b""), sent


def test_a_200_mb_body_gets_413_without_growing_the_servers_memory(server):
    for chunked in (False, True):
        with PeakMemory(server) as memory:
            head, sent = post_raw(server, HUGE, chunked)
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        assert memory.growth < MEMORY_BOUND, f"chunked={chunked}: grew {memory.growth / 2**20:.1f} MiB"
        print(f"200 MB body, chunked={chunked}: 413 after {sent / 2**20:.0f} MiB sent, memory +{memory.growth / 2**20:.1f} MiB")


def test_a_prompt_that_cannot_fit_gets_400_before_it_is_tokenized(server):
    with PeakMemory(server) as memory:
        start = time.perf_counter()
        response = httpx.post(f"{server.base_url}/completions", json={"prompt": "1" * (7 * 2**20)}, timeout=120)
        elapsed = time.perf_counter() - start
    assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
    assert memory.growth < MEMORY_BOUND, f"grew {memory.growth / 2**20:.1f} MiB"
    print(f"7 MiB prompt: 400 in {elapsed:.2f}s, memory +{memory.growth / 2**20:.1f} MiB")


def test_200_concurrent_requests_are_all_served(server):
    async def go():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
            chats = [
                client.post("/chat/completions", json={"messages": [{"role": "user", "content": f"{i}+1="}], "max_tokens": 8})
                for i in range(100)
            ]
            completions = [client.post("/completions", json={"prompt": f"{i}+2=", "max_tokens": 8, "n": 2}) for i in range(100)]
            return await asyncio.gather(*chats, *completions)

    start = time.perf_counter()
    responses = asyncio.run(go())
    print(f"200 concurrent requests: {time.perf_counter() - start:.1f}s")
    assert [r.status_code for r in responses] == [200] * 200
    assert httpx.get(f"{server.root}/health").json()["status"] == "ok"


def test_a_request_for_60k_prompts_x_16_gets_400_without_growing_the_servers_memory(server):
    body = json.dumps({"prompt": [[5, 6, 7, 8]] * 60_000, "n": 16, "max_tokens": 4})  # encoded outside the timing
    with PeakMemory(server) as memory:
        start = time.perf_counter()
        response = httpx.post(f"{server.base_url}/completions", content=body, headers=JSON, timeout=120)
        elapsed = time.perf_counter() - start
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt"
    assert "60000 prompt(s) x n=16 = 960000 sequences; the server's max_sequences_per_request is 4096" in error["message"]
    assert memory.growth < MEMORY_BOUND, f"grew {memory.growth / 2**20:.1f} MiB"
    print(f"60k prompts x 16 ({len(body) / 2**20:.1f} MiB): 400 in {elapsed:.3f}s, memory +{memory.growth / 2**20:.1f} MiB")


def test_a_flood_of_empty_messages_gets_400_without_growing_the_servers_memory(server):
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 200_000, "max_tokens": 4})  # 6.3 MiB
    with PeakMemory(server) as memory:
        start = time.perf_counter()
        response = httpx.post(f"{server.base_url}/chat/completions", content=body, headers=JSON, timeout=120)
        elapsed = time.perf_counter() - start
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "200000 messages" in response.json()["error"]["message"]
    assert memory.growth < MEMORY_BOUND, f"grew {memory.growth / 2**20:.1f} MiB"
    print(f"200k empty messages: 400 in {elapsed:.3f}s, memory +{memory.growth / 2**20:.1f} MiB")


def test_temperature_infinity_gets_400(server):
    body = '{"prompt": "1+1=", "max_tokens": 4, "temperature": Infinity}'
    response = httpx.post(f"{server.base_url}/completions", content=body, headers=JSON, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"


def test_a_request_at_the_limit_does_not_hold_back_a_small_one(server):
    """512 prompts x 8 (4,096 sequences) on a server of 8 slots: the small request, sent after it,
    holds no slot and so is admitted as soon as one frees; it is answered while the large one runs."""

    async def small(client) -> float:
        start = time.perf_counter()
        response = await client.post("/completions", json={"prompt": "3+4=", "max_tokens": 4})
        assert response.status_code == 200
        return time.perf_counter() - start

    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            alone = [await small(client) for _ in range(5)]
            start = time.perf_counter()
            body = {"prompt": [[5, 6, 7, 8]] * 512, "n": 8, "max_tokens": 48, "ignore_eos": True}
            large = asyncio.create_task(client.post("/completions", json=body))
            await asyncio.sleep(0.3)  # the large request is queued and running
            beside = [await small(client) for _ in range(5)]
            large_done_first = large.done()
            response = await large
            return alone, beside, large_done_first, response, time.perf_counter() - start

    alone, beside, large_done_first, response, large_s = asyncio.run(go())
    assert response.status_code == 200 and len(response.json()["choices"]) == 4096
    assert not large_done_first  # every small request was answered while the large one was still running
    print(
        f"small request alone: median {sorted(alone)[2] * 1000:.0f} ms; beside 512 x 8: median "
        f"{sorted(beside)[2] * 1000:.0f} ms; the large request took {large_s:.1f}s"
    )


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_generated_from_the_openapi_schema_gets_a_500(server, mode):
    schema = schemathesis.openapi.from_url(f"{server.root}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {"POST /v1/completions", "POST /v1/weights/update"}
    calls = Counter()

    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no input to get wrong

        # With the token, so that the weight-update route is fuzzed past its authentication too.
        @given(case=operation.as_strategy(mode, headers={"Authorization": f"Bearer {TOKEN}"}))
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def no_500(case):
            response = case.call(timeout=120)
            calls[response.status_code // 100] += 1
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code} {response.text[:300]}"

        no_500()
    print(f"{mode.value}: {sum(calls.values())} requests, by status class {dict(calls)}")


def test_the_server_is_healthy_after_all_that(server):
    assert httpx.get(f"{server.root}/health").json()["status"] == "ok"
    assert completion(server)["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.process.poll() is None
