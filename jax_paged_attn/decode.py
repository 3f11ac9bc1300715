"""Paged decode attention (`flash_attn_with_kvcache`) through a Pallas kernel.

The lowering-independent half of the decode kernel: the static support check, the
config lookup in `jax_paged_attn.tuning`, and the merge of the KV splits
(flash-decoding); the tiling plan (query-row padding, head-dim padding, keys per step,
KV split count) is `jax_paged_attn.plans.plan_decode_tiling`, shared by every
lowering. The kernels themselves are `jax_paged_attn.kernels.triton_decode` (lowering
``"triton"``) and `jax_paged_attn.kernels.mosaic_decode` (lowering ``"mosaic_gpu"``, for
Hopper, 0.74-0.98x the Triton kernel on the H200, run only when asked for; its tiling is
`jax_paged_attn.plans.plan_mosaic_decode_tiling` and this module lays the query rows
out for it).

Semantics are exactly `jax_paged_attn.reference.paged_decode_attention`.
"""
from __future__ import annotations

import functools

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
from jax_paged_attn.tuning import DecodeConfig, MosaicDecodeConfig

Array = jax.Array

TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"
LOWERINGS = (TRITON, MOSAIC_GPU)


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
    del cache_seqlens, alibi_slopes, k_scale, v_scale, spec  # every value and option is supported
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
    if lowering == MOSAIC_GPU:
        return _mosaic_unsupported_reason(q, k_cache, v_cache)
    # The Triton kernel addresses each cache (a plane: its whole stacked array) as one ref.
    return checks.narrow_offsets_reason({"k_cache": k_cache, "v_cache": v_cache})


def _mosaic_cache_itemsizes(k_cache: Array | CachePlane, v_cache: Array | CachePlane) -> tuple[int, int]:
    return jnp.dtype(k_cache.dtype).itemsize, jnp.dtype(v_cache.dtype).itemsize


def _mosaic_unsupported_reason(q: Array, k_cache: Array, v_cache: Array) -> str | None:
    """What the Mosaic GPU kernel (`kernels.mosaic_decode`) lacks, beyond the Triton tier's limits."""
    prefix = "the Mosaic GPU decode kernel"
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"{prefix} takes float16 / bfloat16 queries only (float32 would run its wgmma in TF32), got {q.dtype}"
    least_keys, _ = plans.mosaic_decode_tile(k_cache.shape[1], min(plans.MOSAIC_DECODE_TILE_KEYS))
    least = plans.estimate_mosaic_decode_shared_memory(least_keys, q.shape[-1],
                                                       jnp.dtype(q.dtype).itemsize, 2, 4,
                                                       _mosaic_cache_itemsizes(k_cache, v_cache))
    if least > tuning.MOSAIC_SHARED_MEMORY_LIMIT:
        return f"{prefix} does not fit shared memory at head size {q.shape[-1]} and block size " \
               f"{k_cache.shape[1]} ({least} bytes > {tuning.MOSAIC_SHARED_MEMORY_LIMIT})"
    return None


