"""Varlen (prefill) flash attention kernel for the Pallas Triton lowering.

One kernel body serves packed and paged K/V: keys are rows of a ``[R, Hk, D]`` view
(the packed tokens, or the paged cache with its first two dims merged) and a
row-index function maps a key position of the tile's sequence to its row (packed:
``k_row0 + j``; paged: ``block_table[b, j // bs] * bs + j % bs``), read by gather
loads. The plan (`jax_paged_attn.plans.plan_tiles`) says which rows a tile owns
and which KV blocks it visits, and `jax_paged_attn.plans.PrefillTiling` how it is
tiled; this file only runs them.

Grid: ``(num_tiles, Hq // heads_per_program)``; the tile axis varies fastest, so the
programs running at the same time are neighbouring tiles of one head (and of one
sequence, the plan keeping a sequence's tiles adjacent): they read the same K/V
blocks, which then come from L2. With heads fastest the concurrent programs spread
over every KV head, whose K/V (8 MiB per head at 16k tokens, D 128) no longer fit
together in L2 (measured on the H200, B1 S16384 Hq32 Hk8: +3 % packed, +6 % unpacked).

Numerics: f32 scores and accumulation; the online softmax works in base 2 with
``log2(e)`` folded into the score scale and the ALiBi slopes (``exp2`` is a single
MUFU instruction). fp8 K/V are converted to the query dtype for the MMA (exact: fp8
values are representable in f16 / bf16), and their scales are applied to the scores
(``k_scale``) and the output (``v_scale``): mathematically ``x * scale`` dequantization,
with one rounding fewer. A masked score is ``-inf`` and the running max starts at the
most negative finite f32, so ``exp2`` of a masked score is exactly 0 and a row that
sees no key ends with sum 0 and outputs 0, never NaN. K/V rows past the sequence's
keys are not read (masked loads yield 0), so NaN in unused cache pages cannot leak.
A masked score is removed with ``where`` (a NaN key never reaches the softmax of a row
that cannot see it); in blocks where a causal / window mask hides loaded keys from some
rows, P·V runs over finite values and the rows that see a non-finite value get a NaN
running output (`common.quarantine_nonfinite_values`): a NaN or inf in K or V
reaches exactly the rows that see its key. Unmasked blocks need neither. After the KV
loop a row whose accumulator is non-finite in any channel (an unmasked block's product
puts a non-finite value into its own channel only) is NaN in every channel
(`common.nan_rows_scale`, the reference's NaN rule).
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
from jax_paged_attn.kernels.common import LOG2E, RUNNING_MAX_INIT
from jax_paged_attn.plans import TILE_INFO_WIDTH, PrefillTiling, TileField
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array


def _load(ref, mask: Array | None) -> Array:
    """Gather load; where ``mask`` is False nothing is read and the value is 0."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0.0)


