"""Varlen (prefill) attention through a Pallas kernel: the lowering-independent wrapper.

`varlen_attention` has the contract of `jax_paged_attn.reference.varlen_attention`
(packed or paged keys, cu_seqlens, bottom-right causal, window, ALiBi, soft-cap, fp8
cache) and runs the kernel of `jax_paged_attn.kernels.triton_prefill` (``lowering=
"triton"``) or of `jax_paged_attn.kernels.mosaic_prefill` (``lowering="mosaic_gpu"``,
Hopper; measured faster at head sizes 128 and 256 on the H200 and the H100: the same plan and semantics, its own tiling
`plans.MosaicPrefillTiling`, and TMA's whole-tile reads and writes, see
`plan_mosaic_varlen` and `run_mosaic_varlen`). The rest of this docstring describes the Triton kernel's
tiling; the Mosaic kernel's is in its module. This module
and `jax_paged_attn.plans` (the launch plan, below this wrapper and the kernels, shared
by every lowering) hold everything that does not depend on the lowering:

* `unsupported_reason`: the static support check (shapes, dtypes, spec; trace time).
* `plans.plan_prefill_tiling`: the kernel's tiling (`plans.PrefillTiling`) from the
  config and the shapes.
* `plans.plan_tiles`: the work list, computed in jax.numpy from the cu_seqlens under jit.
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

import jax
import jax.numpy as jnp

from jax_paged_attn import checks, plans, tuning
from jax_paged_attn.kv_view import CachePlane, as_plane
from jax_paged_attn.plans import (  # noqa: F401  (re-exported: the plan's names lived here)
    TILE_INFO_WIDTH,
    TileField,
    heads_per_program,
    num_query_tiles,
    plan_tiles,
    visible_key_interval,
)
from jax_paged_attn.plans import check_prefill_config as check_config
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"
LOWERINGS = (TRITON, MOSAIC_GPU)
"""Lowerings with a varlen kernel: Pallas Triton (any CUDA GPU) and Pallas Mosaic GPU
(Hopper, `jax_paged_attn.kernels.mosaic_prefill`; auto runs it where
`tuning.MOSAIC_PREFILL_HEAD_SIZES` says it was measured faster)."""


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
    if lowering == MOSAIC_GPU:
        # wgmma multiplies 16-bit operands here (fp8 K/V are converted after the TMA).
        if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
            return f"the mosaic_gpu kernel takes float16 or bfloat16 queries, got {q.dtype}"
        return None
    # The Triton kernel addresses k and v (a plane: its whole stacked cache) as one ref each.
    return checks.narrow_offsets_reason({"k": k, "v": v})


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
    config: tuning.PrefillConfig | tuning.MosaicPrefillConfig | None = None,
) -> Array:  # [Tq, Hq, D], q.dtype
    """`reference.varlen_attention` through the Pallas varlen kernel of ``lowering``.

    Same arguments and result as the reference (see its docstring and
    `jax_paged_attn.api.flash_attn_varlen_func`); ``config`` overrides the tuning
    table (a `tuning.PrefillConfig` for ``"triton"``, a `tuning.MosaicPrefillConfig`
    for ``"mosaic_gpu"``), ``interpret`` runs the kernel in Pallas interpret mode
    (CPU tests; for Mosaic GPU its interpreter).
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
    paged = block_table is not None
    device = tuning.target_device()
    package_config = config is None  # the package's choice: its fields apply where they can, unsaid
    if lowering == MOSAIC_GPU:
        if config is None:
            config = tuning.mosaic_prefill_config(head_size, jnp.dtype(q.dtype).name, paged=paged,
                                                  interpret=interpret)
        plans.check_mosaic_prefill_config(config)
    else:
        if config is None:
            config = tuning.prefill_config(head_size, jnp.dtype(q.dtype).name, paged=paged, device=device)
        check_config(config)
    if q.size == 0:  # no token or no head: nothing to compute (a zero-size grid)
        return jnp.zeros(q.shape, q.dtype)
    if k.shape[0] == 0 or (paged and block_table.shape[1] == 0):
        return jnp.zeros(q.shape, q.dtype)  # no key anywhere: every row sees nothing

    if lowering == MOSAIC_GPU:
        return _mosaic_varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes, k_scale, v_scale,
            spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, config=config,
            interpret=interpret, warn_dropped=not package_config)

    tiling = plans.plan_prefill_tiling(num_q_heads, num_kv_heads, head_size, max_seqlen_q=max_seqlen_q,
                                       max_seqlen_k=max_seqlen_k, paged=paged, config=config,
                                       q_itemsize=jnp.dtype(q.dtype).itemsize,
                                       kv_itemsize=jnp.dtype(k.dtype).itemsize,
                                       shared_memory_budget=device.shared_memory_budget)
    if paged:
        num_blocks, block_size = k.shape[0], k.shape[1]
        # Free reshape (leading dims merge) of the whole stacked cache: key j of sequence
        # b is row block_table[b, j // bs] * bs + j % bs of its plane's rows, and the
        # kernel's BlockSpec picks the plane (no slice, so no copy of the cache).
        k_rows = _plane_rows(as_plane(k))
        v_rows = _plane_rows(as_plane(v))
        table = block_table.astype(jnp.int32)
        key_capacity, num_packed_keys = table.shape[1] * block_size, None
    else:
        block_size, table = None, None
        k_rows, v_rows = (k, 0), (v, 0)
        key_capacity, num_packed_keys = None, k.shape[0]
    plan = plans.plan_tiles(
        cu_seqlens_q, cu_seqlens_k, seqused_k, num_q_tokens=num_q_tokens,
        num_packed_keys=num_packed_keys, key_capacity=key_capacity, spec=spec,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        positions_per_tile=tiling.positions_per_tile, block_k=tiling.block_k,
        longest_first=tiling.longest_first)
    slopes = plans.alibi_slopes_log2(alibi_slopes)
    scales = plans.kv_scales(k.dtype, v.dtype, k_scale, v_scale)

    if lowering == TRITON:
        from jax_paged_attn.kernels import triton_prefill

        return triton_prefill.varlen_attention_call(
            q, k_rows, v_rows, plan, table, slopes, scales, spec=spec, tiling=tiling,
            num_kv_rows=num_blocks * block_size if paged else k.shape[0],
            page_size=block_size, interpret=interpret)
    raise AssertionError(lowering)  # unsupported_reason rejected it