def triton_tiling(q_shape: tuple[int, ...], cache_shape: tuple[int, ...], max_blocks: int, q_dtype, cache_dtype,
                  config: DecodeConfig | None = None) -> DecodeTiling:
    """The Triton decode kernel's plan for a call on the target GPU: ``config``, or the
    tuning table's (`tuning.decode_config`), tiled by `plans.plan_decode_tiling` within
    the GPU's shared memory. ``q_shape`` ``[B, Sq, Hq, D]``, ``cache_shape``
    ``[num_blocks, block_size, Hk, D]``, ``max_blocks`` the block table's columns."""
    device = tuning.target_device()
    if config is None:
        config = tuning.decode_config(q_shape[-1], cache_shape[1], q_shape[2] // cache_shape[2], device=device)
    return plans.plan_decode_tiling(q_shape, cache_shape, max_blocks, q_dtype, cache_dtype, config,
                                    shared_memory_budget=device.shared_memory_budget)


def combine_splits(partial_out: Array, lse: Array, dtype) -> Array:
    """Merges per-split attention outputs (flash-decoding's final reduction).

    Args:
      partial_out: f32 ``[splits, B, Sq, Hq, D]``, each split normalized over its keys.
      lse: f32 ``[splits, B, Sq, Hq]`` natural log-sum-exp of each split's scores,
        -inf for a split that saw no key.
      dtype: output dtype.

    Returns:
      ``[B, Sq, Hq, D]`` in ``dtype``; 0 for rows no split saw a key for.

    The splits (a handful, static) are unrolled into elementwise maxima and sums, with
    no reduction over the split axis, so XLA can make the whole merge one loop fusion
    over the output: the reductions over that axis took a kernel of their own before
    the weighted sum (two kernels, about 3 + 5 µs a call on the H200, beside a 90 µs
    decode kernel at head size 64).
    """
    splits = lse.shape[0]
    lse_max = functools.reduce(jnp.maximum, [lse[s] for s in range(splits)])
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = [jnp.exp(lse[s] - lse_max) for s in range(splits)]  # empty splits: exp(-inf) = 0
    total = functools.reduce(jnp.add, weights)
    out = functools.reduce(jnp.add, [w[..., None] * partial_out[s] for s, w in enumerate(weights)])
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
    lowering: str = TRITON,
    interpret: bool = False,
    config: DecodeConfig | MosaicDecodeConfig | None = None,
) -> Array:  # [B, Sq, Hq, D], q.dtype
    """Decode attention over a paged cache with the Pallas kernel (split-KV, GQA-packed).

    Same contract as `jax_paged_attn.reference.paged_decode_attention`. ``lowering``
    picks the kernel (`LOWERINGS`); ``config`` overrides the tuning table
    (`tuning.decode_config`, a `DecodeConfig`, for Triton; `tuning.mosaic_decode_config`,
    a `MosaicDecodeConfig`, for Mosaic GPU); ``interpret`` runs the kernel in Pallas
    interpret mode (CPU tests). Raises NotImplementedError when `unsupported_reason`
    names a reason.
    """
    reason = unsupported_reason(q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes,
                                k_scale, v_scale, spec=spec, lowering=lowering)
    if reason:
        raise NotImplementedError(f"paged decode kernel: {reason}")

    # Zero-size launches: no query (B, Sq or Hq of 0), or no key anywhere; same results
    # as the reference (the tiling plan divides by these sizes).
    if q.size == 0 or block_table.shape[1] == 0 or k_cache.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    if lowering == MOSAIC_GPU:
        if config is not None and not isinstance(config, MosaicDecodeConfig):
            raise TypeError(f"config must be a MosaicDecodeConfig for lowering={MOSAIC_GPU!r}, got "
                            f"{type(config).__name__}.")
        return run_mosaic_decode(q, as_plane(k_cache), as_plane(v_cache), cache_seqlens, block_table, alibi_slopes,
                              k_scale, v_scale, spec=spec, interpret=interpret, config=config)
    from jax_paged_attn.kernels import triton_decode
    tiling = triton_tiling(q.shape, k_cache.shape, block_table.shape[1], q.dtype, k_cache.dtype, config)
    result = triton_decode.paged_decode_call(
        q, as_plane(k_cache), as_plane(v_cache), cache_seqlens.astype(jnp.int32), block_table.astype(jnp.int32),
        plans.alibi_slopes_log2(alibi_slopes), plans.kv_scales(k_cache.dtype, v_cache.dtype, k_scale, v_scale),
        spec=spec, tiling=tiling, interpret=interpret,
    )
    if tiling.num_splits == 1:
        return result
    partial_out, lse = result
    return combine_splits(partial_out, lse, q.dtype)


