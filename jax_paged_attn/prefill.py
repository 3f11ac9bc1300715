"""Varlen (prefill) attention through a Pallas kernel: the lowering-independent wrapper.

`varlen_attention` has the contract of `jax_paged_attn.reference.varlen_attention`
(packed or paged keys, cu_seqlens, bottom-right causal, window, ALiBi, soft-cap, fp8
cache) and runs the kernel of `jax_paged_attn.kernels.triton_prefill`. This module
holds everything that does not depend on the lowering:

* `unsupported_reason`: the static support check (shapes, dtypes, spec; trace time).
* `plan_tiles`: the work list, computed in jax.numpy from the cu_seqlens under jit.
  The kernel's grid has a *static* number of query tiles, ``ceil(Tq / P) + B + 1``
  (P query positions per tile), enough for any ragged packing of Tq rows into B
  sequences plus the padding rows before ``cu_seqlens_q[0]`` (only unvalidated input
  under jit has them) and after ``cu_seqlens_q[-1]``, which are written as 0. Row
  ``t`` of the plan tells tile ``t`` which rows it owns and which KV blocks it can
  see; surplus tiles own no row and exit at once.
* Head-dim padding: D is padded to the next power of two *inside* the kernel by
  masked loads (Triton's tiles need power-of-two sizes); the caller's arrays are
  never copied or padded.
* Config: `jax_paged_attn.tuning.prefill_config` unless ``config=`` is given.
  ``block_q`` and ``block_k`` are upper bounds: they shrink (to a power of 2 >= 16)
  when the static ``max_seqlen_q`` times the heads per tile, or ``max_seqlen_k``, is
  smaller, so decode-like batches do not run mostly idle rows (a shrunk query tile
  gets at most 4 warps).

Work skipping. For each tile the plan computes, in units of ``block_k`` keys,

    kb_lo <= kb_full_lo <= kb_full_hi <= kb_hi

where ``[kb_lo, kb_hi)`` covers every key some row of the tile can see (keys before
the left window edge and after the causal diagonal are never loaded), and
``[kb_full_lo, kb_full_hi)`` holds the blocks that *every* valid row sees entirely.
The kernel runs those blocks without any mask; only the boundary blocks
``[kb_lo, kb_full_lo)`` (left window edge) and ``[kb_full_hi, kb_hi)`` (diagonal,
right window edge, end of the keys) evaluate the mask.

Each of the three loops is software-pipelined on its own (its own prefetch prologue
and drain); ``PrefillConfig.single_kv_loop`` runs ``[kb_lo, kb_hi)`` as one loop that
masks every block instead (as the stock Pallas ``mha`` does), trading mask arithmetic
for one pipeline fill per tile.

GQA packing (``PrefillConfig.pack_gqa``). With ``G = Hq / Hk`` query heads per KV
head, a tile's ``block_q`` rows are ``P = block_q // G`` query positions times the
``G`` heads of one KV group (row ``r`` = position ``r // G``, head ``r % G``; the
``block_q % G`` last rows idle), and the grid's head axis runs over KV heads. Each K/V block is then loaded once for the whole
group instead of once per query head (on the H200 the reuse otherwise has to come
from L2), and short query segments (decode tokens and small chunks in a mixed
batch, ``q_len * G <= block_q``) fill the MMA tile G times better. For long dense
prefill both layouts do the same work: a tile of ``block_q`` rows against the same
KV range. Without packing (or when ``G > block_q``) rows are ``block_q`` positions
of one query head and the grid's head axis runs over query heads. Grid:
``(tiles, heads)``.

Tile order (``PrefillConfig.longest_first``): sequences with the most visible
(query, key) pairs are scheduled first and, inside a sequence, its last query tiles
(the longest under a causal mask) first, so that the GPU's tail is made of short
tiles. Tiles of one sequence stay adjacent, so concurrently running programs share
their K/V in L2; the tile axis is the fastest-varying grid axis for the same reason
(concurrent programs are tiles of one head, not one tile of every head).
"""
from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp

from jax_paged_attn import checks, tuning
from jax_paged_attn.kv_view import CachePlane, as_plane
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

TRITON = "triton"
LOWERINGS = (TRITON,)


