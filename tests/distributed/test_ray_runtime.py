"""`runtime: ray` on a real local Ray cluster: the quickstart with 2 server actors and 2 env-worker
actors learns, and goes on when a server actor and an env-worker actor die."""

import threading

import numpy as np
import pytest

from marin_rl.config import load_config
from marin_rl.storage import read_rollouts
from marin_rl.testing import free_port_range, train_until

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


def rise(records) -> float:
    rewards = [r["batches/addition/reward_mean"] for r in records]
    return np.mean(rewards[-5:]) - np.mean(rewards[:5]) if len(rewards) >= 10 else 0.0


def served_by_server(run_dir) -> dict[str, list[int]]:
    """Server id -> the policy versions of the rollouts it sampled."""
    served = {}
    for rollout in read_rollouts(run_dir, env="addition"):
        (turn,) = [t for t in rollout.turns if t.role == "assistant"]
        served.setdefault(turn.inference_metadata.server_id, []).append(turn.inference_metadata.policy_version)
    return served


def train_killing(config, run_dir, plan, done_when):
    """`train(config)` while `kill_at` kills the planned actors, stopped once every kill is done and
    `done_when(records, killed)` holds (or at max_steps); (its result, its records, {actor: step killed at})."""
    done, killed = threading.Event(), {}
    killer = threading.Thread(target=kill_at, args=(run_dir, plan, done, killed))
    killer.start()
    try:
        result, records = train_until(config, lambda records: len(killed) == len(plan) and done_when(records, killed), poll_s=2.0)
        return result, records, killed
    finally:
        done.set()
        killer.join()


def test_ray_runtime_learns_with_adapters_and_survives_dead_actors(tmp_path):
    """One Ray cluster run (they take minutes on 2 cores) checks both: the run learns and goes on when a
    server actor and an env-worker actor die; with `learner.lora` the pushes are adapters alone, so the
    server actor killed at step 8 comes back holding no base and serves again only once the watcher's
    resync has sent the base with the adapters."""
    run_dir = tmp_path / "ray-lora"
    config = ray_config(run_dir, STEPS, "--learner.lora.rank=16")

    def checked(records, killed) -> bool:  # everything asserted below has happened: the run may stop
        return rise(records) > 0.2 and max(served_by_server(run_dir).get("ray0", [0])) > killed["server0"]

    result, records, killed = train_killing(config, run_dir, [(KILL_SERVER_AT, "server0"), (KILL_WORKER_AT, "env_worker1")], checked)

    assert set(killed) == {"server0", "env_worker1"}
    assert result.final_step == len(records) > KILL_WORKER_AT
    best_rise = max(rise(records[:steps]) for steps in range(10, len(records) + 1))  # the run stops a step or two after
    assert best_rise > 0.2, f"reward rose {best_rise:.3f} at most in {len(records)} steps"
    final = records[-1]
    assert final["broadcast/reconnects"] >= 1  # the restarted server was brought the current weights
    assert final["broadcast/servers_down"] == 0
    assert final["workers/actor_restarts"] >= 1
    assert final["workers/addition/rollouts_rejected"] == 0

    served = served_by_server(run_dir)
    assert set(served) == {"ray0", "ray1"}
    # Server 0 served again after its restart, with versions pushed after it died (its base resent).
    assert max(served["ray0"]) > killed["server0"]
    # Both env-worker actors' shards of the problem stream were drawn (positions even and odd).
    positions = {r.metadata["problem_position"] % 2 for r in read_rollouts(run_dir, env="addition")}
    assert positions == {0, 1}
