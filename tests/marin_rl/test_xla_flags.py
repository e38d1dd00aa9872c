"""The XLA options every run starts with, and a user's own `XLA_FLAGS` kept as they set them."""

import os

import pytest

from marin_rl import compiles
from marin_rl.compiles import (
    CPU_ONLY_XLA_FLAGS,
    DEFAULT_XLA_FLAGS,
    ENGINE_COMPILER_OPTIONS,
    GPU_MEMORY_FRACTION,
    TRITON_DECODE_MAX_ROWS,
    engine_compiler_options,
    set_default_xla_flags,
)


@pytest.fixture(autouse=True)
def an_accelerator_installed(monkeypatch):
    """As on the GPU machines, unless a test says otherwise (this VM has only its CPU)."""
    monkeypatch.setattr(compiles, "only_cpu_available", lambda: False)


def test_defaults_are_added_once_and_the_users_own_setting_of_a_flag_wins(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("MARIN_RL_ADDED_XLA_FLAGS", "")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    set_default_xla_flags()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    set_default_xla_flags()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == GPU_MEMORY_FRACTION
    set_default_xla_flags()
    assert os.environ["XLA_FLAGS"].split() == list(DEFAULT_XLA_FLAGS) == ["--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=2"]

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/dump")
    set_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/dump --xla_gpu_autotune_level=2"

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")  # XLA's own level, for whoever wants its checks
    set_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4 --xla_gpu_enable_triton_gemm=false"


def test_the_engines_decode_of_up_to_128_rows_turns_triton_gemms_back_on_unless_the_user_set_them_or_its_passes_are_exact(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("MARIN_RL_ADDED_XLA_FLAGS", "")  # restored (absent) after the test
    set_default_xla_flags()
    assert "--xla_gpu_enable_triton_gemm=false" in os.environ["XLA_FLAGS"].split()  # the learner's programs
    for rows in (8, 32, TRITON_DECODE_MAX_ROWS):
        assert engine_compiler_options(exact=False, call="decode", rows=rows) == ENGINE_COMPILER_OPTIONS == {"xla_gpu_enable_triton_gemm": True}
    for rows in (TRITON_DECODE_MAX_ROWS + 1, 256, 1024):  # cuBLAS: no Triton autotuning at start
        assert engine_compiler_options(exact=False, call="decode", rows=rows) == {}
    assert engine_compiler_options(exact=False, call="prefill", rows=1) == {}
    assert engine_compiler_options(exact=True, call="decode", rows=32) == {}  # the learner's kernels, for the learner's bits
    set_default_xla_flags()  # again, as a child process that inherited both variables does
    assert engine_compiler_options(exact=False, call="decode", rows=32) == ENGINE_COMPILER_OPTIONS

    for users in ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_enable_triton_gemm=true"):
        monkeypatch.setenv("XLA_FLAGS", users)
        monkeypatch.setenv("MARIN_RL_ADDED_XLA_FLAGS", "")
        set_default_xla_flags()
        assert os.environ["XLA_FLAGS"].split()[0] == users and engine_compiler_options(exact=False, call="decode", rows=32) == {}


def test_where_only_the_cpu_is_there_xla_compiles_at_level_1_unless_the_user_set_a_level(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("MARIN_RL_ADDED_XLA_FLAGS", "")
    set_default_xla_flags()
    assert not any("optimization_level" in flag for flag in os.environ["XLA_FLAGS"].split())  # a GPU's kernels keep XLA's level

    monkeypatch.setattr(compiles, "only_cpu_available", lambda: True)
    monkeypatch.delenv("XLA_FLAGS")
    set_default_xla_flags()
    set_default_xla_flags()  # again, as a child process does: added once
    assert os.environ["XLA_FLAGS"].split() == [*DEFAULT_XLA_FLAGS, *CPU_ONLY_XLA_FLAGS] == [*DEFAULT_XLA_FLAGS, "--xla_backend_optimization_level=1"]

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    set_default_xla_flags()
    assert "--xla_backend_optimization_level=3" in os.environ["XLA_FLAGS"] and "optimization_level=1" not in os.environ["XLA_FLAGS"]


def test_jax_platforms_cpu_means_only_the_cpu(monkeypatch):
    monkeypatch.undo()  # the real check
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert compiles.only_cpu_available()