def run_mosaic_decode(
    q: Array,  # [B, Sq, Hq, D] f16 / bf16
    k_cache: CachePlane,  # [num_blocks, block_size, Hk, D] q's dtype or fp8
    v_cache: CachePlane,  # [num_blocks, block_size, Hk, D] q's dtype or fp8
    cache_seqlens: Array,  # i32[B]
    block_table: Array,  # i32[B, max_blocks]
    alibi_slopes: Array | None,  # f32[Hq] or None
    k_scale: Array | float,  # f32 scalar, used when k_cache is fp8
    v_scale: Array | float,  # f32 scalar, used when v_cache is fp8
    *,
    spec: AttentionSpec,
    interpret: bool = False,
    config: MosaicDecodeConfig | None = None,
    profile_dir: str | None = None,
) -> Array:  # [B, Sq, Hq, D], q.dtype
    """The Mosaic GPU lowering: query rows laid out per program, the kernel, the merge.

    `paged_decode_attention`'s ``lowering="mosaic_gpu"`` path after its checks (caches
    as `CachePlane`s); ``profile_dir``: the kernel's timeline
    (`kernels.mosaic_decode.paged_decode_call`; benchmarks/decode_parts.py).

    The kernel reads one tile of ``tiling.query_rows`` query rows per (KV head, row
    block), so the ``Sq * G`` rows of each KV head (row ``r``: token ``r // G``, head
    ``r % G`` of the group) are gathered and zero-padded here, ``[B, Hk * row_blocks,
    query_rows, D]``, and the output rows scattered back: a copy of q and of the output
    (about ``B * Sq * Hq * D`` elements each, small beside the K/V a decode step reads).
    """
    from jax_paged_attn.kernels import mosaic_decode

    batch, num_q_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if config is None:
        config = tuning.mosaic_decode_config(head_size, k_cache.shape[1], group)
    if config.keys_as_m:  # (the plan checks the shapes; the mask needs the spec)
        reason = plans.mosaic_keys_as_m_unsupported_reason(num_q_tokens, group, head_size, spec)
        if reason is not None:
            raise ValueError(f"config.keys_as_m: {reason}.")
    tiling = plans.plan_mosaic_decode_tiling(q.shape, k_cache.shape, block_table.shape[1], q.dtype, config,
                                             _mosaic_cache_itemsizes(k_cache, v_cache))
    rows = num_q_tokens * group
    padded = tiling.row_blocks * tiling.query_rows
    q_rows = q.reshape(batch, num_q_tokens, num_kv_heads, group, head_size).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_size)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    q_rows = q_rows.reshape(batch, num_kv_heads * tiling.row_blocks, tiling.query_rows, head_size)
    result = mosaic_decode.paged_decode_call(
        q_rows, k_cache, v_cache, cache_seqlens.astype(jnp.int32), block_table.astype(jnp.int32),
        plans.alibi_slopes_log2(alibi_slopes), plans.kv_scales(k_cache.dtype, v_cache.dtype, k_scale, v_scale),
        spec=spec, tiling=tiling, num_q_tokens=num_q_tokens,
        group_size=group, interpret=interpret, profile_dir=profile_dir,
    )

    def unpack_rows(x: Array, has_dim: bool) -> Array:
        """``[..., Hk * row_blocks, query_rows(, D)]`` program rows -> ``[..., Sq, Hq(, D)]``."""
        tail = (head_size,) if has_dim else ()
        lead = x.shape[:x.ndim - 2 - len(tail)]
        x = x.reshape(*lead, num_kv_heads, padded, *tail)[..., :rows, *([slice(None)] * len(tail))]
        x = x.reshape(*lead, num_kv_heads, num_q_tokens, group, *tail)
        n = len(lead)
        x = jnp.moveaxis(x, n, n + 1)  # [..., Sq, Hk, G(, D)]
        return x.reshape(*lead, num_q_tokens, num_q_heads, *tail)

    if tiling.num_splits == 1:
        return unpack_rows(_untransposed(result, tiling), True)
    partial_out, lse = result
    return combine_splits(unpack_rows(_untransposed(partial_out, tiling), True), unpack_rows(lse, False), q.dtype)


def _untransposed(out: Array, tiling: plans.MosaicDecodeTiling) -> Array:
    """The kernel's output rows ``[..., R, D]``: the keys-as-M form writes them ``[..., D, R]``
    (its accumulator's layout); XLA folds the transpose into the rows' unpacking copy."""
    return jnp.swapaxes(out, -1, -2) if tiling.keys_as_m else out
