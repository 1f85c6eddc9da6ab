"""Pallas kernels. `flash_attention_reference` is the plain-jnp semantics the kernels are tested against."""

from ttj_jax.kernels.flash_attention import BlockSizes
from ttj_jax.kernels.flash_attention import attention_reference as flash_attention_reference
from ttj_jax.kernels.flash_attention import flash_attention
from ttj_jax.kernels.flash_attention import flash_attention_fused_qkv

__all__ = ["BlockSizes", "flash_attention", "flash_attention_fused_qkv", "flash_attention_reference"]
