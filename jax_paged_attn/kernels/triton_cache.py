"""Cache write (vLLM's ``reshape_and_cache_flash``), alone or fused with the rotary
embedding: the Pallas kernels and their `pallas_call`s.

Only the kernel lives here; `jax_paged_attn.cache` checks the arguments, picks the
implementation and keeps the XLA scatter as the reference. Semantics are those of
`jax_paged_attn.cache.reshape_and_cache_flash`.

The cache is viewed as rows: ``[num_slots, Hk * D]`` (``num_slots = num_blocks *
block_size``, a free reshape), so token ``t``'s key is one contiguous row of
``Hk * D`` elements written to row ``slot_mapping[t]``. One program handles
``tokens_per_program`` tokens x ``cols_per_program`` columns of that row:

* it loads the tokens' slot ids, then the key and value tile (contiguous rows of the
  packed ``[T, Hk * D]`` inputs); rows of padding tokens (``PAD_SLOT_ID``) and of
  out-of-range slots are neither read nor written;
* for an fp8 cache it stores ``x / scale`` saturated to the format's largest finite
  value (NaN stays NaN), rounded to nearest even, as `cache._quantize` does; the
  division is IEEE-rounded (``div.rn.f32``, not Triton's approximate ``div.full``),
  so the kernel and the XLA path write the same bits;
* it stores into the cache buffer itself: the caches are aliased to the outputs
  (``input_output_aliases``), so under ``jax.jit(..., donate_argnums=...)`` nothing
  but the written rows is touched;
* ``Hk * D`` need not be a power of 2: the columns are padded inside with masks.

Both layouts use the same kernel: two caches ``[num_slots, Hk * D]`` (key, value) or
one stacked cache ``[2, num_slots, Hk * D]`` written by the same program.

Addressing: the kernel's own indices (tokens, slot ids, columns) are int32 and each
stays below ``2**31``; the store addresses ``(slot, column)`` of the cache ref, and
Pallas' Triton lowering turns that into a flat element offset, in 64 bits for a ref of
``2**31`` elements and more (the lowering itself for more than 4 GiB,
`jax_paged_attn.kernels.triton_offsets` for an fp8 cache of ``2**31`` to ``2**32``
elements, which the lowering alone would address with wrapping 32-bit offsets). So
every cache size is written here; only where that widening could not be installed does
such an fp8 cache stay on the scatter (`jax_paged_attn.cache`, which says so). The tiling comes from `jax_paged_attn.plans.plan_cache_write`.

The fused kernel (`rotary_cache_write_call`, `jax_paged_attn.cache.rotary_and_cache_flash_kv`)
starts from one projection's output ``qkv [T, Hk, G + 2, D]`` (per KV head: its ``G``
query heads, its key, its value): it rotates the queries and the key (rotate-half
layout, per-token ``cos`` / ``sin`` rows), writes the rotated key and the value to their
slot, and returns the rotated queries ``[T, Hq, D]``. A decode step then runs one
kernel where XLA ran four (the value slice, two rotations, the write). It also takes
the projection as a split-K product's float32 partials ``[S, T, Hk, G + 2, D]``, summed
and rounded to the model's dtype as it loads them: one kernel less again. One program is
``tokens_per_program`` tokens of one KV head; each half of a head is rotated against
the other half, loaded a second time with the columns swapped (the same cache lines).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged_attn.kernels import common
from jax_paged_attn.plans import CacheWriteConfig, RotaryCacheTiling

Array = jax.Array


def _divide_rn(x: Array, scale: Array, *, interpret: bool) -> Array:
    """f32 ``x / scale`` rounded to nearest even (IEEE), like XLA's division.

    Triton lowers f32 division to the approximate ``div.full.f32`` (up to 2 ulp off),
    which could round a value to a different fp8 neighbour than the XLA path; the
    inline ``div.rn.f32`` is exact. Interpret mode (no PTX) divides with jnp.
    """
    scale = jnp.broadcast_to(scale, x.shape)
    if interpret:
        return x / scale
    [quotient] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, scale],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return quotient


def _quantize(x: Array, cache_dtype, scale: Array | None, *, interpret: bool) -> Array:
    """``x`` in the cache's dtype; for fp8, ``x / scale`` saturated (NaN kept)."""
    if scale is None:
        return x.astype(cache_dtype)
    largest = float(jnp.finfo(cache_dtype).max)
    scaled = _divide_rn(x.astype(jnp.float32), scale, interpret=interpret)
    # Comparisons, not jnp.clip: Triton's float min / max ignore NaN (maxnumf), and a
    # NaN must stay NaN as in the XLA path (and vLLM's __NV_SATFINITE conversion).
    scaled = jnp.where(scaled > largest, largest, scaled)
    scaled = jnp.where(scaled < -largest, -largest, scaled)
    return scaled.astype(cache_dtype)


