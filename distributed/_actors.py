"""The Ray runtime's actors: the local runtime's components, each in its own process.

- `ServerActor`: a `PolicyServer` (the same engine and OpenAI API as the embedded one) on a fixed port
  of its node. It starts serving only once the driver has sent it weights, so an actor that Ray
  restarted serves nothing until the broadcaster has brought it the current version.
- `EnvWorkerActor`: an `EnvWorkers` whose replay buffers are `Outbox`es: finished rollouts wait there
  until the driver collects them (`collect`, a long poll), and the driver sends back what the workers
  need from it: its buffers' `tokens_ahead` (to pause when ahead) and which servers serve this run's
  weights.

Nothing heavy is imported at module level: the driver imports this module to name the classes.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from dataclasses import replace

from marin_rl.compiles import enable_compilation_cache, prepare_process
from marin_rl.types import Rollout

NOT_SERVING = -1
"""The policy version a server actor reports before it got weights."""


def _cpu_only() -> None:
    # Before JAX loads in this process: an actor without a GPU must not grab one of the node's GPUs.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


class ServerActor:
    def __init__(
        self, server_config, model_config, vocab_size: int, tokenizer: str, *, port: int, gpu: bool, compilation_cache: str = "off"
    ):
        """`model_config` is the learner's Levanter model config: weights arrive as its parameters.
        `compilation_cache`: the run's setting (`auto` resolves on the actor's node): a restarted actor,
        and every actor after the first on a node, loads the engine's programs instead of compiling them."""
        prepare_process()  # as `marin-rl train` and `serve` run, before JAX starts here
        if not gpu:
            _cpu_only()
        enable_compilation_cache(compilation_cache)
        self.instance = uuid.uuid4().hex  # a restarted actor is a new instance
        self.config = replace(server_config, port=port)
        self._model_config, self._vocab_size, self._tokenizer_name = model_config, vocab_size, tokenizer
        self._server = None
        self._template = None
        self._tokenizer = None
        self._loader = None

    def base_url(self) -> str:
        """Where env workers reach it: the node's address when it binds every interface."""
        import ray

        host = self.config.host
        if host in ("0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.config.port}/v1"

    def status(self) -> tuple[int, str]:
        """(policy version served, or NOT_SERVING; instance id)."""
        return (NOT_SERVING if self._server is None else self._server.policy_version), self.instance

    def load(self, weights, policy_version: int, reset: bool, adapters=None) -> int:
        """Serve `policy_version`: `weights` (safetensors bytes, or an HF checkpoint directory), LoRA
        `adapters` (bytes, or a file's path) on them or on the base an earlier load kept, or both (see
        `UpdateLoader`); the first load starts the HTTP server. ValueError for an older version (unless
        `reset`) or weights of another architecture; `BaseMissing` for adapters with no base kept."""
        from marin_rl.server import PolicyServer, UpdateLoader
        from marin_rl.tokenizer import load_tokenizer

        if self._server is not None and policy_version < self._server.policy_version and not reset:
            raise ValueError(f"policy version {policy_version} is older than the served {self._server.policy_version}")
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_name)
            self._loader = UpdateLoader(self._model, self.config.compute_dtype)
        model = self._loader(weights, adapters)
        if self._server is None:
            server = PolicyServer(self.config, model, self._tokenizer, policy_version)
            try:
                self._server = server.start()
            except OSError as e:
                server.shutdown()
                raise ValueError(f"ray.server_port: cannot listen on {self.config.host}:{self.config.port} ({e})") from e
            import jax

            from marin_rl.interpreter import tune_interpreter

            tune_interpreter(jax.default_backend())  # for the actor's life, as `marin-rl serve` does
        else:
            self._server.swap_weights(model, policy_version, wait=True)
        return policy_version

    def _model(self, payload):
        """A version's weights: safetensors bytes, or an HF checkpoint on shared storage."""
        import equinox as eqx
        import haliax as hax
        import jax

        from marin_rl.server import load_update

        if self._template is None:
            vocab = hax.Axis("vocab", self._vocab_size)
            self._template = eqx.filter_eval_shape(lambda: self._model_config.build(vocab, key=jax.random.key(0)))
        return load_update(payload, tokenizer=self._tokenizer, template=self._template)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()


class Outbox:
    """An env's replay buffer as an env-worker actor sees it: `add` keeps the rollouts until the driver
    takes them; `tokens_ahead` is the driver buffer's plus what waits here (workers pause on it)."""

    def __init__(self, arrived: threading.Condition):
        self._arrived = arrived  # shared by an actor's outboxes: `collect` waits on any of them
        self._rollouts: list[Rollout] = []
        self._tokens = 0
        self.driver_tokens_ahead = 0
        """The driver's buffer's `tokens_ahead`, as of the last collection."""

    def add(self, rollouts: list[Rollout]) -> int:
        with self._arrived:
            self._rollouts += rollouts
            self._tokens += sum(r.num_tokens for r in rollouts)
            self._arrived.notify_all()
        return len(rollouts)  # the driver's buffer validates them (and counts rejects)

    def tokens_ahead(self) -> int:
        with self._arrived:
            return self.driver_tokens_ahead + self._tokens

    @property
    def holds_rollouts(self) -> bool:
        return bool(self._rollouts)

    def take(self) -> list[Rollout]:
        """Caller holds the shared condition."""
        rollouts, self._rollouts, self._tokens = self._rollouts, [], 0
        return rollouts


