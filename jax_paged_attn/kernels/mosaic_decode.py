"""Paged decode attention: the Pallas kernel body and its launch (Mosaic GPU lowering, Hopper).

Only the kernel lives here; `jax_paged_attn.plans.plan_mosaic_decode_tiling` decides the
tiling (`MosaicDecodeTiling`), `jax_paged_attn.decode` checks support, lays the query
rows out for the kernel and merges the KV splits. Semantics are those of
`jax_paged_attn.reference.paged_decode_attention` within the limits `decode.unsupported_reason`
names for this lowering.

On the H200 (benchmarks/NOTES.md, 2026-12-03 05:59 UTC) it passes the GPU tests and,
with its measured config (`tuning.MOSAIC_DECODE_MEASURED`: a producer and one compute
warpgroup, one wave of programs), reads 3,495-3,622 GB/s of K/V, 0.97-0.99x the Triton
decode kernel in alternating rounds, so auto does not run it; the 64-row wgmma tile
makes a GQA group of 4 a sixteenth of the tensor-core work it pays. Mosaic GPU
interpret mode runs it on jax 0.10 and 0.11 (jax 0.10's interpreter has no rule for
``layout_cast`` and no transposed wgmma operands; `common.mosaic_interpret_params` adds
both there).

What one program does (grid: KV heads x row blocks, sequences, KV splits; one warpgroup,
or with ``tiling.compute_warpgroups`` > 0 a producer warpgroup and that many compute
warpgroups, below):

* its query tile is the ``Sq * G`` rows that share a KV head (row ``r`` is query token
  ``r // G`` of query head ``kv_head * G + r % G``), zero-padded to 64 rows, the M of a
  Hopper warpgroup MMA (wgmma); the wrapper lays them out ``[B, Hk * row_blocks, R, D]``
  (``R = tiling.query_rows``: the rows rounded up to 8, or 64 with several row blocks)
  so one TMA copy brings them to shared memory, whose rows past ``R`` hold zeros, and
  the output leaves as ``R`` rows;
* it streams its share of the sequence's visible keys through a ring of ``num_stages``
  shared-memory stages of ``tile_keys`` keys (64 or 128): each stage is ``pages_per_tile``
  TMA copies of one KV head's rows (contiguous rows ``Hk * D`` apart in the vLLM layout)
  for K and as many for V: whole pages where the block size divides 128, else runs of
  ``gcd(tile_keys, block_size)`` rows, each within one page (a 256-key page: a slice of
  it; 48-key pages: 16-row runs, a stage spanning pages), the page ids read from the
  block table in global memory a step before the copies that use them; a stage's copies
  complete one barrier for K and one for V, and the stage is refilled with the tile ``num_stages`` ahead as
  soon as its math is done, so ``num_stages - 1`` tiles stay in flight while one is
  computed;
* ``S = Q K^T`` is one wgmma (K^T is a transposed view of the K stage, no copy); the
  online softmax runs in base 2 (``exp2``) on the f32 scores in registers; ``P`` is
  stored to shared memory in q's dtype and ``O += P V`` is a second wgmma;
* fp8 pages arrive as fp8 (half the bytes) and each stage is upcast to q's dtype
  through registers into a second shared-memory buffer before its wgmma (Hopper's
  wgmma takes fp8 only with fp8 on both sides); ``k_scale`` multiplies the score scale
  and ``v_scale`` the final normalization;
* masking: a tile holding keys that some row may not see (the first tile of a window,
  the last of a sequence, the causal diagonal of several query tokens) applies the
  bottom-right causal / window mask and the sequence end to its scores, the others
  skip it (a branch); in a tile holding keys outside ``[kv_lo, seq_len)`` (the first
  tile of a window, the last tile of the sequence) those keys' V rows are set to 0 in
  shared memory before ``P V``, so NaN / inf garbage in unused page slots never reaches
  an output (a 0 probability would still give ``0 * NaN = NaN``); out-of-range keys'
  K rows only produce scores that the mask replaces;
* with several query tokens under a causal / window mask, keys in range can be hidden
  from some rows only; in a tile holding such keys, V rows holding a NaN / inf are set
  to 0 and flagged, the flags go through shared memory to reach the score tile's column
  layout, and the rows that see a flagged key get a NaN correction, so their output is
  NaN and every other row's is not (`kernels.common.quarantine_nonfinite_values`, the
  Triton kernels' form); the epilogue makes a row whose accumulator holds a NaN / inf in
  any channel NaN in every channel (`kernels.common.nan_rows_scale`, the reference's
  NaN rule: an unmasked tile's product alone reaches only the value's channel);
* with one split it writes the normalized output in q's dtype; with several, its
  normalized f32 partial output and natural log-sum-exp (-inf for a row that saw no
  key), merged by `decode.combine_splits`.

Warp-specialized form (`tuning.MosaicDecodeConfig.compute_warpgroups` 1 or 2): a
producer warpgroup issues the query and ring copies and refills a slot as soon as the
compute warpgroup that read it arrives on the slot's "free" barrier, so the copies never
wait for the math; tile ``i`` goes to compute warpgroup ``i % n`` (the stages a multiple
of ``n``, so each slot's K / V barriers are always waited for by the same warpgroup, as
a barrier's per-thread phase tracking needs), each with its own running max, sum and
output and its own probabilities / flag / upcast buffers. With two, the second hands
its output and (max, sum) to the first through shared memory, which merges them as
split-KV partials are merged and stores the result. With
``tiling.items_per_program`` > 1 a program attends that many consecutive sequences (the
grid's sequence axis counts programs, the last one's items past the batch write nothing):
their tiles are one stream through the ring (stream tile ``t`` in slot ``t % stages``,
for compute warpgroup ``t % n``), so the producer runs on into the next sequence's pages
while the compute warpgroups finish the current one, its queries going to the other of
two query tiles once both compute warpgroups have arrived on that tile's "free" barrier;
the program's launch and the ring's fill are paid once for all its sequences.

What it does not do yet (each is either refused by `decode.unsupported_reason` or a
known performance gap):

* its wgmmas are synchronous: in the single-warpgroup form the ring's depth is the only
  overlap of memory and math, in the specialized form the other compute warpgroup's;
* the query tile is 64 rows, so a GQA group of 4 with one token wastes 15/16 of the
  tensor-core work, which makes the D 64 decode compute-bound (benchmarks/NOTES.md,
  2026-12-05 05:24 UTC); the keys-as-M form (`_keys_as_m_attend`,
  ``MosaicDecodeConfig.keys_as_m``: the keys as the wgmmas' M side, the ``Sq * G`` rows
  rounded up to 16 as N) computes a quarter of it, alone or with one compute warpgroup
  beside a producer (several sequences a program or one); off: measured slower than the
  default form on an H100 (its cross-warp max each tile costs what it saves).
  Its softmax reduces across the warpgroup's warps, which Mosaic GPU does through one
  shared-memory scratch buffer at a fixed offset: two compute warpgroups would race on
  it, so the form refuses them (`plans.mosaic_keys_as_m_unsupported_reason`);
* the fp8 upcast is synchronous in the one warpgroup (a K and a V tile through
  registers per stage), and to bf16 it goes through f32; float32 queries are refused
  (wgmma would compute in TF32); head sizes that are not multiples of 64 take 64- or
  32-byte swizzles (the widest whose tiles divide a row, `plans.mosaic_swizzle_bytes`;
  the probabilities take the values' swizzle, as a wgmma's operands must agree) and
  output chunks of whole swizzle tiles (D 160: five of 32 columns), unmeasured for speed;
* ``O += P V`` lands in a fresh accumulator added to the running one in registers
  (Mosaic GPU interpret mode cannot run the in-place ``pl.run_state`` form); the output
  is kept in column chunks (`plans.mosaic_output_chunk`: up to 128) and computed one
  chunk at a time, so the extra accumulator is ``[64, 128]`` (64 registers per
  thread), but at D 256 the running output alone is 128 registers per thread: spills
  are possible;
* the block table is read from global memory, one scalar load per page (not staged in
  shared memory); padding query rows are computed like real ones (only the first ``R``
  are written).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_paged_attn import plans, reference
from jax_paged_attn.kernels import common
from jax_paged_attn.kernels.common import LN_2, LOG2E, RUNNING_MAX_INIT
from jax_paged_attn.kv_view import CachePlane
from jax_paged_attn.plans import MOSAIC_DECODE_ROWS, MosaicDecodeTiling
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

def _upcast(x: Array, dtype) -> Array:
    """fp8 -> q's dtype. Hopper converts fp8 to f16 directly; to bf16 only through f32
    (Mosaic GPU refuses the direct cast without a newer ptxas)."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float16):
        return x.astype(dtype)
    return x.astype(jnp.float32).astype(dtype)


