"""Paged decode attention (`flash_attn_with_kvcache`) through a Pallas kernel.

The lowering-independent half of the decode kernel: the static support check, the
config lookup in `jax_paged_attn.tuning`, and the merge of the KV splits
(flash-decoding); the tiling plan (query-row padding, head-dim padding, keys per step,
KV split count) is `jax_paged_attn.plans.plan_decode_tiling`, shared by every
lowering. The kernel itself is `jax_paged_attn.kernels.triton_decode`.

Semantics are exactly `jax_paged_attn.reference.paged_decode_attention`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_paged_attn import checks, plans, tuning
from jax_paged_attn.kv_view import CachePlane, as_plane
from jax_paged_attn.plans import (  # noqa: F401  (re-exported: the plan's names lived here)
    MIN_DOT_ROWS,
    DecodeTiling,
    choose_num_splits,
    estimate_shared_memory,
)
from jax_paged_attn.plans import plan_decode_tiling as plan_tiling
from jax_paged_attn.spec import AttentionSpec
from jax_paged_attn.tuning import DecodeConfig

Array = jax.Array

LOWERINGS = ("triton",)


def unsupported_reason(
    q: Array,  # [B, Sq, Hq, D]
    k_cache: Array,  # [num_blocks, block_size, Hk, D]
    v_cache: Array,  # [num_blocks, block_size, Hk, D]
    cache_seqlens: Array,  # i32[B]
    block_table: Array,  # i32[B, max_blocks]
    alibi_slopes: Array | None,  # f32[Hq] or None
    k_scale: Array,  # f32 scalar
    v_scale: Array,  # f32 scalar
    *,
    spec: AttentionSpec,
    lowering: str,
) -> str | None:
    """Why the decode kernel cannot run this call, or None if it can.

    Looks only at shapes, dtypes and `spec` (it runs at trace time). The public API
    has already rejected malformed inputs; this only reports what the kernel lacks.
    """
    del cache_seqlens, alibi_slopes, k_scale, v_scale, spec  # every value is supported
    if lowering not in LOWERINGS:
        return f"the decode kernel has no {lowering!r} lowering (available: {LOWERINGS})"
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4 or block_table.ndim != 2:
        return "expects q [B, Sq, Hq, D], caches [num_blocks, block_size, Hk, D], block_table [B, max_blocks]"
    if jnp.dtype(q.dtype) not in checks.QUERY_DTYPES:
        return f"query dtype {q.dtype} is not float16 / bfloat16 / float32"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        dtype = jnp.dtype(cache.dtype)
        if dtype != jnp.dtype(q.dtype) and dtype not in checks.FP8_DTYPES:
            return f"{name} dtype {cache.dtype} is neither q's dtype nor fp8"
    head_size = q.shape[-1]
    if head_size not in checks.supported_head_sizes():
        return f"head size {head_size} is not a multiple of 16 in [32, 256]"
    block_size = k_cache.shape[1]
    if block_size % checks.BLOCK_SIZE_MULTIPLE:
        return f"block size {block_size} is not a multiple of {checks.BLOCK_SIZE_MULTIPLE}"
    if k_cache.shape[2] == 0 or q.shape[2] % k_cache.shape[2]:
        return "the query heads are not a multiple of the KV heads"
    # The kernel addresses each cache (a plane: its whole stacked array) as one ref.
    return checks.narrow_offsets_reason({"k_cache": k_cache, "v_cache": v_cache})


def combine_splits(partial_out: Array, lse: Array, dtype) -> Array:
    """Merges per-split attention outputs (flash-decoding's final reduction).

    Args:
      partial_out: f32 ``[splits, B, Sq, Hq, D]``, each split normalized over its keys.
      lse: f32 ``[splits, B, Sq, Hq]`` natural log-sum-exp of each split's scores,
        -inf for a split that saw no key.
      dtype: output dtype.

    Returns:
      ``[B, Sq, Hq, D]`` in ``dtype``; 0 for rows no split saw a key for.
    """
    lse_max = jnp.max(lse, axis=0)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weight = jnp.exp(lse - lse_max[None])  # empty splits: exp(-inf) = 0
    total = jnp.sum(weight, axis=0)
    out = jnp.sum(weight[..., None] * partial_out, axis=0)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)


def paged_decode_attention(
    q: Array,  # [B, Sq, Hq, D] f16 / bf16 / f32
    k_cache: Array | CachePlane,  # [num_blocks, block_size, Hk, D] q's dtype or fp8 (e4m3fn / e5m2)
    v_cache: Array | CachePlane,  # [num_blocks, block_size, Hk, D] like k_cache
    cache_seqlens: Array,  # i32[B]: tokens in the cache, the Sq new ones included
    block_table: Array,  # i32[B, max_blocks]
    alibi_slopes: Array | None,  # f32[Hq] or None
    k_scale: Array | float,  # f32 scalar, used when k_cache is fp8
    v_scale: Array | float,  # f32 scalar, used when v_cache is fp8
    *,
    spec: AttentionSpec,
    lowering: str = "triton",
    interpret: bool = False,
    config: DecodeConfig | None = None,
) -> Array:  # [B, Sq, Hq, D], q.dtype
    """Decode attention over a paged cache with the Pallas kernel (split-KV, GQA-packed).

    Same contract as `jax_paged_attn.reference.paged_decode_attention`. ``config``
    overrides the tuning table (`tuning.decode_config`); ``interpret`` runs the kernel
    in Pallas interpret mode (CPU tests). Raises NotImplementedError when
    `unsupported_reason` names a reason.
    """
    reason = unsupported_reason(q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes,
                                k_scale, v_scale, spec=spec, lowering=lowering)
    if reason:
        raise NotImplementedError(f"paged decode kernel: {reason}")
    from jax_paged_attn.kernels import triton_decode

    # Zero-size launches: no query (B, Sq or Hq of 0), or no key anywhere; same results
    # as the reference (the tiling plan divides by these sizes).
    if q.size == 0 or block_table.shape[1] == 0 or k_cache.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    head_size, block_size = q.shape[-1], k_cache.shape[1]
    group_size = q.shape[2] // k_cache.shape[2]
    device = tuning.target_device()
    if config is None:
        config = tuning.decode_config(head_size, block_size, group_size, device=device)
    tiling = plans.plan_decode_tiling(q.shape, k_cache.shape, block_table.shape[1], q.dtype, k_cache.dtype,
                                      config, shared_memory_budget=device.shared_memory_budget)
    result = triton_decode.paged_decode_call(
        q, as_plane(k_cache), as_plane(v_cache), cache_seqlens.astype(jnp.int32), block_table.astype(jnp.int32),
        plans.alibi_slopes_log2(alibi_slopes), plans.kv_scales(k_cache.dtype, v_cache.dtype, k_scale, v_scale),
        spec=spec, tiling=tiling, interpret=interpret,
    )
    if tiling.num_splits == 1:
        return result
    partial_out, lse = result
    return combine_splits(partial_out, lse, q.dtype)
