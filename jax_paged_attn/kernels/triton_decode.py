"""Paged decode attention: the Pallas kernel body and its `pallas_call` (Triton lowering).

Only the kernel lives here; `jax_paged_attn.plans` decides the tiling (`DecodeTiling`),
`jax_paged_attn.decode` checks support and merges the KV splits. Semantics are those of
`jax_paged_attn.reference.paged_decode_attention`.

One program handles one (row block of one KV head, sequence, KV split):

* its q tile holds the ``Sq * G`` query rows that share the KV head (row ``r`` is
  query token ``r // G`` of query head ``kv_head * G + r % G``), padded to
  ``rows_per_program`` (a power of 2, >= 16 for the tensor-core dot), so every K/V
  page is read once per KV head and never repeated in memory;
* it walks its share of the sequence's visible keys, ``tile_keys`` at a time, reading
  each key's page id from the block table and gathering the rows of that page
  (``D`` contiguous elements each) straight from the paged cache; with
  ``prefetch_page_ids`` a step reads the next step's ids instead (carried through
  the loops), so Triton's pipeliner can keep ``num_stages - 2`` K/V tiles in flight
  during a step's math instead of waiting for each tile right after issuing it;
* tiles are run by three loops: a masked one for the tiles at the sliding-window
  start, an unmasked one for the interior (no key or causal masks at all), and a
  masked one for the tiles at the end of the sequence. Keys outside the visible
  range are never loaded; masked tiles load only in-range keys (others read as 0),
  so NaN garbage in unused pages cannot reach the output; with several query tokens
  and a causal / window mask, masked tiles also keep non-finite values out of the
  P·V of rows that cannot see them (`common.quarantine_nonfinite_values`, as in the
  prefill kernel: two vectors of extra state instead of the ``[M, T]`` mask); after the
  loops a row whose accumulator holds a NaN / inf in any channel is NaN in all of them
  (`common.nan_rows_scale`, the reference's NaN rule);
* the head dim is padded to a power of 2 inside the kernel with masked loads and
  stores; the caller's cache is never copied.

With one split the program writes the normalized output in q's dtype; with several
it writes its normalized partial output and log-sum-exp, merged by the caller.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged_attn import reference
from jax_paged_attn.kernels import common
from jax_paged_attn.kernels.common import LN_2, LOG2E, RUNNING_MAX_INIT
from jax_paged_attn.kv_view import CachePlane
from jax_paged_attn.plans import DecodeTiling
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

def _decode_kernel(
    *refs,
    spec: AttentionSpec,
    tiling: DecodeTiling,
    num_q_tokens: int,
    group_size: int,
    head_size: int,
    block_size: int,
    has_alibi: bool,
    k_dequant: bool,
    v_dequant: bool,
):
    (
        # inputs
        q_ref,  # [B, Sq, Hq, D] q dtype
        k_ref,  # [num_blocks * block_size, Hk, D] q dtype or fp8 (the paged cache, pages flattened)
        v_ref,  # [num_blocks * block_size, Hk, D] like k_ref
        seqlens_ref,  # i32[B]: keys of each sequence, the Sq new tokens included
        block_table_ref,  # i32[B, max_blocks]
        *rest,  # optional inputs (`common.pop_optional`), then the outputs
    ) = refs
    alibi_ref = common.pop_optional(rest, has_alibi)  # f32[Hq]: slopes * log2(e)
    scales_ref = common.pop_optional(rest, k_dequant or v_dequant)  # f32[2]: k_scale, v_scale
    # outputs
    if tiling.num_splits == 1:
        (o_ref,) = rest  # [B, Sq, Hq, D] q dtype
        lse_ref = None
    else:
        o_ref, lse_ref = rest  # f32[splits, B, Sq, Hq, D], f32[splits, B, Sq, Hq]

    num_rows, tile_keys = tiling.rows_per_program, tiling.tile_keys
    padded_head = tiling.padded_head_size
    max_keys = block_table_ref.shape[1] * block_size
    num_pages = k_ref.shape[0] // block_size
    compute_dtype = q_ref.dtype
    # f32 inputs get true f32 dots (the default would be TF32 on GPUs).
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    head_block, seq, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if tiling.row_blocks == 1:
        kv_head, row_block = head_block, 0
    else:
        kv_head, row_block = common.div(head_block, tiling.row_blocks), common.rem(head_block, tiling.row_blocks)

    # q tile rows: (query token, query head of this KV head).
    row = row_block * num_rows + lax.iota(jnp.int32, num_rows)  # [M]
    q_tok = common.div(row, group_size)  # [M] position among the Sq new tokens
    q_head = kv_head * group_size + common.rem(row, group_size)  # [M]
    row_ok = row < num_q_tokens * group_size  # [M] False on padding rows
    dim, dim_ok = common.col_mask(padded_head, head_size)  # [Dp], [Dp] or None

    def with_dims(row_mask: Array | None, rows: int) -> Array | None:
        """[rows, Dp] load/store mask from a row mask and the head-dim padding mask."""
        return common.rows_and_cols(row_mask, dim_ok, rows, padded_head)

    q_rows_mask = with_dims(row_ok, num_rows)
    q = plgpu.load(q_ref.at[seq, q_tok[:, None], q_head[:, None], dim[None, :]], mask=q_rows_mask, other=0)

    scores_scale = spec.softmax_scale
    k_scale = v_scale = None
    if scales_ref is not None:
        if k_dequant:
            k_scale = scales_ref[0]
        if v_dequant:
            v_scale = scales_ref[1]
    slopes_log2 = None
    if alibi_ref is not None:
        slopes_log2 = plgpu.load(alibi_ref.at[q_head], mask=row_ok, other=0.0)  # [M]

    seq_len = jnp.minimum(seqlens_ref[seq], max_keys)
    # Visible keys of the whole tile: [kv_lo, seq_len). Query token i sees keys up to
    # diag(i) = i + seq_len - Sq (causal) and from diag(i) - window_left.
    kv_lo = jnp.int32(0)
    if spec.window_left >= 0:
        kv_lo = jnp.maximum(seq_len - num_q_tokens - spec.window_left, 0)
    # Tiles start at the page holding kv_lo: pages before the window are skipped.
    base = common.div(kv_lo, block_size) * block_size
    num_tiles = common.cdiv(jnp.maximum(seq_len - base, 0), tile_keys)
    tiles_per_split = common.cdiv(num_tiles, tiling.num_splits)
    tile_begin = jnp.minimum(split * tiles_per_split, num_tiles)
    tile_end = jnp.minimum(tile_begin + tiles_per_split, num_tiles)

    # Tiles whose keys every query row sees need no mask: keys in [free_lo, free_hi).
    free_hi = seq_len
    if spec.causal:
        free_hi = jnp.minimum(free_hi, seq_len - num_q_tokens + 1)
    elif spec.window_right >= 0:
        free_hi = jnp.minimum(free_hi, seq_len - num_q_tokens + spec.window_right + 1)
    first_free = jnp.int32(0)
    if spec.window_left >= 0:
        free_lo = seq_len - 1 - spec.window_left
        first_free = common.cdiv(jnp.maximum(free_lo - base, 0), tile_keys)
    end_free = common.div(jnp.maximum(free_hi - base, 0), tile_keys)
    masked_until = jnp.clip(first_free, tile_begin, tile_end)
    unmasked_until = jnp.clip(end_free, masked_until, tile_end)

    key_offsets = lax.iota(jnp.int32, tile_keys)  # [T]
    # A masked tile loads only keys in [kv_lo, seq_len). With one query token that is
    # exactly what it sees; with several, a causal or window mask hides some loaded keys
    # from some rows, and their non-finite values must stay out of those rows' P·V.
    mask_hides_loaded_keys = num_q_tokens > 1 and (spec.causal or spec.is_local)

    def load_tile(cache_ref, cache_row, key_ok):
        """[T, Dp] rows of one KV head; masked-out keys and padded dims read as 0."""
        mask = with_dims(key_ok, tile_keys)
        rows = cache_ref.at[cache_row[:, None], kv_head, dim[None, :]]
        if mask is None:
            return plgpu.load(rows).astype(compute_dtype)
        if jnp.dtype(cache_ref.dtype).itemsize > 1:
            return plgpu.load(rows, mask=mask, other=0).astype(compute_dtype)
        # Triton cannot make an fp8 fill value: zero the masked entries after the upcast.
        x = plgpu.load(rows, mask=mask).astype(compute_dtype)
        return jnp.where(mask, x, 0)

    max_blocks = block_table_ref.shape[1]

    def tile_page_ids(tile):
        """[T] page id of each key of a tile, read without a mask from a clamped index.

        Used to fetch the next tile's ids one step ahead: an index past the table
        (the step after the last) reads its last entry, and ids of keys outside the
        sequence are garbage that `step` masks out, exactly as in the masked load.
        """
        key = base + tile * tile_keys + key_offsets
        return plgpu.load(block_table_ref.at[seq, jnp.minimum(common.div(key, block_size), max_blocks - 1)])

    def step(tile, carry, *, masked: bool):
        if tiling.prefetch_page_ids:
            acc, row_max, row_sum, page = carry  # ..., i32[T] this tile's page ids
        else:
            acc, row_max, row_sum = carry  # f32[M, Dp], f32[M], f32[M]
        key = base + tile * tile_keys + key_offsets  # [T]
        key_ok = ((key >= kv_lo) & (key < seq_len)) if masked else None
        if tiling.prefetch_page_ids:
            # The ids came from the previous step, so this step's K/V addresses do not
            # wait on a load of the same step (Triton can pipeline the K/V loads).
            next_page = tile_page_ids(tile + 1)
        elif masked:
            # Keys past the sequence may have page ids out of the block table, and
            # garbage pages: neither their ids nor their rows are read.
            page = plgpu.load(block_table_ref.at[seq, common.div(key, block_size)], mask=key_ok, other=0)
        else:
            page = plgpu.load(block_table_ref.at[seq, common.div(key, block_size)])
        # Ids outside the cache (only from unvalidated tables under jit) are clamped,
        # never followed: the numbers are then meaningless but memory stays in bounds.
        page = jnp.clip(page, 0, num_pages - 1)
        cache_row = page * block_size + common.rem(key, block_size)  # [T]
        k = load_tile(k_ref, cache_row, key_ok)
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)  # f32[M, T]
        # Scores in log2 units (exp2 is the fast path): s * log2(e).
        scale = scores_scale if k_scale is None else scores_scale * k_scale
        if spec.softcap > 0:
            s = jnp.tanh(qk * (scale / spec.softcap)) * (spec.softcap * LOG2E)
        else:
            s = qk * (scale * LOG2E)
        if slopes_log2 is not None:
            dist = reference.alibi_distance(q_tok[:, None], key[None, :], num_q_tokens, seq_len)
            s = s - slopes_log2[:, None] * dist
        if masked:
            visible = reference.key_visible(q_tok[:, None], key[None, :], num_q_tokens, seq_len, spec)
            s = jnp.where(visible, s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        correction = jnp.exp2(row_max - new_max)
        p = jnp.exp2(s - new_max[:, None])  # masked keys: exp2(-inf) = 0
        row_sum = row_sum * correction + jnp.sum(p, axis=1)
        v = load_tile(v_ref, cache_row, key_ok)
        if masked and mask_hides_loaded_keys:
            v, correction = common.quarantine_nonfinite_values(s, v, correction)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(compute_dtype), v, precision=precision)
        if tiling.prefetch_page_ids:
            return acc, new_max, row_sum, next_page
        return acc, new_max, row_sum

    carry = (
        jnp.zeros((num_rows, padded_head), jnp.float32),
        jnp.full((num_rows,), RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )
    if tiling.prefetch_page_ids:
        # The three loops run consecutive tiles, so one carried id vector feeds them all.
        carry = (*carry, tile_page_ids(tile_begin))
    masked_step = functools.partial(step, masked=True)
    carry = lax.fori_loop(tile_begin, masked_until, masked_step, carry)
    carry = lax.fori_loop(masked_until, unmasked_until, functools.partial(step, masked=False), carry)
    acc, row_max, row_sum = lax.fori_loop(unmasked_until, tile_end, masked_step, carry)[:3]

    # A row that saw no key has row_sum 0 and acc 0: it outputs 0, never NaN.
    seen = row_sum > 0
    inv_sum = common.nan_rows_scale(1.0 / jnp.where(seen, row_sum, 1.0), acc)
    if v_scale is not None:
        inv_sum = inv_sum * v_scale
    out = acc * inv_sum[:, None]
    out_mask = with_dims(row_ok, num_rows)
    if lse_ref is None:
        plgpu.store(o_ref.at[seq, q_tok[:, None], q_head[:, None], dim[None, :]],
                    out.astype(o_ref.dtype), mask=out_mask)
    else:
        plgpu.store(o_ref.at[split, seq, q_tok[:, None], q_head[:, None], dim[None, :]], out, mask=out_mask)
        # Natural-log log-sum-exp of the split's scores; -inf when it saw no key.
        lse = jnp.where(seen, (row_max + jnp.log2(jnp.where(seen, row_sum, 1.0))) * LN_2, -jnp.inf)
        plgpu.store(lse_ref.at[split, seq, q_tok, q_head], lse, mask=row_ok)


def paged_decode_call(
    q: Array,  # [B, Sq, Hq, D] f16 / bf16 / f32
    k_cache: CachePlane,  # [num_blocks, block_size, Hk, D] q's dtype or fp8, a plane of a stacked cache
    v_cache: CachePlane,  # [num_blocks, block_size, Hk, D] like k_cache
    cache_seqlens: Array,  # i32[B]
    block_table: Array,  # i32[B, max_blocks]
    alibi_slopes_log2: Array | None,  # f32[Hq]: ALiBi slopes * log2(e) (plans.alibi_slopes_log2), or None
    scales: Array | None,  # f32[2] (k_scale, v_scale) when either cache is fp8 (plans.kv_scales), else None
    *,
    spec: AttentionSpec,
    tiling: DecodeTiling,
    interpret: bool,
) -> Array | tuple[Array, Array]:
    """Runs the kernel over the grid (KV heads x row blocks, sequences, splits).

    The caches are planes of stacked arrays (`jax_paged_attn.kv_view.CachePlane`): the
    whole stacked array is passed and a BlockSpec selects the plane, so XLA copies
    nothing (K and V may be two planes of one buffer).

    Returns the output ``[B, Sq, Hq, D]`` in q's dtype when ``tiling.num_splits == 1``,
    else ``(partial_out f32[splits, B, Sq, Hq, D], lse f32[splits, B, Sq, Hq])`` where
    each split's output is normalized over its own keys and ``lse`` is the natural
    log-sum-exp of its scores (-inf for a split that saw no key).
    """
    batch, num_q_tokens, num_q_heads, head_size = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    k_dequant = jnp.dtype(k_cache.dtype).itemsize == 1
    v_dequant = jnp.dtype(v_cache.dtype).itemsize == 1
    if (k_dequant or v_dequant) and scales is None:
        raise ValueError("scales (k_scale, v_scale) are required with an fp8 cache.")
    # A free reshape (no copy): one row per cached token of every plane, so a key's row
    # within its plane is page * block_size + slot, and each (row, KV head) is D
    # contiguous elements; the BlockSpec's block index on the rows picks the plane.
    rows = num_blocks * block_size

    def plane_rows(plane: CachePlane) -> tuple[Array, pl.BlockSpec]:
        flat = plane.array.reshape(plane.array.shape[0] * rows, num_kv_heads, head_size)
        return flat, pl.BlockSpec((rows, num_kv_heads, head_size), lambda h, b, s: (plane.plane, 0, 0))

    (k_rows, k_spec), (v_rows, v_spec) = plane_rows(k_cache), plane_rows(v_cache)
    whole = pl.BlockSpec()  # the whole array: the kernel addresses it itself
    inputs = [q, k_rows, v_rows, cache_seqlens, block_table]
    in_specs = [whole, k_spec, v_spec, whole, whole]
    common.append_optional(inputs, alibi_slopes_log2, in_specs, whole)
    common.append_optional(inputs, scales if (k_dequant or v_dequant) else None, in_specs, whole)
    if tiling.num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((tiling.num_splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((tiling.num_splits, *q.shape[:3]), jnp.float32),
        )
    kernel = functools.partial(
        _decode_kernel,
        spec=spec,
        tiling=tiling,
        num_q_tokens=num_q_tokens,
        group_size=num_q_heads // num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        has_alibi=alibi_slopes_log2 is not None,
        k_dequant=k_dequant,
        v_dequant=v_dequant,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_kv_heads * tiling.row_blocks, batch, tiling.num_splits),
        in_specs=in_specs,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(*inputs)