def _mosaic_varlen_attention(
    q: Array, k: Array | CachePlane, v: Array | CachePlane, cu_seqlens_q: Array, cu_seqlens_k: Array,
    block_table: Array | None, seqused_k: Array | None, alibi_slopes: Array | None,
    k_scale: Array | float, v_scale: Array | float, *, spec: AttentionSpec, max_seqlen_q: int,
    max_seqlen_k: int, config: tuning.MosaicPrefillConfig, interpret: bool, warn_dropped: bool,
) -> Array:  # [Tq, Hq, D], q.dtype
    """`varlen_attention` through `jax_paged_attn.kernels.mosaic_prefill` (checked, non-empty
    call): `plan_mosaic_varlen`, then `run_mosaic_varlen`."""
    tiling, plan = plan_mosaic_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, spec=spec,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, config=config,
                                      warn_dropped=warn_dropped)
    return run_mosaic_varlen(q, k, v, plan, block_table, alibi_slopes, k_scale, v_scale, spec=spec,
                             tiling=tiling, interpret=interpret)


def plan_mosaic_varlen(
    q: Array, k: Array | CachePlane, v: Array | CachePlane, cu_seqlens_q: Array, cu_seqlens_k: Array,
    block_table: Array | None, seqused_k: Array | None, *, spec: AttentionSpec, max_seqlen_q: int,
    max_seqlen_k: int, config: tuning.MosaicPrefillConfig, warn_dropped: bool = True,
) -> tuple[plans.MosaicPrefillTiling, Array]:
    """The Mosaic GPU kernel's tiling (static, from the shapes and ``config``) and its work
    list (i32[num_tiles, TILE_INFO_WIDTH], `plans.plan_tiles` aligned to
    `plans.MOSAIC_TMA_ROW_ALIGN`) for `run_mosaic_varlen`; arguments as `varlen_attention`.
    Only the shapes and dtypes of q, k and v are read. ``warn_dropped``: as
    `plans.plan_mosaic_prefill_tiling` (False for the package's own config)."""
    itemsize = lambda x: jnp.dtype(x.dtype).itemsize
    paged = block_table is not None
    tiling = plans.plan_mosaic_prefill_tiling(
        q.shape[-1], itemsize(q), itemsize(k), itemsize(v), max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, block_size=k.shape[1] if paged else None, config=config,
        num_q_heads=q.shape[1], warn_dropped=warn_dropped)
    plan = plans.plan_tiles(
        cu_seqlens_q, cu_seqlens_k, seqused_k, num_q_tokens=q.shape[0],
        num_packed_keys=None if paged else k.shape[0],
        key_capacity=block_table.shape[1] * k.shape[1] if paged else None, spec=spec,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        positions_per_tile=tiling.block_q, block_k=tiling.block_k, longest_first=tiling.longest_first,
        align_rows=plans.MOSAIC_TMA_ROW_ALIGN)
    return tiling, plan


