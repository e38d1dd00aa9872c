"""The Ray runtime's parts alone: what crosses processes, least-loaded routing, shards of a problem stream."""

import asyncio

import equinox as eqx
import jax
import numpy as np
import pytest

from marin_rl.distributed import rollouts_from_bytes, rollouts_to_bytes
from marin_rl.weight_bytes import weights_from_bytes, weights_to_bytes
from marin_rl.envs import Completion, Sampler, SamplingParams
from marin_rl.learner import ModelConfig, build_model
from marin_rl.workers._endpoints import Endpoint, GatedSampler, LeastLoadedSampler
from marin_rl.workers._faults import ServerNotReady
from marin_rl.workers._workers import shard_start
from marin_rl.testing import make_group
from marin_rl.types import InferenceMetadata


def test_rollouts_cross_as_arrow_bytes_unchanged():
    rollouts = make_group([1.0, 0.0, 0.5], env="addition", completion_lens=[3, 1, 4])
    back = rollouts_from_bytes(rollouts_to_bytes(rollouts))
    assert [r.rollout_uid for r in back] == [r.rollout_uid for r in rollouts]
    for a, b in zip(rollouts, back):
        assert a.reward == b.reward and a.rewards == b.rewards
        for ta, tb in zip(a.turns, b.turns, strict=True):
            np.testing.assert_array_equal(ta.token_ids, tb.token_ids)
            if ta.logprobs is not None:
                np.testing.assert_array_equal(ta.logprobs, tb.logprobs)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_weights_cross_as_safetensors_into_a_shape_only_template(dtype):
    config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64)
    model = build_model(config, 104, key=jax.random.key(0))
    template = eqx.filter_eval_shape(lambda: build_model(config, 104, key=jax.random.key(1)))
    back = weights_from_bytes(weights_to_bytes(model, dtype), template)
    tolerance = 0 if dtype is None else 1e-2
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(eqx.filter(back, eqx.is_array)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b, np.float32), atol=tolerance, rtol=tolerance)


def test_weights_of_another_shape_are_refused_by_name():
    small = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=4, num_kv_heads=2, seq_len=64)
    big = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64)
    template = eqx.filter_eval_shape(lambda: build_model(big, 104, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="do not fit the served model"):
        weights_from_bytes(weights_to_bytes(build_model(small, 104, key=jax.random.key(0))), template)


class Slow(Sampler):
    """Answers after `release` is set; counts what it was sent."""

    def __init__(self, release: asyncio.Event):
        self.release, self.calls = release, 0

    async def sample(self, prompt_ids, n, params):
        self.calls += 1
        await self.release.wait()
        metadata = InferenceMetadata(server_id="s", model="m", policy_version=0, finish_reason="stop")
        return [Completion([1], [-0.1], metadata)] * n


class Window:
    def __init__(self, window):
        self.window = window

    def sampling_window(self):
        return self.window

    def report_stale(self, reported):
        self.window = None


def test_requests_go_to_the_least_loaded_ready_server():
    async def run():
        release = asyncio.Event()
        inner = [Slow(release) for _ in range(3)]
        gates = [Window((0, 0)), Window((0, 0)), Window(None)]  # the third does not serve this run's weights
        router = LeastLoadedSampler([GatedSampler(s, Endpoint(f"http://s{i}/v1", "m", f"s{i}", gate=g)) for i, (s, g) in enumerate(zip(inner, gates))])
        tasks = [asyncio.create_task(router.sample([1, 2], n, SamplingParams())) for n in (4, 1, 1, 1)]
        await asyncio.sleep(0.01)
        assert [s.calls for s in inner] == [1, 3, 0]  # 4 sequences on the first, then the second until it has 3
        assert router.in_flight == [4, 3, 0]
        release.set()
        await asyncio.gather(*tasks)
        assert router.in_flight == [0, 0, 0]
        gates[0].window = gates[1].window = None
        with pytest.raises(ServerNotReady):
            await router.sample([1], 1, SamplingParams())

    asyncio.run(run())


def test_an_env_worker_actor_checks_answers_against_the_window_the_driver_shipped():
    from marin_rl.distributed._actors import ShippedGate

    class Serving(Sampler):
        version = 7

        async def sample(self, prompt_ids, n, params):
            metadata = InferenceMetadata(server_id="s", model="m", policy_version=self.version, finish_reason="stop")
            return [Completion([1], [-0.1], metadata)] * n

    def sample(gate, server):
        return asyncio.run(GatedSampler(server, Endpoint("http://s/v1", "m", "s", gate=gate)).sample([1], 2, SamplingParams()))

    # A server actor serves only what the driver pushed: a version pushed after the window was shipped is fine.
    actor, server = ShippedGate(bounded_above=False), Serving()
    actor.window = (5, 6)
    assert len(sample(actor, server)) == 2 and actor.stale == []
    server.version = 4  # older than the window: restarted and given something else, for all the actor knows
    with pytest.raises(ServerNotReady, match="policy version 4"):
        sample(actor, server)
    assert actor.stale == [(4, False)] and actor.sampling_window() is None

    # A remote server may be back with weights of its own: an answer above the window is dropped and
    # reported as above it, for the driver to check against what it pushed.
    remote = ShippedGate(bounded_above=True)
    remote.window = (5, 6)
    server.version = 7
    with pytest.raises(ServerNotReady, match="policy version 7"):
        sample(remote, server)
    assert remote.stale == [(7, True)]


def test_the_driver_marks_a_server_down_only_for_versions_it_never_pushed():
    from marin_rl.distributed._runtime import RayEnvWorkers

    class Transport:  # the driver's own view of one server: confirmed 6, pushing 8
        def __init__(self):
            self.window, self.reported = (6, 8), []

        def sampling_window(self):
            return self.window

        def report_stale(self, version):
            self.reported.append(version)

    transport = Transport()
    workers = RayEnvWorkers([object()], {}, [transport], positions={}, on_failure=lambda e: None)
    reply = {"started": True, "rollouts": {}, "positions": {}, "metrics": {}, "failure": None}
    # 7 and 8, above the window an actor had: pushed since. 999 above it too, but never pushed; 3 below it.
    workers._absorb(0, {**reply, "stale": [(0, 7, True), (0, 8, True), (0, 999, True), (0, 3, False)]})
    assert transport.reported == [999, 3]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_shards_of_a_stream_cover_every_position_once(count):
    for position in range(10):
        starts = [shard_start(position, (i, count)) for i in range(count)]
        assert sorted(starts) == list(range(position, position + count))  # the next `count` positions, one per shard
        assert all(start % count == i for i, start in enumerate(starts))
