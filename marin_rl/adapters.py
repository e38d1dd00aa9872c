"""LoRA adapters on a Levanter model (`levanter.lora`), wherever a model goes: merged into its base, and
sent alone, as safetensors bytes, to servers that hold the base.

The wire format is safetensors: one tensor per adapter matrix, named by its path in the Levanter model
(`transformer.layers.stacked.self_attn.q_proj.lora.lora_A.weight`), in the model's own (stacked)
layout, and the adapters' settings (`rank`, `alpha`, `target_modules`) in the header's metadata. The
receiver builds the same adapters on its base and fills them: no name translation, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from levanter.lora import LoraConfig, LoraLinear, LowRankLinear, is_lora_param, loraize

_METADATA_KEY = "marin_rl.adapters"


def has_adapters(model) -> bool:
    return any(isinstance(node, LoraLinear) for node in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoraLinear)))


def adapter_module_names(model) -> list[str]:
    """Names of the linear layers that carry adapters (`q_proj`, ...), as PEFT's `target_modules`."""
    paths = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda node: isinstance(node, LoraLinear))[0]
    return sorted({path[-1].name for path, node in paths if isinstance(node, LoraLinear)})


def adapter_settings(model) -> dict:
    """`rank`, `alpha` and `target_modules` of `model`'s adapters (what rebuilds them on another copy of the base)."""
    low_rank = next(n for n in jax.tree.leaves(model, is_leaf=is_lora_param) if isinstance(n, LowRankLinear))
    rank = low_rank.lora_A.Out.size
    return {"rank": rank, "alpha": low_rank.scale * rank, "target_modules": adapter_module_names(model)}


@hax.named_jit  # as Levanter's `merge_lora_modules`: sharded parameters merge where they live
def merged(model):
    """`model` with each adapter merged into its layer's weight (W + scale * B A), in W's axis order and
    dtype: a plain model with the base's arrays, shape for shape. A model without adapters is returned as is."""

    def merge(module):
        if not isinstance(module, LoraLinear):
            return module
        weight = module.wrapped.weight
        summed = (weight + module.lora.merge()).rearrange(weight.axes)
        return dataclasses.replace(module.wrapped, weight=summed.astype(weight.dtype))

    return jax.tree.map(merge, model, is_leaf=lambda node: isinstance(node, LoraLinear))


def without_adapters(model):
    """The base `model`'s adapters sit on (its own arrays, not a copy)."""
    return jax.tree.map(lambda n: n.wrapped if isinstance(n, LoraLinear) else n, model, is_leaf=lambda n: isinstance(n, LoraLinear))


def _name(path) -> str:
    """`transformer.layers.stacked.self_attn.q_proj.lora.lora_A.weight`: the attributes down to the array."""
    return ".".join(str(getattr(key, "name", getattr(key, "idx", ""))) for key in path if not isinstance(key, jax.tree_util.FlattenedIndexKey))


def _adapter_arrays(model) -> dict[str, jax.Array]:
    lora = eqx.filter(model, is_lora_param, is_leaf=is_lora_param)
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(lora, eqx.is_array))[0]
    return {_name(path): leaf for path, leaf in leaves}


def adapters_to_bytes(model) -> bytes:
    """`model`'s adapters (and nothing of its base) as safetensors bytes, their settings in its metadata."""
    import safetensors.numpy

    arrays = {name: np.asarray(array) for name, array in _adapter_arrays(model).items()}
    return safetensors.numpy.save(arrays, metadata={_METADATA_KEY: json.dumps(adapter_settings(model))})


def with_adapters_from_bytes(base, data: bytes):
    """`base` with the adapters in `data` (from `adapters_to_bytes`) on it, unmerged; ValueError naming
    the tensor when they do not fit `base`."""
    header = _metadata(data)
    if _METADATA_KEY not in header:
        raise ValueError(f"not an adapters file of marin-rl: no {_METADATA_KEY!r} in its safetensors metadata")
    settings = json.loads(header[_METADATA_KEY])
    config = LoraConfig(r=settings["rank"], alpha=settings["alpha"], target_modules=settings["target_modules"])
    # The key only seeds the adapters' arrays, which are all replaced below.
    adapted = loraize(base, config, jax.random.key(0))
    expected = _adapter_arrays(adapted)
    given = dict(safetensors_arrays(data))
    if set(given) != set(expected):
        missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
        raise ValueError(f"the adapters do not fit the served model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, array in expected.items():
        if given[name].shape != array.shape:
            raise ValueError(f"adapter {name}: shape {list(given[name].shape)}, the served model needs {list(array.shape)}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapted)
    values = [_like(leaf, given[_name(path)]) if _name(path) in expected else leaf for path, leaf in leaves]
    return jax.tree.unflatten(treedef, values)


def _like(leaf, array: np.ndarray):
    return jax.device_put(array.astype(leaf.dtype), leaf.sharding)


def _metadata(data: bytes) -> dict[str, str]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})


def safetensors_arrays(data: bytes):
    """(name, numpy array) of each tensor in safetensors bytes, bfloat16 included."""
    import ml_dtypes
    import safetensors

    # safetensors' own numpy and flax loaders know no bfloat16: read the raw views (ml_dtypes has it).
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32, "I64": np.int64}
    for name, view in safetensors.deserialize(data):
        yield name, np.frombuffer(view["data"], dtype=dtypes[view["dtype"]]).reshape(view["shape"])
