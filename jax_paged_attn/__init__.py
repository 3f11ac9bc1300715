"""jax_paged_attn: vLLM's FlashAttention backend for JAX, with Pallas GPU kernels.

Public API (vLLM names):
  attention  flash_attn_varlen_func, flash_attn_with_kvcache, get_supported_head_sizes
  cache      reshape_and_cache_flash(_kv), rotary_and_cache_flash_kv, copy_blocks,
             copy_kv_cache_blocks, swap_blocks,
             get_kv_cache_shape, get_kv_cache_dtype, allocate_kv_cache, allocate_host_kv_cache,
             PAD_SLOT_ID
  metadata   FlashAttentionMetadata, prefill_metadata, decode_metadata, advance_step,
             validate_metadata, FlashAttentionMetadataBuilder, ScheduledSequence
  layer      paged_attention (vLLM's unified_flash_attention), PagedAttention (Flax NNX)
  models     jax_paged_attn.models: LlamaForCausalLM (Llama, Mistral, Qwen2, Qwen3, Gemma 2),
             LlamaConfig, HF checkpoint I/O
  engine     jax_paged_attn.engine: the generation engine

The names import on first use (PEP 562): ``import jax_paged_attn`` itself loads no JAX,
so the server's command line can start its engine process before it imports JAX
(`jax_paged_attn.serve.cli`).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SOURCES = {
    "jax_paged_attn.api": ("flash_attn_varlen_func", "flash_attn_with_kvcache", "get_supported_head_sizes"),
    "jax_paged_attn.builder": ("FlashAttentionMetadataBuilder", "ScheduledSequence"),
    "jax_paged_attn.cache": ("KV_CACHE_DTYPES", "PAD_SLOT_ID", "allocate_host_kv_cache", "allocate_kv_cache",
                             "copy_blocks", "copy_kv_cache_blocks", "get_kv_cache_dtype", "get_kv_cache_shape",
                             "reshape_and_cache_flash", "reshape_and_cache_flash_kv", "rotary_and_cache_flash_kv",
                             "swap_blocks"),
    "jax_paged_attn.layer": ("PagedAttention", "paged_attention"),
    "jax_paged_attn.metadata": ("FlashAttentionMetadata", "advance_step", "decode_metadata", "prefill_metadata",
                                "validate_metadata"),
    "jax_paged_attn.spec": ("UNBOUNDED", "AttentionSpec"),
}
_SOURCE_OF = {name: module for module, names in _SOURCES.items() for name in names}
__all__ = sorted(_SOURCE_OF)


def __getattr__(name: str) -> Any:
    module = _SOURCE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_paged_attn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from jax_paged_attn.api import flash_attn_varlen_func, flash_attn_with_kvcache, get_supported_head_sizes
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence
    from jax_paged_attn.cache import (
        KV_CACHE_DTYPES,
        PAD_SLOT_ID,
        allocate_host_kv_cache,
        allocate_kv_cache,
        copy_blocks,
        copy_kv_cache_blocks,
        get_kv_cache_dtype,
        get_kv_cache_shape,
        reshape_and_cache_flash,
        reshape_and_cache_flash_kv,
        rotary_and_cache_flash_kv,
        swap_blocks,
    )
    from jax_paged_attn.layer import PagedAttention, paged_attention
    from jax_paged_attn.metadata import (
        FlashAttentionMetadata,
        advance_step,
        decode_metadata,
        prefill_metadata,
        validate_metadata,
    )
    from jax_paged_attn.spec import UNBOUNDED, AttentionSpec