class TileField(enum.IntEnum):
    """Columns of the tile plan (`plan_tiles`), one int32 row per query tile.

    Rows are positions of the tile's sequence; "stored" rows are written by the tile
    (valid rows and the padding after them), "valid" rows also attend.
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


def num_query_tiles(num_q_tokens: int, batch: int, positions_per_tile: int) -> int:
    """Static grid size bounding the tiles of any packing of the query rows.

    B sequences and the padding segments before and after them split ``num_q_tokens``
    rows into at most ``B + 2`` segments; ``sum(ceil(len_i / P)) <= ceil(sum(len_i) / P)
    + B + 1``.
    """
    return -(-num_q_tokens // positions_per_tile) + batch + 1


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
      longest_first: order tiles by decreasing work (see the module docstring);
        otherwise sequences and tiles in order.

    Pure jax.numpy, jit-able: everything static is a Python value. Invalid lengths
    (cu_seqlens past the arrays, negative lengths) are clamped so that the kernel
    never touches memory outside its arrays.
    """
    P = positions_per_tile
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
    seg_tiles = _cdiv(seg_rows, P)

    if longest_first:
        # Visible (query, key) pairs ~ q_len * span of the middle query (exact for
        # the linear spans of causal / window masks away from the clipping).
        mid_lo, mid_hi = visible_key_interval((seg_q_len - 1) // 2, seg_q_len, seg_k_len, spec)
        work = seg_q_len.astype(jnp.float32) * jnp.maximum(mid_hi - mid_lo, 0).astype(jnp.float32)
        work = work.at[batch:].set(-1.0)  # the padding segments go last
        order = jnp.argsort(-work, stable=True).astype(jnp.int32)
    else:
        order = jnp.arange(batch + 2, dtype=jnp.int32)
    ordered_tiles = seg_tiles[order]
    ends = jnp.cumsum(ordered_tiles)
    num_tiles = num_query_tiles(num_q_tokens, batch, P)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    slot = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    real = slot <= batch + 1
    slot = jnp.minimum(slot, batch + 1)
    seg = order[slot]
    local = t - (ends[slot] - ordered_tiles[slot])
    if longest_first:
        local = ordered_tiles[slot] - 1 - local  # a sequence's last tiles first
    pos0 = local * P

    q_row0 = seg_row0[seg] + pos0
    q_rows = jnp.clip(seg_rows[seg] - pos0, 0, P)
    q_rows = jnp.where(real, jnp.clip(jnp.minimum(q_rows, num_q_tokens - q_row0), 0, P), 0)
    q_row0 = jnp.where(real, jnp.clip(q_row0, 0, num_q_tokens), 0)
    t_q_len = jnp.where(real, seg_q_len[seg], 0)
    t_k_len = jnp.where(real, seg_k_len[seg], 0)

    # KV block range: rows pos0..last are the tile's valid (attending) queries.
    valid = jnp.clip(jnp.minimum(t_q_len, pos0 + P) - pos0, 0, P)
    last = pos0 + jnp.maximum(valid, 1) - 1
    lo_first, hi_first = visible_key_interval(pos0, t_q_len, t_k_len, spec)
    lo_last, hi_last = visible_key_interval(last, t_q_len, t_k_len, spec)
    empty = (valid == 0) | (hi_last <= lo_first)
    kb_lo = jnp.where(empty, 0, lo_first // block_k)
    kb_hi = jnp.where(empty, 0, _cdiv(hi_last, block_k))
    kb_full_lo = jnp.clip(_cdiv(lo_last, block_k), kb_lo, kb_hi)
    kb_full_hi = jnp.clip(hi_first // block_k, kb_full_lo, kb_hi)

    columns = {
        TileField.SEQ: jnp.where(real, seg_seq[seg], 0),
        TileField.Q_ROW0: q_row0,
        TileField.Q_ROWS: q_rows,
        TileField.Q_POS0: jnp.where(real, pos0, 0),
        TileField.Q_LEN: t_q_len,
        TileField.K_LEN: t_k_len,
        TileField.K_ROW0: jnp.where(real, seg_k_row0[seg], 0),
        TileField.KB_LO: kb_lo,
        TileField.KB_FULL_LO: kb_full_lo,
        TileField.KB_FULL_HI: kb_full_hi,
        TileField.KB_HI: kb_hi,
    }
    plan = jnp.zeros((num_tiles, TILE_INFO_WIDTH), jnp.int32)
    for field, column in columns.items():
        plan = plan.at[:, int(field)].set(column.astype(jnp.int32))
    return plan


def heads_per_program(num_q_heads: int, num_kv_heads: int, config: tuning.PrefillConfig) -> int:
    """Query heads sharing one tile's rows: the KV group when packing GQA, else 1."""
    group = num_q_heads // num_kv_heads
    if config.pack_gqa and 1 < group <= config.block_q:
        return group
    return 1


def _is_power_of_2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_config(config: tuning.PrefillConfig) -> None:
    """Raises ValueError for a config the kernel cannot compile."""
    if not isinstance(config, tuning.PrefillConfig):
        raise TypeError(f"config must be a PrefillConfig, got {type(config).__name__}.")
    for name in ("block_q", "block_k"):
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


def unsupported_reason(
    q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
    block_table: Array | None, seqused_k: Array | None, alibi_slopes: Array | None,
    k_scale: Array, v_scale: Array, *, lowering: str, spec: AttentionSpec,
    max_seqlen_q: int, max_seqlen_k: int,
) -> str | None:
    """Why the kernel cannot run this call, or None. Shapes, dtypes and spec only.

    Safe at trace time (looks at no array value).
    """
    del cu_seqlens_k, seqused_k, k_scale, v_scale, max_seqlen_q, max_seqlen_k, spec
    if lowering not in LOWERINGS:
        return f"lowering {lowering!r} has no varlen kernel (available: {LOWERINGS})"
    if getattr(q, "ndim", None) != 3:
        return f"q must be [Tq, Hq, D], got shape {getattr(q, 'shape', None)}"
    if jnp.dtype(q.dtype) not in checks.QUERY_DTYPES:
        return f"query dtype {q.dtype} is not float16, bfloat16 or float32"
    head_size = q.shape[2]
    if head_size not in checks.supported_head_sizes():
        return f"head size {head_size} is not one of {checks.supported_head_sizes()}"
    paged = block_table is not None
    kv_rank = 4 if paged else 3
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "ndim", None) != kv_rank:
            return f"{name} must have rank {kv_rank}, got shape {getattr(x, 'shape', None)}"
        if x.shape[-1] != head_size:
            return f"{name} has head size {x.shape[-1]}, q has {head_size}"
        dt = jnp.dtype(x.dtype)
        if dt != jnp.dtype(q.dtype) and dt not in checks.FP8_DTYPES:
            return f"{name} dtype {x.dtype} is neither the query dtype nor fp8"
    if k.shape != v.shape:
        return f"k and v shapes differ: {k.shape} vs {v.shape}"
    num_kv_heads = k.shape[-2]
    if num_kv_heads <= 0 or q.shape[1] % num_kv_heads:
        return f"query heads ({q.shape[1]}) are not a multiple of KV heads ({num_kv_heads})"
    if paged:
        if k.shape[1] % checks.BLOCK_SIZE_MULTIPLE:
            return f"cache block size {k.shape[1]} is not a multiple of {checks.BLOCK_SIZE_MULTIPLE}"
        if block_table.ndim != 2 or block_table.shape[0] != cu_seqlens_q.shape[0] - 1:
            return f"block_table must be [B, max_blocks], got {block_table.shape}"
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (q.shape[1],):
        return f"alibi_slopes must be [Hq], got {alibi_slopes.shape}"
    return None


def _plane_rows(plane: CachePlane) -> tuple[Array, int]:
    """(the stacked cache viewed as rows ``[planes * num_blocks * bs, Hk, D]``, plane)."""
    planes, num_blocks, block_size, num_kv_heads, head_size = plane.array.shape
    return plane.array.reshape(planes * num_blocks * block_size, num_kv_heads, head_size), plane.plane


def varlen_attention(
    q: Array,  # [Tq, Hq, D]
    k: Array | CachePlane,  # [Tk, Hk, D] packed, or [num_blocks, block_size, Hk, D] with block_table
    v: Array | CachePlane,  # same layout as k
    cu_seqlens_q: Array,  # i32[B + 1]
    cu_seqlens_k: Array,  # i32[B + 1]
    block_table: Array | None,  # i32[B, max_blocks_per_seq] or None
    seqused_k: Array | None,  # i32[B] or None
    alibi_slopes: Array | None,  # f32[Hq] or None
    k_scale: Array | float,  # f32 scalar, used when k is fp8
    v_scale: Array | float,  # f32 scalar, used when v is fp8
    *,
    spec: AttentionSpec,
    max_seqlen_q: int,
    max_seqlen_k: int,
    lowering: str = TRITON,
    interpret: bool = False,
    config: tuning.PrefillConfig | None = None,
) -> Array:  # [Tq, Hq, D], q.dtype
    """`reference.varlen_attention` through the Pallas varlen kernel.

    Same arguments and result as the reference (see its docstring and
    `jax_paged_attn.api.flash_attn_varlen_func`); ``config`` overrides the tuning
    table, ``interpret`` runs the kernel in Pallas interpret mode (CPU tests).
    Raises NotImplementedError when `unsupported_reason` gives a reason.
    """
    reason = unsupported_reason(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes,
        k_scale, v_scale, lowering=lowering, spec=spec, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)
    if reason:
        raise NotImplementedError(f"the {lowering} varlen kernel cannot run this call: {reason}")
    num_q_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k.shape[-2]
    if config is None:
        config = tuning.prefill_config(head_size, jnp.dtype(q.dtype).name, paged=block_table is not None)
    check_config(config)
    paged = block_table is not None
    if q.size == 0:  # no token or no head: nothing to compute (a zero-size grid)
        return jnp.zeros(q.shape, q.dtype)
    if k.shape[0] == 0 or (paged and block_table.shape[1] == 0):
        return jnp.zeros(q.shape, q.dtype)  # no key anywhere: every row sees nothing

    group = heads_per_program(num_q_heads, num_kv_heads, config)
    # A tile taller than any sequence's rows only adds idle rows (decode tokens, small
    # chunks): shrink block_q to the rows the longest sequence fills.
    block_q = min(config.block_q, max(16, tuning.next_power_of_2(max_seqlen_q * group)))
    num_warps = config.num_warps if block_q == config.block_q else min(config.num_warps, 4)
    block_k = min(config.block_k, max(16, tuning.next_power_of_2(max_seqlen_k)))
    positions_per_tile = block_q // group
    if paged:
        num_blocks, block_size = k.shape[0], k.shape[1]
        # Free reshape (leading dims merge) of the whole stacked cache: key j of sequence
        # b is row block_table[b, j // bs] * bs + j % bs of its plane's rows, and the
        # kernel's BlockSpec picks the plane (no slice, so no copy of the cache).
        k_rows = _plane_rows(as_plane(k))
        v_rows = _plane_rows(as_plane(v))
        table = block_table.astype(jnp.int32)
        key_capacity, num_packed_keys = table.shape[1] * block_size, None
        num_stages = config.num_stages if config.num_stages_paged is None else config.num_stages_paged
    else:
        block_size, table = None, None
        k_rows, v_rows = (k, 0), (v, 0)
        key_capacity, num_packed_keys = None, k.shape[0]
        num_stages = config.num_stages
    plan = plan_tiles(
        cu_seqlens_q, cu_seqlens_k, seqused_k, num_q_tokens=num_q_tokens,
        num_packed_keys=num_packed_keys, key_capacity=key_capacity, spec=spec,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        positions_per_tile=positions_per_tile, block_k=block_k,
        longest_first=config.longest_first)

    log2e = math.log2(math.e)
    slopes = None if alibi_slopes is None else alibi_slopes.astype(jnp.float32) * log2e
    k_fp8 = jnp.dtype(k.dtype) in checks.FP8_DTYPES
    v_fp8 = jnp.dtype(v.dtype) in checks.FP8_DTYPES
    kv_scales = None
    if k_fp8 or v_fp8:
        kv_scales = jnp.stack([
            jnp.asarray(k_scale, jnp.float32).reshape(()) if k_fp8 else jnp.float32(1.0),
            jnp.asarray(v_scale, jnp.float32).reshape(()) if v_fp8 else jnp.float32(1.0),
        ])

    if lowering == TRITON:
        from jax_paged_attn.kernels import triton_prefill

        return triton_prefill.varlen_attention_call(
            q, k_rows, v_rows, plan, table, slopes, kv_scales, spec=spec,
            block_q=block_q, block_k=block_k, heads_per_program=group,
            num_kv_rows=num_blocks * block_size if paged else k.shape[0],
            page_size=block_size, num_warps=num_warps, num_stages=num_stages,
            single_kv_loop=config.single_kv_loop, prefetch_page_ids=config.prefetch_page_ids,
            interpret=interpret)
    raise AssertionError(lowering)  # unsupported_reason rejected it
