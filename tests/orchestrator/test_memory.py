"""The memory a run holds, estimated from its config (orchestrator/_memory.py), and the start-up check
that refuses a run that cannot fit, with the numbers."""

import pytest

from marin_rl.cli import main
from marin_rl.config import load_config
from marin_rl.errors import ConfigError
from marin_rl.orchestrator._memory import GiB, Shape, check_memory, memory_plan

QUICKSTART = "configs/quickstart.yaml"
LLAMA_8B = [
    "--model.hidden_dim=4096", "--model.intermediate_dim=14336", "--model.num_layers=32", "--model.num_heads=32",
    "--model.num_kv_heads=8", "--model.seq_len=2048", "--batcher.max_seq_len=2048", "--batcher.total_token_budget=16384",
    "--server.max_seq_len=2048", "--server.max_seqs=64",
]  # fmt: skip
LLAMA_3_VOCAB = 128_256


def test_the_8b_shape_has_llama_3_8bs_parameters_and_peft_adapter_count():
    shape = Shape.of(load_config(QUICKSTART, LLAMA_8B), LLAMA_3_VOCAB)
    assert shape.parameters == 8_030_261_248  # Meta-Llama-3-8B, counted by transformers
    assert shape.adapter_parameters(16, None) == 41_943_040  # PEFT's rank-16 adapters on every linear layer
    assert shape.adapter_parameters(16, ["q_proj", "v_proj"]) == 32 * 16 * ((4096 + 4096) + (4096 + 1024))


def test_an_8b_full_fine_tune_is_refused_on_one_80_gb_gpu_and_lora_rank_16_fits_in_75_gib():
    full = load_config(QUICKSTART, LLAMA_8B)
    needed = memory_plan(full, LLAMA_3_VOCAB, backend="gpu").total(0)
    with pytest.raises(ConfigError, match=rf"needs at least {needed / GiB:.2f} GiB on device 0, which has 80\.00 GiB") as refused:
        check_memory(full, LLAMA_3_VOCAB, backend="gpu", device_bytes={0: 80 * GiB})
    assert "learner: trained parameters, gradients, optimizer state 119.66 GiB" in str(refused.value)  # 16 bytes a parameter

    lora = load_config(QUICKSTART, [*LLAMA_8B, "--learner.lora.rank=16"])
    plan = check_memory(lora, LLAMA_3_VOCAB, backend="gpu", device_bytes={0: 75 * GiB})
    parts = plan.parts[0]
    assert parts["learner: frozen base (compute dtype)"] == parts["engine: weights"] == 2 * 8_030_261_248  # bf16, one copy each
    assert parts["engine: the next policy's weights, during a swap"] == parts["engine: weights"]
    assert parts["learner: trained parameters, gradients, optimizer state"] == 16 * 41_943_040
    assert parts["engine: KV cache (131,072 tokens)"] == 131_072 * 32 * 2 * 8 * 128 * 2
    assert 40 * GiB < plan.total(0) < 75 * GiB


def test_fsdp_divides_the_learners_state_and_an_engine_of_its_own_device_holds_none_of_it():
    config = load_config(QUICKSTART, [*LLAMA_8B, "--placement.learner_devices=[0,1]", "--placement.server_devices=[2]"])
    plan = memory_plan(config, LLAMA_3_VOCAB, backend="gpu")
    single = memory_plan(load_config(QUICKSTART, LLAMA_8B), LLAMA_3_VOCAB, backend="gpu")
    state = "learner: trained parameters, gradients, optimizer state"
    assert plan.parts[0][state] == plan.parts[1][state] == single.parts[0][state] / 2
    assert all(not part.startswith("learner") for part in plan.parts[2])


def test_a_run_beyond_the_stated_device_memory_is_refused_at_start_with_the_numbers(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", QUICKSTART, f"--run_dir={run_dir}", "--placement.device_memory_gib=0.001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the run needs at least 0.0") and err.count("\n") == 1, err
    assert "which has 0.00 GiB" in err and "engine: KV cache (4,096 tokens)" in err and "learner.lora.rank" in err
    assert not run_dir.exists()


def test_device_memory_gib_must_be_positive():
    with pytest.raises(ValueError, match="placement.device_memory_gib must be > 0"):
        load_config(QUICKSTART, ["--placement.device_memory_gib=0"])


def test_memory_is_reserved_on_each_accelerator_the_run_uses_off_the_main_thread(monkeypatch):
    """An accelerator's first allocation (JAX's allocator reserving most of a GPU: about 2 s) happens in a
    thread per device, beside the imports and the build; on a CPU nothing is started."""
    import threading

    import jax

    from marin_rl.orchestrator._memory import reserve_device_memory

    config = load_config(QUICKSTART)
    assert reserve_device_memory(config) == []  # this CPU: no allocator to start

    allocated = []
    real_device_put = jax.device_put

    def recording_device_put(value, device):
        allocated.append((device, threading.current_thread() is threading.main_thread()))
        return real_device_put(value, device)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_put", recording_device_put)
    threads = reserve_device_memory(config)
    for thread in threads:
        thread.join(timeout=60)
    assert len(threads) == 1 and not threads[0].is_alive()
    assert allocated == [(jax.devices()[0], False)]
