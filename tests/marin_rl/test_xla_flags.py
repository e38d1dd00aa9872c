"""The XLA options every run starts with, and a user's own `XLA_FLAGS` kept as they set them."""

import os

from marin_rl.compiles import DEFAULT_XLA_FLAGS, GPU_MEMORY_FRACTION, set_default_xla_flags


def test_defaults_are_added_once_and_the_users_own_setting_of_a_flag_wins(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    set_default_xla_flags()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    set_default_xla_flags()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == GPU_MEMORY_FRACTION
    set_default_xla_flags()
    assert os.environ["XLA_FLAGS"].split() == list(DEFAULT_XLA_FLAGS)

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/dump")
    set_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/dump"
