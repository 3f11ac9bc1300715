"""jax_paged_attn: vLLM's FlashAttention backend for JAX, with Pallas GPU kernels."""
from jax_paged_attn.api import (
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_supported_head_sizes,
)
from jax_paged_attn.spec import UNBOUNDED, AttentionSpec

__version__ = "0.1.0"