class ShippedGate:
    """A server's sampling window as the driver's transport last reported it (`VersionGate`).

    The driver may have pushed newer versions since it shipped the window. A server actor serves
    nothing but what the driver pushed (Ray restarts it empty), so its window has no upper bound
    (`bounded_above=False`); a remote server may come back with weights of its own, so an answer above
    its window is dropped and reported, and the driver, which knows what it pushed, decides."""

    def __init__(self, bounded_above: bool):
        self.bounded_above = bounded_above
        self.window: tuple[int, int] | None = None
        self.stale: list[tuple[int, bool]] = []
        """(version, above the window) of answers reported outside the window, for the driver."""

    def sampling_window(self) -> tuple[int, int] | None:
        if self.window is None or self.bounded_above:
            return self.window
        return self.window[0], sys.maxsize

    def report_stale(self, reported: int) -> None:
        self.stale.append((reported, self.window is not None and reported > self.window[1]))
        self.window = None  # until the driver ships the next window


class EnvWorkerActor:
    def __init__(self, config, index: int, count: int, endpoints: list[tuple[str, str, str | None]]):
        """Shard `index` of `count` of every env's problem stream; `endpoints`: (base URL, server id,
        gate) of each server: None, or "actor" / "remote" for one sampled from only inside the window
        the driver sends (`ShippedGate`: a server actor's window has no upper bound)."""
        _cpu_only()
        self.config, self.index, self.count, self.endpoints = config, index, count, endpoints
        self.workers = None
        self.failure: str | None = None
        self._arrived = threading.Condition()

    def start(self, positions: dict[str, int], windows: list) -> None:
        """Build the envs and start sampling from `positions` (each env's, rounded up into this shard),
        from the servers whose sampling `windows` are open (as `collect` takes them)."""
        from marin_rl.envs import build_env
        from marin_rl.tokenizer import load_tokenizer
        from marin_rl.workers import Endpoint, EnvWorkers, worker_specs

        config = self.config
        tokenizer = load_tokenizer(config.tokenizer)
        envs = {e.name: build_env(e.type, e.args, tokenizer=tokenizer, name=e.name) for e in config.envs}
        self.outboxes = {name: Outbox(self._arrived) for name in envs}
        self.gates = [None if gate is None else ShippedGate(bounded_above=gate == "remote") for _, _, gate in self.endpoints]
        self._open(windows)
        endpoints = [
            Endpoint(url, config.server.model_name, server_id, config.server.request_timeout_s, gate=gate)
            for (url, server_id, _), gate in zip(self.endpoints, self.gates)
        ]
        self.workers = EnvWorkers(
            envs,
            worker_specs(config, envs, replica_share=self.count),
            self.outboxes,
            endpoints,
            seed=config.seed,
            max_backoff_s=config.worker_max_backoff_s,
            positions=positions,
            on_failure=self._fail,
            shard=(self.index, self.count),
        ).start()

    def _fail(self, error) -> None:
        self.failure = str(error)
        with self._arrived:
            self._arrived.notify_all()

    def collect(self, tokens_ahead: dict[str, int], windows: list, wait_s: float) -> dict:
        """Hand over the finished rollouts (waiting up to `wait_s` for some), given the driver's buffers'
        `tokens_ahead` and each gated server's sampling `windows`."""
        from marin_rl.distributed._wire import rollouts_to_bytes

        if self.workers is None:
            return {"started": False}
        self._open(windows)
        with self._arrived:
            for name, tokens in tokens_ahead.items():
                self.outboxes[name].driver_tokens_ahead = tokens
            self._arrived.wait_for(lambda: self.failure or any(o.holds_rollouts for o in self.outboxes.values()), timeout=wait_s)
            taken = {name: outbox.take() for name, outbox in self.outboxes.items()}
        stale = [(i, v, above) for i, gate in enumerate(self.gates) if gate is not None for v, above in gate.stale]
        for gate in self.gates:
            if gate is not None:
                gate.stale = []
        return {
            "started": True,
            "rollouts": {name: rollouts_to_bytes(rollouts) for name, rollouts in taken.items() if rollouts},
            "positions": self.workers.positions(),
            "metrics": self.workers.metrics(),
            "stale": stale,
            "failure": self.failure,
        }

    def _open(self, windows: list) -> None:
        for gate, window in zip(self.gates, windows):
            if gate is not None:
                gate.window = None if window is None else tuple(window)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.workers.evaluate(step)

    def stop(self) -> None:
        if self.workers is not None:
            self.workers.stop()
