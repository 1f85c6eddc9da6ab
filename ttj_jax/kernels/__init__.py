"""Pallas kernels. `flash_attention_reference` is the plain-jnp semantics the kernels are tested against."""

from ttj_jax.kernels.flash_attention import BlockSizes, flash_attention, flash_attention_fused_qkv
from ttj_jax.kernels.flash_attention import attention_reference as flash_attention_reference
from ttj_jax.kernels.flash_attention_mgpu import MgpuBlockSizes, flash_attention_mgpu  # Hopper, needs a GPU
from ttj_jax.kernels.fused_stack import FusedWeights, fused_stack_forward, stack_weights

__all__ = ["BlockSizes", "flash_attention", "flash_attention_fused_qkv", "flash_attention_reference",
           "MgpuBlockSizes", "flash_attention_mgpu", "FusedWeights", "fused_stack_forward", "stack_weights"]
