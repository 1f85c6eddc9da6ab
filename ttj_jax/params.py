"""Parameters: PyTorch-equivalent init, docs/spec.md's state_dict names both ways, and prepared weights.

Raw params are a nested dict that mirrors the state_dict names exactly:
    params["layers"][i]["attention"]["q_proj"]["weight"]   <->   "layers.{i}.attention.q_proj.weight"
Prepared weights are what the forward pass consumes: fused `[d, 3d]` QKV, matrices transposed to
`[in, out]` and cast to the numerics policy's GEMM dtype, vectors in fp32. They are derived, built once
per (weights, policy), and never written back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ttj_jax.config import Config
from ttj_jax.numerics import NumericsPolicy

LINEARS = ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.out_proj",
           "ffn_in", "ffn_out")
NORMS = ("norm1", "norm2")


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every state_dict name of docs/spec.md with its shape, in the harness's order."""
    d, f = config.d_model, config.ffn_dim
    linear_shapes = {"attention.q_proj": (d, d), "attention.k_proj": (d, d), "attention.v_proj": (d, d),
                     "attention.out_proj": (d, d), "ffn_in": (f, d), "ffn_out": (d, f)}
    shapes = {}
    for i in range(config.num_layers):
        shapes[f"layers.{i}.norm1.weight"] = (d,)
        shapes[f"layers.{i}.norm1.bias"] = (d,)
        for name in LINEARS[:4]:
            shapes[f"layers.{i}.{name}.weight"] = linear_shapes[name]
            shapes[f"layers.{i}.{name}.bias"] = (linear_shapes[name][0],)
        shapes[f"layers.{i}.norm2.weight"] = (d,)
        shapes[f"layers.{i}.norm2.bias"] = (d,)
        for name in LINEARS[4:]:
            shapes[f"layers.{i}.{name}.weight"] = linear_shapes[name]
            shapes[f"layers.{i}.{name}.bias"] = (linear_shapes[name][0],)
    shapes["final_norm.weight"] = (d,)
    shapes["final_norm.bias"] = (d,)
    return shapes


def init_params(key: jax.Array, config: Config, dtype=jnp.float32) -> dict:
    """PyTorch's default init: nn.Linear weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)); LayerNorm 1 and 0."""
    config = Config.from_object(config)
    flat = {}
    names = expected_shapes(config)
    keys = jax.random.split(key, len(names))
    for k, (name, shape) in zip(keys, names.items()):
        module, leaf = name.rsplit(".", 1)
        if module.endswith(("norm1", "norm2", "final_norm")):
            flat[name] = (jnp.ones if leaf == "weight" else jnp.zeros)(shape, dtype)
        else:
            fan_in = names[f"{module}.weight"][1]
            bound = 1.0 / math.sqrt(fan_in)
            flat[name] = jax.random.uniform(k, shape, dtype, -bound, bound)
    return _unflatten(flat, config.num_layers)


def to_jax_array(value: Any) -> jax.Array:
    """Any array that speaks DLPack or numpy, as a jax array on jax's default device: zero-copy where the
    producer allows and already lives there. A host array (numpy, a CPU torch tensor) on a machine whose
    default backend is a GPU is copied to the GPU: imported as it is, it would be a CPU-committed array
    that pulls every computation using it onto the CPU."""
    if isinstance(value, jax.Array):
        return value
    if getattr(value, "requires_grad", False):   # a framework tensor that tracks gradients
        value = value.detach()
    array = None
    if hasattr(value, "__dlpack__"):
        try:
            array = jax.dlpack.from_dlpack(value)
        except (TypeError, ValueError, RuntimeError, BufferError):
            pass   # e.g. an unaligned CPU buffer: fall through to a copy
    if array is None:
        return jnp.asarray(np.asarray(value))
    if next(iter(array.devices())).platform == "cpu" and jax.default_backend() != "cpu":   # host: to the default device
        return jax.device_put(array, jax.devices()[0])
    return array