def _operand_transforms(itemsize: int, row_elements: int) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose rows are ``row_elements`` long:
    the widest swizzle whose tile width divides the row (`plans.mosaic_swizzle_bytes`:
    D 128 at 16 bits takes 128 bytes, D 96 64, D 80 32), so wgmma reads it without bank
    conflicts; none for fp8 rows that no swizzle divides (80 bytes, say), which are only
    loaded into registers for the upcast."""
    swizzle = plans.mosaic_swizzle_bytes(row_elements, itemsize)
    if not swizzle:
        return ()
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _readable_stage(tile, conv, load_fp8, dtype):
    """The K stage a wgmma reads: ``tile`` itself, or (fp8 pages, ``conv`` given) its
    upcast copy in ``conv``, since wgmma takes fp8 only with fp8 on both sides."""
    if conv is None:
        return tile
    conv[...] = _upcast(load_fp8(tile), dtype)
    plgpu.commit_smem()
    return conv


def _log2_scores(s: Array, spec: AttentionSpec, score_scale, slopes: Array | None, slope_axis: int,
                 alibi_distance) -> Array:
    """Raw scores ``s`` in log2 units (exp2 is the fast path): scaled, soft-capped, and
    with ``slopes`` (one per query row, along ``slope_axis`` of ``s``) times
    ``alibi_distance()`` subtracted."""
    if spec.softcap > 0:
        s = jnp.tanh(s * (score_scale / spec.softcap)) * (spec.softcap * LOG2E)
    else:
        s = s * (score_scale * LOG2E)
    if slopes is not None:
        s = s - lax.broadcast_in_dim(slopes, s.shape, [slope_axis]) * alibi_distance()
    return s


class _Item(NamedTuple):
    """One (sequence, KV head row block, split) a program attends for: i32 scalars."""

    seq: Array  # the batch row (clamped into the batch)
    valid: Array  # bool: the row is in the batch (a program's last items may not be)
    seq_len: Array  # keys in the cache, clamped to the block table's
    kv_lo: Array  # first visible key (a window's start)
    base: Array  # first key of the first tile (kv_lo's page start)
    tile_begin: Array  # the split's first tile
    num_steps: Array  # the split's tiles (0 past the batch)
    free_lo: Array  # keys of [free_lo, free_hi) are in range and seen by every query row
    free_hi: Array


def _decode_kernel(
    *refs,
    spec: AttentionSpec,
    tiling: MosaicDecodeTiling,
    num_q_tokens: int,
    group_size: int,
    block_size: int,
    k_plane: int,
    v_plane: int,
    has_alibi: bool,
    k_dequant: bool,
    v_dequant: bool,
    interpret: bool,
):
    (
        # inputs
        q_ref,  # [B, Hk * row_blocks, R, D] q dtype: the query rows of each program, zero-padded
        k_ref,  # [planes, num_blocks, block_size, Hk, D] the stacked cache holding K (plane k_plane)
        v_ref,  # [planes, num_blocks, block_size, Hk, D] the stacked cache holding V (plane v_plane)
        seqlens_ref,  # i32[B]: keys of each sequence, the Sq new tokens included
        block_table_ref,  # i32[B, max_blocks]
        *rest,  # the optional inputs (`common.pop_optional`), the outputs, the scratch buffers
    ) = refs
    alibi_ref = common.pop_optional(rest, has_alibi)  # f32[Hq]: slopes * log2(e)
    scales_ref = common.pop_optional(rest, k_dequant or v_dequant)  # f32[2]: k_scale, v_scale
    if tiling.num_splits == 1:
        o_ref, *scratch = rest  # [B, Hk * row_blocks, R, D] q dtype (R: tiling.query_rows)
        lse_ref = None
    else:
        # f32[splits, B, Hk * row_blocks, R, D], f32[splits, B, Hk * row_blocks, R]
        o_ref, lse_ref, *scratch = rest
    (q_smems,  # [Q, 64, D] q dtype: the queries (Q = 2 with several items a program, else 1)
     k_smem, v_smem,  # [stages, tile_keys, D] the caches' dtypes: the ring
     p_smems,  # [W, 64, tile_keys] q dtype: each compute warpgroup's probabilities
     o_smem,  # [64, store columns] the output's dtype
     lse_smem,  # f32[64]
     bad_smems,  # f32[W, tile_keys]: each compute warpgroup's non-finite key flags
     q_barriers, k_barriers, v_barriers, *rest_scratch) = scratch  # q: [Q]; k, v: [stages]
    workers, items = tiling.compute_warpgroups, tiling.items_per_program
    if workers:
        free_barriers, *rest_scratch = rest_scratch  # [stages], one arrival: the slot's tile is done
    if items > 1:
        q_free_barriers, *rest_scratch = rest_scratch  # [2], W arrivals: a query tile is read
    if workers == 2:
        # f32[D / chunk, 64, chunk], f32[2, 64], two barriers: the second compute warpgroup's
        # running output and (max, sum), for the first one to merge; written, read.
        merge_acc_smem, merge_stats_smem, merged_barrier, merge_read_barrier, *rest_scratch = rest_scratch
    # fp8 stages are converted to q's dtype into these before the wgmma ([W, tile_keys, D]).
    k_convs = rest_scratch.pop(0) if k_dequant else None
    v_convs = rest_scratch.pop(0) if v_dequant else None

    rows, tile_keys, stages = MOSAIC_DECODE_ROWS, tiling.tile_keys, tiling.num_stages
    copy_rows = tiling.copy_rows
    whole_pages = copy_rows == block_size  # else each copy is a run of rows within one page
    query_rows = tiling.query_rows  # R: the rows of rows [0, 64) a program reads and writes
    dtype = q_ref.dtype
    max_blocks = block_table_ref.shape[1]
    num_pages = k_ref.shape[1]
    max_keys = max_blocks * block_size
    head_size = q_ref.shape[-1]
    chunk = plans.mosaic_output_chunk(head_size)  # output columns per accumulator chunk

    head_block, batch_block, split = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("split")
    kv_head = lax.div(head_block, jnp.int32(tiling.row_blocks))
    row_block = lax.rem(head_block, jnp.int32(tiling.row_blocks))
    wg = lax.axis_index("wg") if workers else jnp.int32(0)
    batch = q_ref.shape[0]
    quarantine = num_q_tokens > 1 and (spec.causal or spec.is_local)

    def item_at(j) -> _Item:
        """The program's ``j``-th sequence (``batch_block * items + j``) and its tiles.
        Past the batch: sequence ``batch - 1`` with no tile and no output."""
        seq = batch_block * items + j
        valid = seq < batch
        seq = jnp.minimum(seq, batch - 1)
        seq_len = jnp.minimum(seqlens_ref[seq], max_keys)
        # Visible keys of the whole tile: [kv_lo, seq_len) (as in the Triton kernel).
        kv_lo = jnp.int32(0)
        if spec.window_left >= 0:
            kv_lo = jnp.maximum(seq_len - num_q_tokens - spec.window_left, 0)
        # Tiles start at kv_lo's page (or, a page holding several tiles, kv_lo's slice of it).
        base = lax.div(kv_lo, jnp.int32(copy_rows)) * copy_rows
        num_tiles = lax.div(jnp.maximum(seq_len - base, 0) + (tile_keys - 1), jnp.int32(tile_keys))
        tiles_per_split = lax.div(num_tiles + (tiling.num_splits - 1), jnp.int32(tiling.num_splits))
        tile_begin = jnp.minimum(split * tiles_per_split, num_tiles)
        num_steps = jnp.where(valid, jnp.minimum(tile_begin + tiles_per_split, num_tiles) - tile_begin, 0)
        # Keys of [free_lo, free_hi) are in range and seen by every query row. With several
        # query tokens under a causal / window mask, keys in range can be hidden from some
        # rows only (`quarantine`).
        free_lo, free_hi = kv_lo, seq_len
        if spec.causal:
            free_hi = seq_len - num_q_tokens + 1
        elif spec.window_right >= 0:
            free_hi = jnp.minimum(seq_len, seq_len - num_q_tokens + spec.window_right + 1)
        if spec.window_left >= 0:
            free_lo = seq_len - 1 - spec.window_left
        return _Item(seq, valid, seq_len, kv_lo, base, tile_begin, num_steps, free_lo, free_hi)

    def tile_location(it: _Item, step) -> tuple:
        """Where tile ``tile_begin + step`` starts, arithmetic only: a ``(table column,
        first row)`` pair of i32 scalars per copy, the row None for whole pages."""
        if whole_pages:  # (consecutive table columns: one division a tile, not one a copy)
            first_col = lax.div(it.base, jnp.int32(block_size)) + (it.tile_begin + step) * tiling.pages_per_tile
            return tuple((first_col + p, None) for p in range(tiling.pages_per_tile))
        first_key = it.base + (it.tile_begin + step) * tile_keys
        located = []
        for p in range(tiling.pages_per_tile):
            col = lax.div(first_key + p * copy_rows, jnp.int32(block_size))
            located.append((col, first_key + p * copy_rows - col * block_size))
        return tuple(located)

    def page_ids(it: _Item, step) -> tuple:
        """Where tile ``tile_begin + step`` is in the cache: a ``(page, first row)`` pair
        of i32 scalars per copy, the row None for whole pages (`tile_location`'s rows).

        Pages past the sequence (or the table) hold no visible key: any in-bounds page
        serves, so the table column is clamped (a step past the last reads the table's
        last entry, harmlessly); ids outside the cache (unvalidated tables under jit)
        are clamped, never followed.
        """
        return tuple((jnp.clip(block_table_ref[it.seq, jnp.minimum(col, max_blocks - 1)], 0, num_pages - 1), row)
                     for col, row in tile_location(it, step))

    def issue(slot, pages: tuple):
        """Starts the TMA copies of the tile at ``pages`` (`page_ids`) into ring slot ``slot``."""
        for p, (page, row) in enumerate(pages):
            rows_in_page = slice(None) if row is None else pl.ds(row, copy_rows)
            dst = pl.ds(p * copy_rows, copy_rows)
            plgpu.copy_gmem_to_smem(k_ref.at[k_plane, page, rows_in_page, kv_head, :], k_smem.at[slot, dst],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[v_plane, page, rows_in_page, kv_head, :], v_smem.at[slot, dst],
                                    v_barriers.at[slot])

    def zero_query_tiles() -> None:
        """Zeros the query tiles' rows past the program's ``R`` (the copies of `load_queries`
        write rows ``[0, R)`` only), before the first copy is issued, by the thread issuing
        it: padding rows then compute zeros, never stale shared memory."""
        if query_rows < q_smems.shape[1]:  # (the keys-as-M form's tiles are R rows: nothing to zero)
            for t in range(q_smems.shape[0]):
                q_smems.at[t][...] = plgpu.layout_cast(jnp.zeros((rows, head_size), q_smems.dtype),
                                                       plgpu.Layout.WGMMA)
            plgpu.commit_smem()  # (visible to the TMA and wgmma proxy)

    def query_tile(j):
        """The query tile of the program's ``j``-th item (two alternate with several)."""
        return lax.rem(j, 2) if items > 1 else 0

    def leading_rows(ref):
        """``ref``'s first ``R`` rows: what a program reads and writes in global memory."""
        return ref if query_rows == rows else ref.at[pl.ds(0, query_rows)]

    def load_queries(it: _Item, j) -> None:
        q_tile = query_tile(j)
        plgpu.copy_gmem_to_smem(q_ref.at[it.seq, head_block], leading_rows(q_smems.at[q_tile]),
                                q_barriers.at[q_tile])

    def load_fp8(ref) -> Array:
        """An fp8 ring tile into registers for its upcast. A tile no swizzle fits (rows of
        80 bytes, say) is plain in shared memory; it is loaded in the wgmma layout, the
        layout its 16-bit copy is stored in (the inferred one has no such store; the
        interpreter has no layouts)."""
        if interpret or plans.mosaic_swizzle_bytes(head_size, jnp.dtype(ref.dtype).itemsize):
            return ref[...]
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)

    def score_iota(dimension: int) -> Array:
        """i32 [64, tile_keys]: each score's row (0) or column (1) index."""
        return plgpu.broadcasted_iota(jnp.int32, (rows, tile_keys), dimension, layout=plgpu.Layout.WGMMA)

    def query_tokens():
        """Each score row's query token (row ``r`` is token ``r // G``). With one token,
        0 for every row: padding rows then attend like real ones and are dropped."""
        if num_q_tokens == 1:
            return jnp.int32(0)
        return lax.div(row_block * rows + score_iota(0), jnp.int32(group_size))

    def attend(it: _Item, step, slot, carry, q_smem, slopes, score_scale, p_smem, bad_smem, k_conv, v_conv):
        """Tile ``step`` of item ``it`` (in ring slot ``slot``) folded into the running
        ``(acc, row_max, row_sum)``: waits for its K and V, ``S = Q K^T``, the online
        softmax, ``O += P V``. Returns the new carry, once the slot's wgmmas are done."""
        # f32[64, D] as a tuple of [64, chunk] column chunks, f32[64], f32[64]
        acc, row_max, row_sum = carry
        seq_len, kv_lo, free_lo, free_hi = it.seq_len, it.kv_lo, it.free_lo, it.free_hi
        first_key = it.base + (it.tile_begin + step) * tile_keys
        with jax.named_scope("wait_k"):
            plgpu.barrier_wait(k_barriers.at[slot])
        with jax.named_scope("scores"):
            k_tile = _readable_stage(k_smem.at[slot], k_conv, load_fp8, dtype)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                return acc_ref[...]

            s = _log2_scores(pl.run_scoped(qk, plgpu.ACC((rows, tile_keys), jnp.float32)), spec, score_scale,
                             slopes, 0, lambda: reference.alibi_distance(
                                 query_tokens(), first_key + score_iota(1), num_q_tokens, seq_len))

            def visible():
                """bool [64, tile_keys]: the mask (causal / window, sequence end, kv_lo)."""
                key = first_key + score_iota(1)
                return reference.key_visible(query_tokens(), key, num_q_tokens, seq_len, spec) & (key >= kv_lo)

            # Only tiles reaching outside [free_lo, free_hi) (keys every row sees, all in
            # range) build the mask: the first tile of a window, the last of a sequence, the
            # causal diagonal of several query tokens. The others skip its ~10 integer
            # operations per score.
            masked = (first_key < free_lo) | (first_key + tile_keys > free_hi)
            s = lax.cond(masked, lambda s: jnp.where(visible(), s, -jnp.inf), lambda s: s, s)
            new_max = jnp.maximum(row_max, s.max(axis=1))
            correction = jnp.exp2(row_max - new_max)
            p = jnp.exp2(s - lax.broadcast_in_dim(new_max, s.shape, [0]))  # masked: exp2(-inf) = 0
            if not quarantine:
                p_smem[...] = p.astype(dtype)  # early: the store overlaps the V copy still in flight
        with jax.named_scope("wait_v"):
            plgpu.barrier_wait(v_barriers.at[slot])
        with jax.named_scope("values"):
            # A tile reaching outside [kv_lo, seq_len) has rows of unused page slots (or of
            # keys before the window) in its V stage: zero them, or 0 * NaN reaches P V.
            edge = (first_key < kv_lo) | (first_key + tile_keys > seq_len)
            v_tile = v_smem.at[slot]

            def in_range_values(v):
                v_key = first_key + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
                return jnp.where((v_key >= kv_lo) & (v_key < seq_len), v, 0).astype(dtype)

            def quarantined(v):
                """``v`` with its non-finite keys' rows set to 0; their flags to ``bad_smem``."""
                bad = common.nonfinite_rows(v)  # [tile_keys], one per key (a row of the V tile)
                bad_smem[...] = jnp.where(bad, 1.0, 0.0)
                return jnp.where(lax.broadcast_in_dim(bad, v.shape, [0]), 0, v).astype(dtype)

            # With several query tokens under a causal / window mask, a masked tile's keys
            # in [kv_lo, seq_len) may be hidden from some rows only: a non-finite value must
            # reach only the rows that see it (in other tiles every row sees every key).
            if v_conv is None:
                @pl.when(masked if quarantine else edge)  # masked includes every edge tile
                def _():
                    v = in_range_values(v_tile[...])
                    v_tile[...] = quarantined(v) if quarantine else v
            else:
                # The values pass through registers anyway: zero the out-of-range rows in
                # every tile (no key is out of range away from the edges) rather than branch.
                v = in_range_values(_upcast(load_fp8(v_tile), dtype))
                if quarantine:
                    @pl.when(masked)
                    def _():
                        v_conv[...] = quarantined(v)

                    @pl.when(jnp.logical_not(masked))
                    def _():
                        v_conv[...] = v
                else:
                    v_conv[...] = v
                v_tile = v_conv
            if quarantine:
                plgpu.commit_smem()  # the flags, written by every thread, read back in another layout

                def poison_rows(correction):
                    """A NaN correction for the rows that see a flagged key: their output is
                    then NaN for good, as the reference's."""
                    # [tile_keys], one per column of the scores (a layout_cast right after a
                    # load is the load's layout, not a relayout).
                    bad_key = plgpu.layout_cast(bad_smem[...], plgpu.Layout.WGMMA.reduce(0))
                    flagged = lax.broadcast_in_dim(bad_key, s.shape, [1]) > 0
                    sees_bad = jnp.where(visible() & flagged, 1.0, 0.0).max(axis=1) > 0
                    return jnp.where(sees_bad, jnp.nan, correction)

                correction = lax.cond(masked, poison_rows, lambda c: c, correction)
                p_smem[...] = p.astype(dtype)
            row_sum = row_sum * correction + p.sum(axis=1)
            acc = tuple(a * lax.broadcast_in_dim(correction, a.shape, [0]) for a in acc)

            plgpu.commit_smem()  # P (and the zeroed / converted V) become visible to the wgmma

            def pv(c, acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_tile.at[:, pl.ds(c * chunk, chunk)])
                return acc_ref[...]  # waits for the wgmma: the slot is free again

            # A fresh accumulator added in registers rather than `pl.run_state` on ``acc``
            # (in place, one [64, chunk] f32 tile fewer in registers): Mosaic GPU interpret
            # mode cannot run run_state, and the tests run this same code there.
            acc = tuple(a + pl.run_scoped(functools.partial(pv, c), plgpu.ACC((rows, chunk), jnp.float32))
                        for c, a in enumerate(acc))
        return acc, new_max, row_sum

    def compute(it: _Item, j, w: int | Array, first_step, step_stride: int, slot_of, after_step, extra):
        """The math of compute warpgroup ``w`` for item ``it`` (the program's ``j``-th):
        its steps ``first_step, first_step + step_stride, ...``, step ``i`` in ring slot
        ``slot_of(i)``. ``after_step(step, slot, extra)`` runs after each step's wgmmas
        and returns the next ``extra`` (loop-carried state). Returns the final ``(acc,
        row_max, row_sum)``."""
        # Only [64]-row vectors and scalars live across the loop: [64, tile_keys] index tiles
        # are rebuilt in each step (cheap integer work) rather than held in registers.
        slopes = None  # f32[64] per row, in the score tile's row layout
        if alibi_ref is not None:
            # Row r's slope is its query head's (r % G): G selects once, then one value per row.
            head_in_group = lax.rem(row_block * rows + score_iota(0), jnp.int32(group_size))
            slopes_2d = jnp.zeros((rows, tile_keys), jnp.float32)
            for g in range(group_size):
                slopes_2d = jnp.where(head_in_group == g, alibi_ref[kv_head * group_size + g], slopes_2d)
            slopes = slopes_2d.max(axis=1)  # every column holds the row's slope
        score_scale = spec.softmax_scale
        if k_dequant:
            score_scale = score_scale * scales_ref[0]  # fp8 K is x / k_scale: scale the scores instead
        buffers = (p_smems.at[w], bad_smems.at[w], k_convs.at[w] if k_dequant else None,
                   v_convs.at[w] if v_dequant else None)
        q_tile = query_tile(j)
        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(q_barriers.at[q_tile])

        def step_fn(i, carry):
            *carry, extra = carry
            step = first_step + i * step_stride
            slot = slot_of(step)
            carry = attend(it, step, slot, tuple(carry), q_smems.at[q_tile], slopes, score_scale, *buffers)
            return *carry, after_step(step, slot, extra)

        carry = (
            tuple(plgpu.layout_cast(jnp.zeros((rows, chunk), jnp.float32), plgpu.Layout.WGMMA)
                  for _ in range(head_size // chunk)),
            plgpu.layout_cast(jnp.full((rows,), RUNNING_MAX_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        my_steps = lax.div(jnp.maximum(it.num_steps - first_step, 0) + (step_stride - 1), jnp.int32(step_stride))
        *carry, _ = lax.fori_loop(0, my_steps, step_fn, (*carry, extra))
        if items > 1:
            plgpu.barrier_arrive(q_free_barriers.at[q_tile])  # its wgmmas have completed
        return tuple(carry)

    def epilogue(it: _Item, acc, row_max, row_sum):
        """Normalizes and stores the item's output (and log-sum-exp with splits)."""
        seq = it.seq
        # A row that saw no key has row_sum 0 and acc 0: it outputs 0, never NaN.
        seen = row_sum > 0
        safe_sum = jnp.where(seen, row_sum, 1.0)
        inv_sum = common.nan_rows_scale(1.0 / safe_sum, *acc)
        if v_dequant:
            inv_sum = inv_sum * scales_ref[1]  # fp8 V is x / v_scale
        o_rows = o_ref.at[seq, head_block] if lse_ref is None else o_ref.at[split, seq, head_block]
        if lse_ref is not None:
            lse_smem[...] = jnp.where(seen, (row_max + jnp.log2(safe_sum)) * LN_2, -jnp.inf)
        # The output leaves through a [64, store] buffer (`plans.mosaic_store_chunk`), a
        # store's columns at a time: a whole f32 [64, 256] tile would not fit beside the ring.
        store = o_smem.shape[1]
        for i, col0 in enumerate(range(0, head_size, store)):
            a = acc[col0 // chunk]
            if store < chunk:
                a = a[:, col0 % chunk:col0 % chunk + store]
            if i:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffer's last copy has read it
            o_smem[...] = (a * lax.broadcast_in_dim(inv_sum, a.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(leading_rows(o_smem), o_rows.at[:, pl.ds(col0, store)])
            if i == 0 and lse_ref is not None:
                plgpu.copy_smem_to_gmem(leading_rows(lse_smem), lse_ref.at[split, seq, head_block])
        # Only until the copies have read the buffers (the next item's output goes there):
        # their writes complete on their own, by the kernel's end at the latest, and
        # nothing in the kernel reads the output.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def keys_as_m_attend(it: _Item, j, w, first_step, step_stride: int, slot_of, after_step, extra):
        """`_keys_as_m_attend` over compute warpgroup ``w``'s buffers, for the ``j``-th item."""
        q_tile = query_tile(j)
        return _keys_as_m_attend(
            it, first_step=first_step, step_stride=step_stride, slot_of=slot_of, after_step=after_step,
            extra=extra, q_smem=q_smems.at[q_tile], q_barrier=q_barriers.at[q_tile],
            q_free_barrier=q_free_barriers.at[q_tile] if items > 1 else None, k_smem=k_smem,
            v_smem=v_smem, p_smem=p_smems.at[w], k_barriers=k_barriers, v_barriers=v_barriers, alibi_ref=alibi_ref,
            spec=spec, tiling=tiling, num_q_tokens=num_q_tokens, group_size=group_size, kv_head=kv_head,
            load_fp8=load_fp8, k_conv=k_convs.at[w] if k_dequant else None,
            v_conv=v_convs.at[w] if v_dequant else None, k_scale=scales_ref[0] if k_dequant else None)

    def keys_as_m_store(it: _Item, acc, col_max, col_sum) -> None:
        with jax.named_scope("epilogue"):
            pl.when(it.valid)(lambda: _keys_as_m_store(
                it, acc, col_max, col_sum, o_smem=o_smem, lse_smem=lse_smem, o_ref=o_ref, lse_ref=lse_ref,
                head_block=head_block, split=split, v_scale=scales_ref[1] if v_dequant else None))

    if not workers:
        it = item_at(jnp.int32(0))
        zero_query_tiles()
        load_queries(it, 0)
        # One warpgroup refills each slot right after that slot's tile, with the page ids
        # loaded a step early: its TMA copies then wait for no global load (a scalar load
        # per page would stall every step).
        with jax.named_scope("fill"):
            for s in range(stages):
                pl.when(s < it.num_steps)(functools.partial(issue, s, page_ids(it, s)))

        # Only the pages cross the loop: a row offset carried through it is a loop argument
        # whose divisibility Mosaic GPU's layout inference cannot see (copies inside a page
        # then fail to compile), so the rows are recomputed where the copies start.
        def pages_of(step) -> tuple:
            return tuple(page for page, _ in page_ids(it, step))

        def refill(step, slot, pages):
            rows = (row for _, row in tile_location(it, step + stages))
            pl.when(step + stages < it.num_steps)(functools.partial(issue, slot, tuple(zip(pages, rows))))
            return pages_of(step + stages + 1)

        if tiling.keys_as_m:
            keys_as_m_store(it, *keys_as_m_attend(it, 0, 0, jnp.int32(0), 1,
                                                  lambda step: lax.rem(step, jnp.int32(stages)), refill,
                                                  pages_of(stages)))
            return
        result = compute(it, 0, 0, jnp.int32(0), 1, lambda step: lax.rem(step, jnp.int32(stages)), refill,
                         pages_of(stages))
        with jax.named_scope("epilogue"):
            epilogue(it, *result)
        return

    # Warp-specialized: the ring carries the program's items' tiles as one stream (tile
    # ``i`` of item ``j`` is stream tile ``first_j + i``, ``first_j`` the tiles of the
    # items before it), in slot ``stream tile % stages``, for compute warpgroup ``stream
    # tile % W``: the stages being a multiple of W, each slot's barriers are always waited
    # for by the same warpgroup, as the per-thread phase tracking of a barrier wait needs.
    @pl.when(wg == workers)
    def _producer():
        """Keeps the ring full: refills each slot as soon as its tile's compute warpgroup
        has released it, running on into the next item's tiles."""

        def next_item(j, first):
            it = item_at(j)
            if items > 1:
                # Query tile j % 2 held item j - 2's queries: wait until every compute warpgroup read them.
                pl.when(j >= 2)(lambda: plgpu.barrier_wait(q_free_barriers.at[query_tile(j)]))
            load_queries(it, j)

            def refill(i, _):
                stream = first + i
                slot = lax.rem(stream, jnp.int32(stages))
                pages = page_ids(it, i)  # (loaded before the wait: its latency hides behind it)
                pl.when(stream >= stages)(lambda: plgpu.barrier_wait(free_barriers.at[slot]))
                issue(slot, pages)

            with jax.named_scope("refill"):
                lax.fori_loop(0, it.num_steps, refill, None)
            return first + it.num_steps

        zero_query_tiles()
        stream = lax.fori_loop(0, items, next_item, jnp.int32(0))

        def drain(i, _):  # the last tiles' releases, refilled by nothing
            plgpu.barrier_wait(free_barriers.at[lax.rem(i, jnp.int32(stages))])

        # Every completed phase of a barrier is waited for by the thread that waits on it
        # (the Mosaic GPU interpreter checks it; the producer is idle here anyway).
        with jax.named_scope("drain"):
            lax.fori_loop(jnp.maximum(stream - stages, 0), stream, drain, None)
            if items > 1:
                for j in range(max(items - 2, 0), items):
                    plgpu.barrier_wait(q_free_barriers.at[j % 2])

    def release(step, slot, extra):
        plgpu.barrier_arrive(free_barriers.at[slot])
        return extra

    def store(it: _Item, acc, row_max, row_sum) -> None:
        with jax.named_scope("epilogue"):
            pl.when(it.valid)(lambda: epilogue(it, acc, row_max, row_sum))

    def merge_and_store(it: _Item, acc: tuple, row_max, row_sum) -> None:
        """Two compute warpgroups: the second hands its output (``acc``'s ``[64, chunk]``
        chunks) and its (max, sum) to the first through shared memory, which merges them
        as split partials are merged and stores the item's output."""
        stats = plgpu.Layout.WGMMA.reduce(1)

        @pl.when(wg == 1)
        def _hand_over():
            with jax.named_scope("merge"):
                for c, a in enumerate(acc):
                    merge_acc_smem.at[c][...] = a
                merge_stats_smem.at[0][...] = row_max
                merge_stats_smem.at[1][...] = row_sum
                plgpu.barrier_arrive(merged_barrier)
                plgpu.barrier_wait(merge_read_barrier)  # (the buffers are free for the next item)

        @pl.when(wg == 0)
        def _merge_and_store():
            with jax.named_scope("merge"):
                plgpu.barrier_wait(merged_barrier)
                other_max = plgpu.layout_cast(merge_stats_smem.at[0][...], stats)
                other_sum = plgpu.layout_cast(merge_stats_smem.at[1][...], stats)
                new_max = jnp.maximum(row_max, other_max)
                mine, other = jnp.exp2(row_max - new_max), jnp.exp2(other_max - new_max)
                merged = tuple(
                    a * lax.broadcast_in_dim(mine, a.shape, [0])
                    + plgpu.layout_cast(merge_acc_smem.at[c][...], plgpu.Layout.WGMMA)
                    * lax.broadcast_in_dim(other, a.shape, [0])
                    for c, a in enumerate(acc))
                plgpu.barrier_arrive(merge_read_barrier)
            store(it, merged, new_max, row_sum * mine + other_sum * other)

    @pl.when(wg < workers)
    def _compute():
        def next_item(j, first):
            it = item_at(j)
            # This warpgroup's first tile of the item: the first stream tile >= first that is
            # wg modulo W.
            mine = lax.rem(wg - lax.rem(first, jnp.int32(workers)) + workers, jnp.int32(workers))
            def slot_of(step):
                return lax.rem(first + step, jnp.int32(stages))

            if tiling.keys_as_m:  # (one compute warpgroup: `plans.mosaic_keys_as_m_unsupported_reason`)
                keys_as_m_store(it, *keys_as_m_attend(it, j, wg, mine, workers, slot_of, release, ()))
                return first + it.num_steps
            acc, row_max, row_sum = compute(it, j, wg, mine, workers, slot_of, release, ())
            if workers == 1:
                store(it, acc, row_max, row_sum)
            else:
                merge_and_store(it, acc, row_max, row_sum)
            return first + it.num_steps

        lax.fori_loop(0, items, next_item, jnp.int32(0))


def _keys_as_m_attend(it: _Item, *, first_step, step_stride: int, slot_of, after_step, extra, q_smem, q_barrier,
                      q_free_barrier, k_smem, v_smem, p_smem, k_barriers, v_barriers, alibi_ref,
                      spec: AttentionSpec, tiling: MosaicDecodeTiling, num_q_tokens: int, group_size: int, kv_head,
                      load_fp8, k_conv, v_conv, k_scale) -> tuple[Array, Array, Array]:
    """The keys-as-M form (`tuning.MosaicDecodeConfig.keys_as_m`) of one compute
    warpgroup's work on item ``it``: its steps ``first_step, first_step + step_stride,
    ...`` of the ring (step ``i`` in slot ``slot_of(i)``; ``after_step(step, slot, extra)``
    runs after each step's wgmmas and returns the next loop-carried ``extra``: the
    single-warpgroup form refills the slot, the warp-specialized one releases it to the
    producer). The queries arrive in ``q_smem`` (``q_barrier``); ``q_free_barrier``
    (several items a program) is arrived on once they are read. Returns the transposed
    running output f32 ``[D, N]`` and the columns' max (log2 units) and sum, f32 ``[N]``
    (`_keys_as_m_store` normalizes and stores them).

    ``S^T = K Q^T`` is a wgmma with the tile's keys as M and the ``N = tiling.query_rows``
    query rows as N (``Q^T`` a transposed view of the ``[N, D]`` query tile), so its
    ``[tile_keys, N]`` f32 scores hold each query row in a column: the online softmax's
    max reduces over axis 0, across the warpgroup's warps, each tile (its sum's terms
    accumulate elementwise and reduce once, after the loop), and its running statistics
    are column vectors. ``P^T`` (the scores' own layout) goes to shared memory
    as the ``[tile_keys, N]`` operand of ``O^T += V^T P^T``, whose M side is the head
    (``V^T`` a transposed view of the V stage), accumulated as ``[D, N]`` f32. The values'
    stages take the probabilities' swizzle (a wgmma's shared-memory operands share one),
    which N rows of 16-bit elements set. The output leaves transposed, ``[D, N]`` (the
    wrapper transposes it back with the rows it unpacks anyway). Masks, the sequence end,
    ALiBi, soft-cap, splits, the zeroed out-of-range value rows and the fp8 stages'
    upcast (``k_conv`` / ``v_conv``: the K tile in the queries' swizzle, the V tile in the
    probabilities'; ``k_scale`` scales the scores, ``v_scale`` the output) are the other
    form's; `plans.mosaic_keys_as_m_unsupported_reason` names what it does not take."""
    n, tile_keys = tiling.query_rows, tiling.tile_keys
    dtype, head_size = q_smem.dtype, q_smem.shape[-1]
    def score_iota(dimension: int) -> Array:
        """i32 [tile_keys, N]: each transposed score's key offset (0) or query row (1)."""
        return plgpu.broadcasted_iota(jnp.int32, (tile_keys, n), dimension, layout=plgpu.Layout.WGMMA)

    def query_tokens():
        """Each column's query token (column ``c`` is token ``c // G``); 0 with one token."""
        if num_q_tokens == 1:
            return jnp.int32(0)
        return lax.div(score_iota(1), jnp.int32(group_size))

    score_scale = spec.softmax_scale if k_scale is None else spec.softmax_scale * k_scale
    slopes = None  # f32[N] per query row, in the scores' column layout
    if alibi_ref is not None:
        head_in_group = lax.rem(score_iota(1), jnp.int32(group_size))
        slopes_2d = jnp.zeros((tile_keys, n), jnp.float32)
        for g in range(group_size):
            slopes_2d = jnp.where(head_in_group == g, alibi_ref[kv_head * group_size + g], slopes_2d)
        slopes = slopes_2d.max(axis=0)  # every row holds the column's slope

    def step_fn(i, carry):
        # f32[D, N], f32[N], f32[tile_keys, N] (the column sums' terms, summed over the keys
        # once after the loop: one cross-warp reduction a tile, the max's, not two), extra
        acc, col_max, sum_terms, extra = carry
        step = first_step + i * step_stride
        slot = slot_of(step)
        first_key = it.base + (it.tile_begin + step) * tile_keys
        with jax.named_scope("wait_k"):
            plgpu.barrier_wait(k_barriers.at[slot])
        with jax.named_scope("scores"):
            k_tile = _readable_stage(k_smem.at[slot], k_conv, load_fp8, dtype)

            def kq(acc_ref):
                plgpu.wgmma(acc_ref, k_tile, plgpu.transpose_ref(q_smem, (1, 0)))
                return acc_ref[...]

            s = _log2_scores(pl.run_scoped(kq, plgpu.ACC((tile_keys, n), jnp.float32)), spec, score_scale,
                             slopes, 1, lambda: reference.alibi_distance(
                                 query_tokens(), first_key + score_iota(0), num_q_tokens, it.seq_len))

            def visible():
                """bool [tile_keys, N]: the mask (causal / window, sequence end, kv_lo)."""
                key = first_key + score_iota(0)
                return (reference.key_visible(query_tokens(), key, num_q_tokens, it.seq_len, spec)
                        & (key >= it.kv_lo))

            masked = (first_key < it.free_lo) | (first_key + tile_keys > it.free_hi)
            s = lax.cond(masked, lambda s: jnp.where(visible(), s, -jnp.inf), lambda s: s, s)
            new_max = jnp.maximum(col_max, s.max(axis=0))
            correction = jnp.exp2(col_max - new_max)
            p = jnp.exp2(s - lax.broadcast_in_dim(new_max, s.shape, [1]))  # masked: exp2(-inf) = 0
            sum_terms = sum_terms * lax.broadcast_in_dim(correction, s.shape, [1]) + p
            p_smem[...] = p.astype(dtype)  # early: the store overlaps the V copy still in flight
        with jax.named_scope("wait_v"):
            plgpu.barrier_wait(v_barriers.at[slot])
        with jax.named_scope("values"):
            v_tile = v_smem.at[slot]

            def in_range_values(v):
                v_key = first_key + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
                return jnp.where((v_key >= it.kv_lo) & (v_key < it.seq_len), v, 0).astype(dtype)

            # A tile reaching outside [kv_lo, seq_len) has rows of unused page slots (or of
            # keys before the window) in its V stage: zero them, or 0 * NaN reaches P V.
            if v_conv is None:
                @pl.when((first_key < it.kv_lo) | (first_key + tile_keys > it.seq_len))
                def _():
                    v_tile[...] = in_range_values(v_tile[...])
            else:  # through registers anyway: zero the out-of-range rows of every tile
                v_conv[...] = in_range_values(_upcast(load_fp8(v_tile), dtype))
                v_tile = v_conv

            acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1])
            plgpu.commit_smem()  # P (and the zeroed V rows) become visible to the wgmma

            def vp(acc_ref):
                plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_tile, (1, 0)), p_smem)
                return acc_ref[...]  # waits for the wgmma: the slot is free again

            acc = acc + pl.run_scoped(vp, plgpu.ACC((head_size, n), jnp.float32))
        return acc, new_max, sum_terms, after_step(step, slot, extra)

    carry = (plgpu.layout_cast(jnp.zeros((head_size, n), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((n,), RUNNING_MAX_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(0)),
             plgpu.layout_cast(jnp.zeros((tile_keys, n), jnp.float32), plgpu.Layout.WGMMA),
             extra)
    with jax.named_scope("q_wait"):
        plgpu.barrier_wait(q_barrier)
    my_steps = lax.div(jnp.maximum(it.num_steps - first_step, 0) + (step_stride - 1), jnp.int32(step_stride))
    acc, col_max, sum_terms, _ = lax.fori_loop(0, my_steps, step_fn, carry)
    if q_free_barrier is not None:
        plgpu.barrier_arrive(q_free_barrier)  # its wgmmas have completed
    return acc, col_max, sum_terms.sum(axis=0)


def _keys_as_m_store(it: _Item, acc: Array, col_max: Array, col_sum: Array, *, o_smem, lse_smem, o_ref, lse_ref,
                     head_block, split, v_scale) -> None:
    """Normalizes item ``it``'s keys-as-M output (`_keys_as_m_attend`'s) and stores it,
    transposed ``[D, N]``, with its log-sum-exp where the call has splits."""
    # A column that saw no key has sum 0 and acc 0: it outputs 0, never NaN; a column whose
    # accumulator holds a NaN / inf in any channel is NaN in all of them (the reference's
    # NaN rule; the accumulator's channels run down its columns).
    seen = col_sum > 0
    safe_sum = jnp.where(seen, col_sum, 1.0)
    inv_sum = common.nan_rows_scale(1.0 / safe_sum, acc, channel_axis=0)
    if v_scale is not None:
        inv_sum = inv_sum * v_scale  # fp8 V is x / v_scale
    o_cols = o_ref.at[it.seq, head_block] if lse_ref is None else o_ref.at[split, it.seq, head_block]
    o_smem[...] = (acc * lax.broadcast_in_dim(inv_sum, acc.shape, [1])).astype(o_smem.dtype)
    if lse_ref is not None:
        lse_smem[...] = jnp.where(seen, (col_max + jnp.log2(safe_sum)) * LN_2, -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_cols)
    if lse_ref is not None:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, it.seq, head_block])
    # Only until the copies have read the buffers (the next item's output goes there).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


PROFILE_RANGES_PER_TILE = 4
"""Named regions a compute warpgroup records per tile (waits for K and V, scores,
values), what the profiler's event buffer is sized for, beside `PROFILE_RANGES_FIXED`."""
PROFILE_RANGES_FIXED = 8
"""Regions a warpgroup records once per item (the query wait, the merge, the epilogue) or
once per program (the profiler's own among them)."""


def _compiler_params(profile_dir: str | None, tiling: MosaicDecodeTiling, max_keys: int):
    if not profile_dir:
        return plgpu.CompilerParams(approx_math=True)
    # The most tiles an item can take: its split of the longest sequence, plus one for a
    # window's first page starting mid-tile. A program records every item it attends: sized
    # for one item, the trace of a program of several held the first item's tiles alone.
    tiles = -(-(-(-max_keys // tiling.tile_keys)) // tiling.num_splits) + 1
    space = tiling.items_per_program * (PROFILE_RANGES_PER_TILE * tiles + PROFILE_RANGES_FIXED)
    profile = dict(profile_space=space, profile_dir=profile_dir)
    if "profile_bounds_check" in plgpu.CompilerParams.__dataclass_fields__:  # (jax >= 0.11)
        profile["profile_bounds_check"] = True  # a longer trace is cut, not written over shared memory
    return plgpu.CompilerParams(approx_math=True, **profile)


def paged_decode_call(
    q_rows: Array,  # [B, Hk * row_blocks, R = tiling.query_rows, D] f16 / bf16 (decode.py lays them out)
    k_cache: CachePlane,  # [num_blocks, block_size, Hk, D] q's dtype or fp8, a plane of a stacked cache
    v_cache: CachePlane,  # [num_blocks, block_size, Hk, D] like k_cache
    cache_seqlens: Array,  # i32[B]
    block_table: Array,  # i32[B, max_blocks]
    alibi_slopes_log2: Array | None,  # f32[Hq]: ALiBi slopes * log2(e) (plans.alibi_slopes_log2), or None
    scales: Array | None,  # f32[2] (k_scale, v_scale) when either cache is fp8 (plans.kv_scales), else None
    *,
    spec: AttentionSpec,
    tiling: MosaicDecodeTiling,
    num_q_tokens: int,
    group_size: int,
    interpret: bool = False,
    profile_dir: str | None = None,
) -> Array | tuple[Array, Array]:
    """Runs the kernel over the grid (KV heads x row blocks, sequences, splits).

    The caches are planes of stacked arrays (`jax_paged_attn.kv_view.CachePlane`): the
    whole stacked array reaches the kernel and each TMA copy names the plane, so XLA
    copies nothing. ``interpret`` runs the kernel in Mosaic GPU interpret mode
    (`common.mosaic_interpret_params`; CPU tests).

    Returns the output rows ``[B, Hk * row_blocks, R, D]`` in q's dtype when
    ``tiling.num_splits == 1``, else ``(partial_out f32[splits, B, Hk * row_blocks, R, D],
    lse f32[splits, B, Hk * row_blocks, R])``, each split normalized over its own keys,
    ``lse`` the natural log-sum-exp of its scores (-inf for a split that saw no key).
    Padding rows hold 0 (-inf log-sum-exp). With ``tiling.keys_as_m`` the output rows
    are transposed: ``[B, Hk, D, R]`` (``[splits, B, Hk, D, R]`` f32 with splits).

    ``profile_dir`` (GPU only): each call also writes a timeline of every warpgroup's
    named regions (the ring's fill, and per tile the waits for K and V, the scores and
    the values; the producer's refill and drain; the merge and the epilogue) as a Chrome
    trace JSON file into that directory, through the Mosaic GPU profiler
    (benchmarks/decode_parts.py --timeline reads it).
    """
    batch, head_blocks, query_rows, head_size = q_rows.shape
    assert query_rows == tiling.query_rows, (q_rows.shape, tiling)
    _, block_size, _, _ = k_cache.shape
    dtype = q_rows.dtype
    itemsize = jnp.dtype(dtype).itemsize
    k_dequant, v_dequant = plans.is_fp8(k_cache.dtype), plans.is_fp8(v_cache.dtype)
    if (k_dequant or v_dequant) and scales is None:
        raise ValueError("scales (k_scale, v_scale) are required with an fp8 cache.")
    inputs = [q_rows, k_cache.array, v_cache.array, cache_seqlens, block_table]
    common.append_optional(inputs, alibi_slopes_log2)
    common.append_optional(inputs, scales if (k_dequant or v_dequant) else None)
    splits = tiling.num_splits
    # keys_as_m: the output rows leave transposed, [..., D, query_rows]
    out_rows = (batch, head_blocks, head_size, query_rows) if tiling.keys_as_m else q_rows.shape
    if splits == 1:
        out_type = jax.ShapeDtypeStruct(out_rows, dtype)
        out_dtype = dtype
    else:
        out_type = (
            jax.ShapeDtypeStruct((splits, *out_rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, head_blocks, query_rows), jnp.float32),
        )
        out_dtype = jnp.float32
    keys = tiling.tile_keys

    def ring(cache: CachePlane):
        """The cache's stages in its own dtype (fp8 pages arrive as fp8 bytes)."""
        cache_dtype = cache.dtype
        transforms = _operand_transforms(jnp.dtype(cache_dtype).itemsize, head_size)
        return plgpu.SMEM((tiling.num_stages, keys, head_size), cache_dtype, transforms=transforms)

    operand = _operand_transforms(itemsize, head_size)
    scratch = _scratch_types(tiling, q_rows, k_cache, v_cache, ring, operand, out_dtype, k_dequant, v_dequant)
    return _launch(scratch, inputs, out_type, spec=spec, tiling=tiling, num_q_tokens=num_q_tokens,
                   group_size=group_size, block_size=block_size, k_cache=k_cache, v_cache=v_cache,
                   has_alibi=alibi_slopes_log2 is not None, k_dequant=k_dequant, v_dequant=v_dequant,
                   interpret=interpret, profile_dir=profile_dir, max_keys=block_table.shape[1] * block_size)


def _scratch_types(tiling: MosaicDecodeTiling, q_rows: Array, k_cache: CachePlane, v_cache: CachePlane, ring,
                   operand: tuple, out_dtype, k_dequant: bool, v_dequant: bool) -> list:
    """The kernel's scratch buffers, in the order `_decode_kernel` unpacks them.

    With the queries as the wgmmas' M side, the tiles are 64 rows (the query rows
    zero-padded) and the probabilities take the head's swizzle. With ``tiling.keys_as_m``
    (`_keys_as_m_attend`) the query tiles are the program's ``R`` rows, the
    probabilities ``P^T`` are ``[tile_keys, R]`` and set the values' swizzle (a wgmma's
    shared-memory operands share one; fp8 stages keep their own, since the wgmma reads
    their upcast copies), the output is ``[D, R]``, and the non-finite key flags go
    unused."""
    head_size, dtype, keys = q_rows.shape[-1], q_rows.dtype, tiling.tile_keys
    itemsize = jnp.dtype(dtype).itemsize
    workers = tiling.compute_warpgroups
    per_worker = max(workers, 1)  # the single-warpgroup form's buffers: one of each
    items = tiling.items_per_program
    query_tiles = 2 if items > 1 else 1
    if tiling.keys_as_m:
        assert workers < 2, "the plan refuses two compute warpgroups with keys_as_m"
        rows = tiling.query_rows
        values = _operand_transforms(itemsize, rows)
        v_ring = ring(v_cache) if v_dequant else plgpu.SMEM((tiling.num_stages, keys, head_size), dtype,
                                                            transforms=values)
        probabilities = plgpu.SMEM((per_worker, keys, rows), dtype, transforms=values)  # P^T
        output = plgpu.SMEM((head_size, rows), out_dtype)  # transposed
    else:
        rows, values = MOSAIC_DECODE_ROWS, operand
        chunk = plans.mosaic_output_chunk(head_size)
        v_ring = ring(v_cache)
        # P: the values' swizzle, the head's (a wgmma's two shared-memory operands must share
        # one), which rows of 64 or 128 keys always fit
        probabilities = plgpu.SMEM((per_worker, rows, keys), dtype, transforms=operand)
        # output rows, a column chunk at a time
        output = plgpu.SMEM((rows, plans.mosaic_store_chunk(head_size, jnp.dtype(out_dtype).itemsize)), out_dtype)
        merge_output = plgpu.SMEM((head_size // chunk, rows, chunk), jnp.float32,
                                  transforms=_operand_transforms(4, chunk))
    scratch = [
        plgpu.SMEM((query_tiles, rows, head_size), dtype, transforms=operand),  # Q
        ring(k_cache),  # K ring
        v_ring,  # V ring
        probabilities,
        output,
        plgpu.SMEM((rows,), jnp.float32),  # log-sum-exp
        plgpu.SMEM((per_worker, keys), jnp.float32),  # 1.0 for a key with a non-finite value (several query tokens)
        plgpu.Barrier(num_arrivals=1, num_barriers=query_tiles),  # Q
        plgpu.Barrier(num_arrivals=tiling.pages_per_tile, num_barriers=tiling.num_stages),  # K stages
        plgpu.Barrier(num_arrivals=tiling.pages_per_tile, num_barriers=tiling.num_stages),  # V stages
    ]
    if workers:
        scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=tiling.num_stages))  # a slot's tile is done
    if items > 1:
        scratch.append(plgpu.Barrier(num_arrivals=workers, num_barriers=2))  # a query tile is read
    if workers == 2:
        scratch += [merge_output,
                    plgpu.SMEM((2, rows), jnp.float32),  # and its running max and sum
                    plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)]  # written, read
    # fp8 stages upcast to q's dtype for the wgmma, K then V, one per compute warpgroup (K in
    # the queries' swizzle, V in the probabilities').
    scratch += [plgpu.SMEM((per_worker, keys, head_size), dtype, transforms=t)
                for d, t in ((k_dequant, operand), (v_dequant, values)) if d]
    return scratch


def _launch(scratch: list, inputs: list, out_type, *, spec: AttentionSpec, tiling: MosaicDecodeTiling,
            num_q_tokens: int, group_size: int, block_size: int, k_cache: CachePlane, v_cache: CachePlane,
            has_alibi: bool, k_dequant: bool, v_dequant: bool, interpret: bool, profile_dir: str | None,
            max_keys: int):
    """The kernel over the grid (KV heads x row blocks, sequences, splits), either form."""
    batch, head_blocks = inputs[0].shape[0], inputs[0].shape[1]
    workers, items, splits = tiling.compute_warpgroups, tiling.items_per_program, tiling.num_splits
    kernel = functools.partial(
        _decode_kernel,
        spec=spec,
        tiling=tiling,
        num_q_tokens=num_q_tokens,
        group_size=group_size,
        block_size=block_size,
        k_plane=k_cache.plane,
        v_plane=v_cache.plane,
        has_alibi=has_alibi,
        k_dequant=k_dequant,
        v_dequant=v_dequant,
        interpret=interpret,
    )
    extra = {"interpret": common.mosaic_interpret_params()} if interpret else {}
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(head_blocks, -(-batch // items), splits),
        grid_names=("heads", "batch", "split"),
        **({"num_threads": workers + 1, "thread_name": "wg"} if workers else {}),
        compiler_params=_compiler_params(profile_dir, tiling, max_keys),
        kernel_name="paged_decode_attention_mgpu",
        **extra,
    )(*inputs)
