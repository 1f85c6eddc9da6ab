"""ttj-jax: a pre-LN causal Transformer layer stack in JAX (docs/spec.md), planned per shape."""

from ttj_jax.config import Config
from ttj_jax.masks import MaskKind, classify_mask
from ttj_jax.model import executable, forward, model_key, validate_inputs
from ttj_jax.numerics import EXACT_FP32, MIXED_FP16, NumericsPolicy, get_policy
from ttj_jax.params import (
                            PreparedWeights,
                            StackedWeights,
                            expected_shapes,
                            init_params,
                            params_from_state_dict,
                            params_to_state_dict,
                            prepare_weights,
)
from ttj_jax.planner import DeviceFacts, InputFacts, Plan, device_facts, plan
from ttj_jax.reference import reference_forward as reference
from ttj_jax.ring_attention import sequence_parallel_forward
from ttj_jax.shapes import CPU_SMALL, OFFICIAL, SUITES, Shape
from ttj_jax.streaming import stream_forward

__all__ = [
    "Config", "MaskKind", "classify_mask", "executable", "forward", "model_key", "validate_inputs",
    "EXACT_FP32", "MIXED_FP16", "NumericsPolicy", "get_policy", "PreparedWeights", "StackedWeights",
    "expected_shapes",
    "init_params", "params_from_state_dict", "params_to_state_dict", "prepare_weights", "DeviceFacts",
    "InputFacts", "Plan", "device_facts", "plan", "reference", "CPU_SMALL", "OFFICIAL", "SUITES", "Shape",
    "stream_forward", "sequence_parallel_forward",
]
