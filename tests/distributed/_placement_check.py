"""Run in a fresh process with 4 host devices (XLA_FLAGS is read when JAX starts): the learner on a
2-device mesh against the same learner on one device, and two engines on devices 2 and 3 fed from it.

Prints one JSON line of findings; `test_placement.py` asserts on them."""

import json
import os
import sys
from pathlib import Path

assert "--xla_force_host_platform_device_count=4" in os.environ.get("XLA_FLAGS", ""), "run with 4 host devices"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))
from conftest import pack  # noqa: E402  (the learner tests' random packed batches)

from marin_rl.engine import Engine, EngineConfig, GenerationJob  # noqa: E402
from marin_rl.learner import Learner, LearnerConfig, LossConfig, ModelConfig  # noqa: E402
from marin_rl.learner._mesh import LearnerMesh  # noqa: E402
from marin_rl.rl_example import RlExample  # noqa: E402
from marin_rl.tokenizer import load_tokenizer  # noqa: E402


def main(work: Path) -> None:
    devices = jax.devices()
    tokenizer = load_tokenizer("char")
    model_config = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64, compute_dtype="float32")
    config = LearnerConfig(loss=LossConfig(beta=0.1), microbatch_rows=2)
    batches = [RlExample.from_packed(pack([[7, 12, 9], [32], [20, 5], [3, 10]], 32, seed=s)) for s in range(2)]

    def train(mesh, name):
        learner = Learner(config, model_config, work / name, tokenizer, key=jax.random.key(0), mesh=mesh)
        return learner, [learner.step(b)["loss"] for b in batches]

    single, single_losses = train(None, "single")
    out = {"single_losses": single_losses}
    for name, fsdp in (("fsdp", True), ("data", False)):
        learner, losses = train(LearnerMesh.over(devices[:2], fsdp=fsdp), name)
        params = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
        out[name] = {
            "losses": losses,
            "max_param_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(params(single.model), params(learner.model))),
            "param_devices": sorted({d.id for leaf in params(learner.model) for d in leaf.devices()}),
            "sharded_leaves": sum(not leaf.sharding.is_fully_replicated for leaf in params(learner.model)),
        }
        if fsdp:
            fsdp_learner = learner  # feeds the engines below

    engine_config = EngineConfig(max_seqs=4, max_seq_len=64, page_size=8, decode_steps=4, batch_wait_s=0.0)
    version = fsdp_learner.policy_version
    engines = [Engine(engine_config, fsdp_learner.model, version, device=devices[i]) for i in (2, 3)]
    job = lambda: GenerationJob(prompt_ids=[5, 6, 7, 8], n=2, max_tokens=6, temperature=0.0, seed=1, stop_sequences=[])  # noqa: E731
    before = [e.submit(job()).result(timeout=300) for e in engines]
    fsdp_learner.step(batches[0])
    swaps = []
    for engine in engines:
        engine.swap(fsdp_learner.model, version + 1)
        swaps.append(sorted({d.id for leaf in jax.tree.leaves(eqx.filter(engine.core._weights, eqx.is_array)) for d in leaf.devices()}))
    after = [e.submit(job()).result(timeout=300) for e in engines]
    reference = Engine(engine_config, fsdp_learner.model, version + 1)  # on the default device
    expected = reference.submit(job()).result(timeout=300)
    out["engines"] = {
        "weight_devices_after_swap": swaps,
        "cache_devices": [sorted({d.id for leaf in e.core._cache.keys for d in leaf.devices()}) for e in engines],
        "versions_before": [r.policy_version for r in before],
        "versions_after": [r.policy_version for r in after],
        "tokens_after": [[s.token_ids for s in r.samples] for r in after],
        "tokens_default_device": [s.token_ids for s in expected.samples],
    }
    for engine in [*engines, reference]:
        engine.stop()
    out["train"] = placed_run(work / "run")
    print("RESULT " + json.dumps(out))


def placed_run(run_dir: Path) -> dict:
    """The quickstart, shrunk, with the learner on devices 0-1 and an engine on each of devices 2 and 3."""
    from marin_rl.config import load_config
    from marin_rl.orchestrator import train
    from marin_rl.storage import read_rollouts
    from marin_rl.testing import QUICK_RUN

    overrides = [f"--run_dir={run_dir}", "--max_steps=3", "--checkpoint_every=100", *QUICK_RUN]
    overrides += ["--placement.learner_devices=[0,1]", "--placement.server_devices=[2,3]"]
    result = train(load_config("configs/quickstart.yaml", overrides))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    servers = sorted({t.inference_metadata.server_id for r in read_rollouts(run_dir) for t in r.turns if t.role == "assistant"})
    return {"final_step": result.final_step, "servers": servers, "swap_seconds": [r["broadcast/swap_seconds"] for r in records]}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
