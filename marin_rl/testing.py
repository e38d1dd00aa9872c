"""Builders of valid records for tests (ours and researchers')."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from marin_rl.types import InferenceMetadata, Rollout, Turn

_uids = itertools.count()


def make_rollout(
    *,
    env: str = "env",
    group_id: str = "g0",
    problem_id: str = "p0",
    prompt_len: int = 4,
    completion_len: int = 3,
    reward: float = 1.0,
    policy_version: int = 0,
    is_truncated: bool = False,
    rewards: dict[str, float] | None = None,
    seed: int | None = None,
    rollout_uid: str | None = None,
) -> Rollout:
    """A single-turn rollout with random ids (in [1, 100)) and logprobs."""
    rng = np.random.default_rng(seed)
    prompt = Turn("user", "prompt", rng.integers(1, 100, prompt_len).astype(np.int32))
    completion = Turn(
        "assistant",
        "completion",
        rng.integers(1, 100, completion_len).astype(np.int32),
        logprobs=-rng.random(completion_len).astype(np.float32),
        inference_metadata=InferenceMetadata(
            server_id="test", model="test", policy_version=policy_version, finish_reason="length" if is_truncated else "stop"
        ),
    )
    return Rollout(
        environment=env,
        problem_id=problem_id,
        rollout_uid=rollout_uid or f"{env}-{next(_uids)}",
        group_id=group_id,
        turns=(prompt, completion),
        rewards={"correct": reward} if rewards is None else rewards,
        reward=reward,
        is_truncated=is_truncated,
    )


def make_group(
    rewards: list[float],
    *,
    env: str = "env",
    group_id: str = "g0",
    prompt_len: int = 4,
    completion_lens: list[int] | None = None,
    policy_version: int = 0,
    seed: int = 0,
    problem_id: str | None = None,
) -> list[Rollout]:
    """One group: a rollout per reward, sharing a prompt length and group id (and problem: `problem_id`,
    by default the group id)."""
    completion_lens = completion_lens or [3] * len(rewards)
    return [
        make_rollout(
            env=env,
            group_id=group_id,
            problem_id=group_id if problem_id is None else problem_id,
            prompt_len=prompt_len,
            completion_len=n,
            reward=r,
            policy_version=policy_version,
            seed=seed + i,
        )
        for i, (r, n) in enumerate(zip(rewards, completion_lens, strict=True))
    ]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server that must come back on the same one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 now (Ray's server actors take `ray.server_port + i`)."""
    import socket

    for _ in range(100):
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def start_serve_process(checkpoint, workdir, *, token: str | None = None, port: int = 0, flags=(), timeout_s: float = 240):
    """A `marin-rl serve` subprocess of `checkpoint`, returned with its base URL once it listens.

    Its output goes to `workdir/serve-<n>.log` (named in the error if it does not start); stop it with
    `process.terminate()` (or kill it: that is what the reliability tests do).
    """
    import json
    import time

    workdir = Path(workdir)
    n = len(list(workdir.glob("serve-*.log")))
    ready, log_path = workdir / f"serve-{n}.ready.json", workdir / f"serve-{n}.log"
    command = [
        sys.executable, "-m", "marin_rl.server", f"--checkpoint={Path(checkpoint).resolve()}",
        f"--server.port={port}", f"--ready_file={ready}", *flags,
    ]  # fmt: skip
    env = {**os.environ, **({"MARIN_RL_WEIGHT_TOKEN": token} if token else {})}
    with open(log_path, "w") as log:
        # In `workdir`: `-m` puts the working directory first on the path, and a source tree's own
        # `marin_rl/` folder (without the packages an install maps into it) would shadow the package.
        process = subprocess.Popen(command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"serve process did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return process, json.loads(ready.read_text())["base_url"]


QUICK_RUN = ["--batcher.total_token_budget=640", "--batcher.max_wait_s=5", "--server.max_seqs=16"]
"""Overrides that shrink the quickstart so a step is quick on a shared CPU."""


def run_command(args: list[str], cwd: str | os.PathLike | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`marin-rl ARGS` as a user runs it: the installed script, without PYTHONPATH."""
    script = Path(sys.executable).with_name("marin-rl")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def metrics_records(run_dir) -> list[dict]:
    """The run's metrics.jsonl, one dict per logged step (none before the first)."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # the last line may be half written


def train_until(config, reached, poll_s: float = 0.5):
    """`train(config)`, stopped as a signal stops it once `reached(records)` holds for the steps logged so
    far (or at `max_steps`): a test of learning within N steps need not run the steps after it learned.
    Returns (the run's result, its records)."""
    import threading

    from marin_rl.orchestrator import train

    stop, result = threading.Event(), {}
    trainer = threading.Thread(target=lambda: result.setdefault("run", train(config, stop=stop)), name="train-until")
    trainer.start()
    while trainer.is_alive():
        trainer.join(poll_s)
        if not stop.is_set() and reached(metrics_records(config.run_dir)):
            stop.set()
    assert "run" in result, "train raised (its traceback is above)"
    return result["run"], metrics_records(config.run_dir)


def compilations_after_first_step(records: list[dict]) -> dict[int, float]:
    """Step -> compilations during it, for the steps after the first that compiled (metrics.jsonl
    records, in order; `compile/count` is the run's total so far)."""
    counts = [(r["step"], r["compile/count"]) for r in records]
    return {step: count - before for (_, before), (step, count) in zip(counts, counts[1:]) if count != before}


def with_trained_adapters(base, lora_config, *, seed: int, scale: float = 0.05):
    """`base` with LoRA adapters (`lora_config`) whose B is drawn from N(0, scale^2) instead of zero, as
    after training: the adapted model computes something else than the base."""
    import equinox as eqx
    import jax

    from marin_rl.learner import add_adapters

    model = add_adapters(base, lora_config, key=jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(model))))

    def perturb(path, x):
        key = next(keys)
        return x + scale * jax.random.normal(key, x.shape, x.dtype) if "lora_B" in jax.tree_util.keystr(path) else x

    return eqx.combine(jax.tree_util.tree_map_with_path(perturb, eqx.filter(model, eqx.is_array)), model)