def run_mosaic_varlen(
    q: Array, k: Array | CachePlane, v: Array | CachePlane, plan: Array, block_table: Array | None,
    alibi_slopes: Array | None, k_scale: Array | float, v_scale: Array | float, *, spec: AttentionSpec,
    tiling: plans.MosaicPrefillTiling, interpret: bool = False, profile_dir: str | None = None,
) -> Array:  # [Tq, Hq, D], q.dtype
    """The Mosaic GPU kernel over a plan from `plan_mosaic_varlen` (``profile_dir``: its
    timeline, `mosaic_prefill.varlen_attention_call`).

    The kernel reads q and k / v by TMA in whole 8-row tiles: the plan aligns each
    tile's first query row and each sequence's first packed key row to 8
    (`plans.MOSAIC_TMA_ROW_ALIGN`), rows past an array's end read as zeros, and only a
    row count that is not a multiple of 8 is padded (a copy). The Mosaic GPU
    interpreter of jax 0.10 cannot read past an array's end, so in interpret mode q
    and packed k / v are padded by a tile as well. The kernel writes the packed output
    itself (``direct_output``, where the head size allows), or one output slab per
    tile, from which each packed row is gathered here.
    """
    from jax_paged_attn.kernels import mosaic_prefill

    num_q_tokens = q.shape[0]
    if block_table is not None:
        k_plane, v_plane = as_plane(k), as_plane(v)
        k_in, v_in = (k_plane.array, k_plane.plane), (v_plane.array, v_plane.plane)
        table = block_table.astype(jnp.int32)
    else:
        # Packed keys as one plane of one page holding every row.
        rows = _tma_rows(k.shape[0], tiling.block_k, interpret)
        pad = lambda x: _pad_rows(x, rows)[None, None]
        k_in, v_in = (pad(k), 0), (pad(v), 0)
        table = None
    q_in = _pad_rows(q, _tma_rows(num_q_tokens, tiling.block_q, interpret))
    # (The padding's zero rows and the rows past the end that TMA reads as zeros are finite.)
    values_finite = jnp.isfinite(v).all().astype(jnp.int32).reshape(1) if tiling.precheck_values else None
    out = mosaic_prefill.varlen_attention_call(
        q_in, k_in, v_in, plan, table, plans.alibi_slopes_log2(alibi_slopes),
        plans.kv_scales(k.dtype, v.dtype, k_scale, v_scale), values_finite, spec=spec, tiling=tiling,
        interpret=interpret, profile_dir=profile_dir)
    if tiling.direct_output:
        return out[:num_q_tokens]
    return _gather_tile_rows(out, plan, num_q_tokens)


def _tma_rows(num_rows: int, tile_rows: int, interpret: bool) -> int:
    """Rows an array read by the Mosaic GPU kernel's TMA copies must have: a multiple of
    8 (copies read whole 8-row tiles), plus a tile in interpret mode (jax 0.10's
    interpreter cannot read past the end, where the GPU reads zeros)."""
    return plans.round_up(num_rows + (tile_rows if interpret else 0), plans.MOSAIC_TMA_ROW_ALIGN)


def _pad_rows(x: Array, rows: int) -> Array:
    """``x`` with zero rows appended up to ``rows`` (no copy when it has them)."""
    if x.shape[0] == rows:
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _gather_tile_rows(tiles: Array, plan: Array, num_q_tokens: int) -> Array:
    """``[Tq, Hq, D]`` from per-tile slabs ``[num_tiles, block_q, Hq, D]``: packed row
    ``q_row0[t] + i`` (``i < q_rows[t]``, ``q_pos0[t] + i >= 0``: an aligned tile's lead
    rows are the previous segment's) is row ``i`` of tile ``t``'s slab."""
    num_tiles, block_q = tiles.shape[:2]
    offset = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    rows = plan[:, int(TileField.Q_ROW0)][:, None] + offset
    owned = (offset < plan[:, int(TileField.Q_ROWS)][:, None]) & (plan[:, int(TileField.Q_POS0)][:, None] + offset >= 0)
    source = jnp.arange(num_tiles, dtype=jnp.int32)[:, None] * block_q + offset
    index = jnp.zeros((num_q_tokens,), jnp.int32).at[jnp.where(owned, rows, num_q_tokens)].set(
        source, mode="drop")
    return tiles.reshape(num_tiles * block_q, *tiles.shape[2:])[index]