def _cache_write_kernel(
    *refs,
    tiling: CacheWriteConfig,
    num_tokens: int,
    row_size: int,
    num_slots: int,
    fp8: bool,
    stacked: bool,
    interpret: bool,
):
    (
        # inputs
        key_ref,  # [T, Hk * D] f16 / bf16 / f32
        value_ref,  # [T, Hk * D] key's dtype
        slots_ref,  # i32[T], PAD_SLOT_ID (-1) or out-of-range: not written
        *rest,  # optional inputs (`common.pop_optional`), the aliased caches, then the outputs
    ) = refs
    scales_ref = common.pop_optional(rest, fp8)  # f32[2]: k_scale, v_scale
    num_caches = 1 if stacked else 2
    # The aliased cache inputs (rest[:num_caches]) are the outputs' buffers; only the
    # output refs are written.
    # outputs
    out_refs = rest[num_caches:]  # [2, num_slots, Hk * D] or 2 x [num_slots, Hk * D] cache dtype
    cache_dtype = out_refs[0].dtype

    tokens, cols = tiling.tokens_per_program, tiling.cols_per_program
    token = pl.program_id(0) * tokens + lax.iota(jnp.int32, tokens)  # [TT]
    col = pl.program_id(1) * cols + lax.iota(jnp.int32, cols)  # [TC]
    if num_tokens % tokens:
        slot = plgpu.load(slots_ref.at[token], mask=token < num_tokens, other=-1)
    else:
        slot = plgpu.load(slots_ref.at[token])
    slot_ok = (slot >= 0) & (slot < num_slots)  # [TT]
    # Rows not written point past the end of the cache: masked on the GPU, and dropped
    # by the interpreter's scatter (an in-range dummy row could collide with a real one).
    target = jnp.where(slot_ok, slot, num_slots)  # [TT]
    mask = jnp.broadcast_to(slot_ok[:, None], (tokens, cols))  # [TT, TC]
    if row_size % cols:
        mask = mask & (col < row_size)[None, :]

    k_scale = v_scale = None
    if scales_ref is not None:
        k_scale, v_scale = scales_ref[0], scales_ref[1]
    rows = (token[:, None], col[None, :])
    key = plgpu.load(key_ref.at[rows], mask=mask, other=0)
    value = plgpu.load(value_ref.at[rows], mask=mask, other=0)
    key = _quantize(key, cache_dtype, k_scale, interpret=interpret)
    value = _quantize(value, cache_dtype, v_scale, interpret=interpret)
    dest = (target[:, None], col[None, :])
    if stacked:
        (kv_out_ref,) = out_refs
        plgpu.store(kv_out_ref.at[(0, *dest)], key, mask=mask)
        plgpu.store(kv_out_ref.at[(1, *dest)], value, mask=mask)
    else:
        k_out_ref, v_out_ref = out_refs
        plgpu.store(k_out_ref.at[dest], key, mask=mask)
        plgpu.store(v_out_ref.at[dest], value, mask=mask)


