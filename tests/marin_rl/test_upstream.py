"""Each private or probed interface of `marin_rl._upstream` is still what it was checked against: a
failure here names the dependency release that changed it (see that entry's comment)."""

from __future__ import annotations

import dataclasses
import os
import importlib
import inspect
import warnings

import haliax as hax
import haliax.nn as hnn
import jax
import pytest
from haliax.nn.scan import BlockSeq, Stacked
from levanter.layers.attention import Attention, AttentionConfig
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
from levanter.models.llama import LlamaConfig, LlamaDecoderLayer
from levanter.models.qwen import Qwen3Config, QwenConfig, QwenDecoderLayer

from marin_rl import _upstream


def test_jax_core_is_constant_dim_is_there_for_haliax():
    _upstream.restore_jax_core_is_constant_dim()
    import jax._src.core

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert jax.core.is_constant_dim is jax._src.core.is_constant_dim
    # Once haliax stops calling it, the workaround can go.
    assert "jax.core.is_constant_dim" in inspect.getsource(importlib.import_module("haliax.jax_utils"))


def test_the_cudnn_module_has_the_packed_layout():
    cudnn = importlib.import_module(_upstream.CUDNN_ATTENTION_MODULE)  # imports on CPU jaxlib too
    assert cudnn.MaskType.PADDING_CAUSAL
    parameters = inspect.signature(cudnn.dot_product_attention).parameters
    for name in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout"):
        assert name in parameters, name


def test_device_probes():
    device = jax.devices()[0]
    capability = _upstream.compute_capability(device)
    if device.platform == "gpu":
        assert float(capability) > 0
    else:
        assert capability is None
    assert hasattr(type(device), "memory_stats")
    stats = _upstream.device_memory_stats(device)
    assert stats is None or "bytes_limit" in stats


def test_a_jitted_function_counts_its_compiled_shapes():
    square = jax.jit(lambda x: x * x)
    assert _upstream.jit_cache_size(square) == 0
    square(jax.numpy.ones(2))
    square(jax.numpy.ones(3))
    square(jax.numpy.ones(3))
    assert _upstream.jit_cache_size(square) == 2


def test_compute_qkv_takes_what_we_pass_and_names_the_axes_we_read():
    parameters = inspect.signature(Attention._compute_qkv).parameters
    assert list(parameters)[:2] == ["self", "x"]
    assert {"key", "pos_ids"} <= set(parameters)
    Embed, Position = hax.Axis("embed", 16), hax.Axis("position", 3)
    config = AttentionConfig(Embed=Embed, num_heads=4, num_kv_heads=2, rope=DefaultRotaryEmbeddingsConfig())
    attention = Attention.init(config, key=jax.random.key(0))
    q, k, v = _upstream.attention_qkv(attention, hax.ones((Position, Embed)), pos_ids=hax.arange(Position))
    assert set(q.shape) == {"position", "kv_head", "q_heads_per_group", "head_size"}
    assert set(k.shape) == set(v.shape) == {"position", "kv_head", "head_size"}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_decoder_layers_have_the_modules_the_engine_reads():
    read = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    post = {"post_attn_layernorm", "post_mlp_layernorm"}
    assert read | post <= _fields(LlamaDecoderLayer)
    assert read <= _fields(QwenDecoderLayer) and not post & _fields(QwenDecoderLayer)
    assert _upstream.post_norms(object()) == (None, None)


def test_sliding_window_fields():
    for cls in (QwenConfig, Qwen3Config):
        assert {"sliding_window", "use_sliding_window"} <= _fields(cls), cls
        assert _upstream.uses_sliding_window(cls(sliding_window=8, use_sliding_window=True))
        assert not _upstream.uses_sliding_window(cls(sliding_window=8, use_sliding_window=False))
    assert not {"sliding_window", "use_sliding_window"} & _fields(LlamaConfig)


@pytest.mark.parametrize("container", [Stacked, BlockSeq])
def test_layer_containers(container):
    Block, In, Out = hax.Axis("block", 3), hax.Axis("in", 2), hax.Axis("out", 4)
    layers = container.init(Block, hnn.Linear)(In=In, Out=Out, key=jax.random.split(jax.random.key(0), 3))
    modules = _upstream.layer_modules(layers)
    assert len(modules) == 3 and all(m.weight.axes == (Out, In) for m in modules)
    assert _upstream.layer_template(layers).Out == Out


IMPORTS_TRANSFORMERS_IMAGE_UTILS = """
import sys
from marin_rl._upstream import transformers_without_torch
if sys.argv[1] == "without":
    transformers_without_torch()
try:
    import transformers.image_utils  # what levanter's HF checkpoint module reaches
except ImportError:
    pass
"""


@pytest.mark.parametrize("call", ["without", "not called"])
def test_transformers_leaves_an_installed_torchvision_alone(tmp_path, call):
    """An installed torchvision (here a stand-in that records its import) is not imported once
    `transformers_without_torch` ran: transformers would import it, and torch with it."""
    import subprocess
    import sys

    (tmp_path / "torchvision").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "torchvision" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('stand-in')\n")
    (tmp_path / "torchvision-0.99.0.dist-info").mkdir()
    (tmp_path / "torchvision-0.99.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\n")
    env = {k: v for k, v in os.environ.items() if k != "USE_TORCH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    subprocess.run([sys.executable, "-c", IMPORTS_TRANSFORMERS_IMAGE_UTILS, call], env=env, check=True, timeout=300)
    assert marker.exists() == (call == "not called")
