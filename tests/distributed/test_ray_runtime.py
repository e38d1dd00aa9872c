"""`runtime: ray` on a real local Ray cluster: the quickstart with 2 server actors and 2 env-worker
actors learns as the local runtime does, and goes on when a server actor and an env-worker actor die."""

import json
import threading

import numpy as np
import pytest

from marin_rl.config import load_config
from marin_rl.orchestrator import train
from marin_rl.storage import read_rollouts
from marin_rl.testing import free_port_range

pytestmark = pytest.mark.slow

STEPS = 40
KILL_SERVER_AT = 8
KILL_WORKER_AT = 14


def ray_config(run_dir, max_steps, *extra):
    return load_config(
        "configs/quickstart.yaml",
        [
            f"--run_dir={run_dir}",
            f"--max_steps={max_steps}",
            "--checkpoint_every=100",
            "--runtime=ray",
            "--ray.num_servers=2",
            "--ray.num_env_workers=2",
            f"--ray.server_port={free_port_range(2)}",
            "--ray.server_num_cpus=0.5",
            "--ray.env_worker_num_cpus=0.5",
            "--ray.object_store_mb=128",
            "--broadcaster.reconnect_max_backoff_s=2",
            *extra,
        ],
    )


def steps_logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_at(run_dir, plan, done: threading.Event, killed: dict):
    """Kill each named actor of the run (Ray restarts it) once the run has logged its step."""
    import ray

    from marin_rl.distributed._runtime import actor_namespace

    for step, name in plan:
        while steps_logged(run_dir) < step:
            if done.wait(0.2):
                return
        ray.kill(ray.get_actor(name, namespace=actor_namespace(run_dir)), no_restart=False)
        killed[name] = steps_logged(run_dir)


def train_killing(config, run_dir, plan):
    """`train(config)` while `kill_at` kills the planned actors; (its result, {actor: step killed at})."""
    done, killed = threading.Event(), {}
    killer = threading.Thread(target=kill_at, args=(run_dir, plan, done, killed))
    killer.start()
    try:
        return train(config), killed
    finally:
        done.set()
        killer.join()


def test_ray_runtime_learns_and_survives_dead_actors(tmp_path):
    run_dir = tmp_path / "ray"
    result, killed = train_killing(ray_config(run_dir, STEPS), run_dir, [(KILL_SERVER_AT, "server0"), (KILL_WORKER_AT, "env_worker1")])

    assert result.final_step == STEPS and not result.stopped_early
    assert set(killed) == {"server0", "env_worker1"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["batches/addition/reward_mean"] for r in records]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.3, f"reward went from {first:.3f} to {last:.3f}"
    final = records[-1]
    assert final["broadcast/reconnects"] >= 1  # the restarted server was brought the current weights
    assert final["broadcast/servers_down"] == 0
    assert final["workers/actor_restarts"] >= 1
    assert final["workers/addition/rollouts_rejected"] == 0

    served = {}
    for rollout in read_rollouts(run_dir, env="addition"):
        (turn,) = [t for t in rollout.turns if t.role == "assistant"]
        served.setdefault(turn.inference_metadata.server_id, []).append(turn.inference_metadata.policy_version)
    assert set(served) == {"ray0", "ray1"}
    # Server 0 served again after its restart, with versions pushed after it died.
    assert max(served["ray0"]) > killed["server0"]
    # Both env-worker actors' shards of the problem stream were drawn (positions even and odd).
    positions = {r.metadata["problem_position"] % 2 for r in read_rollouts(run_dir, env="addition")}
    assert positions == {0, 1}


def test_ray_server_actors_get_lora_adapters_alone_and_a_restarted_one_gets_the_base_again(tmp_path):
    """With `learner.lora`, each push to the server actors is the adapters alone; the actor killed at step
    8 comes back holding no base, and the watcher's resync sends the base with the adapters."""
    run_dir = tmp_path / "ray-lora"
    config = ray_config(run_dir, STEPS, "--learner.lora.rank=16", "--ray.num_env_workers=1")
    result, killed = train_killing(config, run_dir, [(KILL_SERVER_AT, "server0")])

    assert result.final_step == STEPS and not result.stopped_early
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["broadcast/reconnects"] >= 1 and final["broadcast/servers_down"] == 0
    assert final["workers/addition/rollouts_rejected"] == 0
    rewards = [r["batches/addition/reward_mean"] for r in records]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.2, f"reward went from {first:.3f} to {last:.3f}"
    versions = [t.inference_metadata.policy_version for r in read_rollouts(run_dir, env="addition") for t in r.turns if t.role == "assistant" and t.inference_metadata.server_id == "ray0"]
    assert max(versions) > killed["server0"]