def cache_write_call(
    key: Array,  # [T, Hk, D] f16 / bf16 / f32
    value: Array,  # [T, Hk, D] key's dtype
    slots: Array,  # i32[T]: PAD_SLOT_ID or out-of-range entries are dropped
    scales: Array | None,  # f32[2] (k_scale, v_scale) for an fp8 cache (plans.kv_scales), else None
    caches: tuple[Array, ...],  # ([2, num_blocks, bs, Hk, D],) or (k [num_blocks, bs, Hk, D], v same)
    *,
    tiling: CacheWriteConfig,
    interpret: bool = False,
) -> tuple[Array, ...]:
    """Writes every token's key and value row into its slot; returns the caches.

    ``caches`` is either one stacked cache ``[2, num_blocks, block_size, Hk, D]`` or a
    (key, value) pair of ``[num_blocks, block_size, Hk, D]`` caches, in key's dtype or
    fp8 (then ``scales`` is required and the cache stores ``x / scale``). The outputs
    alias the caches (``input_output_aliases``): donated under jit, they are updated
    in place. The returned tuple matches ``caches``. No argument checks here (see
    `jax_paged_attn.cache`); ``tiling`` comes from `plans.plan_cache_write`.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    stacked = len(caches) == 1
    cache_shape = caches[0].shape
    num_slots = cache_shape[-4] * cache_shape[-3]
    row_size = num_kv_heads * head_size
    cache_dtype = jnp.dtype(caches[0].dtype)
    fp8 = cache_dtype.itemsize == 1
    if fp8 and scales is None:
        raise ValueError("scales (k_scale, v_scale) are required with an fp8 cache.")
    if num_tokens == 0:
        return tuple(caches)

    # Free reshapes (bitcasts, aliasing survives them): one row per token / slot.
    flat_caches = [c.reshape(*c.shape[:-4], num_slots, row_size) for c in caches]
    inputs = [key.reshape(num_tokens, row_size), value.reshape(num_tokens, row_size),
              slots.astype(jnp.int32)]
    common.append_optional(inputs, scales.astype(jnp.float32).reshape(2) if fp8 else None)
    first_cache = len(inputs)
    inputs.extend(flat_caches)
    kernel = functools.partial(
        _cache_write_kernel,
        tiling=tiling,
        num_tokens=num_tokens,
        row_size=row_size,
        num_slots=num_slots,
        fp8=fp8,
        stacked=stacked,
        interpret=interpret,
    )
    grid = (pl.cdiv(num_tokens, tiling.tokens_per_program), pl.cdiv(row_size, tiling.cols_per_program))
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in flat_caches],
        grid=grid,
        input_output_aliases={first_cache + i: i for i in range(len(flat_caches))},
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=1),
        interpret=interpret,
        name="reshape_and_cache_flash",
    )(*inputs)
    return tuple(out.reshape(c.shape) for out, c in zip(outs, caches))


def _rotate_half_partner(dim: Array, head_size: int) -> tuple[Array, Array]:
    """``(partner, sign)`` ``[Dp]``: column ``c`` of ``rotate_half(x)`` is
    ``sign[c] * x[partner[c]]`` (``-x[c + D/2]`` in the first half, ``x[c - D/2]`` in the
    second; padded columns point at themselves)."""
    half = head_size // 2
    first = dim < half
    partner = jnp.where(first, dim + half, jnp.where(dim < head_size, dim - half, dim))
    return partner, jnp.where(first, -1.0, 1.0).astype(jnp.float32)


def _masked_load(ref: Any, mask: Array | None) -> Array:
    """``ref``'s elements, 0 where ``mask`` is False (Triton takes a fill value only with a mask)."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _rotary_cache_write_kernel(
    *refs,
    tiling: RotaryCacheTiling,
    num_tokens: int,
    group: int,
    head_size: int,
    num_slots: int,
    fp8: bool,
    dtype,
    interpret: bool,
):
    (
        # inputs
        qkv_ref,  # [S, T, Hk, G + 2, D]: queries, key, value of each KV head; summed over S
        # (a split-K product's float32 partials, S = 1: the product in `dtype`) and rounded to dtype
        cos_ref,  # [T, D] any float: cos of each token's angles (both halves)
        sin_ref,  # [T, D] like cos_ref
        slots_ref,  # i32[T], PAD_SLOT_ID (-1) or out-of-range: not written
        *rest,  # optional inputs (`common.pop_optional`), the aliased cache, then the outputs
    ) = refs
    scales_ref = common.pop_optional(rest, fp8)  # f32[2]: k_scale, v_scale
    # rest[0] is the aliased cache input (the output's buffer); only the output is written.
    q_out_ref, kv_out_ref = rest[1:]  # [T, Hq, D] dtype; [2, num_slots, Hk * D] cache dtype
    cache_dtype = kv_out_ref.dtype

    tokens, groups, padded_head = tiling.tokens_per_program, tiling.padded_group, tiling.padded_head_size
    kv_head = pl.program_id(1)
    token = pl.program_id(0) * tokens + lax.iota(jnp.int32, tokens)  # [TT]
    token_ok = token < num_tokens if num_tokens % tokens else None
    dim, dim_ok = common.col_mask(padded_head, head_size)  # [Dp], [Dp] or None
    partner, sign = _rotate_half_partner(dim, head_size)

    def projection(row_tokens: Array, head: Array | int, cols: Array, mask: Array | None) -> Array:
        """``[rows, Dp]`` of the projection in dtype: the partials summed in float32, rounded once."""
        total = None
        for split in range(qkv_ref.shape[0]):
            part = _masked_load(qkv_ref.at[split, row_tokens[:, None], kv_head, head, cols[None, :]], mask)
            total = part.astype(jnp.float32) if total is None else total + part.astype(jnp.float32)
        return total.astype(dtype)

    def rotated(row_tokens: Array, head: Array | int, row_mask: Array | None, rows: int) -> Array:
        """f32 ``[rows, Dp]``: rows (token, head of this KV head's G + 2) rotated."""
        mask = common.rows_and_cols(row_mask, dim_ok, rows, padded_head)
        head = head if isinstance(head, int) else head[:, None]
        x = projection(row_tokens, head, dim, mask)
        x_partner = projection(row_tokens, head, partner, mask)
        cos = _masked_load(cos_ref.at[row_tokens[:, None], dim[None, :]], mask)
        sin = _masked_load(sin_ref.at[row_tokens[:, None], dim[None, :]], mask)
        return (x.astype(jnp.float32) * cos.astype(jnp.float32)
                + sign[None, :] * x_partner.astype(jnp.float32) * sin.astype(jnp.float32))

    # Queries: rows (token, query head of this KV head), G padded to a power of 2.
    row = lax.iota(jnp.int32, tokens * groups)
    row_token = pl.program_id(0) * tokens + common.div(row, groups)
    row_head = common.rem(row, groups)
    row_ok = row_head < group if groups != group else None
    if num_tokens % tokens:
        in_range = row_token < num_tokens
        row_ok = in_range if row_ok is None else row_ok & in_range
    q = rotated(row_token, row_head, row_ok, tokens * groups).astype(dtype)
    q_mask = common.rows_and_cols(row_ok, dim_ok, tokens * groups, padded_head)
    plgpu.store(q_out_ref.at[row_token[:, None], kv_head * group + row_head[:, None], dim[None, :]], q,
                mask=q_mask)

    # Key (rotated, rounded to qkv's dtype first, as the unfused path writes it) and value.
    if token_ok is None:
        slot = plgpu.load(slots_ref.at[token])
    else:
        slot = plgpu.load(slots_ref.at[token], mask=token_ok, other=-1)
    slot_ok = (slot >= 0) & (slot < num_slots)  # [TT]
    target = jnp.where(slot_ok, slot, num_slots)  # past the end: masked, and dropped by the interpreter
    k_scale = v_scale = None
    if scales_ref is not None:
        k_scale, v_scale = scales_ref[0], scales_ref[1]
    key = rotated(token, group, token_ok, tokens).astype(dtype)
    load_mask = common.rows_and_cols(token_ok, dim_ok, tokens, padded_head)
    value = projection(token, group + 1, dim, load_mask)
    key = _quantize(key, cache_dtype, k_scale, interpret=interpret)
    value = _quantize(value, cache_dtype, v_scale, interpret=interpret)
    write_mask = common.rows_and_cols(slot_ok, dim_ok, tokens, padded_head)
    col = kv_head * head_size + dim  # [Dp] within the slot's Hk * D row
    plgpu.store(kv_out_ref.at[0, target[:, None], col[None, :]], key, mask=write_mask)
    plgpu.store(kv_out_ref.at[1, target[:, None], col[None, :]], value, mask=write_mask)