def params_from_state_dict(state_dict: Mapping[str, Any], config: Config | None = None) -> dict:
    """Builds raw params from a mapping with docs/spec.md's names. With a config, every name and shape is
    checked against it; without one, the layer count and widths are read from the names."""
    names = list(state_dict)
    if config is None:
        config = infer_config(state_dict)
    config = Config.from_object(config)
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in state_dict]
    unexpected = [n for n in names if n not in expected]
    if missing or unexpected:
        raise ValueError(f"state_dict does not match the config ({config.num_layers} layers, "
                         f"d_model={config.d_model}, ffn_dim={config.ffn_dim}): "
                         f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                         f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
    flat = {}
    for name, shape in expected.items():
        array = to_jax_array(state_dict[name])
        if tuple(array.shape) != shape:
            raise ValueError(f"state_dict[{name!r}] has shape {tuple(array.shape)}, expected {shape}")
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(f"state_dict[{name!r}] has dtype {array.dtype}, expected a floating dtype")
        flat[name] = array
    return _unflatten(flat, config.num_layers)


def params_to_state_dict(params: Mapping) -> dict[str, jax.Array]:
    """The inverse of params_from_state_dict: docs/spec.md's names -> arrays, in the harness's order."""
    flat = {}
    for i, layer in enumerate(params["layers"]):
        for module in ("norm1", *LINEARS[:4], "norm2", *LINEARS[4:]):
            node = layer
            for part in module.split("."):
                node = node[part]
            flat[f"layers.{i}.{module}.weight"] = node["weight"]
            flat[f"layers.{i}.{module}.bias"] = node["bias"]
    flat["final_norm.weight"] = params["final_norm"]["weight"]
    flat["final_norm.bias"] = params["final_norm"]["bias"]
    return flat


def infer_config(state_dict: Mapping[str, Any], *, num_heads: int = 1, causal: bool = True,
                 batch_size: int = 1, seq_len: int = 1) -> Config:
    """Reads num_layers, d_model and ffn_dim off the names and shapes (num_heads cannot be read)."""
    layer_ids = {int(m.group(1)) for n in state_dict if (m := re.match(r"layers\.(\d+)\.", n))}
    if "final_norm.weight" not in state_dict or "layers.0.ffn_in.weight" not in state_dict:
        raise ValueError("state_dict lacks 'final_norm.weight' or 'layers.0.ffn_in.weight'; "
                         "pass config= to see exactly which names are missing")
    d_model = int(state_dict["final_norm.weight"].shape[0])
    ffn_dim = int(state_dict["layers.0.ffn_in.weight"].shape[0])
    return Config(batch_size=batch_size, seq_len=seq_len, d_model=d_model, num_heads=num_heads,
                  ffn_dim=ffn_dim, num_layers=len(layer_ids), causal=causal)


def _unflatten(flat: Mapping[str, Any], num_layers: int) -> dict:
    params: dict = {"layers": [dict() for _ in range(num_layers)], "final_norm": {}}
    for name, value in flat.items():
        parts = name.split(".")
        if parts[0] == "layers":
            node = params["layers"][int(parts[1])]
            parts = parts[2:]
        else:
            node = params
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return params


class LayerStackWeights:
    """Per-layer weights, the final LayerNorm's and the numerics policy's name, as a pytree (the name is
    static). Subclasses say how `layers` is laid out; register each with
    jax.tree_util.register_pytree_node_class."""

    def __init__(self, layers, final_norm: dict, policy_name: str):
        self.layers = layers
        self.final_norm = final_norm
        self.policy_name = policy_name

    def tree_flatten(self):
        return (self.layers, self.final_norm), self.policy_name

    @classmethod
    def tree_unflatten(cls, policy_name, children):
        return cls(*children, policy_name)


@jax.tree_util.register_pytree_node_class
class PreparedWeights(LayerStackWeights):
    """Weights in the layout and dtypes the forward pass consumes, for one numerics policy: `layers` is a
    list of one dict per layer."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> dict:
        return self.layers[i]


@jax.tree_util.register_pytree_node_class
class StackedWeights(LayerStackWeights):
    """PreparedWeights with each per-layer array stacked over the layers (`layers[name]` is [L, ...]):
    fourteen arrays whatever the depth, where PreparedWeights has twelve per layer. jax's dispatch costs
    1-3 us of host time per argument on the H200 host (`bench/dispatch_cost.py`), so the layer-by-layer
    program takes these; a static slice `layers[name][i]` of an argument costs it no copy kernel there."""

    @property
    def num_layers(self) -> int:
        return next(iter(self.layers.values())).shape[0]

    def layer(self, i: int) -> dict:
        return {name: stacked[i] for name, stacked in self.layers.items()}


def stacked_layers(prepared: PreparedWeights) -> dict:
    """`prepared`'s per-layer arrays stacked over the layers, by name. Traceable."""
    return {name: jnp.stack([layer[name] for layer in prepared.layers]) for name in prepared.layers[0]}


def stack_layer_weights(prepared: PreparedWeights) -> StackedWeights:
    """StackedWeights of `prepared` (the same arrays, stacked). Traceable: build it once under jit."""
    return StackedWeights(stacked_layers(prepared), dict(prepared.final_norm), prepared.policy_name)


def prepare_weights(params: Mapping, policy: NumericsPolicy) -> PreparedWeights:
    """Fused QKV `[d, 3d]`, matrices as `[in, out]` in the policy's weight dtype (its GEMM dtype unless
    it says otherwise), vectors in fp32. Traceable: run it under jit (the forward does) or once and keep
    the result."""
    gemm = policy.stored_weight_dtype
    f32 = jnp.float32

    def matrix(weight):       # torch's [out, in] -> [in, out]
        return jnp.asarray(weight).T.astype(gemm)

    def vector(v):
        return jnp.asarray(v).astype(f32)

    layers = []
    for layer in params["layers"]:
        attn = layer["attention"]
        layers.append({
            "norm1_weight": vector(layer["norm1"]["weight"]), "norm1_bias": vector(layer["norm1"]["bias"]),
            # torch's three [d, d] stacked to [3d, d], then transposed: the same [d, 3d] as joining the
            # three transposes, and a training GEMM that keeps w^T (numerics.WEIGHT_RESIDUAL_TRANSPOSED)
            # gets the stacked weights back with the transposes cancelled, no copy
            "qkv_weight": matrix(jnp.concatenate([jnp.asarray(attn[name]["weight"]) for name in
                                                  ("q_proj", "k_proj", "v_proj")], axis=0)),
            "qkv_bias": jnp.concatenate([vector(attn["q_proj"]["bias"]), vector(attn["k_proj"]["bias"]),
                                         vector(attn["v_proj"]["bias"])]),
            "out_weight": matrix(attn["out_proj"]["weight"]), "out_bias": vector(attn["out_proj"]["bias"]),
            "norm2_weight": vector(layer["norm2"]["weight"]), "norm2_bias": vector(layer["norm2"]["bias"]),
            "ffn_in_weight": matrix(layer["ffn_in"]["weight"]), "ffn_in_bias": vector(layer["ffn_in"]["bias"]),
            "ffn_out_weight": matrix(layer["ffn_out"]["weight"]), "ffn_out_bias": vector(layer["ffn_out"]["bias"]),
        })
    final_norm = {"weight": vector(params["final_norm"]["weight"]),
                  "bias": vector(params["final_norm"]["bias"])}
    return PreparedWeights(layers, final_norm, policy.name)