def _prefill_kernel(
    *refs,
    spec: AttentionSpec,
    tiling: PrefillTiling,
    head_size: int,
    page_size: int | None,
    num_pages: int,
    max_pages_per_seq: int,
    has_alibi: bool,
    k_fp8: bool,
    v_fp8: bool,
):
    (
        # inputs
        tile_ref,  # i32[TILE_INFO_WIDTH]: this tile's row of the plan (TileField columns)
        q_ref,  # [Tq, heads_per_program, Dp] q dtype; columns >= head_size lie outside q
        k_ref,  # [R, Dp] q dtype or fp8: K rows of this program's KV head
        v_ref,  # [R, Dp] same layout as k_ref
        *rest,  # optional inputs (`common.pop_optional`), then the output
    ) = refs
    block_table_ref = common.pop_optional(rest, page_size is not None)  # i32[B, max_blocks]
    alibi_ref = common.pop_optional(rest, has_alibi)  # f32[heads_per_program] slopes * log2(e)
    kv_scale_ref = common.pop_optional(rest, k_fp8 or v_fp8)  # f32[2] (k_scale, v_scale)
    # outputs
    (o_ref,) = rest  # [Tq, heads_per_program, Dp] q dtype
    block_q, block_k = tiling.block_q, tiling.block_k
    heads_per_program = tiling.heads_per_program
    single_kv_loop = tiling.single_kv_loop
    prefetch_page_ids = tiling.prefetch_page_ids and page_size is not None  # paged only
    head_size_padded = q_ref.shape[-1]
    compute_dtype = q_ref.dtype
    positions_per_tile = block_q // heads_per_program
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else lax.Precision.DEFAULT

    def field(f: TileField) -> Array:
        return tile_ref[int(f)]

    q_rows = field(TileField.Q_ROWS)

    @pl.when(q_rows > 0)  # surplus tiles of the static grid exit here
    def _():
        seq = field(TileField.SEQ)
        q_row0 = field(TileField.Q_ROW0)
        q_pos0 = field(TileField.Q_POS0)
        q_len = field(TileField.Q_LEN)
        k_len = field(TileField.K_LEN)
        k_row0 = field(TileField.K_ROW0)

        # Tile row r = (query position r // hpp, head r % hpp of this program's heads).
        r = lax.iota(jnp.int32, block_q)
        if heads_per_program == 1:
            pos_in_tile, head_in_group = r, jnp.zeros_like(r)
        else:
            pos_in_tile = common.div(r, heads_per_program)
            head_in_group = common.rem(r, heads_per_program)
        stored = pos_in_tile < q_rows
        if positions_per_tile * heads_per_program < block_q:  # group does not divide block_q
            stored &= pos_in_tile < positions_per_tile
        q_pos = q_pos0 + pos_in_tile  # [block_q] position in the sequence
        attends = stored & (q_pos < q_len)
        q_token = q_row0 + pos_in_tile  # [block_q] packed row

        col, col_ok = common.col_mask(head_size_padded, head_size)
        col_ok = None if col_ok is None else col_ok[None, :]  # [1, Dp], expanded once

        def and_cols(row_mask: Array | None, rows: int) -> Array | None:
            return common.rows_and_cols(row_mask, col_ok, rows, head_size_padded)

        q = _load(q_ref.at[q_token[:, None], head_in_group[:, None], col[None, :]],
                  and_cols(stored, block_q))  # [block_q, Dp]

        if kv_scale_ref is not None:
            k_scale, v_scale = kv_scale_ref[0], kv_scale_ref[1]
        else:
            k_scale = v_scale = None
        # Scores in log2 units: s2 = log2(e) * softcap(scale * q.k).
        if spec.softcap > 0:
            pre_tanh = spec.softmax_scale / spec.softcap
            post_tanh = spec.softcap * LOG2E
        else:
            pre_tanh, post_tanh = spec.softmax_scale * LOG2E, None
        if k_fp8:
            pre_tanh = k_scale * pre_tanh
        slope = None
        if alibi_ref is not None:
            slope = plgpu.load(alibi_ref.at[head_in_group])[:, None]  # [block_q, 1]

        # Masked blocks load only keys < k_len, and rows past q_len are zeroed at the end;
        # a causal or window mask also hides loaded keys from some rows, whose non-finite
        # values must then stay out of those rows' P·V (unmasked blocks need nothing).
        mask_hides_loaded_keys = spec.causal or spec.is_local

        def key_rows(k_pos: Array) -> Array:  # [block_k] positions -> rows of k_ref / v_ref
            if page_size is None:
                return k_row0 + k_pos
            logical = jnp.minimum(common.div(k_pos, page_size), max_pages_per_seq - 1)
            page = plgpu.load(block_table_ref.at[seq, logical])
            page = jnp.clip(page, 0, num_pages - 1)  # bad ids read a real page, never outside
            return page * page_size + common.rem(k_pos, page_size)

        def visit(kb, state, rows, *, width: int, masked: bool):
            acc, m_prev, l_prev = state
            k_pos = kb * width + lax.iota(jnp.int32, width)  # [width]
            kv_mask = and_cols(k_pos < k_len if masked else None, width)
            index = (rows[:, None], col[None, :])
            k = _load(k_ref.at[index], kv_mask)  # [width, Dp]
            if k_fp8:
                k = k.astype(compute_dtype)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)  # [block_q, width]
            s = s * pre_tanh
            if post_tanh is not None:
                s = jnp.tanh(s) * post_tanh
            if slope is not None:
                s = s - slope * reference.alibi_distance(q_pos[:, None], k_pos[None, :], q_len, k_len)
            if masked:
                visible = reference.key_visible(q_pos[:, None], k_pos[None, :], q_len, k_len, spec)
                s = jnp.where(visible, s, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            correction = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - m_next[:, None])
            l_next = l_prev * correction + jnp.sum(p, axis=1)
            v = _load(v_ref.at[index], kv_mask)  # [width, Dp]
            if v_fp8:
                v = v.astype(compute_dtype)
            if masked and mask_hides_loaded_keys:
                v, correction = common.quarantine_nonfinite_values(s, v, correction)
            pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            return acc * correction[:, None] + pv, m_next, l_next

        def block_rows(kb: Array, width: int) -> Array:  # [width] rows of KV step kb
            return key_rows(kb * width + lax.iota(jnp.int32, width))

        def kv_loop(kb_begin: Array, kb_end: Array, state, *, masked: bool):
            """Visits KV blocks [kb_begin, kb_end) (units of block_k) in steps of ``width`` keys."""
            width = tiling.masked_block_k if masked else block_k
            steps_per_block = block_k // width
            begin, end = kb_begin * steps_per_block, kb_end * steps_per_block
            step = functools.partial(visit, width=width, masked=masked)
            if not prefetch_page_ids:
                return lax.fori_loop(begin, end, lambda j, st: step(j, st, block_rows(j, width)), state)

            # The carry holds this step's K/V rows; the step loads the block-table
            # entries of the next one, so no K/V address waits on a load of its own step.
            def prefetching_step(j, carry):
                *st, rows = carry
                return (*step(j, st, rows), block_rows(j + 1, width))

            return lax.fori_loop(begin, end, prefetching_step, (*state, block_rows(begin, width)))[:3]

        carry = (
            jnp.zeros((block_q, head_size_padded), jnp.float32),
            jnp.full((block_q,), RUNNING_MAX_INIT, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        )
        kb_lo, kb_full_lo = field(TileField.KB_LO), field(TileField.KB_FULL_LO)
        kb_full_hi, kb_hi = field(TileField.KB_FULL_HI), field(TileField.KB_HI)
        if single_kv_loop:  # one software pipeline per tile, every block masked
            carry = kv_loop(kb_lo, kb_hi, carry, masked=True)
        else:
            if spec.window_left >= 0:  # left window edge: the only blocks before the full ones
                carry = kv_loop(kb_lo, kb_full_lo, carry, masked=True)
            carry = kv_loop(kb_full_lo, kb_full_hi, carry, masked=False)
            carry = kv_loop(kb_full_hi, kb_hi, carry, masked=True)
        acc, _, l_sum = carry[:3]

        # One reciprocal per row instead of a division per element; sees no key -> 0.
        inv_sum = common.nan_rows_scale(1.0 / jnp.where(l_sum > 0, l_sum, 1.0), acc)
        if v_fp8:
            inv_sum = inv_sum * v_scale
        out = acc * inv_sum[:, None]
        out = jnp.where(attends[:, None], out, 0.0)
        plgpu.store(
            o_ref.at[q_token[:, None], head_in_group[:, None], col[None, :]],
            out.astype(o_ref.dtype), mask=and_cols(stored, block_q))


def varlen_attention_call(
    q: Array,  # [Tq, Hq, D] f16 / bf16 / f32
    k_rows: tuple[Array, int],  # ([P * R, Hk, D], plane): packed keys (P = 1), or a stacked
    #   paged cache viewed as rows [planes * num_blocks * bs, Hk, D]; plane p is rows p*R..p*R+R-1
    v_rows: tuple[Array, int],  # same layout as k_rows (may be another plane of the same array)
    plan: Array,  # i32[num_tiles, TILE_INFO_WIDTH] from plans.plan_tiles
    block_table: Array | None,  # i32[B, max_blocks] (paged) or None (packed)
    alibi_slopes_log2: Array | None,  # f32[Hq]: ALiBi slopes * log2(e) (plans.alibi_slopes_log2), or None
    kv_scales: Array | None,  # f32[2] (k_scale, v_scale) when K or V is fp8 (plans.kv_scales), else None
    *,
    spec: AttentionSpec,
    tiling: PrefillTiling,
    num_kv_rows: int,
    page_size: int | None,
    interpret: bool = False,
) -> Array:  # [Tq, Hq, D] q.dtype
    """Builds and runs the pallas_call of `_prefill_kernel` over the plan's tiles.

    ``tiling`` (`jax_paged_attn.plans.plan_prefill_tiling`) gives the tile sizes, the
    query heads sharing a tile's rows (1, or the whole GQA group), the KV loop
    structure and the launch parameters; ``num_kv_rows`` is the rows of one K/V plane;
    ``page_size`` is the cache block size for a paged cache, None for packed keys.
    Every row of the output is written (padding rows with 0).
    """
    num_q_tokens, num_q_heads, head_size = q.shape
    (k_rows, k_plane), (v_rows, v_plane) = k_rows, v_rows
    num_kv_heads = k_rows.shape[1]
    group = num_q_heads // num_kv_heads
    hpp = tiling.heads_per_program
    assert num_q_heads % hpp == 0 and (hpp == 1 or hpp == group), (hpp, group)
    head_size_padded = tiling.padded_head_size
    num_tiles = plan.shape[0]
    assert plan.shape[1] == TILE_INFO_WIDTH
    k_fp8, v_fp8 = jnp.dtype(k_rows.dtype).itemsize == 1, jnp.dtype(v_rows.dtype).itemsize == 1
    if (k_fp8 or v_fp8) and kv_scales is None:
        raise ValueError("kv_scales (k_scale, v_scale) are required with fp8 keys or values.")

    def kv_head(plane: int):  # program's KV head: heads g*hpp .. g*hpp+hpp-1 share it
        return lambda t, g: (plane, (g * hpp) // group, 0)

    paged = block_table is not None
    inputs = [plan, q, k_rows, v_rows]
    in_specs = [
        pl.BlockSpec((None, TILE_INFO_WIDTH), lambda t, g: (t, 0)),
        pl.BlockSpec((num_q_tokens, hpp, head_size_padded), lambda t, g: (0, g, 0)),
        pl.BlockSpec((num_kv_rows, None, head_size_padded), kv_head(k_plane)),
        pl.BlockSpec((num_kv_rows, None, head_size_padded), kv_head(v_plane)),
    ]
    common.append_optional(inputs, block_table, in_specs,
                           pl.BlockSpec(block_table.shape, lambda t, g: (0, 0)) if paged else None)
    common.append_optional(inputs, alibi_slopes_log2, in_specs, pl.BlockSpec((hpp,), lambda t, g: (g,)))
    common.append_optional(inputs, kv_scales, in_specs, pl.BlockSpec((2,), lambda t, g: (0,)))
    kernel = functools.partial(
        _prefill_kernel,
        spec=spec,
        tiling=tiling,
        head_size=head_size,
        page_size=page_size,
        num_pages=num_kv_rows // page_size if paged else 0,
        max_pages_per_seq=block_table.shape[1] if paged else 0,
        has_alibi=alibi_slopes_log2 is not None,
        k_fp8=k_fp8,
        v_fp8=v_fp8,
    )
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_q_heads // hpp),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((num_q_tokens, hpp, head_size_padded), lambda t, g: (0, g, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="varlen_attention",
    )(*inputs)
