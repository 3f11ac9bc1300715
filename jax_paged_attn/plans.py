"""Launch plans of the kernels, below both the wrappers and the kernels.

Everything a kernel launch needs that is not the kernel itself, and does not depend on
the lowering: the prefill tile plan and its field layout (`TileField`), the static
tilings the kernels receive (`PrefillTiling`, `DecodeTiling`; the cache write's is its
`tuning.CacheWriteConfig` as is), the decode split choice and shared-memory estimate,
the preparation of the optional kernel inputs (ALiBi slopes in log2 units, fp8
K/V scales) done the same way for every kernel, and the size rule for refs the Triton
lowering would address with too narrow offsets (`narrow_offsets_overflow`). The Mosaic
GPU kernels reuse the tile plan and the optional inputs, with tilings of their own
(`MosaicPrefillTiling`: warpgroups, a TMA ring, copies that never cross a cache page;
`MosaicDecodeTiling`). The weight-streaming matmul's plan (`MatmulTiling`, `plan_matmul`)
lives here too.

Layering: `spec`, `kv_view` and `tuning` at the bottom, then this module; the kernels
(`jax_paged_attn.kernels`) import only these, `reference`'s mask helpers and
`kernels.common`; the wrappers (`prefill`, `decode`, `cache`) import the kernels and
this module. Nothing here imports a kernel or a wrapper (`tests/test_layering.py`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import warnings

import jax
import jax.numpy as jnp

from jax_paged_attn import tuning
from jax_paged_attn.spec import AttentionSpec
from jax_paged_attn.tuning import (CacheWriteConfig, DecodeConfig, MosaicDecodeConfig, PrefillConfig,
                                   next_power_of_2)

Array = jax.Array

__all__ = [
    "LOG2E", "MIN_DOT_ROWS", "TILE_INFO_WIDTH", "TileField", "PrefillTiling", "DecodeTiling",
    "CacheWriteConfig", "visible_key_interval", "num_query_tiles", "plan_tiles", "heads_per_program",
    "round_up", "check_prefill_config", "plan_prefill_tiling", "estimate_prefill_shared_memory",
    "estimate_shared_memory", "decode_tile_keys",
    "choose_num_splits", "plan_decode_tiling", "plan_cache_write", "is_fp8", "kv_scales",
    "alibi_slopes_log2", "NARROW_OFFSETS_MAX_BYTES", "narrow_offsets_overflow",
    "MOSAIC_DECODE_QUERY_ROW_MULTIPLE", "MOSAIC_DECODE_ROWS", "MOSAIC_SWIZZLES", "mosaic_swizzle_bytes",
    "MOSAIC_F32_STORE_COLUMNS", "MosaicDecodeTiling",
    "estimate_mosaic_decode_shared_memory", "plan_mosaic_decode_tiling", "MOSAIC_OUTPUT_CHUNK",
    "mosaic_output_chunk", "mosaic_store_chunk", "MOSAIC_DECODE_TILE_KEYS", "mosaic_decode_tile",
    "MOSAIC_ROWS_PER_WARPGROUP", "MOSAIC_TMA_ROW_ALIGN", "MOSAIC_TMA_SMEM_ALIGN", "MOSAIC_MIN_BLOCK_K",
    "MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE", "MosaicPrefillTiling", "check_mosaic_prefill_config", "mosaic_work_rows",
    "mosaic_prefill_smem_bytes", "plan_mosaic_prefill_tiling", "mosaic_heads_per_program",
    "MOSAIC_AUTO_HEADS_PER_PROGRAM", "MOSAIC_AUTO_HEADS_PER_PROGRAM_MAX_KEYS", "ConfigFieldDroppedWarning",
    "MatmulTiling", "matmul_unsupported_reason", "check_matmul_config", "plan_matmul", "matmul_shared_memory",
    "AddRmsNormTiling", "plan_add_rms_norm",
]

LOG2E = math.log2(math.e)
"""The kernels' online softmax works in base 2 (``exp2``): scores and ALiBi slopes are
multiplied by ``log2(e)``."""

MIN_DOT_ROWS = 16
"""Smallest M / N / K of a tensor-core dot: the least rows or keys of a kernel tile."""


def _is_power_of_2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def round_up(x: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def _prev_power_of_2(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


# =========================================================================== prefill (varlen)


class TileField(enum.IntEnum):
    """Columns of the tile plan (`plan_tiles`), one int32 row per query tile.

    Rows are positions of the tile's sequence; "stored" rows are written by the tile
    (valid rows and the padding after them), "valid" rows also attend.

    In a plan aligned to ``A`` rows (``plan_tiles(align_rows=A)``, the Mosaic GPU
    kernel's: a TMA copy of a swizzled tile starts on a whole 8-row tile) every
    segment's first tile starts ``Q_ROW0 mod A`` rows early, so ``Q_POS0`` may be
    negative: rows at negative positions belong to the previous segment, are computed
    and never stored. Likewise packed keys: KV block ``kb`` holds keys ``kb * block_k
    - K_LEAD ..``, the first ``K_LEAD`` of block 0 being the previous sequence's.
    """

    SEQ = 0  # sequence index (row of block_table); 0 for padding and surplus tiles
    Q_ROW0 = 1  # packed row of the tile's first position
    Q_ROWS = 2  # positions the tile stores, 0..P (0: surplus tile, exits at once)
    Q_POS0 = 3  # position of the tile's first row within its sequence
    Q_LEN = 4  # query count of the sequence (clamped to max_seqlen_q; 0 for padding)
    K_LEN = 5  # key count of the sequence (clamped; 0 for padding)
    K_ROW0 = 6  # packed row of the sequence's key 0 (0 for a paged cache)
    KB_LO = 7  # first KV block (of block_k keys) the tile can see
    KB_FULL_LO = 8  # first KV block every valid row sees entirely (no mask)
    KB_FULL_HI = 9  # end of the unmasked KV blocks
    KB_HI = 10  # end of the KV blocks the tile can see
    K_LEAD = 11  # keys before the sequence's key 0 in its first KV block (aligned plans; else 0)


TILE_INFO_WIDTH = 16  # columns per plan row: TileField padded to 64 bytes


def _cdiv(a: Array, b: int) -> Array:
    return -((-a) // b)


def visible_key_interval(q_pos: Array, q_len: Array, k_len: Array, spec: AttentionSpec
                         ) -> tuple[Array, Array]:
    """``[lo, hi)``: the keys query ``q_pos`` sees under `spec` (always an interval).

    Both ends are non-decreasing in ``q_pos``; ``hi <= lo`` means no visible key.
    Matches `reference.key_visible` for ``0 <= q_pos < q_len``.
    """
    diag = q_pos + (k_len - q_len)
    if spec.window_left >= 0:
        lo = jnp.maximum(diag - spec.window_left, 0)
    else:
        lo = jnp.zeros_like(diag)
    right = 0 if spec.causal else spec.window_right
    if right >= 0:
        hi = jnp.minimum(diag + right + 1, k_len)
    else:
        hi = jnp.broadcast_to(k_len, diag.shape)
    return lo, hi


def num_query_tiles(num_q_tokens: int, batch: int, positions_per_tile: int, align_rows: int = 1) -> int:
    """Static grid size bounding the tiles of any packing of the query rows.

    B sequences and the padding segments before and after them split ``num_q_tokens``
    rows into at most ``B + 2`` segments; ``sum(ceil(len_i / P)) <= ceil(sum(len_i) / P)
    + B + 1``. An aligned plan adds fewer than ``align_rows`` lead rows to each segment.
    """
    lead_rows = (batch + 2) * (align_rows - 1)
    return -(-(num_q_tokens + lead_rows) // positions_per_tile) + batch + 1


def plan_tiles(
    cu_seqlens_q: Array,  # i32[B + 1]
    cu_seqlens_k: Array,  # i32[B + 1]
    seqused_k: Array | None,  # i32[B] or None
    *,
    num_q_tokens: int,
    num_packed_keys: int | None,
    key_capacity: int | None,
    spec: AttentionSpec,
    max_seqlen_q: int,
    max_seqlen_k: int,
    positions_per_tile: int,
    block_k: int,
    longest_first: bool = True,
    align_rows: int = 1,
) -> Array:  # i32[num_query_tiles(...), TILE_INFO_WIDTH]
    """The kernel's work list: one row of `TileField` columns per query tile.

    Args:
      num_q_tokens: Tq, rows of q (rows before ``cu_seqlens_q[0]`` and past
        ``max(cu_seqlens_q)`` form two padding segments whose tiles write zeros).
      num_packed_keys: rows of packed k / v (key counts are clamped so no read goes
        past them), or None for a paged cache.
      key_capacity: keys a block-table row can address (``max_blocks * block_size``)
        for a paged cache, or None.
      positions_per_tile: P, query positions per tile.
      block_k: keys per KV block of the kernel's inner loop.
      longest_first: order tiles by decreasing work (see `jax_paged_attn.prefill`);
        otherwise sequences and tiles in order.
      align_rows: A, the row alignment of every tile's first query row and of every
        packed KV block's first row (`TileField`): 1 for none. A plan for A > 1 has up
        to one more tile per segment; ``positions_per_tile`` and ``block_k`` must be
        multiples of A.

    Pure jax.numpy, jit-able: everything static is a Python value. Invalid lengths
    (cu_seqlens past the arrays, negative lengths) are clamped so that the kernel
    never touches memory outside its arrays.
    """
    P = positions_per_tile
    if align_rows < 1 or P % align_rows or block_k % align_rows:
        raise ValueError(f"align_rows={align_rows} must be positive and divide positions_per_tile={P} "
                         f"and block_k={block_k}")
    batch = cu_seqlens_q.shape[0] - 1
    cu_q = cu_seqlens_q.astype(jnp.int32)
    cu_k = cu_seqlens_k.astype(jnp.int32)
    q_raw = jnp.maximum(cu_q[1:] - cu_q[:-1], 0)
    q_len = jnp.minimum(q_raw, max_seqlen_q)
    k_len = (cu_k[1:] - cu_k[:-1]) if seqused_k is None else seqused_k.astype(jnp.int32)
    k_len = jnp.clip(k_len, 0, max_seqlen_k)
    if key_capacity is not None:
        k_len = jnp.minimum(k_len, key_capacity)
        k_row0 = jnp.zeros((batch,), jnp.int32)
    else:
        k_row0 = jnp.clip(cu_k[:-1], 0, num_packed_keys)
        k_len = jnp.minimum(k_len, num_packed_keys - k_row0)

    # Segments: the B sequences, then the padding rows after them and those before
    # cu_seqlens_q[0] (valid cu_seqlens start at 0, but under jit nobody checks), so
    # that every row outside the sequences is written with 0, as the reference does.
    # The trailing one starts at the largest offset: no row of a sequence is also a
    # padding row, even for decreasing (invalid) cu_seqlens.
    zeros = jnp.zeros((2,), jnp.int32)
    last_row = jnp.clip(jnp.max(cu_q, keepdims=True), 0, num_q_tokens)
    first_row = jnp.clip(cu_q[:1], 0, num_q_tokens)
    seg_rows = jnp.concatenate([q_raw, num_q_tokens - last_row, first_row])
    seg_row0 = jnp.concatenate([jnp.clip(cu_q[:-1], 0, num_q_tokens), last_row, zeros[:1]])
    seg_q_len = jnp.concatenate([q_len, zeros])
    seg_k_len = jnp.concatenate([k_len, zeros])
    seg_k_row0 = jnp.concatenate([k_row0, zeros])
    seg_seq = jnp.concatenate([jnp.arange(batch, dtype=jnp.int32), zeros])
    # Aligned plans start each segment's rows and keys A-aligned, the lead rows and keys
    # (the previous segment's) in front of position 0.
    seg_q_lead = seg_row0 % align_rows
    seg_k_lead = seg_k_row0 % align_rows
    seg_row0, seg_k_row0 = seg_row0 - seg_q_lead, seg_k_row0 - seg_k_lead
    seg_tiles = jnp.where(seg_rows > 0, _cdiv(seg_rows + seg_q_lead, P), 0)

    # Each segment's place in the order and first tile, then each tile's segment, all by
    # comparing every pair (segments are few): a sort, a search and a gather per field
    # were a dozen small kernels on the GPU, 0.05-0.14 ms before every call.
    seg_ids = jnp.arange(batch + 2, dtype=jnp.int32)
    if longest_first:
        # Visible (query, key) pairs ~ q_len * span of the middle query (exact for
        # the linear spans of causal / window masks away from the clipping).
        mid_lo, mid_hi = visible_key_interval((seg_q_len - 1) // 2, seg_q_len, seg_k_len, spec)
        work = seg_q_len.astype(jnp.float32) * jnp.maximum(mid_hi - mid_lo, 0).astype(jnp.float32)
        work = jnp.where(seg_ids < batch, work, -1.0)  # the padding segments go last
        # Rank by decreasing work, ties in segment order (a stable sort's order).
        before = (work[None, :] > work[:, None]) | ((work[None, :] == work[:, None])
                                                    & (seg_ids[None, :] < seg_ids[:, None]))
    else:
        before = seg_ids[None, :] < seg_ids[:, None]
    # before[s, j]: segment j's tiles come before segment s's.
    seg_start = jnp.sum(jnp.where(before, seg_tiles[None, :], 0), axis=1)
    num_tiles = num_query_tiles(num_q_tokens, batch, P, align_rows)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    owns = (seg_start[None, :] <= t[:, None]) & (t[:, None] < (seg_start + seg_tiles)[None, :])  # [tiles, segs]
    real = t < jnp.sum(seg_tiles)
    seg_fields = jnp.stack([seg_start, seg_tiles, seg_q_lead, seg_row0, seg_rows, seg_q_len, seg_k_len,
                            seg_k_lead, seg_seq, seg_k_row0], axis=1)
    # At most one segment owns a tile (none past the last one's: zeros).
    (start, tiles, q_lead, seg_row0_t, seg_rows_t, seg_q_len_t, seg_k_len_t, seg_k_lead_t, seg_seq_t,
     seg_k_row0_t) = jnp.moveaxis(jnp.sum(jnp.where(owns[:, :, None], seg_fields[None], 0), axis=1), 1, 0)
    local = t - start
    if longest_first:
        local = tiles - 1 - local  # a sequence's last tiles first
    pos0 = local * P - q_lead  # position of the tile's row 0

    q_row0 = seg_row0_t + local * P
    q_rows = jnp.clip(seg_rows_t - pos0, 0, P)  # counted from row 0, lead rows included
    q_rows = jnp.where(real, jnp.clip(jnp.minimum(q_rows, num_q_tokens - q_row0), 0, P), 0)
    q_row0 = jnp.where(real, jnp.clip(q_row0, 0, num_q_tokens), 0)
    t_q_len = jnp.where(real, seg_q_len_t, 0)
    t_k_len = jnp.where(real, seg_k_len_t, 0)

    # KV block range: rows first..last are the tile's valid (attending) queries; blocks
    # count from the sequence's aligned key row, k_lead keys before its key 0.
    first = jnp.maximum(pos0, 0)
    valid = jnp.clip(jnp.minimum(t_q_len, pos0 + P) - first, 0, P)
    last = first + jnp.maximum(valid, 1) - 1
    k_lead = jnp.where(real, seg_k_lead_t, 0)
    lo_first, hi_first = visible_key_interval(first, t_q_len, t_k_len, spec)
    lo_last, hi_last = visible_key_interval(last, t_q_len, t_k_len, spec)
    empty = (valid == 0) | (hi_last <= lo_first)
    kb_lo = jnp.where(empty, 0, (lo_first + k_lead) // block_k)
    kb_hi = jnp.where(empty, 0, _cdiv(hi_last + k_lead, block_k))
    kb_full_lo = jnp.clip(_cdiv(lo_last + k_lead, block_k), kb_lo, kb_hi)
    kb_full_hi = jnp.clip((hi_first + k_lead) // block_k, kb_full_lo, kb_hi)

    columns = {
        TileField.SEQ: jnp.where(real, seg_seq_t, 0),
        TileField.Q_ROW0: q_row0,
        TileField.Q_ROWS: q_rows,
        TileField.Q_POS0: jnp.where(real, pos0, 0),
        TileField.Q_LEN: t_q_len,
        TileField.K_LEN: t_k_len,
        TileField.K_ROW0: jnp.where(real, seg_k_row0_t, 0),
        TileField.KB_LO: kb_lo,
        TileField.KB_FULL_LO: kb_full_lo,
        TileField.KB_FULL_HI: kb_full_hi,
        TileField.KB_HI: kb_hi,
        TileField.K_LEAD: k_lead,
    }
    # One stack, not a scatter per column (XLA ran those as separate kernels).
    unused = jnp.zeros((num_tiles,), jnp.int32)
    by_index = {int(field): column.astype(jnp.int32) for field, column in columns.items()}
    return jnp.stack([by_index.get(i, unused) for i in range(TILE_INFO_WIDTH)], axis=1)


def heads_per_program(num_q_heads: int, num_kv_heads: int, config: PrefillConfig) -> int:
    """Query heads sharing one tile's rows: the KV group when packing GQA, else 1."""
    group = num_q_heads // num_kv_heads
    if config.pack_gqa and 1 < group <= config.block_q:
        return group
    return 1


def check_prefill_config(config: PrefillConfig) -> None:
    """Raises ValueError for a config the kernel cannot compile."""
    if not isinstance(config, PrefillConfig):
        raise TypeError(f"config must be a PrefillConfig, got {type(config).__name__}.")
    for name in ("block_q", "block_k", "masked_block_k"):
        value = getattr(config, name)
        if not (isinstance(value, int) and _is_power_of_2(value) and value >= 16):
            raise ValueError(f"config.{name} must be a power of 2 >= 16 (a tl.dot tile side), got {value!r}.")
    if not (isinstance(config.num_warps, int) and _is_power_of_2(config.num_warps)):
        raise ValueError(f"config.num_warps must be a power of 2, got {config.num_warps!r}.")
    for name in ("pack_gqa", "longest_first", "single_kv_loop", "prefetch_page_ids"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"config.{name} must be a bool, got {getattr(config, name)!r}.")
    for name in ("num_stages", "num_stages_paged"):
        value = getattr(config, name)
        if name == "num_stages_paged" and value is None:
            continue
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"config.{name} must be an int >= 1, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class PrefillTiling:
    """Static launch plan of the varlen (prefill) kernel, from `plan_prefill_tiling`.

    Attributes:
      block_q: rows per tile (query positions x packed heads); power of 2, >= 16.
      block_k: keys per KV step; power of 2, >= 16.
      heads_per_program: query heads sharing a tile's rows (1, or the GQA group).
      padded_head_size: head size rounded up to a power of 2 (masked in-kernel).
      num_warps, num_stages: Triton launch parameters (num_stages already the paged
        one over a paged cache).
      single_kv_loop: one KV loop per tile masking every block, instead of the
        masked / unmasked / masked loops.
      prefetch_page_ids: load the block-table entries one KV step ahead (paged only:
        always False for packed keys).
      longest_first: order of the tiles in the plan (`plan_tiles`).
      masked_block_k: keys per step of the masked loops (a divisor of ``block_k``, power
        of 2, >= 16). Masked blocks carry the extra work that keeps a non-finite value
        from rows that cannot see it; narrower steps keep its registers below the
        unmasked loop's (`jax_paged_attn.tuning.PrefillConfig.masked_block_k`).
    """

    block_q: int
    block_k: int
    heads_per_program: int
    padded_head_size: int
    num_warps: int
    num_stages: int
    single_kv_loop: bool = False
    prefetch_page_ids: bool = False
    longest_first: bool = True
    masked_block_k: int | None = None

    def __post_init__(self) -> None:
        if self.masked_block_k is None:
            object.__setattr__(self, "masked_block_k", self.block_k)
        assert self.block_k % self.masked_block_k == 0, (self.block_k, self.masked_block_k)

    @property
    def positions_per_tile(self) -> int:
        """Query positions per tile (P): ``block_q // heads_per_program``."""
        return self.block_q // self.heads_per_program


def estimate_prefill_shared_memory(block_q: int, block_k: int, padded_head_size: int, q_itemsize: int,
                                   kv_itemsize: int, num_stages: int) -> int:
    """Bytes of shared memory the varlen kernel takes, as a sizing rule: the query tile
    plus ``num_stages`` buffers of K and V tiles."""
    return (block_q * padded_head_size * q_itemsize
            + num_stages * 2 * block_k * padded_head_size * kv_itemsize)


def plan_prefill_tiling(num_q_heads: int, num_kv_heads: int, head_size: int, *, max_seqlen_q: int,
                        max_seqlen_k: int, paged: bool, config: PrefillConfig, q_itemsize: int = 2,
                        kv_itemsize: int = 2,
                        shared_memory_budget: int = tuning.REFERENCE_DEVICE.shared_memory_budget,
                        ) -> PrefillTiling:
    """The varlen kernel's tiling for these shapes and `config` (checked beforehand).

    ``block_q`` and ``block_k`` are upper bounds: a tile taller than any sequence's rows
    only adds idle rows (decode tokens, small chunks), so ``block_q`` shrinks to the rows
    the longest sequence fills (a power of 2 >= 16; the shrunk tile gets at most 4
    warps), and ``block_k`` to ``max_seqlen_k``. A tiling whose
    `estimate_prefill_shared_memory` passes ``shared_memory_budget`` (a GPU with less
    shared memory than the one the config was chosen on,
    `jax_paged_attn.tuning.TuningDevice`) loses pipeline stages down to 2, then halves
    ``block_k``, then ``block_q``, until it fits (or both reach 16).
    """
    group = heads_per_program(num_q_heads, num_kv_heads, config)
    block_q = min(config.block_q, max(MIN_DOT_ROWS, next_power_of_2(max_seqlen_q * group)))
    block_k = min(config.block_k, max(MIN_DOT_ROWS, next_power_of_2(max_seqlen_k)))
    num_stages = config.num_stages
    if paged and config.num_stages_paged is not None:
        num_stages = config.num_stages_paged
    padded_head_size = next_power_of_2(head_size)
    while estimate_prefill_shared_memory(block_q, block_k, padded_head_size, q_itemsize, kv_itemsize,
                                         num_stages) > shared_memory_budget:
        if num_stages > 2:
            num_stages -= 1
        elif block_k > MIN_DOT_ROWS:
            block_k //= 2
        elif block_q > MIN_DOT_ROWS and block_q // 2 >= group:
            block_q //= 2
        else:
            break
    num_warps = config.num_warps if block_q == config.block_q else min(config.num_warps, 4)
    return PrefillTiling(
        block_q=block_q,
        block_k=block_k,
        heads_per_program=group,
        padded_head_size=padded_head_size,
        num_warps=num_warps,
        num_stages=num_stages,
        single_kv_loop=config.single_kv_loop,
        prefetch_page_ids=config.prefetch_page_ids and paged,
        longest_first=config.longest_first,
        # One loop masks every block: narrowing it would narrow the whole kernel.
        masked_block_k=block_k if config.single_kv_loop else min(block_k, config.masked_block_k),
    )




MOSAIC_ROWS_PER_WARPGROUP = 64
"""Query rows of one Mosaic GPU compute warpgroup: its wgmma M."""


MOSAIC_TMA_ROW_ALIGN = 8
"""Rows of one tile of a swizzled shared-memory buffer. A TMA copy into it reads whole
8-row tiles of the global array (which Mosaic GPU views tiled the same way), so every
copy starts at a multiple of 8 rows, and an array read in tiles has a multiple of 8
rows: the Mosaic GPU prefill plans are aligned to it (`plan_tiles(align_rows=...)`)."""

MOSAIC_TMA_SMEM_ALIGN = 128
"""Bytes a TMA copy's shared-memory address is aligned to: the Mosaic GPU prefill
kernel copies single output rows from a plain buffer only where a row is a multiple
of it (`MosaicPrefillTiling.direct_output`)."""

MOSAIC_MIN_BLOCK_K = 64
"""Least keys per Mosaic GPU KV block: masked blocks load the V tile into registers in
the wgmma layout, whose tiles have 64 rows."""


@dataclasses.dataclass(frozen=True)
class MosaicPrefillTiling:
    """Static launch plan of the Mosaic GPU varlen kernel, from `plan_mosaic_prefill_tiling`.

    Attributes:
      compute_warpgroups: warpgroups computing attention, 64 query rows each (1, 2, or
        3 up to `MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE`).
      warp_specialized: one more warpgroup issues the TMA copies (the producer);
        otherwise the single compute warpgroup refills each ring slot itself after
        its block (compute_warpgroups is then 1).
      block_k: keys per KV block; a multiple of 64.
      num_stages: slots of the shared-memory K/V ring (>= 2).
      copy_rows: rows per TMA copy: block_k for packed keys, ``gcd(block_k, block_size)``
        over a paged cache (a copy never crosses a page).
      pingpong: with 2 compute warpgroups, stagger them so that one's softmax overlaps
        the other's wgmma (`tuning.MosaicPrefillConfig.pingpong`).
      longest_first: order of the tiles in the plan (`plan_tiles`).
      nonfinite_check: how masked blocks keep a NaN / inf from the rows the mask hides
        it from (`tuning.MosaicPrefillConfig.nonfinite_check`): ``"product"`` (a matrix
        product finds the rows that see one), ``"key_flags"`` (per-key flags) or
        ``"probe"`` (P·V as in an unmasked block while the values are all finite, the
        ``"key_flags"`` way otherwise).
      fence_softmax: the softmax's row sums and 16-bit probabilities are computed and
        fenced before the barriers of P·V (`tuning.MosaicPrefillConfig.fence_softmax`).
      persistent_programs: 0 for a program per (tile, head); else that many programs
        walk the work items in turn (`tuning.MosaicPrefillConfig.persistent_programs`).
      masked_block_k: keys per part of a masked block (a multiple of 64 dividing
        block_k; `tuning.MosaicPrefillConfig.masked_block_k`).
      direct_output: the kernel writes the packed output ``[Tq, Hq, D]`` itself;
        otherwise one slab per tile ``[num_tiles, block_q, Hq, D]`` that the wrapper
        gathers from (`tuning.MosaicPrefillConfig.direct_output`, where an output row
        is a multiple of `MOSAIC_TMA_SMEM_ALIGN` bytes).
      precheck_values: the call checks its values for NaN / inf once (one reduction over
        the packed values, `tuning.MosaicPrefillConfig.precheck_values`); while every one is
        finite, masked blocks run whole, P·V as in an unmasked block. Packed keys only.
      work_rows: rows of each compute warpgroup's value work tile (`mosaic_work_rows`):
        block_k with fp8 values (whole blocks converted), a masked part's keys for the
        non-finite handling, or 0 where the masked blocks borrow the warpgroup's query
        tile instead (`tuning.MosaicPrefillConfig.value_work_tile`) and reload the
        queries after.
      heads_per_program: query heads a program runs its tile for, one after the other,
        the ring's KV blocks one stream through them (`tuning.MosaicPrefillConfig.
        heads_per_program`; a divisor of the query heads). The grid's head axis has
        ``Hq / heads_per_program`` programs.
      overlap_softmax: the unmasked blocks' softmax overlaps the previous block's P·V
        (`tuning.MosaicPrefillConfig.overlap_softmax`).
      query_buffers: query tiles per compute warpgroup: 2 loads the next head's (or, in the
        persistent form with a producer, the next item's) queries while the current one
        computes (`tuning.MosaicPrefillConfig.prefetch_queries`, where shared memory holds
        the second tile), else 1.
      pingpong_across_items: the ping-pong's two compute warpgroups stay staggered across
        a program's work items (`tuning.MosaicPrefillConfig.pingpong_across_items`).
      exp2_fma_columns: keys of each unmasked block whose probabilities come from the
        FMA-pipe polynomial (`tuning.MosaicPrefillConfig.exp2_fma_columns`; 0: none).
    """

    compute_warpgroups: int
    block_k: int
    num_stages: int
    copy_rows: int
    warp_specialized: bool = True
    pingpong: bool = True
    longest_first: bool = True
    nonfinite_check: str = "product"
    fence_softmax: bool = False
    persistent_programs: int = 0
    masked_block_k: int = 64
    direct_output: bool = True
    work_rows: int = 64
    precheck_values: bool = False
    heads_per_program: int = 1
    query_buffers: int = 1
    overlap_softmax: bool = False
    pingpong_across_items: bool = False
    exp2_fma_columns: int = 0

    @property
    def block_q(self) -> int:
        """Query positions per tile (the plan's P): 64 per compute warpgroup."""
        return self.compute_warpgroups * MOSAIC_ROWS_PER_WARPGROUP


def check_mosaic_prefill_config(config: tuning.MosaicPrefillConfig) -> None:
    """Raises TypeError / ValueError for a config the Mosaic GPU kernel cannot compile."""
    if not isinstance(config, tuning.MosaicPrefillConfig):
        raise TypeError(f"config must be a MosaicPrefillConfig for lowering='mosaic_gpu', got "
                        f"{type(config).__name__}.")
    if not (isinstance(config.block_k, int) and config.block_k >= MOSAIC_MIN_BLOCK_K
            and config.block_k % MOSAIC_MIN_BLOCK_K == 0 and config.block_k <= 256):
        raise ValueError(f"config.block_k must be a multiple of {MOSAIC_MIN_BLOCK_K} up to 256 (a wgmma N), "
                         f"got {config.block_k!r}.")
    if not (isinstance(config.masked_block_k, int) and config.masked_block_k >= MOSAIC_MIN_BLOCK_K
            and config.masked_block_k % MOSAIC_MIN_BLOCK_K == 0):
        raise ValueError(f"config.masked_block_k must be a multiple of {MOSAIC_MIN_BLOCK_K}, got "
                         f"{config.masked_block_k!r}.")
    if not (isinstance(config.num_stages, int) and config.num_stages >= 2):
        raise ValueError(f"config.num_stages must be an int >= 2 (the TMA ring), got {config.num_stages!r}.")
    if config.compute_warpgroups not in (1, 2, 3):
        raise ValueError(f"config.compute_warpgroups must be 1, 2 or 3, got {config.compute_warpgroups!r}.")
    for name in ("warp_specialized", "pingpong", "longest_first", "fence_softmax", "direct_output",
                 "precheck_values", "prefetch_queries", "overlap_softmax", "pingpong_across_items"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"config.{name} must be a bool, got {getattr(config, name)!r}.")
    if not (isinstance(config.persistent_programs, int) and config.persistent_programs >= 0):
        raise ValueError(f"config.persistent_programs must be an int >= 0 (0: a program per work item), got "
                         f"{config.persistent_programs!r}.")
    if not (isinstance(config.heads_per_program, int) and config.heads_per_program >= 0):
        raise ValueError(f"config.heads_per_program must be an int >= 0 (0: the plan chooses), got "
                         f"{config.heads_per_program!r}.")
    if config.persistent_programs and config.heads_per_program > 1:
        raise ValueError("config.heads_per_program > 1 and config.persistent_programs are two ways to give a "
                         "program several work items; set one of them.")
    if config.nonfinite_check not in tuning.MOSAIC_NONFINITE_CHECKS:
        raise ValueError(f"config.nonfinite_check must be one of {tuning.MOSAIC_NONFINITE_CHECKS}, got "
                         f"{config.nonfinite_check!r}.")
    if config.value_work_tile not in tuning.MOSAIC_VALUE_WORK_TILES:
        raise ValueError(f"config.value_work_tile must be one of {tuning.MOSAIC_VALUE_WORK_TILES}, got "
                         f"{config.value_work_tile!r}.")
    if not (isinstance(config.exp2_fma_columns, int) and not isinstance(config.exp2_fma_columns, bool)
            and 0 <= config.exp2_fma_columns < config.block_k and config.exp2_fma_columns % MOSAIC_EXP2_FMA_STEP == 0):
        raise ValueError(f"config.exp2_fma_columns must be a multiple of {MOSAIC_EXP2_FMA_STEP} (a P·V wgmma's K) "
                         f"below config.block_k ({config.block_k}), got {config.exp2_fma_columns!r}.")
    if not config.warp_specialized and config.compute_warpgroups != 1:
        raise ValueError("config.compute_warpgroups must be 1 without warp specialization (the one "
                         f"warpgroup also issues the copies), got {config.compute_warpgroups}.")


MOSAIC_EXP2_FMA_STEP = 64
"""`tuning.MosaicPrefillConfig.exp2_fma_columns` comes in steps of this many keys: each
part of the probabilities is the operand of its own P·V wgmma, whose K is a multiple of
the value tile's 128-byte swizzle, 64 keys of 16-bit values."""

MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE = 64
"""Largest head size at which the Mosaic GPU prefill runs three compute warpgroups (192
query rows a tile, FlashAttention-3's tile at D 64): three of them get 160 registers a
thread each (`jax_paged_attn.kernels.mosaic_prefill.REGISTER_SPLIT`), which hold a 64 x D
f32 accumulator, the masked blocks' second product tile and a 64 x block_k score tile at
D 64 only. Past it a config's 3 runs 2; so do queries of at most 128 positions (a third
warpgroup would hold idle rows). An option, not the default: at B16 S1024 D64 it measured
level with two (0.328 against 0.327 ms, 0.337 with 128-key blocks against two's 0.299;
the H200, 2026-12-04, benchmarks/NOTES.md)."""

MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE = 128
"""Largest head size at which the Mosaic GPU prefill runs two compute warpgroups with the
``"product"`` or ``"probe"`` check: its masked blocks hold a second 64 x D f32 product
beside the accumulator (D registers a thread for both), past the 232 registers a compute
warpgroup gets at D 256: two warpgroups ran about 4x slower there than "key_flags" (the H200,
2026-12-02), one 1.7x. Larger head sizes run those checks with one."""


def mosaic_work_rows(block_k: int, v_itemsize: int, config: tuning.MosaicPrefillConfig,
                     borrow_query_tile: bool = False) -> int:
    """Rows of a compute warpgroup's value work tile in the Mosaic GPU prefill kernel:
    ``block_k`` with fp8 values (an unmasked block's values converted whole), else the
    keys of a masked part (the non-finite handling rewrites them), except 0 where the
    masked parts have 64 keys and the warpgroup's 64-row query tile serves instead
    (``borrow_query_tile``, or the ``"probe"`` check unless ``config.value_work_tile`` is
    ``"own"``: only its rare redo rewrites values); the queries are then reloaded after
    the block. (At D 128 and 128-key blocks, and at D 256, the work tile is what decides
    whether two compute warpgroups fit in shared memory.)"""
    if v_itemsize == 1:
        return block_k
    masked = math.gcd(block_k, config.masked_block_k)
    probe_borrows = config.nonfinite_check == "probe" and config.value_work_tile != "own"
    if masked == MOSAIC_ROWS_PER_WARPGROUP and (borrow_query_tile or probe_borrows):
        return 0
    return masked


def mosaic_prefill_smem_bytes(compute_warpgroups: int, block_k: int, head_size: int, num_stages: int,
                              q_itemsize: int, k_itemsize: int, v_itemsize: int, work_rows: int,
                              query_buffers: int = 1) -> int:
    """Shared memory of the Mosaic GPU prefill kernel's tiles
    (`jax_paged_attn.kernels.mosaic_prefill`): per compute warpgroup its queries / output,
    its value work tile of ``work_rows`` (`mosaic_work_rows`), its converted-key tile
    (fp8 keys), its f32 key flags
    (``"key_flags"``; counted always: 4 bytes a key) and its two buffers of f32 row flags
    (``"probe"``; counted always), plus the K and V ring. Barriers and alignment fit in
    the budget's margin. ``query_buffers`` query tiles per warpgroup (2: the next head's
    queries prefetched)."""
    conv_rows = block_k if k_itemsize == 1 else 0
    per_warpgroup = ((query_buffers * MOSAIC_ROWS_PER_WARPGROUP + work_rows + conv_rows) * head_size * q_itemsize
                     + 4 * block_k + 2 * 4 * MOSAIC_ROWS_PER_WARPGROUP)
    return compute_warpgroups * per_warpgroup + num_stages * block_k * head_size * (k_itemsize + v_itemsize)


class ConfigFieldDroppedWarning(UserWarning):
    """A config field the user set that the plan cannot honour for these shapes (said once
    per field and reason); the kernel runs without it."""


_dropped_fields: set[tuple[str, str]] = set()


def _drop_config_field(field: str, reason: str, warn: bool = True) -> bool:
    """Warns once per (field, reason) that ``config.<field>`` is off for this call (with
    ``warn``); False."""
    if warn and (field, reason) not in _dropped_fields:
        _dropped_fields.add((field, reason))
        warnings.warn(f"config.{field} is off for this call: {reason}.", ConfigFieldDroppedWarning, stacklevel=3)
    return False


def plan_mosaic_prefill_tiling(head_size: int, q_itemsize: int, k_itemsize: int, v_itemsize: int, *,
                               num_q_heads: int, max_seqlen_q: int, max_seqlen_k: int, block_size: int | None,
                               config: tuning.MosaicPrefillConfig,
                               warn_dropped: bool = True) -> MosaicPrefillTiling:
    """The Mosaic GPU varlen kernel's tiling for these shapes and `config` (checked).

    block_k shrinks to ``max_seqlen_k`` (a power of 2, at least `MOSAIC_MIN_BLOCK_K`) and
    the compute warpgroups to 1 when ``max_seqlen_q <= 64`` (decode-like batches would
    run a warpgroup of idle rows) or when the non-finite check's second product tile
    would not fit the registers (`MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE`); 3 of them to 2
    past `MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE` or for ``max_seqlen_q <= 128``. Then,
    until the tiles fit `tuning.MOSAIC_SHARED_MEMORY_BUDGET`: the ring drops to 2 slots,
    block_k halves (to 64), the compute warpgroups drop one by one (the least tiling fits
    at every head size; two ping-ponged warpgroups are worth more than longer blocks, as in the stock
    attention_mgpu kernel's choice at D 256), except that with ``config.value_work_tile``
    ``"auto"`` the masked blocks first give up their value work tile for the query tile
    (`mosaic_work_rows`).
    ``config.direct_output`` holds where an output row is a multiple of
    `MOSAIC_TMA_SMEM_ALIGN` bytes (the one-row copies of a partial warpgroup read shared
    memory at each row's start; on the H200 a head size of 32 at 16 bits faulted with a
    misaligned address); other head sizes keep the slab per tile.
    ``query_buffers`` is 2 with ``config.prefetch_queries``, several heads per program (or
    persistent programs with a producer) and room for the second query tile, else 1.
    A field the plan cannot honour is dropped with a `ConfigFieldDroppedWarning`, once per
    field and reason, unless ``warn_dropped`` is False: the package's own config
    (`tuning.mosaic_prefill_config`, a call without ``config``) sets fields such as
    ``prefetch_queries`` for every call of a head size, meaning "where it applies".
    ``heads_per_program`` is the largest divisor of ``num_q_heads`` up to
    ``config.heads_per_program``, or with 0 (auto) up to `MOSAIC_AUTO_HEADS_PER_PROGRAM` for
    packed keys of at most `MOSAIC_AUTO_HEADS_PER_PROGRAM_MAX_KEYS` a sequence, else 1.
    """
    block_k = max(MOSAIC_MIN_BLOCK_K, min(config.block_k, next_power_of_2(max_seqlen_k)))
    block_k -= block_k % MOSAIC_MIN_BLOCK_K  # (a config's multiple of 64 may not be a power of 2)
    stages = config.num_stages
    workers = 1 if max_seqlen_q <= MOSAIC_ROWS_PER_WARPGROUP else config.compute_warpgroups
    if workers == 3 and (head_size > MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE
                         or max_seqlen_q <= 2 * MOSAIC_ROWS_PER_WARPGROUP):
        workers = 2
    if config.nonfinite_check in ("product", "probe") and head_size > MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE:
        workers = 1
    borrow = config.value_work_tile == "query"

    def work_rows() -> int:
        return mosaic_work_rows(block_k, v_itemsize, config, borrow)

    def fits() -> bool:
        return mosaic_prefill_smem_bytes(workers, block_k, head_size, stages, q_itemsize, k_itemsize,
                                         v_itemsize, work_rows()) <= tuning.MOSAIC_SHARED_MEMORY_BUDGET

    while not fits() and stages > 2:
        stages -= 1
    while not fits() and block_k > MOSAIC_MIN_BLOCK_K:
        block_k = max(MOSAIC_MIN_BLOCK_K, block_k // 2 - (block_k // 2) % MOSAIC_MIN_BLOCK_K)
    if not fits() and workers >= 2 and config.value_work_tile == "auto":
        borrow = True  # a query tile reloaded after each masked block beats losing a warpgroup
    while not fits() and workers > 1:
        workers -= 1
        borrow = config.value_work_tile == "query"
    if config.value_work_tile == "query" and work_rows() != 0:
        raise ValueError(
            "config.value_work_tile='query' needs 16-bit values and 64-key masked parts (the query "
            f"tile's 64 rows hold them), got {v_itemsize}-byte values and "
            f"{math.gcd(block_k, config.masked_block_k)}-key parts; use 'auto' or 'own'.")
    copy_rows = block_k if block_size is None else math.gcd(block_k, block_size)
    heads_per_program = mosaic_heads_per_program(config, num_q_heads, max_seqlen_k, paged=block_size is not None)
    # A second query tile only where a program has a next head or item to prefetch for
    # (several heads a program; persistent programs with a producer) and shared memory
    # holds it beside the tiling chosen above (it never costs the tiling a slot, a wider
    # block or a warpgroup).
    has_next = heads_per_program > 1 or (config.persistent_programs > 0 and config.warp_specialized)
    drop = functools.partial(_drop_config_field, warn=warn_dropped)  # (a C partial: the warning's stacklevel holds)
    query_buffers = 1
    if config.prefetch_queries and not has_next:
        drop("prefetch_queries", "a program has no next head or item to load queries for "
             "(one head a program, not persistent with a producer)")
    elif config.prefetch_queries and mosaic_prefill_smem_bytes(
            workers, block_k, head_size, stages, q_itemsize, k_itemsize, v_itemsize, work_rows(),
            query_buffers=2) > tuning.MOSAIC_SHARED_MEMORY_BUDGET:
        drop("prefetch_queries", f"no shared memory for a second query tile beside {workers} "
             f"compute warpgroups, {block_k}-key blocks and {stages} ring slots at head size {head_size}")
    elif config.prefetch_queries:
        query_buffers = 2
    # overlap_softmax only for 16-bit keys and values (fp8 blocks run one by one,
    # `tuning.MosaicPrefillConfig`).
    overlap_softmax = config.overlap_softmax
    if overlap_softmax and (k_itemsize != q_itemsize or v_itemsize != q_itemsize):
        overlap_softmax = drop("overlap_softmax", "fp8 keys or values run their blocks one by one")
    pingpong_across_items = config.pingpong_across_items
    if pingpong_across_items and not (config.pingpong and workers == 2):
        pingpong_across_items = drop("pingpong_across_items", "no ping-pong (it staggers two compute warpgroups)")
    elif pingpong_across_items and not has_next:  # (ping-pong has a producer: persistent programs have items)
        pingpong_across_items = drop("pingpong_across_items",
                                     "a program has one work item (one head a program, not persistent)")
    exp2_fma_columns = config.exp2_fma_columns
    if exp2_fma_columns and v_itemsize != q_itemsize:
        exp2_fma_columns = drop("exp2_fma_columns", "fp8 values are converted whole, for one P·V a block")
    elif exp2_fma_columns and overlap_softmax:
        exp2_fma_columns = drop("exp2_fma_columns", "overlap_softmax issues one P·V a block")
    elif exp2_fma_columns >= block_k:
        exp2_fma_columns = drop("exp2_fma_columns", f"the plan's blocks hold {block_k} keys (shared memory)")
    return MosaicPrefillTiling(compute_warpgroups=workers, block_k=block_k, num_stages=stages,
                               copy_rows=copy_rows, warp_specialized=config.warp_specialized,
                               pingpong=config.pingpong, longest_first=config.longest_first,
                               nonfinite_check=config.nonfinite_check,
                               fence_softmax=config.fence_softmax,
                               persistent_programs=config.persistent_programs,
                               masked_block_k=math.gcd(block_k, config.masked_block_k),
                               direct_output=config.direct_output
                               and head_size * q_itemsize % MOSAIC_TMA_SMEM_ALIGN == 0,
                               work_rows=work_rows(),
                               precheck_values=config.precheck_values and block_size is None,
                               heads_per_program=heads_per_program, query_buffers=query_buffers,
                               overlap_softmax=overlap_softmax, pingpong_across_items=pingpong_across_items,
                               exp2_fma_columns=int(exp2_fma_columns))


MOSAIC_AUTO_HEADS_PER_PROGRAM = 4
"""Query heads a Mosaic GPU prefill program runs in turn with ``heads_per_program=0``
(auto) on short packed sequences: each head's launch, ring fill and first query wait were
measured to cost more than the stream's slower per-block loop there (the H200,
2026-12-02; `tuning.MosaicPrefillConfig.heads_per_program`)."""

MOSAIC_AUTO_HEADS_PER_PROGRAM_MAX_KEYS = 4096
"""Longest sequence (``max_seqlen_k``) for which auto runs several heads per program:
faster at 1,024-4,096 keys, 5.5 % slower at 16,384 (the H200, 2026-12-02)."""


def mosaic_heads_per_program(config: tuning.MosaicPrefillConfig, num_q_heads: int, max_seqlen_k: int, *,
                             paged: bool) -> int:
    """Query heads per program of the Mosaic GPU prefill kernel: the largest divisor of
    ``num_q_heads`` up to the config's ``heads_per_program``; 0 (auto) asks for
    `MOSAIC_AUTO_HEADS_PER_PROGRAM` on packed keys of at most
    `MOSAIC_AUTO_HEADS_PER_PROGRAM_MAX_KEYS`, 1 otherwise (and with persistent programs)."""
    wanted = config.heads_per_program
    if wanted == 0:
        short = not paged and max_seqlen_k <= MOSAIC_AUTO_HEADS_PER_PROGRAM_MAX_KEYS
        wanted = MOSAIC_AUTO_HEADS_PER_PROGRAM if short and not config.persistent_programs else 1
    return max(d for d in range(1, wanted + 1) if num_q_heads % d == 0)

# =========================================================================== paged decode


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """Static launch plan of the decode kernel, from `plan_decode_tiling`.

    Attributes:
      rows_per_program: query rows (``Sq * G`` padded) per program; power of 2, >= 16.
      row_blocks: programs per KV head along the query rows (> 1 only when
        ``Sq * G`` exceeds the row cap).
      padded_head_size: head size rounded up to a power of 2 (masked in-kernel).
      tile_keys: keys per inner-loop step; power of 2, >= 16.
      num_splits: KV splits per (sequence, KV head); 1 writes the final output.
      num_warps, num_stages: Triton launch parameters.
      prefetch_page_ids: read each tile's block-table entries one step ahead (a
        loop-carried id vector) instead of in the step that uses them.
    """

    rows_per_program: int
    row_blocks: int
    padded_head_size: int
    tile_keys: int
    num_splits: int
    num_warps: int
    num_stages: int
    prefetch_page_ids: bool = False


def estimate_shared_memory(tile_keys: int, padded_head_size: int, cache_itemsize: int,
                           compute_itemsize: int, num_stages: int, prefetch_page_ids: bool = False) -> int:
    """Bytes of shared memory the compiled decode kernel takes (an upper estimate).

    Calibrated on Triton's sm_90 output: K and V tiles in ``(num_stages - 1) // 2``
    buffers when the block-table load is in the step that uses it (the pipeliner gives
    it its own stages), ``num_stages - 1`` when the ids are prefetched a step ahead,
    plus layout conversion scratch, larger when fp8 tiles are upcast.
    """
    kv_buffers = max(1, num_stages - 1 if prefetch_page_ids else (num_stages - 1) // 2)
    tile_elements = tile_keys * padded_head_size
    staged = kv_buffers * 2 * tile_elements * cache_itemsize
    scratch = tile_elements * compute_itemsize * (3 if cache_itemsize != compute_itemsize else 2) // 2
    return staged + scratch + 4096


def decode_tile_keys(block_size: int, head_size: int, cache_itemsize: int, compute_itemsize: int,
                     config: DecodeConfig,
                     shared_memory_budget: int = tuning.DECODE_SHARED_MEMORY_BUDGET) -> int:
    """Keys per inner step: pages_per_step pages, a power of 2, fitting
    ``shared_memory_budget`` (default: the H200's, `tuning.DECODE_SHARED_MEMORY_BUDGET`)."""
    tile = max(MIN_DOT_ROWS, _prev_power_of_2(config.pages_per_step * block_size))
    padded_head = next_power_of_2(head_size)
    while tile > MIN_DOT_ROWS and estimate_shared_memory(
        tile, padded_head, cache_itemsize, compute_itemsize, config.num_stages, config.prefetch_page_ids
    ) > shared_memory_budget:
        tile //= 2
    return tile


def choose_num_splits(
    batch: int, num_kv_heads: int, row_blocks: int, max_keys: int, tile_keys: int,
    config: DecodeConfig | MosaicDecodeConfig,
) -> int:
    """KV splits per (sequence, KV head) so that a few long sequences still fill the GPU.

    ``config.num_splits > 0`` is used as is. Otherwise: enough splits for about
    ``config.target_programs`` programs, but no more than leave each split
    ``config.min_tiles_per_split`` steps of the longest context the block table allows
    (``max_keys``; the kernel divides each sequence's actual keys evenly).
    """
    if config.num_splits > 0:
        return config.num_splits
    programs = batch * num_kv_heads * row_blocks
    wanted = -(-config.target_programs // programs)
    max_tiles = -(-max_keys // tile_keys)
    most = max(1, max_tiles // max(config.min_tiles_per_split, 1))
    return max(1, min(wanted, most))


def plan_decode_tiling(
    q_shape: tuple[int, ...], cache_shape: tuple[int, ...], max_blocks: int, q_dtype, cache_dtype,
    config: DecodeConfig, shared_memory_budget: int = tuning.DECODE_SHARED_MEMORY_BUDGET,
) -> DecodeTiling:
    """The decode kernel's static launch plan for these shapes and `config`.

    ``q_shape`` is ``[B, Sq, Hq, D]``, ``cache_shape`` ``[num_blocks, block_size, Hk, D]``,
    ``max_blocks`` the block table's columns. Query rows (``Sq * G``) are padded to a
    power of 2 >= 16 and capped by ``config.max_q_rows`` (more rows take more programs).
    ``shared_memory_budget``: bytes of shared memory a program may take on the target
    GPU (`jax_paged_attn.tuning.TuningDevice.shared_memory_budget`).
    """
    batch, num_q_tokens, num_q_heads, head_size = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    rows = num_q_tokens * (num_q_heads // num_kv_heads)
    max_rows = max(MIN_DOT_ROWS, _prev_power_of_2(config.max_q_rows))
    rows_per_program = min(max(MIN_DOT_ROWS, next_power_of_2(rows)), max_rows)
    row_blocks = -(-rows // rows_per_program)
    tile_keys = decode_tile_keys(block_size, head_size, jnp.dtype(cache_dtype).itemsize,
                                 jnp.dtype(q_dtype).itemsize, config, shared_memory_budget)
    num_splits = choose_num_splits(batch, num_kv_heads, row_blocks, max_blocks * block_size, tile_keys, config)
    return DecodeTiling(
        rows_per_program=rows_per_program,
        row_blocks=row_blocks,
        padded_head_size=next_power_of_2(head_size),
        tile_keys=tile_keys,
        num_splits=num_splits,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        prefetch_page_ids=config.prefetch_page_ids,
    )


# =========================================================================== paged decode, Mosaic GPU

MOSAIC_DECODE_ROWS = 64
"""Query rows of one Mosaic GPU decode program: the M of a Hopper warpgroup MMA
(``Sq * G`` rows of a KV head, zero-padded; more rows take more programs)."""

MOSAIC_DECODE_QUERY_ROW_MULTIPLE = 8
"""A program's query rows in global memory are a multiple of this: the 16-bit query
tile's shared-memory tiling is 8 rows deep, so a TMA copy of whole 8-row tiles lands
in it (and a 32-byte log-sum-exp row meets TMA's 16-byte granule)."""

MOSAIC_SWIZZLES = (128, 64, 32)
"""Swizzles (bytes) of Mosaic GPU shared-memory tiles, widest first."""


def mosaic_swizzle_bytes(row_elements: int, itemsize: int) -> int:
    """The widest swizzle (`MOSAIC_SWIZZLES`) of a shared-memory tile whose rows are
    ``row_elements`` long: its tiles are ``swizzle // itemsize`` elements wide, so they
    must divide the row; 0 where none does (fp8 rows of 80 bytes, say: such tiles are
    only loaded into registers, never a wgmma operand)."""
    return next((size for size in MOSAIC_SWIZZLES if row_elements * itemsize % size == 0), 0)


MOSAIC_OUTPUT_CHUNK = 128
"""Most output columns the Mosaic GPU decode kernel accumulates and stores as one chunk."""


def mosaic_output_chunk(head_size: int) -> int:
    """Output columns per accumulator chunk of the Mosaic GPU decode kernel: the most, up
    to `MOSAIC_OUTPUT_CHUNK`, that divide the head and are whole swizzle tiles of the
    16-bit value rows (each chunk's P·V reads a column slice of the V tile): D 128: 128,
    D 96: 96, D 192: 64, D 160: 32, D 240: 80."""
    width = mosaic_swizzle_bytes(head_size, 2) // 2
    return max(c for c in range(width, min(head_size, MOSAIC_OUTPUT_CHUNK) + 1, width) if head_size % c == 0)


MOSAIC_F32_STORE_COLUMNS = 64
"""Most f32 columns of the Mosaic GPU decode kernel's output buffer (split partials)."""


def mosaic_store_chunk(head_size: int, out_itemsize: int) -> int:
    """Output columns the Mosaic GPU decode kernel stages in shared memory per store: an
    accumulator chunk, or for f32 partials its largest divisor up to
    `MOSAIC_F32_STORE_COLUMNS` in whole 8-column tiles of the wgmma layout (16 KiB
    instead of 32 at D 128: with two 64-key stages the kernel then takes ~105 KiB, so two
    fit an SM)."""
    chunk = mosaic_output_chunk(head_size)
    if out_itemsize != 4:
        return chunk
    return max(c for c in range(8, min(chunk, MOSAIC_F32_STORE_COLUMNS) + 1, 8) if chunk % c == 0)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeTiling:
    """Static launch plan of the Mosaic GPU decode kernel, from `plan_mosaic_decode_tiling`.

    Attributes:
      row_blocks: programs per KV head along the query rows (``Sq * G`` rows in blocks
        of `MOSAIC_DECODE_ROWS`).
      query_rows: query rows a program reads and writes in global memory: ``Sq * G``
        rounded up to `MOSAIC_DECODE_QUERY_ROW_MULTIPLE` in one row block, else
        `MOSAIC_DECODE_ROWS` (the kernel's tile stays 64 rows, the rest zeros in shared
        memory: padding the rows in global memory to 64 would make the wrapper's query
        copy and the output 16 times as large at a GQA group of 4).
      tile_keys: keys per pipeline stage, ``pages_per_tile`` copies of ``copy_rows`` rows
        (`mosaic_decode_tile`).
      pages_per_tile: TMA copies (per K and V) per stage: whole pages where the block
        size divides 128, else runs of ``copy_rows`` rows, each within one page.
      copy_rows: rows per TMA copy: the block size, or ``gcd(tile_keys, block_size)``.
      num_stages: K/V tiles in the shared-memory ring (a multiple of
        ``compute_warpgroups`` when warp-specialized).
      num_splits: KV splits per (sequence, KV head); 1 writes the final output.
      compute_warpgroups: 0: one warpgroup copies and computes; 1 or 2: a producer
        warpgroup and that many compute warpgroups (`tuning.MosaicDecodeConfig`).
      items_per_program: consecutive sequences a warp-specialized program attends for,
        its ring carrying their tiles as one stream (1 without warp specialization).
      keys_as_m: the keys as the wgmmas' M side (`tuning.MosaicDecodeConfig.keys_as_m`):
        ``query_rows`` is then ``Sq * G`` rounded up to
        `MOSAIC_DECODE_KEYS_AS_M_ROW_MULTIPLE`, the shared-memory query tile has just
        those rows, and the kernel writes its output transposed, ``[..., D, query_rows]``.
    """

    row_blocks: int
    tile_keys: int
    pages_per_tile: int
    num_stages: int
    num_splits: int
    compute_warpgroups: int = 0
    items_per_program: int = 1
    query_rows: int = MOSAIC_DECODE_ROWS
    copy_rows: int = 16
    keys_as_m: bool = False

    @property
    def warp_specialized(self) -> bool:
        return self.compute_warpgroups > 0


def estimate_mosaic_decode_shared_memory(tile_keys: int, head_size: int, itemsize: int, num_stages: int,
                                         out_itemsize: int, cache_itemsizes: tuple[int, int] | None = None,
                                         compute_warpgroups: int = 0, query_tiles: int = 1) -> int:
    """Bytes of shared memory of the Mosaic GPU decode kernel: the K/V ring (in the
    caches' dtypes, ``cache_itemsizes`` for K and V, default q's), the upcast buffers of
    each fp8 operand, the query tiles (``query_tiles``: two with several items a
    program), the probabilities tiles, the output buffer (`mosaic_store_chunk` columns;
    ``out_itemsize``: q's for one split, 4 for f32 partials), the log-sum-exp row, the non-finite key flags, with two compute
    warpgroups the second one's f32 running output and row statistics for the merge,
    and the barrier arrays, each rounded up to 1 KiB as Mosaic GPU aligns every scratch
    buffer. The upcast, probabilities and flag buffers are per compute warpgroup."""
    rows = MOSAIC_DECODE_ROWS
    workers = max(compute_warpgroups, 1)
    k_size, v_size = cache_itemsizes or (itemsize, itemsize)
    buffers = [num_stages * tile_keys * head_size * k_size, num_stages * tile_keys * head_size * v_size]
    buffers += [workers * tile_keys * head_size * itemsize for size in (k_size, v_size) if size != itemsize]
    buffers += [query_tiles * rows * head_size * itemsize, workers * rows * tile_keys * itemsize,
                rows * mosaic_store_chunk(head_size, out_itemsize) * out_itemsize, rows * 4, workers * tile_keys * 4]
    if compute_warpgroups > 1:
        buffers += [rows * head_size * 4, 2 * rows * 4]
    buffers += [8 * num_stages] * (3 if compute_warpgroups else 2) + [16] * 4  # mbarriers
    return sum(round_up(size, 1024) for size in buffers)


MOSAIC_DECODE_KEYS_AS_M_ROW_MULTIPLE = 16
"""With ``MosaicDecodeConfig.keys_as_m`` a program's query rows (the wgmmas' N) are a
multiple of this: the probabilities' shared-memory tile is ``[tile_keys, N]``, and a
wgmma's two shared-memory operands share one swizzle, so N rows of 16-bit elements set
the values' swizzle too (16 rows: 32 bytes, the narrowest swizzle Mosaic GPU tiles)."""


def mosaic_keys_as_m_unsupported_reason(num_q_tokens: int, group_size: int, head_size: int,
                                        spec: AttentionSpec | None = None, *,
                                        compute_warpgroups: int = 0) -> str | None:
    """Why ``MosaicDecodeConfig.keys_as_m`` cannot run a call, or None: head sizes that
    are multiples of 64 (the values' M side), at most `MOSAIC_DECODE_ROWS` query rows a KV
    head, and (given ``spec``) no causal or window mask over several query tokens (keys
    hidden from some rows only: the non-finite quarantine of the other form is not built
    here). Given ``compute_warpgroups``: at most one beside the producer
    (the softmax's column max and sum reduce across a warpgroup's warps, which Mosaic GPU
    does through one shared-memory scratch buffer at a fixed offset: two compute
    warpgroups reducing at once would overwrite each other's partials)."""
    if head_size % 64:
        return f"the head size must be a multiple of 64 (the values' wgmma M side), got {head_size}"
    if num_q_tokens * group_size > MOSAIC_DECODE_ROWS:
        return (f"a KV head's query rows (Sq * G = {num_q_tokens * group_size}) must be at most "
                f"{MOSAIC_DECODE_ROWS}")
    if spec is not None and num_q_tokens > 1 and (spec.causal or spec.is_local):
        return "several query tokens under a causal or window mask are not supported (the non-finite quarantine)"
    if compute_warpgroups > 1:
        return (f"at most one compute warpgroup, got {compute_warpgroups}: the softmax's cross-warp reductions "
                f"share Mosaic GPU's one reduction scratch buffer, on which two would race")
    return None


MOSAIC_DECODE_TILE_KEYS = (64, 128)
"""``MosaicDecodeConfig.tile_keys`` values: multiples of 64, since masked stages load
their values into registers in the wgmma layout, whose tiles have 64 rows."""


def mosaic_decode_tile(block_size: int, tile_keys: int) -> tuple[int, int]:
    """(keys per stage, rows per TMA copy) of the Mosaic GPU decode kernel for cache pages
    of ``block_size`` keys and the config's ``tile_keys``: whole pages where the block size
    divides 128 (``max(tile_keys, block_size)`` keys, a copy a page); else ``tile_keys``
    keys in copies of ``gcd(tile_keys, block_size)`` rows, each within one page (a
    256-key page: 64- or 128-row slices; 48: 16-row runs, a stage's rows spanning pages).
    A stage stays a multiple of 64 keys: masked stages load their values into registers
    in the wgmma layout, whose tiles have 64 rows."""
    if 128 % block_size == 0:
        return max(tile_keys, block_size), block_size
    return tile_keys, math.gcd(tile_keys, block_size)


def plan_mosaic_decode_tiling(
    q_shape: tuple[int, ...], cache_shape: tuple[int, ...], max_blocks: int, q_dtype,
    config: MosaicDecodeConfig, cache_itemsizes: tuple[int, int] | None = None,
    multiprocessors: int | None = None,
) -> MosaicDecodeTiling:
    """The Mosaic GPU decode kernel's static launch plan for these shapes and `config`.

    ``q_shape`` is ``[B, Sq, Hq, D]``, ``cache_shape`` ``[num_blocks, block_size, Hk, D]``,
    ``max_blocks`` the block table's columns, ``cache_itemsizes`` the K and V caches'
    element sizes (default: q's; 1 for fp8 pages), ``multiprocessors`` the GPU's SMs for
    ``config.items_per_program == 0`` (default: `tuning.target_device`'s). A stage holds
    whole pages or a slice of one (`mosaic_decode_tile`). Raises ValueError for a
    ``config.tile_keys`` the kernel cannot take.
    """
    batch, num_q_tokens, num_q_heads, head_size = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    if config.tile_keys not in MOSAIC_DECODE_TILE_KEYS:
        raise ValueError(f"config.tile_keys must be one of {MOSAIC_DECODE_TILE_KEYS}, got {config.tile_keys}.")
    tile_keys, copy_rows = mosaic_decode_tile(block_size, config.tile_keys)
    if config.num_stages < 2:
        raise ValueError(f"config.num_stages must be at least 2, got {config.num_stages}.")
    if config.compute_warpgroups not in (0, 1, 2):
        raise ValueError(f"config.compute_warpgroups must be 0, 1 or 2, got {config.compute_warpgroups}.")
    if config.items_per_program < 0 or (config.items_per_program > 1 and not config.compute_warpgroups):
        raise ValueError(f"config.items_per_program must be 0 (auto) or 1, or more with config.compute_warpgroups "
                         f"> 0, got {config.items_per_program} with {config.compute_warpgroups} compute warpgroups.")
    rows = num_q_tokens * (num_q_heads // num_kv_heads)
    row_blocks = -(-rows // MOSAIC_DECODE_ROWS)
    query_rows = MOSAIC_DECODE_ROWS if row_blocks > 1 else round_up(rows, MOSAIC_DECODE_QUERY_ROW_MULTIPLE)
    itemsize = jnp.dtype(q_dtype).itemsize
    if config.keys_as_m:
        reason = mosaic_keys_as_m_unsupported_reason(num_q_tokens, num_q_heads // num_kv_heads, head_size,
                                                     compute_warpgroups=config.compute_warpgroups)
        if reason is not None:
            raise ValueError(f"config.keys_as_m: {reason}.")
        query_rows = round_up(rows, MOSAIC_DECODE_KEYS_AS_M_ROW_MULTIPLE)
    num_splits = choose_num_splits(batch, num_kv_heads, row_blocks, max_blocks * block_size, tile_keys, config)
    out_itemsize = itemsize if num_splits == 1 else 4
    items = min(config.items_per_program, batch)
    if not config.compute_warpgroups:
        items = 1
    elif items == 0:  # auto: one wave of programs
        sms = multiprocessors or tuning.target_device().multiprocessors
        items = min(-(-batch * num_kv_heads * row_blocks * num_splits // sms), batch)

    def smem(keys: int, stages: int, workers: int) -> int:
        return estimate_mosaic_decode_shared_memory(keys, head_size, itemsize, stages, out_itemsize,
                                                    cache_itemsizes, workers, query_tiles=2 if items > 1 else 1)

    def fit(keys: int, workers: int) -> int | None:
        """The most stages up to the config's (a multiple of the compute warpgroups, at
        least 2) that fit shared memory, or None."""
        step = max(workers, 1)
        stages = max(round_up(config.num_stages, step), 2)
        while stages > 2 and smem(keys, stages, workers) > tuning.MOSAIC_SHARED_MEMORY_LIMIT:
            stages -= step
        return stages if smem(keys, stages, workers) <= tuning.MOSAIC_SHARED_MEMORY_LIMIT else None

    # Fewer stages first, then (the pages allowing) 64-key stages (at D 256 two 128-key
    # stages alone take 256 KiB), then one compute warpgroup instead of two (the second
    # one's merge buffer).
    workers = config.compute_warpgroups
    stages = fit(tile_keys, workers)
    if stages is None and tile_keys > 64 and block_size != 128:
        tile_keys, copy_rows = mosaic_decode_tile(block_size, 64)
        stages = fit(tile_keys, workers)
    if stages is None and workers == 2:
        workers = 1
        stages = fit(tile_keys, workers)
    if stages is None:
        raise ValueError(
            f"the Mosaic GPU decode kernel does not fit shared memory at head size {head_size} and block size "
            f"{block_size} ({smem(tile_keys, 2, workers)} bytes > {tuning.MOSAIC_SHARED_MEMORY_LIMIT}).")
    return MosaicDecodeTiling(row_blocks=row_blocks, tile_keys=tile_keys,
                              pages_per_tile=tile_keys // copy_rows, num_stages=stages,
                              num_splits=num_splits, compute_warpgroups=workers, items_per_program=items,
                              query_rows=query_rows, copy_rows=copy_rows, keys_as_m=config.keys_as_m)


# =========================================================================== cache write


def plan_cache_write(num_tokens: int, num_kv_heads: int, head_size: int,
                     config: CacheWriteConfig | None = None) -> CacheWriteConfig:
    """The cache-write kernel's tiling: ``config``, or `tuning.cache_write_config` for
    rows of ``num_kv_heads * head_size`` elements."""
    if config is not None:
        return config
    return tuning.cache_write_config(num_tokens, num_kv_heads * head_size)


@dataclasses.dataclass(frozen=True)
class RotaryCacheTiling:
    """Static launch plan of the fused rotary + cache-write kernel, from `plan_rotary_cache_write`.

    Attributes:
      tokens_per_program: tokens one program handles (a power of 2), for one KV head.
      padded_group: the KV head's query heads (``G``) padded to a power of 2.
      padded_head_size: ``D`` padded to a power of 2 (masked inside the kernel).
      num_warps: Triton launch parameter.
    """

    tokens_per_program: int
    padded_group: int
    padded_head_size: int
    num_warps: int = 4


def plan_rotary_cache_write(num_tokens: int, group: int, head_size: int) -> RotaryCacheTiling:
    """The fused kernel's tiling: one KV head's ``group`` query heads, key and value per
    program, over about `tuning.ROTARY_CACHE_WRITE_ELEMENTS_PER_PROGRAM` query elements
    (at least one token, at most the batch's tokens rounded up to a power of 2)."""
    padded_group, padded_head = next_power_of_2(group), next_power_of_2(head_size)
    # A power of 2 over powers of 2: a power of 2 (or 0, then one token).
    tokens = max(1, tuning.ROTARY_CACHE_WRITE_ELEMENTS_PER_PROGRAM // (padded_group * padded_head))
    tokens = min(tokens, next_power_of_2(max(num_tokens, 1)))
    return RotaryCacheTiling(tokens_per_program=tokens, padded_group=padded_group, padded_head_size=padded_head)


# =========================================================================== weight-streaming matmul


@dataclasses.dataclass(frozen=True)
class MatmulTiling:
    """Static launch plan of the weight-streaming matmul, from `plan_matmul`.

    Attributes:
      rows: x's rows as the kernel sees them (a power of 2, >= `MIN_DOT_ROWS`).
      block_n, block_k: output columns per program, weight rows per loop step.
      split_k: programs along ``K`` (1: the kernel writes the output dtype).
      num_warps, num_stages, eviction_policy: Triton launch parameters and load hint.
      gated: the gated-MLP form: ``w`` holds gate then up columns, the output is
        ``activation(gate) * up`` (one split; ``block_n`` columns of each half per program).
      activation: the gate's activation in the gated form, one of `GATED_ACTIVATIONS`.
    """

    rows: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    eviction_policy: str | None
    gated: bool = False
    activation: str = "silu"


def matmul_unsupported_reason(num_rows: int, depth: int, num_cols: int,
                              config: tuning.MatmulConfig) -> str | None:
    """Why `plan_matmul` cannot tile ``[num_rows, depth] @ [depth, num_cols]`` with
    ``config``, or None."""
    if num_rows > tuning.MATMUL_MAX_ROWS:
        return f"{num_rows} rows exceed the kernel's {tuning.MATMUL_MAX_ROWS}"
    if num_cols % config.block_n:
        return f"N={num_cols} is not a multiple of block_n={config.block_n}"
    if depth % config.block_k:
        return f"K={depth} is not a multiple of block_k={config.block_k}"
    if config.split_k and depth % (config.split_k * config.block_k):
        return f"K={depth} is not a multiple of split_k * block_k = {config.split_k * config.block_k}"
    return None


def check_matmul_config(config: tuning.MatmulConfig) -> None:
    for name in ("block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or not _is_power_of_2(value):
            raise ValueError(f"MatmulConfig.{name} must be a power of 2 >= 16, got {value}")
    if config.split_k < 0 or (config.split_k and not _is_power_of_2(config.split_k)):
        raise ValueError(f"MatmulConfig.split_k must be 0 (choose) or a power of 2, got {config.split_k}")
    if config.eviction_policy not in ("", "evict_first", "evict_last"):
        raise ValueError("MatmulConfig.eviction_policy must be '', 'evict_first' or 'evict_last', "
                         f"got {config.eviction_policy!r}")


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gate activations of the matmul's gated form, by Hugging Face's ``hidden_act`` names:
SwiGLU's SiLU, and Gemma's GeGLU with the tanh-approximated GELU."""


def plan_matmul(num_rows: int, depth: int, num_cols: int, config: tuning.MatmulConfig | None = None, *,
                itemsize: int = 2, budget: int = tuning.DECODE_SHARED_MEMORY_BUDGET,
                gated: bool = False, activation: str = "silu") -> MatmulTiling:
    """The weight-streaming matmul's tiling for ``[num_rows, depth] @ [depth, num_cols]``
    (`matmul_unsupported_reason` must be None); ``num_stages`` drops (to 2 at least)
    until `matmul_shared_memory` fits ``budget``. ``gated``: the gated-MLP form with the
    gate's ``activation`` (`GATED_ACTIVATIONS`), ``num_cols`` output columns from
    ``2 * num_cols`` weight columns, never split along ``K`` (the activation needs whole
    sums)."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}.")
    config = config or tuning.MatmulConfig()
    check_matmul_config(config)
    reason = matmul_unsupported_reason(num_rows, depth, num_cols, config)
    if reason is not None:
        raise ValueError(f"the weight-streaming matmul cannot tile this product: {reason}")
    split = 1 if gated else config.split_k
    if not split:
        split = 1
        col_blocks = num_cols // config.block_n
        while (col_blocks * split < config.target_programs
               and depth % (2 * split * config.block_k) == 0
               and depth // (2 * split * config.block_k) >= config.min_k_steps):
            split *= 2
    rows = max(MIN_DOT_ROWS, next_power_of_2(num_rows))
    stages = config.num_stages
    weight_tiles = 2 if gated else 1
    while stages > 2 and matmul_shared_memory(rows, config.block_k, config.block_n, stages, itemsize,
                                              weight_tiles) > budget:
        stages -= 1
    return MatmulTiling(
        rows=rows, block_n=config.block_n, block_k=config.block_k, split_k=split,
        num_warps=config.num_warps, num_stages=stages,
        eviction_policy=config.eviction_policy or None, gated=gated, activation=activation,
    )


def matmul_shared_memory(rows: int, block_k: int, block_n: int, num_stages: int, itemsize: int,
                         weight_tiles: int = 1) -> int:
    """Bytes of shared memory the Triton pipeliner gives the matmul's loop: ``num_stages``
    buffers of an x tile and ``weight_tiles`` w tiles (2 in the gated form; as compiled
    on the H200)."""
    return num_stages * (rows * block_k + weight_tiles * block_k * block_n) * itemsize


# =========================================================================== residual add + RMSNorm


@dataclasses.dataclass(frozen=True)
class AddRmsNormTiling:
    """Static launch plan of the fused residual add + RMSNorm, from `plan_add_rms_norm`.

    Attributes:
      rows_per_program: whole rows one program adds and normalizes (a power of 2).
      padded_cols: the row length padded to a power of 2 (masked inside the kernel).
      num_warps: Triton launch parameter.
    """

    rows_per_program: int
    padded_cols: int
    num_warps: int


def plan_add_rms_norm(num_rows: int, num_cols: int, num_partials: int = 1) -> AddRmsNormTiling:
    """Whole rows per program: about `tuning.ADD_RMS_NORM_ELEMENTS_PER_PROGRAM` elements
    (at least one row, at most the rows rounded up to a power of 2); a warp (4 to 16) per
    `tuning.ADD_RMS_NORM_LOADS_PER_WARP` elements it loads from the ``num_partials``
    partial products."""
    padded_cols = next_power_of_2(num_cols)
    rows = max(1, tuning.ADD_RMS_NORM_ELEMENTS_PER_PROGRAM // padded_cols)
    rows = min(rows, next_power_of_2(max(num_rows, 1)))
    # A program's time is its loads' latency: more warps keep more of them in flight.
    loads = num_partials * rows * padded_cols
    warps = min(16, max(4, next_power_of_2(-(-loads // tuning.ADD_RMS_NORM_LOADS_PER_WARP))))
    return AddRmsNormTiling(rows_per_program=rows, padded_cols=padded_cols, num_warps=warps)


# =========================================================================== element offsets

NARROW_OFFSETS_MAX_BYTES = 2**32
"""Pallas' Triton lowering addresses a ref of at most this many bytes with signed 32-bit
element offsets, and a larger one with 64-bit offsets (jax 0.10.2 and 0.11.2)."""


def narrow_offsets_overflow(shape: tuple[int, ...], dtype) -> bool:
    """True when Pallas' Triton lowering, left as it is, would address a ref of this
    shape and dtype with 32-bit element offsets although it holds ``2**31`` elements or
    more.

    The lowering sizes its choice in bytes (64-bit offsets above
    `NARROW_OFFSETS_MAX_BYTES`) while the offsets count elements, so a ref of ``2**31``
    elements or more that still fits in 4 GiB, which needs 1-byte elements (an fp8
    cache of 2 to 4 GiB), gets signed 32-bit offsets that wrap past ``2**31 - 1``. (At
    exactly ``2**31`` elements the last element is still reachable; the rule counts that
    size in, which costs nothing but 64-bit offsets.) The one rule behind both
    `jax_paged_attn.kernels.triton_offsets`, which widens those offsets, and the
    wrappers' support checks when that fix is not installed
    (`jax_paged_attn.checks.narrow_offsets_reason`).
    """
    elements = math.prod(shape)
    return elements >= 2**31 and elements * jnp.dtype(dtype).itemsize <= NARROW_OFFSETS_MAX_BYTES


# =========================================================================== optional kernel inputs


def is_fp8(dtype) -> bool:
    """True for a one-byte (fp8) K/V or cache dtype: the kernels dequantize it."""
    return jnp.dtype(dtype).itemsize == 1


def kv_scales(k_dtype, v_dtype, k_scale: Array | float, v_scale: Array | float) -> Array | None:
    """The kernels' fp8 scale input: f32[2] ``(k_scale, v_scale)`` when K or V is fp8,
    else None (the kernel then takes no scale input). A kernel reads a scale only for
    the fp8 operand, so the other one's value does not matter."""
    if not (is_fp8(k_dtype) or is_fp8(v_dtype)):
        return None
    return jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()),
                      jnp.asarray(v_scale, jnp.float32).reshape(())])


def alibi_slopes_log2(alibi_slopes: Array | None) -> Array | None:
    """The kernels' ALiBi input: f32[Hq] slopes times ``log2(e)`` (scores are in base-2
    units), or None without ALiBi."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.astype(jnp.float32) * LOG2E