def rotary_cache_write_call(
    qkv: Array,  # [S, T, Hk, G + 2, D]: partial products summed over S (S = 1: the product)
    cos: Array,  # [T, D] float
    sin: Array,  # [T, D] float
    slots: Array,  # i32[T]: PAD_SLOT_ID or out-of-range entries are dropped
    scales: Array | None,  # f32[2] (k_scale, v_scale) for an fp8 cache (plans.kv_scales), else None
    kv_cache: Array,  # [2, num_blocks, block_size, Hk, D] qkv's dtype or fp8
    *,
    tiling: RotaryCacheTiling,
    dtype,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Rotates the queries and keys of ``qkv`` (summed over its first axis and rounded to
    ``dtype``), writes keys and values into their slots.

    Returns ``(query [T, G * Hk, D] rotated, in dtype, kv_cache)``; the cache
    output aliases ``kv_cache`` (updated in place when donated). No argument checks here
    (see `jax_paged_attn.cache.rotary_and_cache_flash_kv`); ``tiling`` comes from
    `plans.plan_rotary_cache_write`.
    """
    _, num_tokens, num_kv_heads, heads_per_kv, head_size = qkv.shape
    group = heads_per_kv - 2
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    fp8 = jnp.dtype(kv_cache.dtype).itemsize == 1
    if fp8 and scales is None:
        raise ValueError("scales (k_scale, v_scale) are required with an fp8 cache.")
    flat_cache = kv_cache.reshape(2, num_slots, num_kv_heads * head_size)  # a bitcast: aliasing survives it
    inputs = [qkv, cos, sin, slots.astype(jnp.int32)]
    common.append_optional(inputs, scales.astype(jnp.float32).reshape(2) if fp8 else None)
    cache_index = len(inputs)
    inputs.append(flat_cache)
    kernel = functools.partial(
        _rotary_cache_write_kernel, tiling=tiling, num_tokens=num_tokens, group=group, head_size=head_size,
        num_slots=num_slots, fp8=fp8, dtype=jnp.dtype(dtype), interpret=interpret)
    query, flat_cache = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_size), dtype),
                   jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype)],
        grid=(pl.cdiv(num_tokens, tiling.tokens_per_program), num_kv_heads),
        input_output_aliases={cache_index: 1},
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=1),
        interpret=interpret,
        name="rotary_and_cache_flash",
    )(*inputs)
    return query, flat_cache.reshape(kv_cache.shape)
