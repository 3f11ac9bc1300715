"""Varlen (prefill) flash attention kernel for the Pallas Mosaic GPU lowering (Hopper).

Measured on the H200 (benchmarks/NOTES.md, 2026-12-02 21:39 UTC: 387-586 TFLOP/s at D 128
and 461 at D 256, where auto runs it). K/V blocks arrive by TMA in a
``num_stages``-deep shared-memory ring, one barrier per slot, and ``wgmma`` computes
Q·K^T (Q and K from shared memory) and P·V (P from registers). Two forms
(`jax_paged_attn.tuning.MosaicPrefillConfig.warp_specialized`):

* warp-specialized (the default): a producer warpgroup issues the TMA copies, waiting
  for each slot to be released by every compute warpgroup (a second barrier per slot),
  while 1, 2 or 3 (D 64) compute warpgroups, 64 query rows each, run the softmax and the
  matmuls (registers moved from the producer to them with ``setmaxnreg``, as the stock
  ``attention_mgpu`` kernel does);
* single warpgroup: one warpgroup computes and refills each slot after its block (the
  CPU tests' default: the interpreter runs it several times faster).

With two compute warpgroups a shared barrier staggers them (ping-pong,
`tuning.MosaicPrefillConfig.pingpong`): one's softmax overlaps the other's wgmma; the
stagger is set up around each work item, or with ``pingpong_across_items`` (off by
default: level or slower on the H200, 2026-12-05) once around a program's items, so one warpgroup starts the
next item while the other finishes the current one.

Optional forms (`tuning.MosaicPrefillConfig`): ``persistent_programs`` (one program per
SM walks the (tile, head) work items, each role in its own item loop, the items streaming
through the ring back to back: the producer fetches the next item's first blocks while
the compute warpgroups finish the current one, and with ``prefetch_queries`` each compute
warpgroup loads the next item's queries at the start of the current one; off by default:
an earlier form measured 1.5-2.5x slower than the grid form on the H200 (2026-12-02, -04),
its wgmmas serialized by ptxas for want of registers, see `_prefill_kernel`; this form,
with prefetched queries and the stagger across items, x0.62 - 1.01 the grid form's
speed, 2026-12-05), ``fence_softmax`` (the
stock kernel's softmax order before the P·V barriers; measured level),
``direct_output`` (below; on by default) and ``masked_block_k``: a masked block runs in
parts of that many keys, so that 128-key blocks (the stock kernel's best at D 128, and
ours: the D 128 default) do not carry the masked blocks' non-finite handling at full
width, and the value work tile holds one part (a whole block's left no room for the
second compute warpgroup), and ``value_work_tile``: a masked block may rewrite its
values in the warpgroup's query tile instead, the queries reloaded after (what lets two
compute warpgroups fit at D 256).

``overlap_softmax`` (off by default): in the unmasked blocks a warpgroup issues Q·K^T of
block j, rescales its accumulator, issues P·V of block j - 1 (its 16-bit probabilities a
register operand, converted at the end of the previous block), and runs block j's softmax
while that P·V runs (FlashAttention-3's intra-warpgroup overlap, in its order). Earlier
forms measured slower on the H200 (2026-12-04, alternating rounds): the probabilities
converted between the two wgmmas made ptxas serialize them (its C7513 note), x0.72 at
B8 S2048 D128; through a shared-memory tile, x0.76 (its stores, barriers and fences on
each block's path, and spills). This form compiles without that note and with the
default's hot loop (1 - 2 spill reloads a block), yet measured slower too: x0.89 - 0.98
the default's speed on the four dense shapes (the H200, 2026-12-05).

``exp2_fma_columns`` (off by default: 6–8 % slower on an H100, 2026-12-07): in the unmasked blocks the
probabilities of the first that many keys come from `common.exp2_fma` (adds, a cubic and
the exponent's bits: the FMA and ALU pipes) and the rest's from exp2 (the XU), and P·V
runs one wgmma per part: FlashAttention-4's split of the exponentials, aimed at D 64,
where a block's exp2 alone keeps the XU as long as its two wgmmas keep the tensor cores.

Not done yet (the path to the FLOP/s targets of benchmarks/RESULTS.md): why that overlap
and the persistent form lose (their timelines), GQA packing of a KV group's heads into
one tile (K/V are read once per query head, the reuse left to L2), short work items
(short prompts over a paged cache run a program per head of a few blocks, mostly fixed
cost and the causal diagonal, one program an SM: 0.66x the Triton kernel at D 64 on the
H200, 2026-12-05), and cheaper lead blocks
(a packed sequence starting off a multiple of 8 rows gives each of its tiles a masked
first block: 11.6 % of the varlen suite's programs). A
work item's fixed cost (its launch, ring fill, query load and epilogue) measured 6.7-7.8
us on the H200 against 1.75 us per 128 x 128 block: 30 % of the kernel at B8 S2048 D128.
Two single-warpgroup programs an SM, which overlap one's fixed cost with the other's
blocks, measured 20 % slower. With equal blocks the stock kernel is 1.24-1.34x faster at
B8 S2048, level at B1 S16384. A guarded masked tail costs about 3 unmasked blocks, a
prechecked one about 1.7 (``precheck_values``). Skipping or unmasking a masked block's
parts per warpgroup behind ``lax.cond`` made the whole kernel 1.2-1.5x slower, its
unmasked loop included: reverted.

Work list and semantics are the Triton tier's (`jax_paged_attn.kernels.triton_prefill`):
the plan (`jax_paged_attn.plans.plan_tiles`) gives each query tile its rows and the KV
blocks it visits, ``[kb_lo, kb_full_lo)`` and ``[kb_full_hi, kb_hi)`` masked and
``[kb_full_lo, kb_full_hi)`` unmasked; `jax_paged_attn.plans.plan_mosaic_prefill_tiling`
the tile sizes. Grid: ``(num_tiles, Hq / heads_per_program)``, which Mosaic GPU launches
with the last axis as CUDA's x, so programs are issued head axis fastest: the programs
running at once are a few tiles of every head, a KV head's blocks read by its G query
heads' programs together, from L2 (issued tile axis fastest instead: 7 % slower at B8
S2048 D128, 11 % at D 256, 3 % at D 64, 1 % faster at B1 S16384; the H200, 2026-12-04);
or persistent programs walking the items tile fastest (below); a work item is one query
head's ``block_q`` rows (64 per compute warpgroup; no GQA packing: the KV head ``h // G``
is read by each of its G query heads, from L2). With ``heads_per_program`` > 1 (`tuning.MosaicPrefillConfig`; auto: 4 on
short packed sequences) a program runs its tile for that many consecutive heads, one
after the other: the ring carries the tile's KV blocks once per head as one stream (the
producer runs on into the next head's blocks), and each compute warpgroup reloads its
queries after storing the previous head's output (3-6 % faster at 1-4k keys on the
H200; its per-block loop measured about 7 % slower, so long sequences keep 1), or
with ``prefetch_queries`` loads the next head's queries into a second query tile while
the current head computes (the two tiles used in turn; 5 % faster at D 64 and 128 on the
H200, 2026-12-05, where the package's config turns it on; an earlier form measured 4-16 %
slower).
Every compute warpgroup goes through all of the tile's blocks in order (each slot is
released by all of them) and computes those its own rows can see, with the tile's
masked / unmasked split, except that blocks of the tile's masked tail that its
own rows see whole run unmasked (with causal masking, the second warpgroup sees the
first one's diagonal block whole).

Memory layout (all TMA; a copy into a swizzled buffer reads whole 8-row tiles of the
global array, so every copy starts on a multiple of 8 rows, `plans.MOSAIC_TMA_ROW_ALIGN`;
rows past an array's end read as zeros):

* q: ``[Tq, Hq, D]`` (rows a multiple of 8); a compute warpgroup reads its 64 rows of
  head h from ``q_row0 + 64 * wg``. The plan is aligned (`plans.plan_tiles` with
  ``align_rows=8``): a sequence's first tile starts up to 7 rows early, at negative
  positions (the previous sequence's rows: computed, never stored).
* k / v: ``[planes, pages, page_rows, Hk, D]``. A paged cache is its stacked planes;
  packed keys are one plane of one "page" holding every row (a multiple of 8), each
  sequence's KV blocks counted from its key row aligned down to 8: block ``kb`` holds
  keys ``kb * block_k - k_lead ..`` (`TileField.K_LEAD`), the lead keys masked. A KV
  block is ``block_k // copy_rows`` TMA copies of ``copy_rows`` rows
  (``gcd(block_k, block_size)`` over a paged cache: a copy never crosses a page), all
  arriving on the slot's barrier.
* output: with ``direct_output`` (`tuning.MosaicPrefillConfig`, the default), the packed
  ``[Tq, Hq, D]`` written by the kernel: a compute warpgroup whose 64 rows all belong to
  its tile stores them with one TMA copy; one whose rows include an aligned tile's lead
  rows or run past its sequence stores only its own rows, a one-row TMA copy each from
  a plain-layout buffer (a TMA copy from a swizzled tile writes whole 8-row tiles, and
  a tile's lead rows and rows past its sequence are other tiles'). Without it, one slab
  per tile ``[num_tiles, block_q, Hq, D]``, from which the wrapper gathers each packed
  row (measured 0-16 % slower on the H200). (Whole warpgroups stored straight and partial ones copied in
  by an XLA scatter measured slower on the H200: the scatter alone 0.9 ms at B8 S2048,
  where the gather costs about 0.15.)

Numerics as the Triton kernel: f32 scores and accumulator, base-2 online softmax with
``log2(e)`` folded into the score scale and the ALiBi slopes, running max starting at
the most negative finite f32 (a row that sees no key outputs 0). fp8 K/V are converted
to the query dtype in shared memory after the TMA (exact), their scales applied to the
scores and the output. Masked blocks also load keys the tile's rows cannot see (keys
past the sequence's end, NaN-filled stale pages): their scores become ``-inf`` by
``where``; their values are split into finite values (non-finite -> 0) for P·V and a
0/1 "non-finite" tile, and a second ``wgmma`` of the 0/1 visibility against it finds the
(row, column) pairs that see a non-finite value, which become NaN (`MosaicPrefillConfig`
``nonfinite_check="product"``); or (``"key_flags"``, the default at D 192 and 256) a key
holding a non-finite value is flagged and its value row zeroed in
one pass, the flags reach the score tile's columns through shared memory, and the rows
that see a flagged key become NaN; or (``"probe"``, the default at D 64 and 128) P·V
runs from the ring as in an unmasked block, into a fresh accumulator whose row 0 is checked: a
non-finite value anywhere among the block's values makes every row of that product
non-finite (0 * NaN), and only then is the block redone the "key_flags" way. So a NaN
or inf in K or V reaches exactly the rows that see its key, as in the reference; the
epilogue makes a row non-finite in any channel (an unmasked block's or the "product"
check's (row, column) NaN) NaN in every channel (`common.nan_rows_scale`, the
reference's NaN rule). With
``precheck_values`` (`tuning.MosaicPrefillConfig`, packed keys) the wrapper first reduces
the packed values to one flag; while every value is finite there is nothing to keep from
any row, and a masked block runs whole, only its scores masked. (Masked blocks load
the V tile into registers in the wgmma layout, whose tiles have 64 rows: block_k is a
multiple of 64.)

Interpret mode (``interpret=True``, CPU tests) runs this kernel in the Mosaic GPU
interpreter: TMA copies, barriers, the ring, the loops and all the softmax / mask
arithmetic are interpreted as written. Two things differ, because the interpreter of
jax 0.10 (the CI's) cannot run them: the two matmuls are ``lax.dot_general`` on the
shared-memory tiles instead of ``wgmma`` (its ``wgmma`` takes neither a transposed
shared-memory operand nor a register operand), and register-layout annotations
(``layout_cast``, ``broadcasted_iota``'s layout) are dropped (no CPU rule). The
interpreter runs each warpgroup as a thread (it checks the barrier protocol: every
completed phase must be waited for, hence the producer's drain). The
``wgmma`` path is covered by lowering for CUDA on CPU (`tests/test_lowering.py`) and by
the ``gpu``-marked tests on the H200.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_paged_attn import plans, reference
from jax_paged_attn.kernels import common
from jax_paged_attn.kernels.common import LOG2E, RUNNING_MAX_INIT
from jax_paged_attn.plans import MOSAIC_ROWS_PER_WARPGROUP as ROWS_PER_WARPGROUP
from jax_paged_attn.plans import MOSAIC_TMA_ROW_ALIGN as TMA_ROW_ALIGN
from jax_paged_attn.plans import TILE_INFO_WIDTH, MosaicPrefillTiling, TileField
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

# Registers per thread after the split (setmaxnreg), by compute warpgroups: the producer
# only issues copies, compute warpgroups hold a 64 x block_k score tile and a 64 x D
# accumulator. The split must fit 64K registers: 2 x 232 + 40 (the stock attention_mgpu
# kernel's figures) and 3 x 160 + 32 (FlashAttention-3's at D 64) warpgroup-threads' worth.
REGISTER_SPLIT = {1: (232, 40), 2: (232, 40), 3: (160, 32)}  # workers -> (compute, producer)

def smem_transforms(minor_dim: int, dtype) -> tuple:
    """Tiling + swizzle of a 2-D shared-memory tile whose rows have ``minor_dim`` elements
    (the widest swizzle dividing a row, as wgmma and TMA want). Rows of 16-byte multiples
    only (fp8 at D = 48, 80, ...) get no transform: Mosaic GPU swizzles 32, 64 or 128
    bytes, and such tiles (fp8 K/V) only feed register loads, never a wgmma."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor_dim * bits)
    if swizzle < 32:
        return ()
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _convert(x: Array, dtype) -> Array:
    """fp8 -> f16 / bf16 (exact). The hardware converts fp8 to f16 only: bf16 goes through f32."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.float16):
        x = x.astype(jnp.float32)
    return x.astype(dtype)


class _Ops:
    """The few operations whose form differs between the GPU and the interpreter."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def layout(self, x: Array, layout) -> Array:
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape: tuple[int, int], dim: int) -> Array:
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def load(self, ref) -> Array:
        """A ring tile into registers, in the wgmma layout (the layout of the 16-bit tiles
        it is converted into and of the score tile it is masked with)."""
        if self.interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)

    def row_bcast(self, x: Array, shape: tuple[int, int]) -> Array:  # [M] -> [M, N]
        return lax.broadcast_in_dim(x, shape, [0])

    def mma(self, a, b_ref, *, transpose_b: bool, shape: tuple[int, int], while_running=None) -> Array:
        """f32 ``a @ b`` (``a @ b.T`` with transpose_b); ``a`` a shared-memory ref or a
        register array, ``b_ref`` a shared-memory ref. ``while_running()`` runs after the
        wgmma is issued, before waiting for it."""
        if self.interpret:
            a_val = a if isinstance(a, jax.Array) else a[...]
            dims = ((1,), (1,)) if transpose_b else ((1,), (0,))
            if while_running is not None:
                while_running()
            return lax.dot_general(a_val, b_ref[...], (dims, ((), ())), preferred_element_type=jnp.float32)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b_ref.T if transpose_b else b_ref)
            if while_running is not None:
                while_running()
            return acc_ref[...]

        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    def mma_overlapped(self, acc: Array, acc_scale: Array, p: Array, v_ref, q_ref, k_ref, *, on_scores,
                       while_running=None) -> tuple[Array, tuple]:
        """Issues ``q @ k.T`` (f32, a fresh accumulator), rescales ``acc`` by ``acc_scale``
        (the same shape) while it runs, then issues ``acc + p @ v`` (``p`` a register
        array), runs ``while_running()``, waits for the scores only and runs
        ``on_scores(scores)`` while the P·V product still runs; returns (``acc * acc_scale
        + p @ v``, what ``on_scores`` returned). ``p`` holds its values before Q·K^T is
        issued (a register operand defined between two wgmmas in flight makes ptxas
        serialize them)."""
        score_shape = (q_ref.shape[0], k_ref.shape[0])
        if self.interpret:
            scores = self.mma(q_ref, k_ref, transpose_b=True, shape=score_shape, while_running=while_running)
            return self.mma_acc(acc * acc_scale, p, v_ref), on_scores(scores)

        def run(acc_ref, scores_ref):  # (a scoped accumulator starts at zero)
            plgpu.wgmma(scores_ref, q_ref, k_ref.T)
            acc_ref[...] = acc * acc_scale
            plgpu.wgmma(acc_ref, p, v_ref)  # in flight until acc_ref is read
            if while_running is not None:
                while_running()
            results = on_scores(common.wgmma_accumulator_load(scores_ref, wait_n=1))
            return acc_ref[...], results

        return pl.run_scoped(run, plgpu.ACC(acc.shape, jnp.float32), plgpu.ACC(score_shape, jnp.float32))

    def mma_acc(self, acc: Array, a, b_ref) -> Array:
        """``acc + a @ b`` (f32 accumulator in place on the GPU); ``a`` a register array or a
        shared-memory ref."""
        return self.mma_acc_parts(acc, [(a, b_ref)])

    def mma_acc_parts(self, acc: Array, parts: Sequence[tuple[Any, Any]]) -> Array:
        """``acc + sum(a @ b for a, b in parts)``: one wgmma a part into one accumulator,
        waited for once (``a`` register arrays or shared-memory refs, ``b`` shared-memory
        refs)."""
        if self.interpret:
            for a, b_ref in parts:
                a = a if isinstance(a, jax.Array) else a[...]
                acc = acc + lax.dot_general(a, b_ref[...], (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
            return acc

        def run(acc_ref):
            for a, b_ref in parts:
                plgpu.wgmma(acc_ref, a, b_ref)

        return pl.run_state(run)(plgpu.ACC.init(acc))


class _PingPong:
    """Staggers two compute warpgroups so that one's softmax overlaps the other's wgmma
    (FlashAttention-3's ping-pong, the stock attention_mgpu kernel's schedule barrier).

    A barrier both warpgroups arrive on: each phase completes when both have arrived.
    Per KV block each warpgroup meets the other once while its Q·K^T wgmma runs, and
    once more (arrive, then wait) between its softmax and its P·V; warpgroup 1 meets once
    before its first block (`lead_in`) and warpgroup 0 once after its last (`lead_out`),
    so warpgroup 1 runs half a block behind and both complete the same phases: around
    each work item, or with ``tiling.pingpong_across_items`` around a program's items.
    """

    def __init__(self, barrier, wg: Array):
        self.barrier = barrier
        self.wg = wg

    def arrive(self) -> None:
        plgpu.barrier_arrive(self.barrier)

    def wait(self) -> None:
        plgpu.barrier_wait(self.barrier)

    def meet(self) -> None:
        self.arrive()
        self.wait()

    def lead_in(self) -> None:
        """Warpgroup 1 starts one meeting behind warpgroup 0 ..."""
        pl.when(self.wg == 1)(self.meet)

    def lead_out(self) -> None:
        """... and warpgroup 0 ends one behind: both meet as often."""
        with jax.named_scope("final_meet"):
            pl.when(self.wg == 0)(self.meet)


def _prefill_kernel(
    *refs,
    spec: AttentionSpec,
    tiling: MosaicPrefillTiling,
    page_rows: int,
    num_pages: int,
    max_pages_per_seq: int,
    paged: bool,
    planes: tuple[int, int],
    group: int,
    has_alibi: bool,
    k_fp8: bool,
    v_fp8: bool,
    num_tiles: int,
    num_heads: int,
    interpret: bool,
):
    (
        # inputs (GMEM)
        plan_ref,  # i32[num_tiles, TILE_INFO_WIDTH]
        q_ref,  # [Tq (a multiple of 8), Hq, D] q dtype
        k_ref,  # [planes, pages, page_rows, Hk, D] q dtype or fp8
        v_ref,  # same layout as k_ref
        *rest,
    ) = refs
    rest = list(rest)
    table_ref = common.pop_optional(rest, paged)  # i32[B, max_blocks]
    alibi_ref = common.pop_optional(rest, has_alibi)  # f32[Hq] slopes * log2(e)
    scale_ref = common.pop_optional(rest, k_fp8 or v_fp8)  # f32[2] (k_scale, v_scale)
    finite_ref = common.pop_optional(rest, tiling.precheck_values)  # i32[1]: 1 if every value is finite
    (
        o_ref,  # output: [Tq (a multiple of 8), Hq, D] q dtype, the packed rows (tiling.direct_output);
        #   else [num_tiles, block_q, Hq, D], tile t's rows
        # scratch (SMEM), W = compute warpgroups
        q_smem,  # [B * W, 64, D] q dtype, B = tiling.query_buffers: each compute warpgroup's
        #   queries, then its output (buffer b of warpgroup w at b * W + w; with 2 buffers
        #   the heads of a program use them in turn, the next head's queries loaded into
        #   one while the current head computes from the other).
        #   With tiling.direct_output, a union (common.mosaic_smem_union) of it and
        #   out_rows [B * W, 64, D] q dtype (plain rows): after the KV loop, a partial
        #   warpgroup's output, stored row by row
        k_ring,  # [num_stages, block_k, D] K dtype
        v_ring,  # [num_stages, block_k, D] V dtype
        v_work,  # [W, tiling.work_rows, D] q dtype: 0/1 non-finite flags, then finite values
        #   (masked blocks), or converted values (fp8); a [W, 8] f32 placeholder when 0
        #   (the masked blocks then use q_smem, the queries reloaded after)
        k_conv,  # [W, block_k, D] q dtype: converted fp8 keys (a [W, 8] f32 placeholder otherwise)
        key_bad,  # [W, block_k] f32: 1.0 for a key with a non-finite value (nonfinite_check "key_flags")
        probe_rows,  # [W, 2, 64] f32: 1.0 for a row of a masked block's P·V holding a NaN / inf
        #   (nonfinite_check "probe"; two buffers used in turn, see masked_pv_with_probe)
        # barriers
        q_bars,  # [B * W]: the queries arrived in that buffer
        k_bars,  # [num_stages]: the slot's K block arrived (copies_per_block TMA arrivals)
        v_bars,  # [num_stages]: the slot's V block arrived
        k_free,  # [num_stages]: every compute warpgroup is done with the slot's K block
        v_free,  # [num_stages]: every compute warpgroup is done with the slot's V block
        schedule,  # [1], 2 arrivals: the compute warpgroups' ping-pong (see _PingPong)
    ) = rest  # (k_free / v_free unused without warp specialization, schedule without ping-pong)
    if tiling.direct_output:
        (q_smem,), (out_rows,) = q_smem
    ops = _Ops(interpret)
    rows, block_k, stages = ROWS_PER_WARPGROUP, tiling.block_k, tiling.num_stages
    workers, specialized = tiling.compute_warpgroups, tiling.warp_specialized
    wg = lax.axis_index("wg")
    # (Ping-pong staggers exactly two: three compute warpgroups interleave on their own.)
    pingpong = _PingPong(schedule.at[0], wg) if tiling.pingpong and workers == 2 else None
    # The stagger around each work item, or (pingpong_across_items) around a program's.
    item_pingpong = pingpong if pingpong and not tiling.pingpong_across_items else None
    program_pingpong = pingpong if pingpong and tiling.pingpong_across_items else None

    def staggered_items(run_items) -> None:
        """A compute warpgroup's ``run_items()``, between the program's stagger meetings
        where the ping-pong spans its items (``pingpong_across_items``)."""
        if program_pingpong:
            program_pingpong.lead_in()
        run_items()
        if program_pingpong:
            program_pingpong.lead_out()
    compute_registers, producer_registers = REGISTER_SPLIT[workers]
    copy_rows = tiling.copy_rows
    head_size = q_smem.shape[-1]
    dtype = q_smem.dtype
    k_plane, v_plane = planes
    out_shape = (rows, head_size)

    def load_query_tile(q_row: Array, h: Array, buffer: Array | int) -> None:
        """A compute warpgroup's 64 query rows from packed row ``q_row`` of head ``h`` into
        its query tile ``buffer``."""
        qi = buffer * workers + wg
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row, rows), h], q_smem.at[qi], q_bars.at[qi])

    def drain_ring(streamed: Array) -> None:
        """The producer waits for the releases of a stream's last blocks, which no copy
        follows: every completed phase of a barrier is waited for by the thread that waits
        on it (the Mosaic GPU interpreter checks this; on the GPU the producer is idle
        here anyway)."""
        def drain(i, _):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        with jax.named_scope("drain"):
            lax.fori_loop(jnp.maximum(streamed - stages, 0), streamed, drain, None)

    def work_item(t: Array, h0: Array, num_heads_here: int, role: str | None = None,
                  ring_offset: Array | None = None, q_buffer: Array | None = None) -> Array | None:
        """Query tile ``t`` of the plan for query heads ``h0 .. h0 + num_heads_here - 1``, in
        turn. The ring carries one stream of KV blocks, the tile's blocks once per head
        (`MosaicPrefillTiling.heads_per_program`): the producer runs into the next head's
        blocks while the compute warpgroups finish the current one. ``role`` "producer" or
        "compute": only that warpgroup role's part, for a caller that has branched on the
        role already (the persistent form's per-role item loops); None: every part, each
        behind a branch on the warpgroup.
        ``ring_offset`` (a producer's persistent form): the item's stream continues the
        ring where the program's previous items left it, its first block in slot
        ``ring_offset % stages``, so the producer fetches this item's first blocks as soon
        as the compute warpgroups release the previous item's last slots (no fill, no
        drain: the caller drains after its last item). None: the stream starts the ring
        anew in slot 0, filled at once, drained at its end.
        ``q_buffer`` (one head): the query tile buffer the caller loaded this item's
        queries into (`load_item_queries`); None: the item loads its own.
        Returns the number of blocks the item streamed through the ring (with
        ``ring_offset``; else None)."""
        producer_part, compute_part = role in (None, "producer"), role in (None, "compute")
        continuous = ring_offset is not None

        def for_warpgroups(condition, body) -> None:
            if role is None:
                pl.when(condition)(body)
            else:
                body()

        def field(f: TileField) -> Array:
            return plan_ref[t, int(f)]

        # Every field read at once, before the branch (the loads' latencies overlap;
        # every tile, surplus ones included, has its row).
        with jax.named_scope("setup"):
            q_rows = field(TileField.Q_ROWS)
            seq = field(TileField.SEQ)
            q_row0 = field(TileField.Q_ROW0)
            q_pos0 = field(TileField.Q_POS0)
            q_len = field(TileField.Q_LEN)
            k_len = field(TileField.K_LEN)
            k_row0 = field(TileField.K_ROW0)
            kb_lo, kb_full_lo = field(TileField.KB_LO), field(TileField.KB_FULL_LO)
            kb_full_hi, kb_hi = field(TileField.KB_FULL_HI), field(TileField.KB_HI)
            k_lead = field(TileField.K_LEAD)  # block kb holds keys kb * block_k - k_lead ..
        streamed = jnp.where(q_rows > 0, (kb_hi - kb_lo) * num_heads_here, 0) if continuous else None

        @pl.when(q_rows > 0)  # surplus tiles of the static grid exit here
        def _():
            num_blocks = kb_hi - kb_lo
            stream = num_blocks * num_heads_here  # blocks through the ring

            # A block of the stream: (KV block, the program's query head j it is for).
            def stream_block(s: Array) -> tuple[Array, Array]:  # the stream's s-th block
                if num_heads_here == 1:
                    return kb_lo + s, jnp.int32(0)
                j = lax.div(s, jnp.maximum(num_blocks, 1))  # (no block: no fetch either)
                return kb_lo + s - j * num_blocks, j

            def next_block(kb: Array, j: Array) -> tuple[Array, Array]:
                """The stream's block after (kb, j), without a division: it lies on the
                producer's path from a released slot to that slot's next copy."""
                if num_heads_here == 1:
                    return kb + 1, j
                wraps = kb + 1 == kb_hi
                return jnp.where(wraps, kb_lo, kb + 1), jnp.where(wraps, j + 1, j)

            def fetch(ring, bars, src, block: tuple[Array, Array], slot: Array, plane: int) -> None:
                """Issues the TMA copies of stream block ``block`` of ``src`` into ``ring[slot]``."""
                kb, j = block
                kv_head = lax.div(h0 + j, jnp.int32(group))  # (a constant divisor)
                for c in range(block_k // copy_rows):
                    key0 = kb * block_k + c * copy_rows
                    if paged:
                        logical = jnp.minimum(lax.div(key0, jnp.int32(page_rows)), max_pages_per_seq - 1)
                        # A bad page id reads a real page, never outside the cache.
                        page = jnp.clip(table_ref[seq, logical], 0, num_pages - 1)
                        row = lax.rem(key0, jnp.int32(page_rows))
                    else:
                        page, row = 0, k_row0 + key0
                    # A TMA copy into a tiled buffer starts on a whole tile: the plan aligns
                    # packed rows, and a copy of a page starts at a multiple of copy_rows.
                    row = pl.multiple_of(row, TMA_ROW_ALIGN)
                    dst = ring.at[slot]
                    if copy_rows < block_k:
                        dst = dst.at[pl.ds(c * copy_rows, copy_rows)]
                    plgpu.copy_gmem_to_smem(src.at[plane, page, pl.ds(row, copy_rows), kv_head], dst, bars.at[slot])

            def fetch_block(s: int | Array, slot: Array) -> None:  # the stream's s-th block, K and V
                block = stream_block(jnp.int32(s))
                fetch(k_ring, k_bars, k_ref, block, slot, k_plane)
                fetch(v_ring, v_bars, v_ref, block, slot, v_plane)

            @jax.named_scope("fill")
            def _fill_the_ring():
                for i in range(stages):
                    @pl.when(i < stream)
                    def _():
                        fetch_block(i, jnp.int32(i))

            if (producer_part or not specialized) and not continuous:
                for_warpgroups(wg == (workers if specialized else 0), _fill_the_ring)

            if specialized and producer_part:
                def _producer():
                    """Refills each slot of the ring as soon as every compute warpgroup has
                    released it."""
                    if not tiling.persistent_programs:  # (persistent: once, before the items)
                        plgpu.set_max_registers(producer_registers, action="decrease")

                    def refill(i, block):
                        slot = lax.rem(i, jnp.int32(stages))
                        plgpu.barrier_wait(k_free.at[slot])
                        fetch(k_ring, k_bars, k_ref, block, slot, k_plane)
                        plgpu.barrier_wait(v_free.at[slot])
                        fetch(v_ring, v_bars, v_ref, block, slot, v_plane)
                        return next_block(*block)

                    if continuous:
                        def produce(i, block):  # the slot's previous block (if any) released first
                            g = ring_offset + i
                            slot = lax.rem(g, jnp.int32(stages))
                            pl.when(g >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                            fetch(k_ring, k_bars, k_ref, block, slot, k_plane)
                            pl.when(g >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                            fetch(v_ring, v_bars, v_ref, block, slot, v_plane)
                            return next_block(*block)

                        with jax.named_scope("refill"):
                            lax.fori_loop(jnp.int32(0), stream, produce, stream_block(jnp.int32(0)))
                        return

                    with jax.named_scope("refill"):
                        lax.fori_loop(jnp.int32(stages), stream, refill, stream_block(jnp.int32(stages)))

                    drain_ring(stream)

                for_warpgroups(wg == workers, _producer)

            if not compute_part:
                return

            row0 = wg * rows
            q_row = pl.multiple_of(q_row0 + row0, TMA_ROW_ALIGN)  # the plan aligns q_row0
            prefetch = tiling.query_buffers == 2

            def load_queries(h: Array, buffer: Array | int) -> None:
                load_query_tile(q_row, h, buffer)

            def compute_head(h: Array, base: Array, j: Array | int) -> None:
                """Rows ``wg * 64 ..`` of the tile, query head ``h`` (the program's ``j``-th),
                against the tile's KV blocks they can see: the ring stream's blocks
                ``base ..``."""
                if q_buffer is not None:
                    buffer = q_buffer
                else:
                    buffer = lax.rem(j, 2) if prefetch else 0
                qi = buffer * workers + wg
                my_q, q_bar, my_out_rows = q_smem.at[qi], q_bars.at[qi], out_rows.at[qi] if tiling.direct_output else None
                my_work, my_conv, my_bad = v_work.at[wg], k_conv.at[wg], key_bad.at[wg]
                my_probe = probe_rows.at[wg]
                my_pos0 = q_pos0 + row0
                if q_buffer is not None:
                    pass  # (loaded by the caller: before its item loop or at the previous item's start)
                elif not prefetch:
                    load_queries(h, 0)
                else:  # (this head's queries were loaded before the head loop or by the previous head)
                    # The other buffer's last reader, the previous head's output store, has
                    # read it (its epilogue waits for that).
                    pl.when(j + 1 < num_heads_here)(lambda: load_queries(h + 1, 1 - buffer))

                if scale_ref is not None:
                    k_scale, v_scale = scale_ref[0], scale_ref[1]
                else:
                    k_scale = v_scale = None
                # Scores in log2 units: s2 = log2(e) * softcap(scale * q.k).
                if spec.softcap > 0:
                    pre_tanh, post_tanh = spec.softmax_scale / spec.softcap, spec.softcap * LOG2E
                else:
                    pre_tanh, post_tanh = spec.softmax_scale * LOG2E, None
                if k_fp8:
                    pre_tanh = k_scale * pre_tanh
                slope = alibi_ref[h] if alibi_ref is not None else None
                # The call's values all finite (tiling.precheck_values), or None: unknown.
                values_finite = finite_ref[0] > 0 if finite_ref is not None else None
                # Without soft-cap or ALiBi the scale goes into the exponent's FMA (and the
                # row max, scaled once: a positive scale keeps the max), not a pass of its
                # own over the score tile (the stock kernel's form).
                folded = post_tanh is None and slope is None and isinstance(pre_tanh, float) and pre_tanh > 0

                def slot_of(kb):  # the ring slot of KV block kb of this head's part of the stream
                    position = base + kb - kb_lo
                    return lax.rem(ring_offset + position if continuous else position, jnp.int32(stages))

                def visit(kb, carry, *, masked: bool, compute: bool = True):
                    """KV block ``kb``: its barrier protocol always (wait for it, release it,
                    meet the other warpgroup), its attention only with ``compute``. A masked
                    block runs in parts of ``tiling.masked_block_k`` keys, each guarded against
                    non-finite values, unless the call's values are all finite
                    (``tiling.precheck_values``): then it runs whole, as an unmasked block."""
                    slot = slot_of(kb)
                    plgpu.barrier_wait(k_bars.at[slot])
                    if not compute:
                        if pingpong:
                            pingpong.meet()
                        if specialized:
                            plgpu.barrier_arrive(k_free.at[slot])
                        if pingpong:
                            pingpong.arrive()
                        plgpu.barrier_wait(v_bars.at[slot])
                        if pingpong:
                            pingpong.wait()
                        release_v(kb, slot)
                        return carry
                    def in_guarded_parts(carry):  # non-finite values behind the mask kept from the rows
                        width = tiling.masked_block_k
                        parts = block_k // width
                        for part in range(parts):
                            carry = attend(kb, slot, carry, part * width, width, masked=True,
                                           first=part == 0, last=part == parts - 1)
                        return carry

                    def whole(carry, masked: bool):  # the block at full width, P·V straight from the ring
                        return attend(kb, slot, carry, 0, block_k, masked=masked, guard=False, first=True, last=True)

                    if not masked:
                        carry = whole(carry, masked=False)
                    elif values_finite is None:
                        carry = in_guarded_parts(carry)
                    else:  # every value finite (checked once per call): nothing to keep from any row
                        carry = lax.cond(values_finite, functools.partial(whole, masked=True), in_guarded_parts,
                                         carry)
                    release_v(kb, slot)
                    return carry

                def softmax_part(s, kb, key0: int, m_prev, l_prev, *, masked: bool, fma_columns: int = 0):
                    """The online softmax of the raw scores ``s`` [64, width] of keys ``key0 ..``
                    of KV block ``kb``: (f32 probabilities, running max, row sums, the
                    accumulator's correction factor, the visibility mask (None unless
                    ``masked``)). With ``fma_columns`` (an unmasked block only) the
                    probabilities are two arrays: the first ``fma_columns`` columns'
                    from `common.exp2_fma` (the FMA pipe), the rest's from exp2 (the XU),
                    so the two pipes share the block's exponentials."""
                    score_shape = s.shape
                    visible = None
                    if not folded:
                        s = s * pre_tanh
                    if post_tanh is not None:
                        s = jnp.tanh(s) * post_tanh
                    if slope is not None or masked:
                        q_pos = my_pos0 + ops.iota(score_shape, 0)
                        # (The block's keys, not the bare column index: that one is the same
                        # every block, and hoisted out of the loop it holds 32 registers.)
                        k_pos = kb * block_k + key0 - k_lead + ops.iota(score_shape, 1)
                    if slope is not None:
                        s = s - slope * reference.alibi_distance(q_pos, k_pos, q_len, k_len)
                    if masked:
                        # `reference.key_visible` (and, over packed keys, no lead key of a block
                        # 0: the previous sequence's) as each row's interval of keys: a compare
                        # or two and a select a score, the bounds computed once a row (a
                        # compare and a select for each condition before: twice the
                        # instructions of an unmasked block).
                        lo, hi = plans.visible_key_interval(q_pos, q_len, k_len, spec)
                        hi = jnp.where(q_pos < q_len, hi, lo)  # (rows past the sequence see nothing)
                        visible = k_pos < hi
                        if spec.window_left >= 0 or not paged:  # (else lo is 0, a paged key's least)
                            visible &= k_pos >= lo
                        s = jnp.where(visible, s, -jnp.inf)
                    row_max = s.max(axis=1)
                    m_next = jnp.maximum(m_prev, row_max * pre_tanh if folded else row_max)
                    correction = jnp.exp2(m_prev - m_next)
                    x = (s * pre_tanh if folded else s) - ops.row_bcast(m_next, score_shape)
                    if fma_columns:
                        assert not masked  # exp2_fma gives -inf no 0: unmasked scores only
                        p = (common.exp2_fma(x[:, :fma_columns]), jnp.exp2(x[:, fma_columns:]))
                        l_next = l_prev * correction + p[0].sum(axis=1) + p[1].sum(axis=1)
                        return p, m_next, l_next, correction, visible
                    p = jnp.exp2(x)
                    l_next = l_prev * correction + p.sum(axis=1)
                    return p, m_next, l_next, correction, visible

                def attend(kb, slot, carry, key0: int, width: int, *, masked: bool, first: bool, last: bool,
                           guard: bool = True):
                    """Keys ``key0 .. key0 + width`` of KV block ``kb`` (in ring ``slot``).
                    The block's first part meets the other warpgroup while its Q·K^T runs and
                    waits for the values; its last part releases the keys. A masked part keeps
                    non-finite values from the rows its mask hides them from (``guard``;
                    without it P·V runs as in an unmasked block)."""
                    acc, m_prev, l_prev = carry
                    score_shape = (rows, width)
                    k_tile = k_ring.at[slot]
                    v_tile = v_ring.at[slot]
                    # The value work tile: its first `width` rows, or (tiling.work_rows 0,
                    # 64-key parts) the warpgroup's query tile, the queries reloaded after.
                    work = my_q if tiling.work_rows == 0 else my_work
                    bad_flags = my_bad
                    if width < block_k:
                        k_tile, v_tile = k_tile.at[pl.ds(key0, width)], v_tile.at[pl.ds(key0, width)]
                        bad_flags = my_bad.at[pl.ds(0, width)]
                    if work.shape[0] > width:
                        work = work.at[pl.ds(0, width)]
                    if k_fp8:
                        conv = my_conv if width == block_k else my_conv.at[pl.ds(0, width)]
                        conv[...] = _convert(ops.load(k_tile), dtype)
                        plgpu.commit_smem()  # register stores -> visible to wgmma
                        k_tile = conv
                    s = ops.mma(my_q, k_tile, transpose_b=True, shape=score_shape,
                                while_running=pingpong.meet if pingpong and first else None)  # [64, width]
                    if specialized and last:
                        plgpu.barrier_arrive(k_free.at[slot])  # the block's wgmmas have completed
                    # Split exponentials: unmasked blocks only (`tiling.exp2_fma_columns`).
                    fma_columns = 0 if masked else tiling.exp2_fma_columns
                    p, m_next, l_next, correction, visible = softmax_part(s, kb, key0, m_prev, l_prev, masked=masked,
                                                                          fma_columns=fma_columns)
                    acc = acc * ops.row_bcast(correction, out_shape)
                    p_in = p  # the P·V operand: f32 here, rounded to the query dtype at the product
                    if tiling.fence_softmax and not masked and not v_fp8:
                        # The stock kernel's order: everything of the softmax, the 16-bit
                        # probabilities included, before the barrier (no reordering past it).
                        p_in = jax.tree_util.tree_map(lambda x: x.astype(dtype), p)
                        acc, l_next, m_next, p_in = lax.optimization_barrier((acc, l_next, m_next, p_in))
                    if first:
                        if pingpong:  # softmax done: let the other warpgroup's wgmma run, then ours
                            pingpong.arrive()
                            plgpu.barrier_wait(v_bars.at[slot])
                            pingpong.wait()
                        else:
                            plgpu.barrier_wait(v_bars.at[slot])
                    guarded = masked and guard
                    if guarded and tiling.nonfinite_check == "probe":
                        probe = my_probe.at[lax.rem(kb * (block_k // width) + key0 // width, jnp.int32(2))]
                        acc = masked_pv_with_probe(acc, p, v_tile, visible, work, bad_flags, probe,
                                                   functools.partial(restore_queries, kb, last))
                        return acc, m_next, l_next
                    if guarded:
                        # Keys hidden from some rows may hold NaN / inf (stale pages, a causal
                        # future): a 0/1 product first finds the (row, column) pairs that see a
                        # non-finite value, then P·V runs over the finite values (one work tile,
                        # reused: each wgmma has completed before the tile is rewritten).
                        # In the query dtype (fp8 converts exactly; half the registers of f32).
                        v = _convert(ops.load(v_tile), dtype) if v_fp8 else ops.load(v_tile)
                        if tiling.nonfinite_check == "key_flags":
                            acc = masked_pv_with_key_flags(acc, p, v, visible, work, bad_flags)
                        else:
                            # (no is_finite rule in the lowering; NaN compares False, inf exceeds max)
                            finite = jnp.abs(v) <= jnp.asarray(jnp.finfo(dtype).max, dtype)
                            work[...] = jnp.where(finite, 0.0, 1.0).astype(dtype)
                            plgpu.commit_smem()
                            seen = ops.mma(jnp.where(visible, 1.0, 0.0).astype(dtype), work, transpose_b=False,
                                           shape=out_shape)
                            work[...] = jnp.where(finite, v, 0.0).astype(dtype)
                            plgpu.commit_smem()
                            acc = ops.mma_acc(acc, p.astype(dtype), work)
                            acc = jnp.where(seen > 0, jnp.nan, acc)
                        restore_queries(kb, last)
                    else:
                        if v_fp8:
                            my_work[...] = _convert(ops.load(v_tile), dtype)
                            plgpu.commit_smem()
                            v_tile = my_work
                        if fma_columns:  # one wgmma per part of the probabilities, on its rows of V
                            acc = ops.mma_acc_parts(acc, [
                                (p_in[0].astype(dtype), v_tile.at[pl.ds(0, fma_columns)]),
                                (p_in[1].astype(dtype), v_tile.at[pl.ds(fma_columns, width - fma_columns)])])
                        else:
                            acc = ops.mma_acc(acc, p_in.astype(dtype), v_tile)
                    return acc, m_next, l_next

                def masked_pv_with_key_flags(acc, p, v, visible, work, bad_flags):
                    """P·V of a masked block (or part) whose values may hold NaN / inf behind
                    the mask (`tuning.MosaicPrefillConfig.nonfinite_check` "key_flags"): a key
                    with a non-finite value is flagged and its row of V zeroed (one pass to
                    the work tile ``work``); the flags reach the score tile's columns through
                    shared memory (``bad_flags``), and a row that sees a flagged key becomes
                    NaN, as in the reference. The values of keys no row sees are zeroed too:
                    0 * NaN would reach every row."""
                    bad = common.nonfinite_rows(v)  # [width], one per key (a row of the V tile)
                    bad_flags[...] = jnp.where(bad, 1.0, 0.0)
                    work[...] = jnp.where(lax.broadcast_in_dim(bad, v.shape, [0]), 0.0, v).astype(dtype)
                    plgpu.commit_smem()  # flags and values, written by every thread, read in other layouts
                    bad_key = ops.layout(bad_flags[...], plgpu.Layout.WGMMA.reduce(0))  # one per score column
                    flagged = lax.broadcast_in_dim(bad_key, p.shape, [1]) > 0
                    sees_bad = jnp.where(visible & flagged, 1.0, 0.0).max(axis=1) > 0
                    acc = ops.mma_acc(acc, p.astype(dtype), work)
                    return jnp.where(ops.row_bcast(sees_bad, out_shape), jnp.nan, acc)

                def masked_pv_with_probe(acc, p, v_tile, visible, work, bad_flags, probe, restore):
                    """P·V of a masked block (or part) the cheap way while its values are all
                    finite (`tuning.MosaicPrefillConfig.nonfinite_check` "probe"): the
                    product straight from the ring into a fresh accumulator, as in an
                    unmasked block. Every row of that product multiplies every value of the
                    block (a hidden key by a probability of 0), so a NaN / inf anywhere among
                    the values makes every row of it non-finite (0 * NaN, 0 * inf): row 0's
                    flag tells the whole warpgroup (through shared memory, a uniform branch
                    around wgmma). Only then is the product redone the "key_flags" way, which
                    keeps the non-finite values from the rows the mask hides them from. (Row
                    0 can also be non-finite through its own probabilities, a NaN key it
                    sees: the redo computes the same.) ``probe`` alternates between two
                    buffers, so a fast thread's next write cannot meet a slow thread's read
                    of this one (a commit's barrier lies between). Without a work tile of
                    its own (``tiling.work_rows`` 0: the probe needs none at 64-key parts),
                    the redo rewrites the warpgroup's query tile, then ``restore``s it."""
                    src = v_tile
                    if v_fp8:
                        work[...] = _convert(ops.load(v_tile), dtype)
                        plgpu.commit_smem()
                        src = work
                    pv = ops.mma(p.astype(dtype), src, transpose_b=False, shape=out_shape)
                    probe[...] = jnp.where(common.nonfinite_rows(pv), 1.0, 0.0)
                    plgpu.commit_smem()  # every row's flag written before row 0's is read

                    def redo():
                        v = _convert(ops.load(v_tile), dtype) if v_fp8 else ops.load(v_tile)
                        out = masked_pv_with_key_flags(acc, p, v, visible, work, bad_flags)
                        restore()
                        return out

                    return lax.cond(probe[0] > 0, redo, lambda: acc + pv)

                def restore_queries(kb, last: bool) -> None:
                    """After keys of block ``kb`` (``last``: its last part) rewrote their values in
                    the query tile (``tiling.work_rows`` 0; its wgmmas have completed), the
                    queries back into it by TMA, unless this was the last block the warpgroup
                    computes (below tail_split; with causal masking its diagonal, mostly):
                    then only the output uses the tile."""
                    if tiling.work_rows:
                        return

                    def reload():
                        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row, rows), h], my_q, q_bar)
                        plgpu.barrier_wait(q_bar)

                    if last:
                        pl.when(kb < tail_split - 1)(reload)
                    else:
                        reload()

                def release_v(kb, slot) -> None:  # the slot's wgmmas have completed
                    if specialized:
                        plgpu.barrier_arrive(v_free.at[slot])
                    else:  # no producer: refill the slot ourselves
                        @pl.when(base + kb - kb_lo + stages < stream)
                        def _():
                            fetch_block(base + kb - kb_lo + stages, slot)

                def overlapped_unmasked(lo, hi, carry):
                    """Unmasked blocks ``lo .. hi - 1`` with each block's softmax running while
                    the previous block's P·V wgmma runs (`tuning.MosaicPrefillConfig.
                    overlap_softmax`, FlashAttention-3's intra-warpgroup overlap, in its
                    order): Q·K^T of block j is issued, the accumulator rescaled by block
                    j - 1's correction, P·V of block j - 1 issued, the scores waited for
                    alone; block j's 16-bit probabilities stay in registers for the next
                    block's P·V. The first block has no P·V before it, the last one's runs
                    after the loop (both behind a branch on ``lo < hi``). Each block meets
                    the other warpgroup twice (ping-pong), as `visit` does: once after issuing
                    its wgmmas, once after its softmax."""
                    score_shape = (rows, block_k)

                    def softmax_of_scores(kb, slot, s, m, l):
                        """Block kb's scores are in: release its keys, run its softmax, then
                        let the other warpgroup's wgmmas go; (f32 probabilities, running
                        max, row sums, the accumulator's correction)."""
                        if specialized:
                            plgpu.barrier_arrive(k_free.at[slot])
                        p, m_next, l_next, correction, _ = softmax_part(s, kb, 0, m, l, masked=False)
                        if pingpong:
                            pingpong.meet()
                        return p, m_next, l_next, correction

                    def as_operand(p, m, l, correction):
                        """The probabilities rounded to the P·V operand, once no P·V is in
                        flight (registers written while one runs make ptxas serialize the
                        wgmmas: the new operand may take the old one's registers)."""
                        return p.astype(dtype), m, l, correction

                    def first(state):
                        acc, m, l = state
                        slot = slot_of(lo)
                        plgpu.barrier_wait(k_bars.at[slot])
                        s = ops.mma(my_q, k_ring.at[slot], transpose_b=True, shape=score_shape,
                                    while_running=pingpong.meet if pingpong else None)
                        return (acc, *as_operand(*softmax_of_scores(lo, slot, s, m, l)))

                    def step(kb, state):  # state: (acc, block kb - 1's p, m, l, correction)
                        acc, p, m, l, correction = state
                        slot, prev = slot_of(kb), slot_of(kb - 1)
                        plgpu.barrier_wait(k_bars.at[slot])
                        plgpu.barrier_wait(v_bars.at[prev])
                        acc, after = ops.mma_overlapped(
                            acc, ops.row_bcast(correction, out_shape), p, v_ring.at[prev], my_q, k_ring.at[slot],
                            on_scores=lambda s: softmax_of_scores(kb, slot, s, m, l),
                            while_running=pingpong.meet if pingpong else None)
                        release_v(kb - 1, prev)
                        return (acc, *as_operand(*after))

                    def last(state):
                        acc, p, m, l, correction = state
                        prev = slot_of(hi - 1)
                        plgpu.barrier_wait(v_bars.at[prev])
                        acc = ops.mma_acc(acc * ops.row_bcast(correction, out_shape), p, v_ring.at[prev])
                        release_v(hi - 1, prev)
                        return acc, m, l

                    def no_blocks(state):  # (the loop's state, never read)
                        acc, m, l = state
                        return (acc, ops.layout(jnp.zeros(score_shape, dtype), plgpu.Layout.WGMMA), m, l,
                                ops.layout(jnp.ones((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))

                    state = lax.cond(lo < hi, first, no_blocks, carry)
                    state = lax.fori_loop(lo + 1, hi, step, state)
                    return lax.cond(lo < hi, last, lambda state: (state[0], state[2], state[3]), state)

                carry = (
                    ops.layout(jnp.zeros(out_shape, jnp.float32), plgpu.Layout.WGMMA),
                    ops.layout(jnp.full((rows,), RUNNING_MAX_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                    ops.layout(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                )
                with jax.named_scope("q_wait"):
                    plgpu.barrier_wait(q_bar)
                if item_pingpong:
                    item_pingpong.lead_in()
                # Every compute warpgroup goes through every block of the tile, in order (the
                # ring's slots are released by all of them), but computes only the blocks its
                # own rows can see: the plan's masked / unmasked split is the whole tile's,
                # and a warpgroup of rows past the sequence's end sees none.
                # (Rows at negative positions, an aligned tile's lead, are the previous
                # segment's: computed with the others, never stored.)
                has_rows = (row0 < q_rows) & (my_pos0 < q_len) & (my_pos0 + rows > 0)
                my_first = jnp.maximum(my_pos0, 0)
                my_last = jnp.minimum(jnp.minimum(my_pos0 + rows, q_pos0 + q_rows), q_len) - 1
                my_lo, _ = plans.visible_key_interval(my_first, q_len, k_len, spec)
                _, my_hi = plans.visible_key_interval(my_last, q_len, k_len, spec)
                lead_split = jnp.where(
                    has_rows, jnp.clip(lax.div(my_lo + k_lead, jnp.int32(block_k)), kb_lo, kb_full_lo), kb_full_lo)
                mid_split = jnp.where(has_rows, kb_full_hi, kb_full_lo)
                tail_split = jnp.where(
                    has_rows, jnp.clip(common.cdiv(my_hi + k_lead, block_k), kb_full_hi, kb_hi), kb_full_hi)
                # The tile's masked tail starts where a block stops being visible to *every*
                # row of the tile; this warpgroup's own rows may see more of it whole (the
                # second warpgroup sees the first one's diagonal block whole): those blocks
                # take the unmasked path. A block [a, a + block_k) is whole to the rows
                # [my_first, my_last] when a >= lo(my_last) and a + block_k <= hi(my_first).
                _, first_hi = plans.visible_key_interval(my_first, q_len, k_len, spec)
                last_lo, _ = plans.visible_key_interval(my_last, q_len, k_len, spec)
                whole_hi = lax.div(jnp.maximum(first_hi + k_lead, 0), jnp.int32(block_k))
                extends = has_rows & (kb_full_hi * block_k - k_lead >= last_lo)
                my_full_hi = jnp.where(extends, jnp.clip(whole_hi, kb_full_hi, tail_split), kb_full_hi)
                def each_block(**kind):  # a region's blocks one by one through `visit`
                    return lambda lo, hi, carry: lax.fori_loop(lo, hi, functools.partial(visit, **kind), carry)

                masked_blocks, unmasked_blocks = each_block(masked=True), each_block(masked=False)
                skipped_blocks = each_block(masked=True, compute=False)
                # Blocks before the full ones (a left window edge, or packed keys' block 0
                # holding the previous sequence's lead keys), then the rest in order; each
                # region named (the profiler's timeline, `varlen_attention_call`).
                regions = []
                if spec.window_left >= 0 or not paged:
                    regions += [("lead_skipped", kb_lo, lead_split, skipped_blocks),
                                ("lead_masked", lead_split, kb_full_lo, masked_blocks)]
                regions += [("unmasked", kb_full_lo, mid_split,
                             overlapped_unmasked if tiling.overlap_softmax else unmasked_blocks),
                            ("mid_skipped", mid_split, kb_full_hi, skipped_blocks),
                            ("tail_unmasked", kb_full_hi, my_full_hi, unmasked_blocks),
                            ("tail_masked", my_full_hi, tail_split, masked_blocks),
                            ("tail_skipped", tail_split, kb_hi, skipped_blocks)]
                for region, lo, hi, run_blocks in regions:
                    with jax.named_scope(region):
                        carry = run_blocks(lo, hi, carry)
                acc, _, l_sum = carry
                if item_pingpong:
                    item_pingpong.lead_out()
                with jax.named_scope("epilogue"):
                    # One reciprocal per row; a row that sees no key -> 0.
                    inv_sum = common.nan_rows_scale(1.0 / jnp.where(l_sum > 0, l_sum, 1.0), acc)
                    if v_fp8:
                        inv_sum = inv_sum * v_scale
                    out = acc * ops.row_bcast(inv_sum, out_shape)
                    row = row0 + ops.iota(out_shape, 0)
                    attends = (row < q_rows) & (q_pos0 + row < q_len) & (q_pos0 + row >= 0)
                    out = jnp.where(attends, out, 0.0).astype(dtype)
                    if not tiling.direct_output:
                        my_q[...] = out
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(my_q, o_ref.at[t, pl.ds(row0, rows), h])
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (see below)
                        return
                    # (my_out_rows: my_q's memory)
                    # A warpgroup whose 64 rows are all this tile's stores them with one TMA copy
                    # (8-aligned: the plan aligns q_row0). One holding an aligned tile's lead
                    # rows or a sequence's end shares rows with a neighbouring tile, and a TMA
                    # copy from a swizzled tile writes whole 8-row tiles: it stores only its own
                    # rows, one TMA copy each, from a plain-layout buffer (my_q's memory, free
                    # after the KV loop). At most two such warpgroups per sequence and head.
                    whole = (row0 + rows <= q_rows) & (my_pos0 >= 0)  # no lead rows, none past the tile
                    partial = (row0 < q_rows) & jnp.logical_not(whole)

                    @pl.when(whole)
                    def _():
                        my_q[...] = out
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(my_q, o_ref.at[pl.ds(q_row, rows), h])

                    @pl.when(partial)
                    def _():
                        my_out_rows[pl.ds(0, rows)] = out
                        plgpu.commit_smem()

                        def store_row(i, _):
                            plgpu.copy_smem_to_gmem(my_out_rows.at[pl.ds(i, 1)], o_ref.at[pl.ds(q_row + i, 1), h])

                        own_lo = jnp.maximum(-my_pos0, 0)  # lead rows: the previous segment's
                        own_hi = jnp.minimum(q_rows - row0, rows)  # rows past the tile: the next one's
                        lax.fori_loop(own_lo, own_hi, store_row, None)

                    # Only until the copies have read the tile (the next head's queries
                    # go there): their writes complete on their own, by the kernel's end
                    # at the latest, and nothing in the kernel reads the output.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def _compute():
                if specialized and not tiling.persistent_programs:
                    plgpu.set_max_registers(compute_registers, action="increase")
                if num_heads_here == 1:
                    compute_head(h0, jnp.int32(0), 0)
                else:
                    if prefetch:
                        load_queries(h0, 0)

                    def next_head(j, _):
                        compute_head(h0 + j, j * num_blocks, j)

                    staggered_items(lambda: lax.fori_loop(0, num_heads_here, next_head, None))

            for_warpgroups(wg < workers, _compute)

        return streamed

    if tiling.persistent_programs:
        # One program per SM walks the items strided by the program count, tile fastest
        # within a head (the grid form's programs are issued head fastest, module
        # docstring): the programs running at once share a head's K/V in L2 (walking them
        # head fastest spread them over four sequences and every head: unmasked blocks
        # 1.7x slower, the H100, 2026-12-02).
        # The stride also gives every program its share of long and short tiles (the plan
        # orders them longest first; a run of neighbouring items would give the first
        # programs the longest: 2.7x slower at B1 S16384).
        # With a producer, each role runs its own item loop after its register split: code
        # that both roles reach after the split (one loop over both roles' parts) makes
        # ptxas ignore setmaxnreg and serialize every wgmma for want of registers (its
        # C7507 / C7512 notes). The items stream through the ring back to back: the
        # producer fetches an item's first blocks into the slots the previous item's last
        # blocks free while the compute warpgroups finish that item, and drains the ring
        # once, after its last item. Without a producer each item fills and drains the
        # ring. Every barrier's phases stay matched across items either way (each waits
        # for what it arrives on).
        # Off by default: the earlier form (one item loop over both roles' code, the ring
        # filled and drained per item) measured 1.6x the grid form's kernel time at B8
        # S2048 D128 under Nsight Compute, its SMs 90 % active, DRAM 7 % busy (the H200,
        # 2026-12-04): each item ran slower, its wgmmas serialized. This form (with
        # prefetched queries and the stagger across items) ran at x1.01 the grid form's
        # speed at B8 S2048 D128 but x0.62 at B1 S16384, x0.91 at D 64 and x0.83 at D 256
        # (the H200, 2026-12-05).
        num_items = num_tiles * num_heads
        program, step = lax.axis_index("program"), jnp.int32(min(tiling.persistent_programs, num_items))

        num_my_items = lax.div(num_items - program + step - 1, step)
        # With two query tiles a compute warpgroup (with a producer) loads the next item's
        # queries at the start of each item, into the tile the previous item used (its
        # output store has read it by then): the tiles alternate item by item.
        prefetch_items = tiling.query_buffers == 2 and specialized

        def tile_and_head(item: Array) -> tuple[Array, Array]:  # tile fastest within a head
            return lax.rem(item, jnp.int32(num_tiles)), lax.div(item, jnp.int32(num_tiles))

        def load_item_queries(item: Array, buffer: Array | int) -> None:
            """A compute warpgroup's 64 query rows of ``item`` (if a real tile) into ``buffer``."""
            tile, head = tile_and_head(item)

            @pl.when(plan_ref[tile, int(TileField.Q_ROWS)] > 0)
            def _():
                q_row = pl.multiple_of(plan_ref[tile, int(TileField.Q_ROW0)] + wg * rows, TMA_ROW_ALIGN)
                load_query_tile(q_row, head, buffer)

        def items(role: str | None) -> Array:
            """The program's items for ``role``; the blocks they streamed through the ring.
            A producer's items stream through the ring back to back (``ring_offset``)."""
            continuous = role is not None
            prefetching = prefetch_items and role == "compute"
            if prefetching:
                pl.when(num_my_items > 0)(lambda: load_item_queries(program, 0))

            def next_item(i, streamed):
                item = program + i * step
                tile, head = tile_and_head(item)
                if not continuous:
                    work_item(tile, head, 1)
                    return streamed
                buffer = None
                if prefetching:
                    buffer = lax.rem(i, 2)
                    pl.when(i + 1 < num_my_items)(lambda: load_item_queries(item + step, 1 - buffer))
                return streamed + work_item(tile, head, 1, role, ring_offset=streamed, q_buffer=buffer)

            return lax.fori_loop(0, num_my_items, next_item, jnp.int32(0))

        if specialized:
            @pl.when(wg == workers)
            def _producer_items():
                plgpu.set_max_registers(producer_registers, action="decrease")
                drain_ring(items("producer"))

            @pl.when(wg < workers)
            def _compute_items():
                plgpu.set_max_registers(compute_registers, action="increase")
                staggered_items(lambda: items("compute"))
        else:
            items(None)
    else:
        heads = tiling.heads_per_program
        work_item(lax.axis_index("tile"), lax.axis_index("head_group") * heads, heads)


PROFILE_RANGES_PER_ITEM = 14
"""Named regions a warpgroup records per work item, what the profiler's event buffer is
sized for: at most 12 for a compute warpgroup (the profiler's own "Init" among them),
plus the buffer's header. (With 12, the last region, the epilogue, was cut.)"""


def _compiler_params(profile_dir: str | None, *, items_per_program: int):
    if not profile_dir:
        return plgpu.CompilerParams(approx_math=True)
    profile = dict(profile_space=PROFILE_RANGES_PER_ITEM * items_per_program, profile_dir=profile_dir)
    if "profile_bounds_check" in plgpu.CompilerParams.__dataclass_fields__:  # (jax >= 0.11)
        profile["profile_bounds_check"] = True  # a longer trace is cut, not written over shared memory
    return plgpu.CompilerParams(approx_math=True, **profile)


def varlen_attention_call(
    q: Array,  # [Tq (a multiple of 8), Hq, D] f16 / bf16
    k: tuple[Array, int],  # ([planes, pages, page_rows, Hk, D], plane) q dtype or fp8
    v: tuple[Array, int],  # same layout as k (may be another plane of the same array)
    plan: Array,  # i32[num_tiles, TILE_INFO_WIDTH] from plans.plan_tiles
    block_table: Array | None,  # i32[B, max_blocks] (paged) or None (packed: one page)
    alibi_slopes_log2: Array | None,  # f32[Hq] ALiBi slopes * log2(e), or None
    kv_scales: Array | None,  # f32[2] (k_scale, v_scale) when K or V is fp8, else None
    values_finite: Array | None = None,  # i32[1]: 1 if every value is finite (tiling.precheck_values)
    *,
    spec: AttentionSpec,
    tiling: MosaicPrefillTiling,
    interpret: bool = False,
    profile_dir: str | None = None,
) -> Array:  # q.dtype: [Tq, Hq, D] (tiling.direct_output) or [num_tiles, block_q, Hq, D]
    """Builds and runs the Mosaic GPU kernel over the plan's tiles.

    ``tiling`` (`jax_paged_attn.plans.plan_mosaic_prefill_tiling`) gives the compute
    warpgroups (64 query rows each; ``block_q`` = 64 x their number), block_k, the ring
    depth and the rows per TMA copy (block_k for packed keys, ``gcd(block_k,
    block_size)`` for a paged cache). With ``tiling.direct_output`` the packed
    output, every row the plan's tiles own written by the one tile that owns it; else
    one slab per tile, whose rows past its sequence and lead rows (an aligned tile's)
    hold garbage or zeros: the caller gathers only each tile's own rows.

    ``profile_dir`` (GPU only): each call also writes a timeline of every warpgroup's
    named regions (the setup, the ring's fill, refill and drain, the query wait, each
    loop over the KV blocks, the final ping-pong meeting, the epilogue;
    `PROFILE_RANGES_PER_ITEM` a work item) as a Chrome trace JSON file into
    that directory, through the Mosaic GPU profiler (its event buffer takes some
    shared memory; benchmarks/prefill_parts.py --timeline reads the files).
    """
    _, num_q_heads, head_size = q.shape
    (k_arr, k_plane), (v_arr, v_plane) = k, v
    _, num_pages, page_rows, num_kv_heads, _ = k_arr.shape
    block_k, stages, workers = tiling.block_k, tiling.num_stages, tiling.compute_warpgroups
    assert block_k % tiling.copy_rows == 0 and tiling.block_q == workers * ROWS_PER_WARPGROUP, tiling
    assert num_q_heads % tiling.heads_per_program == 0, tiling  # (plans.mosaic_heads_per_program: a divisor)
    num_tiles = plan.shape[0]
    assert plan.shape[1] == TILE_INFO_WIDTH
    k_fp8, v_fp8 = jnp.dtype(k_arr.dtype).itemsize == 1, jnp.dtype(v_arr.dtype).itemsize == 1
    if (k_fp8 or v_fp8) and kv_scales is None:
        raise ValueError("kv_scales (k_scale, v_scale) are required with fp8 keys or values.")
    if tiling.precheck_values != (values_finite is not None):
        raise ValueError("values_finite is given exactly when tiling.precheck_values is set.")
    paged = block_table is not None
    dtype = q.dtype

    def tile(rows: int, dt, lead: int):
        return plgpu.SMEM((lead, rows, head_size), dt, transforms=smem_transforms(head_size, dt))

    copies = block_k // tiling.copy_rows
    placeholder = plgpu.SMEM((workers, TMA_ROW_ALIGN), jnp.float32)
    query_tiles = tiling.query_buffers * workers
    scratch = [
        common.mosaic_smem_union((tile(ROWS_PER_WARPGROUP, dtype, query_tiles),),
                                 (plgpu.SMEM((query_tiles, ROWS_PER_WARPGROUP, head_size), dtype),),
                                 interpret=interpret)
        if tiling.direct_output else tile(ROWS_PER_WARPGROUP, dtype, query_tiles),
        tile(block_k, k_arr.dtype, stages),
        tile(block_k, v_arr.dtype, stages),
        # (An unused tile is a few bytes of placeholder: at D 256 its 8-row tiles would
        # keep the second compute warpgroup out of shared memory.)
        tile(tiling.work_rows, dtype, workers) if tiling.work_rows else placeholder,
        tile(block_k, dtype, workers) if k_fp8 else placeholder,
        plgpu.SMEM((workers, block_k), jnp.float32),
        plgpu.SMEM((workers, 2, ROWS_PER_WARPGROUP), jnp.float32),
        plgpu.Barrier(num_barriers=query_tiles),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=workers, num_barriers=stages),
        plgpu.Barrier(num_arrivals=workers, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
    ]
    inputs = [plan, q, k_arr, v_arr]
    common.append_optional(inputs, block_table)
    common.append_optional(inputs, alibi_slopes_log2)
    common.append_optional(inputs, kv_scales)
    common.append_optional(inputs, values_finite)
    kernel = functools.partial(
        _prefill_kernel,
        spec=spec,
        tiling=tiling,
        page_rows=page_rows,
        num_pages=num_pages,
        max_pages_per_seq=block_table.shape[1] if paged else 1,
        paged=paged,
        planes=(k_plane, v_plane),
        group=num_q_heads // num_kv_heads,
        has_alibi=alibi_slopes_log2 is not None,
        k_fp8=k_fp8,
        v_fp8=v_fp8,
        num_tiles=num_tiles,
        num_heads=num_q_heads,
        interpret=interpret,
    )
    if tiling.persistent_programs:
        grid, grid_names = (min(tiling.persistent_programs, num_tiles * num_q_heads),), ("program",)
    else:
        grid, grid_names = (num_tiles, num_q_heads // tiling.heads_per_program), ("tile", "head_group")
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(
            q.shape if tiling.direct_output else (num_tiles, tiling.block_q, num_q_heads, head_size), dtype),
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=workers + 1 if tiling.warp_specialized else 1,
        thread_name="wg",
        compiler_params=_compiler_params(profile_dir, items_per_program=-(-num_tiles * num_q_heads // grid[0])
                                         if tiling.persistent_programs else tiling.heads_per_program),
        interpret=common.mosaic_interpret_params() if interpret else None,
        kernel_name="varlen_attention_mosaic",
    )(*inputs)
