"""Seconds per weight push, from the learner's float32 model to a server's serving copy:

- `colocated`: into an engine on the learner's device (a cast, in place).
- `device`: into an engine on device `--engine-device` (cast where the model lives, then one copy device
  to device), as `placement.server_devices` does.
- `upload`: to a `marin-rl serve` process (on the GPU `--engine-device`, through CUDA_VISIBLE_DEVICES) as
  `broadcaster.remote_transfer: upload` sends it: safetensors bytes of `--export-dtype` in the body of
  POST /v1/weights/upload, no file. Prints the split: bytes made, then the request (upload, load, swap).

Each upload is confirmed by the server (the version it serves). Bit-exactness is the tests' job
(tests/broadcaster/test_remote_transport.py).

    python benchmarks/bench_swap.py --size 1b --to colocated device upload --engine-device 1    # 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_swap.py --size tiny --dtype float32 --export-dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_generate import SIZES, build

TOKEN = "bench-swap-token"


def in_process(model, args, device) -> list[float]:
    from marin_rl.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(max_seqs=8, max_seq_len=1024, compute_dtype=args.dtype), model, device=device)
    seconds = []
    for version in range(1, args.swaps + 1):
        start = time.perf_counter()
        engine.swap(model, version)  # copy (cast, one array per layer) + install at the next device call
        seconds.append(time.perf_counter() - start)
    engine.stop()
    return seconds


def upload(model, args) -> list[float]:
    import httpx

    from marin_rl.broadcaster import BytesExports, RemoteTransport
    from marin_rl.learner import save_hf_model
    from marin_rl.testing import start_serve_process
    from marin_rl.tokenizer import load_tokenizer

    work = tempfile.mkdtemp(prefix="bench-swap-")
    tokenizer = load_tokenizer("char")
    checkpoint = save_hf_model(model, tokenizer, os.path.join(work, "start"))
    if args.engine_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.engine_device)  # for the serve process only
    flags = ["--server.max_seqs=8", "--server.max_seq_len=1024", f"--server.compute_dtype={args.dtype}", "--tokenizer=char"]
    process, base_url = start_serve_process(checkpoint, work, token=TOKEN, flags=flags, timeout_s=900)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    answers, post = [], httpx.post

    def recorded(url, **kwargs):
        response = post(url, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:2000]}\nserver log:\n{log_tail(work)}")
        answers.append(response.json())
        return response

    httpx.post = recorded
    try:
        exports = BytesExports(args.export_dtype)  # what the broadcaster makes once per version
        remote = RemoteTransport(base_url, TOKEN, exports=exports, timeout_s=900)
        seconds, made = [], []
        for version in range(1, args.swaps + 1):
            start = time.perf_counter()
            payload = exports.export(model, version)
            made.append(time.perf_counter() - start)
            remote.push(model, version)
            seconds.append(time.perf_counter() - start)
            assert remote.confirmed_version() == version
        remote.close()
    finally:
        httpx.post = post
        process.terminate()
        process.wait(timeout=60)
    size = len(payload.weights) / 2**20
    loads = [a["load_seconds"] for a in answers[1:]]
    swaps = [a["swap_seconds"] for a in answers[1:]]
    print(
        f"upload: {size:,.0f} MiB of {args.export_dtype or 'float32'} per push; median of pushes 2..: bytes made "
        f"{statistics.median(made[1:]):.3f} s, request {statistics.median(seconds[1:]) - statistics.median(made[1:]):.3f} s "
        f"(server load {statistics.median(loads):.3f} s, swap {statistics.median(swaps):.3f} s)",
        flush=True,
    )
    return seconds


def log_tail(work: str) -> str:
    logs = sorted(Path(work).glob("serve-*.log"))
    return logs[-1].read_text()[-4000:] if logs else "(none)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--dtype", default="bfloat16", help="the servers' compute dtype")
    parser.add_argument("--export-dtype", default="bfloat16", help="upload: dtype of the bytes sent")
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--to", nargs="+", choices=["colocated", "device", "upload"], default=["colocated"])
    parser.add_argument("--engine-device", type=int, default=1, help="device: the engine's device index; upload: the serve process's GPU")
    args = parser.parse_args()

    from marin_rl.compiles import prepare_process

    prepare_process()  # as `marin-rl train` runs
    import jax

    model = build(args.size, 1024)
    params = sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size"))
    for target in args.to:
        if target == "upload":
            seconds = upload(model, args)
        else:
            seconds = in_process(model, args, jax.devices()[args.engine_device] if target == "device" else None)
        print(
            f"{jax.devices()[0].device_kind}: {args.size} ({params / 1e9:.2f}B params) push to {target}, serving {args.dtype}: "
            f"first {seconds[0]:.3f} s, then median {statistics.median(seconds[1:]):.3f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
