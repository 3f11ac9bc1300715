"""Kernel configurations and the tables that choose them, shared by every lowering.

Kernel files never pick their own block sizes: the wrappers in `jax_paged_attn.prefill`,
`jax_paged_attn.decode` and `jax_paged_attn.cache` ask this module (an explicit
``config=`` argument overrides the table; benchmarks sweep configs that way) and
`jax_paged_attn.plans` turns the config into the kernel's tiling for the call's shapes.

Table keys are rounded to powers of two before lookup (so nearby shapes share an
entry); a missing key falls back to the default config. The key layout is documented on
each table.

Tables are per GPU model. The measured entries (package data, `MEASURED_TABLES_FILE`)
were chosen by measurement with `benchmarks/bench_attention.py --tune` (see
benchmarks/NOTES.md) and apply only on the GPU they were measured on (its
``device_kind``, e.g. ``"NVIDIA H200"``). On a GPU without measured entries the kernels run
the defaults below, starting points for the H200, which `TuningDevice`'s shared-memory
limit then shrinks to fit (`jax_paged_attn.plans`); that is said once
(`UntunedDeviceWarning`). On a CPU (interpret mode, or lowering for CUDA from a CPU host)
the H200's tables apply: that is the GPU the kernels are developed and tested on.

A user can measure a table for their own GPU: ``python3 -m jax_paged_attn.tune`` (see
`jax_paged_attn.tune`) sweeps the configs for a model's shapes and writes a user table,
a JSON file per GPU model beside the compilation cache (`user_tables_dir`,
``$JAX_PAGED_ATTN_TUNING_DIR`` moves it; ``off`` turns user tables off), read on the
first lookup for that GPU. Precedence, per table key: an explicit ``config=`` argument,
then the user table of the GPU (if written by this JAX version), then the shipped
measured table, then the defaults. A user who tuned wants their table, so it wins over
the shipped one for the keys it holds; every other key keeps the shipped entry.
`describe_tables` says which table is in force (the engine's start report).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import tempfile
import warnings
from typing import Any, Iterable


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tiling of the varlen (prefill) kernel (`jax_paged_attn.prefill`).

    block_q: rows per program (query positions x packed heads), a power of 2 >= 16;
    block_k: keys per inner-loop step, a power of 2 >= 16 (any cache block size:
    keys are gathered row by row through the block table); both are upper bounds,
    shrunk for calls whose max_seqlen_q * heads per tile / max_seqlen_k are smaller
    (the shrunk query tile then uses at most 4 warps); num_warps / num_stages:
    Triton launch parameters (num_stages is the software-pipelining depth of the KV
    loop); pack_gqa: put the query heads of one KV group in the rows of a tile
    (``block_q // group`` positions each), so a K/V block is loaded once per group;
    longest_first: schedule the sequences and tiles with the most work first;
    num_stages_paged: num_stages over a paged cache (None: num_stages). There the K/V
    addresses come from a block-table load in the same loop step, and Triton's
    pipeliner spends stages on that load too: K/V get ``(num_stages - 1) // 2``
    buffers ahead (at least 1), so a paged call may want 5; single_kv_loop: run a
    tile's KV blocks as one loop that masks every block (one software-pipeline fill
    and drain per tile, as the stock Pallas ``mha``) instead of three loops (masked
    left-window edge, unmasked middle, masked diagonal / end) whose middle one does no
    mask arithmetic; prefetch_page_ids: over a paged cache, load the block-table
    entries of the next KV step in the current one (carried through the loop), so
    the K/V loads of a step depend on no load of that step (no effect when packed);
    masked_block_k: keys per step of the masked loops (capped at block_k; a power of 2
    >= 16): those steps also keep non-finite K/V from the rows the mask hides them
    from. That work, in full-width masked steps, slowed the whole kernel by 20-40 % on
    the H200 (B8 S2048 Hq32 Hk8 D128 causal, block_k 32: 277 -> 191 TFLOP/s) although
    only the diagonal and window-edge blocks take it; narrower steps lower the
    registers it needs (compiled for sm_90: 228 per thread at 32 keys, 218 at 16, 210
    without the check). The masked loops cover few blocks, so narrow steps there cost
    little; which width wins is measured by the sweep (`bench_attention.py --tune`).
    Ignored with single_kv_loop (one loop masks every block).
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = True
    longest_first: bool = True
    num_stages_paged: int | None = None
    single_kv_loop: bool = False
    prefetch_page_ids: bool = True
    masked_block_k: int = 32


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the paged decode kernel (`jax_paged_attn.decode`).

    pages_per_step: cache pages loaded per inner-loop step (keys per step =
    pages_per_step * block_size, rounded down to a power of 2 and shrunk to fit
    ``DECODE_SHARED_MEMORY_BUDGET``); num_splits: KV splits per (sequence, KV head),
    merged afterwards (flash-decoding), 0 = choose from the batch so that about
    ``target_programs`` programs run, each with at least ``min_tiles_per_split`` steps of
    the longest possible context; max_q_rows: cap on the query rows (Sq * query heads
    per KV head, padded to a power of 2 >= 16) of one program, more rows take more
    programs; num_warps / num_stages: Triton launch parameters; prefetch_page_ids: load
    the block-table entries of the next step in the current one (carried through the
    loop). Without it the K/V addresses come from a block-table load in the same step,
    so Triton's pipeliner splits num_stages between the two loads: K/V get
    ``(num_stages - 1) // 2`` buffers (at least 1) and every step waits for the tile
    its previous step issued (1 buffer: no K/V load is in flight during the step's
    math). With it the K/V loads get ``num_stages - 1`` buffers and each step waits
    only for the oldest: ``num_stages - 2`` tiles stay in flight during the math
    (sm_90 TTGIR: num_stages 3 -> 2 buffers, ``async_wait num=2``; 4 -> 3 buffers,
    ``num=4``), and the id load of a step is consumed only by the next one.
    """

    pages_per_step: int = 4
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 3
    max_q_rows: int = 64
    target_programs: int = 1024
    min_tiles_per_split: int = 4
    prefetch_page_ids: bool = False


REFERENCE_DEVICE_KIND = "NVIDIA H200"
"""The GPU whose tables a call lowered on a CPU host takes (see the module docstring)."""

REFERENCE_MULTIPROCESSORS = 132
"""The H200's SMs: a plan's count where the GPU's is unknown (a CPU host lowering for CUDA)."""

# Shared memory one thread block may opt into, by compute capability (CUDA programming
# guide, "Technical Specifications per Compute Capability"); the kernels need sm_80+.
_SHARED_MEMORY_PER_BLOCK_KIB = {
    (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99,
    (9, 0): 227, (10, 0): 227, (10, 3): 227, (11, 0): 227, (12, 0): 99, (12, 1): 99,
}
_SMALLEST_SHARED_MEMORY_KIB = 99  # an unlisted compute capability: the least of the above

# Headroom below the limit for what the kernels' shared-memory estimates leave out
# (Triton's layout-conversion scratch, barriers); calibrated on the H200, where the
# decode kernel's budget of 200 of 227 KiB never failed to compile.
_SHARED_MEMORY_HEADROOM = 27 * 1024


@dataclasses.dataclass(frozen=True)
class TuningDevice:
    """The GPU a call's kernels are planned for.

    kind: JAX's ``device_kind`` (``"NVIDIA H200"``), the key of the measured tables;
    shared_memory_per_block: bytes of shared memory one program (thread block) may use;
    multiprocessors: SMs (JAX's ``core_count``; the H200's 132 where unknown), what one
    wave of programs fills.
    """

    kind: str
    shared_memory_per_block: int
    multiprocessors: int = REFERENCE_MULTIPROCESSORS

    @property
    def shared_memory_budget(self) -> int:
        """Bytes a kernel's estimated shared memory may reach (the limit less headroom)."""
        return self.shared_memory_per_block - _SHARED_MEMORY_HEADROOM


REFERENCE_DEVICE = TuningDevice(REFERENCE_DEVICE_KIND, _SHARED_MEMORY_PER_BLOCK_KIB[(9, 0)] * 1024)

# Shared memory the decode kernel may take on the H200; a key tile whose estimate
# (`jax_paged_attn.plans.estimate_shared_memory`) exceeds a device's budget is halved.
DECODE_SHARED_MEMORY_BUDGET = REFERENCE_DEVICE.shared_memory_budget


def device_from_properties(kind: str, compute_capability: str | None,
                           multiprocessors: int | None = None) -> TuningDevice:
    """The `TuningDevice` of a CUDA GPU from its ``device_kind``, ``compute_capability``
    (``"9.0"``; None or unparsable: the smallest limit of the GPUs the kernels run on) and
    SM count (None: `REFERENCE_MULTIPROCESSORS`)."""
    try:
        major, minor = (int(part) for part in str(compute_capability).split(".")[:2])
        kib = _SHARED_MEMORY_PER_BLOCK_KIB.get((major, minor), _SMALLEST_SHARED_MEMORY_KIB)
    except ValueError:
        kib = _SMALLEST_SHARED_MEMORY_KIB
    return TuningDevice(kind, kib * 1024, multiprocessors or REFERENCE_MULTIPROCESSORS)


@functools.cache
def target_device() -> TuningDevice:
    """The GPU JAX's default device is, or `REFERENCE_DEVICE` when it is not a GPU (a CPU
    host runs the kernels in interpret mode or lowers them for CUDA without running them)."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        return REFERENCE_DEVICE
    return device_from_properties(device.device_kind, getattr(device, "compute_capability", None),
                                  getattr(device, "core_count", None))


class UntunedDeviceWarning(UserWarning):
    """The kernels run on a GPU without measured tuning tables (default configs, fitted to
    its shared memory); issued once per GPU model."""


_warned_devices: set[str] = set()


def _warn_untuned(device: TuningDevice) -> None:
    if device.kind in _warned_devices:
        return
    _warned_devices.add(device.kind)
    warnings.warn(
        f"no tuning table was measured on {device.kind}: the Pallas kernels use default tile configs "
        f"(starting points for the {REFERENCE_DEVICE_KIND}, shrunk to its "
        f"{device.shared_memory_per_block // 1024} KiB of shared memory per block), which may be slower than "
        f"tuned ones; `{TUNE_COMMAND}` measures a table for it.",
        UntunedDeviceWarning, stacklevel=4)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Tiling of the Mosaic GPU paged decode kernel (`jax_paged_attn.kernels.mosaic_decode`).

    tile_keys: keys per pipeline stage (64 or 128: masked stages load their values in
    the wgmma layout, 64-row tiles; whole pages where the block size divides 128, a page
    of 128 keys making 128-key stages, else runs of rows within pages,
    `jax_paged_attn.plans.mosaic_decode_tile`); num_stages: K/V tiles in the TMA ring
    (all but the one being computed stay in flight during a step's math), lowered until the ring fits
    ``MOSAIC_SHARED_MEMORY_LIMIT`` (at least 2); num_splits, target_programs,
    min_tiles_per_split: the KV split choice, as in `DecodeConfig`
    (`jax_paged_attn.plans.choose_num_splits`). Default: 4 pages of 16 keys per stage,
    2 stages, the fastest of a 9-config sweep on 3 of the 4 decode shapes of
    benchmarks/NOTES.md (H200, 2026-12-01: 0.31-0.38 ms where 4 stages took
    0.40-0.47; a shallower ring leaves shared memory for more programs per SM, which
    hides more latency than a deeper ring does in one program).

    compute_warpgroups: 0 (the default): the program's one warpgroup issues the TMA
    copies and does the math, refilling each ring slot after its tile; 1 or 2: warp
    specialization, a producer warpgroup keeps the ring full while that many compute
    warpgroups take the tiles in turn (tile ``i`` to warpgroup ``i % n``, each with its
    own running max, sum and output, merged through shared memory at the end), so the
    copies never wait for the math and two warpgroups' math overlaps. The stages are
    rounded up to a multiple of it (each slot then always feeds the same warpgroup); two
    become one where the second one's merge buffer does not fit shared memory beside the
    smallest ring (D 256). Measured on the H200 (2026-12-03, page 16, D 128): two
    compute warpgroups at 4 stages and 512 target programs within -2..+3 % of the
    single-warpgroup form; the per-tile math then overlaps the copies (its timeline).
    The fields' defaults are that single-warpgroup form; the package runs
    `MOSAIC_DECODE_MEASURED` (`mosaic_decode_config`). items_per_program (with
    warp specialization): consecutive sequences a program attends for, one after the
    other, the ring carrying their tiles as one stream (the producer runs on into the
    next sequence's pages while the compute warpgroups finish the last one's, and its
    queries go to a second query tile), so short sequences pay the ring's fill and the
    program's launch once per program (measured, with the unpadded query rows: 4 a
    program 3-6 % faster than 1 at three shapes, 6 % slower at B256 ctx1024; one wave
    3-5 % faster than the simple form on all four, benchmarks/NOTES.md 2026-12-03).
    0: auto, as many as make one wave of programs
    (about one per SM, `TuningDevice.multiprocessors`: ``ceil(B * Hk * row_blocks *
    splits / SMs)``, at most B); without warp specialization always 1.

    keys_as_m: the keys as the wgmmas' M side (``S^T = K Q^T`` over ``N`` query rows,
    ``O^T += V^T P^T``): a tile's ``Sq * G`` query rows are the N of a wgmma, rounded up
    to 16 (`plans.MOSAIC_DECODE_KEYS_AS_M_ROW_MULTIPLE`), instead of the M side's 64, so
    a GQA group of 4 computes 4x its scores, not 16x, and the softmax runs on 16 columns
    of each key tile (its reductions cross the warpgroup's warps); alone or with one
    compute warpgroup beside a producer, one or several sequences a program. Head sizes
    that are multiples of 64, at most 64 query rows a KV head, no causal or window mask
    over several query tokens, not two compute warpgroups
    (`plans.mosaic_keys_as_m_unsupported_reason` says why each). Off: on an H100
    (benchmarks/NOTES.md, 2026-12-07 12:41 UTC) ×1.15 the single-warpgroup form at D 64
    GQA 4, slower at D 128 and GQA 8, and slower than `MOSAIC_DECODE_MEASURED` everywhere
    (its cross-warp max each tile costs what its smaller wgmmas save).
    """

    tile_keys: int = 64
    num_stages: int = 2
    num_splits: int = 0
    target_programs: int = 1024
    min_tiles_per_split: int = 4
    compute_warpgroups: int = 0
    items_per_program: int = 1
    keys_as_m: bool = False


# Shared memory the Mosaic GPU decode kernel may take: Hopper's 227 KiB per block (the
# opt-in maximum; the Mosaic GPU kernels run on sm_90 and newer, which all have it). Its
# estimate (`plans.estimate_mosaic_decode_shared_memory`) counts its scratch buffers
# exactly, so no margin for compiler scratch as with Triton.
MOSAIC_SHARED_MEMORY_LIMIT = REFERENCE_DEVICE.shared_memory_per_block


# key: (head_size rounded up to a power of 2, query dtype name, paged: K/V read through a
# block table) -> PrefillConfig. Paged and packed calls tune apart: over a paged cache
# the K/V addresses come from a page-id load (see prefetch_page_ids).
PREFILL_TABLE: dict[tuple[int, str, bool], PrefillConfig] = {
    # Starting points for the H200 (228 KiB shared memory per SM, 64K registers), to be
    # replaced by the measured sweep. D <= 128: the stock Pallas `mha` tiling, 128 x 128
    # with 2 stages, which runs at 241 TFLOP/s (D128) in the same lowering; a 64-key
    # step doubles the per-step fixed cost (row max / sum shuffles, accumulator rescale,
    # two wgmma waits), and the KV loop compiles to the same code as stock's (sm_90
    # TTGIR: wgmma, 16-byte cp.async, pipelined). 8 warps at D 64 too: with 4 the
    # 128 x 128 score tile and the accumulator exceed 255 registers and ptxas spills
    # (~390 spill instructions); 8 warps need 197. D = 256: every 128-row tile spills
    # (128 x 256 f32 accumulator), 64 x 64 over 8 warps does not (measured 161 TFLOP/s);
    # the sweep tries 64 x 32 and 128-row tiles.
    # Shared memory ~ block_q * Dp * 2 + num_stages * 2 * block_k * Dp * 2 bytes.
    # Over a paged cache, prefetch_page_ids (the default) gives the K/V loads the same
    # num_stages buffers as packed keys (sm_90 TTGIR: 3 stages -> 3 buffers, waits on
    # the oldest); reading the ids in the step, 3 stages leave 2 buffers and a full wait.
    **{(d, dt, paged): PrefillConfig(block_q=128, block_k=128, num_warps=8, num_stages=2)
       for d in (32, 64, 128) for dt in ("bfloat16", "float16") for paged in (False, True)},
    **{(256, dt, paged): PrefillConfig(block_q=64, block_k=64, num_warps=8, num_stages=2)
       for dt in ("bfloat16", "float16") for paged in (False, True)},
    # float32 runs IEEE f32 dots (FMA, not tensor cores) and doubles every tile's bytes.
    **{(d, "float32", paged): PrefillConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
       for d in (32, 64, 128, 256) for paged in (False, True)},
}

# key: (head_size rounded up to a power of 2, block_size, query heads per KV head rounded
# up to a power of 2) -> DecodeConfig
DECODE_TABLE: dict[tuple[int, int, int], DecodeConfig] = {}  # measured entries: MEASURED_TABLES


def describe_tables(device: TuningDevice | None = None) -> str:
    """Which tile configs the kernels take on ``device`` (default: `target_device`), in
    words: the user's table (its path, date and JAX version), the shipped measured
    table, or none (the defaults, and the command that measures a table). The engine's
    start report carries it."""
    device = target_device() if device is None else device
    user = user_table(device.kind)
    if user is not None:
        rest = ("the shipped table measured on it" if device.kind in MEASURED_TABLES
                else "the defaults") + " for other shapes"
        return (f"tile configs tuned on this {device.kind} by the user ({user.path}, {user.date}, "
                f"jax {user.jax_version}; {rest})")
    if device.kind in MEASURED_TABLES:
        return f"tile configs measured on the {device.kind}"
    return (f"no tile configs measured on the {device.kind}: defaults fitted to its "
            f"{device.shared_memory_per_block // 1024} KiB of shared memory per block; "
            f"`{TUNE_COMMAND}` measures a table for it")


# Shared memory the Mosaic GPU prefill kernel may take (of Hopper's 227 KiB per block,
# with the Triton kernels' headroom: its estimate leaves out scratch); its ring and
# block_k shrink to fit (`jax_paged_attn.plans.plan_mosaic_prefill_tiling`).
MOSAIC_SHARED_MEMORY_BUDGET = REFERENCE_DEVICE.shared_memory_budget


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Tiling of the Mosaic GPU varlen (prefill) kernel (`jax_paged_attn.prefill` with
    ``lowering="mosaic_gpu"``, `jax_paged_attn.kernels.mosaic_prefill`).

    block_k: keys per KV block, a multiple of 64 up to 256 (shrunk for short keys and to
    fit shared memory); num_stages: slots of the shared-memory K/V ring the TMA copies
    run ahead by (>= 2); compute_warpgroups: warpgroups of 64 query rows each computing
    attention (1, 2, or 3 at head sizes up to 64, FlashAttention-3's tile there,
    `jax_paged_attn.plans.MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE`; a tile has 64 x that
    many query positions); warp_specialized: a
    producer warpgroup issues the TMA copies while the compute warpgroups run (as the
    stock attention_mgpu kernel); False: one warpgroup computes and refills each ring
    slot after its block (compute_warpgroups must then be 1; the CPU tests' form, see
    `jax_paged_attn.kernels.mosaic_prefill`); pingpong: with 2 compute warpgroups,
    stagger them with a shared barrier so that one's softmax overlaps the other's wgmma
    (FlashAttention-3's ping-pong; the stock kernel's ``use_schedule_barrier``, on by
    default there); longest_first: as `PrefillConfig.longest_first`; nonfinite_check: how
    a masked block keeps a NaN / inf value from the rows its key is hidden from:
    ``"product"`` (a 0/1 matrix product of the visibility with the values' non-finite
    flags finds the rows that see one: a second wgmma and two shared-memory passes of
    the value tile per masked block) or ``"key_flags"`` (one flag per key, through shared
    memory to the score tile's columns, and a row reduction: one pass, no second wgmma;
    the default at head sizes 192 and 256) or ``"probe"`` (P·V
    from the ring as in an unmasked block, plus a check of its rows: a non-finite value
    anywhere among the block's values makes every row of the product non-finite, and
    only then the block is redone the "key_flags" way; its fresh accumulator costs as
    many registers as "product"'s (past D 128 both run one compute warpgroup,
    `jax_paged_attn.plans.MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE`), and it needs no value
    work tile, `jax_paged_attn.plans.mosaic_work_rows`; the default at head sizes 64 and
    128, see `MOSAIC_PREFILL_BY_HEAD_SIZE`); fence_softmax: in
    unmasked blocks, compute the row sums and the 16-bit probabilities before the
    barriers that wait for the values and (ping-pong) hand the tensor cores to the other
    warpgroup, fenced by an optimization barrier (the stock attention_mgpu kernel's
    order at head sizes up to 128, which it reports to matter; on the H200 within 2 % either
    way, 2026-12-02);
    persistent_programs: 0 for a program per (tile, head) work item; N > 0 for N
    programs (e.g. one per SM) that walk the items in turn, each role (producer, compute)
    in its own loop, the items streaming through the ring back to back, so the producer
    fetches the next item's first blocks while the compute warpgroups finish the current
    one (short sequences pay the ring's fill once per SM, not per tile). An earlier form
    (one item loop over both roles' code, the ring filled and drained per item) measured
    slower on the H200 at one program per SM in either item order (2026-12-02, -04): ptxas
    ignored its register split and serialized its wgmmas; this form (with prefetched queries
    and the stagger across items) ran at x0.62 - 1.01 the grid form's speed (2026-12-05);
    masked_block_k: keys per step of a masked block (a multiple of 64 dividing block_k;
    capped at block_k): a masked block (the causal diagonal, window edges, sequence
    ends) runs in parts of that many keys, each keeping non-finite values from the rows
    the mask hides them from, so 128-key blocks elsewhere do not pay that work's
    registers, and the value work tile holds one part (the Triton tier's
    `PrefillConfig.masked_block_k`; 128-key blocks in 64-key parts are the D 128
    default);
    direct_output: the kernel writes the packed output itself (a whole warpgroup's rows
    with one TMA copy, a partial one's own rows one copy each) instead of one slab per
    tile from which the wrapper gathers every row (measured on the H200, 2026-12-02:
    faster or level on every prefill, varlen and prefix shape of the benchmark, 12 % at
    B8 S2048 D128, 16 % at B16 S1024 D64; the default). Only where an output row is a
    multiple of 128 bytes (head sizes that are multiples of 64 at 16 bits): a one-row
    TMA copy reads shared memory from a 128-byte boundary; other head sizes keep the
    slab (`jax_paged_attn.plans.plan_mosaic_prefill_tiling`); value_work_tile: where a
    masked block's rewritten values go (`MOSAIC_VALUE_WORK_TILES`): ``"own"``, a work tile
    per compute warpgroup; ``"query"``, the warpgroup's query tile, the queries reloaded
    by TMA after the block unless it is the tile's last (16-bit values, 64-key masked
    parts); ``"auto"`` (the default), the query tile where that lets a second compute
    warpgroup fit shared memory (D 256 at 64-key blocks) or with the ``"probe"`` check
    (only its rare redo rewrites values), otherwise its own tile; precheck_values: the
    call first checks every value of the packed V for NaN / inf (one XLA reduction, a
    read of V at memory speed); while all are finite no masked block has one to keep
    from a row, so masked blocks run whole, P·V as in an unmasked block (one branch per
    masked block), and the non-finite check above runs only for a call whose values hold
    one. Over a paged cache it is off whatever the config says: the cache's pages would have to be
    gathered to be checked (`jax_paged_attn.plans.plan_mosaic_prefill_tiling`);
    heads_per_program: query heads each program runs its query tile for, one after the
    other (the largest divisor of the query heads up to this): the ring carries the
    tile's KV blocks once per head as one stream, so the producer fetches the next
    head's first blocks while the compute warpgroups finish the current head, and a
    program's launch, its ring's fill and its queries' first wait are paid once per
    that many heads. The heads of a program have the same tile, so the same work, and
    within a GQA group the same keys and values (read again from L2). 1 is a program
    per (tile, head); 0 (the package default, `MOSAIC_PREFILL_BY_HEAD_SIZE`) lets the
    plan choose: `jax_paged_attn.plans.MOSAIC_AUTO_HEADS_PER_PROGRAM` heads for packed
    keys up to `jax_paged_attn.plans.MOSAIC_AUTO_HEADS_PER_PROGRAM_MAX_KEYS` keys a
    sequence, else 1 (measured on the H200, 2026-12-02, alternating rounds in one
    process: 4 heads 3 % faster at B8 S2048 D128, 6 % at B16 S1024 D64, 2 % at B4 S4096
    D256, 5.5 % slower at B1 S16384 D128, where a work item's per-block loop ran about 7 %
    slower, for a reason not yet found; paged caches unmeasured apart from one noisy sweep);
    prefetch_queries: with several heads per program, each compute warpgroup loads the
    next head's queries into a second query tile while the current head computes, where
    shared memory holds it (D 64 and 128 at the default tiling, not D 256), instead of
    after the current head's output store (about 0.8 µs a head on the H200, the
    timelines of 2026-12-02); with persistent programs and a producer, the next item's
    queries at the start of each item. Where the plan cannot honour it (no next head or
    item, no room) a `jax_paged_attn.plans.ConfigFieldDroppedWarning` says so once (not
    for the package's config, which sets it for every call at D 64 and 128: "where it
    applies"). Off in the class default; on in the package's config at D 64 and 128
    (`MOSAIC_PREFILL_BY_HEAD_SIZE`).
    overlap_softmax: in the unmasked blocks, each block's softmax runs while the previous
    block's P·V wgmma runs (FlashAttention-3's intra-warpgroup overlap, in its order): Q·K^T
    of block j is issued, the accumulator rescaled, P·V of block j - 1 issued with its
    16-bit probabilities as a register operand (converted at the end of the previous
    block), the scores waited for alone. Only with 16-bit keys and values (fp8 blocks are
    converted in shared memory first): else the blocks run one by one, and a
    `jax_paged_attn.plans.ConfigFieldDroppedWarning` says so once. Off: this form ran at
    x0.89 - 0.98 the default's speed on the H200 (2026-12-05, the four dense
    shapes, alternating rounds); earlier forms x0.72 - 0.91 (2026-12-04: probabilities
    converted between the two wgmmas, which ptxas serialized, or kept in a shared-memory
    tile).
    pingpong_across_items: with ping-pong and several work items a program (several
    heads, or persistent programs), the two compute warpgroups stay staggered from one
    item to the next: the second warpgroup meets the first once before the program's
    first item and the first once after its last, instead of before and after every
    item, so the first warpgroup starts the next item's Q·K^T and softmax while the
    second finishes the current one's last P·V and stores its output (FlashAttention-3's
    ping-pong across tiles). Where a program has one item, or no ping-pong, a
    `jax_paged_attn.plans.ConfigFieldDroppedWarning` says so once. Off: x1.006 the
    default's speed at B8 S2048 D128, x0.93 at B16 S1024 D64; with prefetched queries
    x1.02 / x1.00 there, against x1.056 / x1.052 for the prefetch alone (the H200,
    2026-12-05, alternating rounds), though the per-item meetings it removes measured
    1.4 µs of a 4-head program's 74 at B8 S2048 D128 (2026-12-04).
    exp2_fma_columns: in the unmasked blocks, the probabilities of the first this many
    columns (keys) of each block come from an FMA-pipe polynomial
    (`jax_paged_attn.kernels.common.exp2_fma`, relative error <= 1.02e-4) and the rest
    from the XU's exp2, and P·V runs as one wgmma per part: FlashAttention-4's split of
    the exponentials between the two pipes, for head size 64, where a block's exp2 keeps
    the XU as long as its matmuls keep the tensor cores (the H100 under Nsight Compute,
    2026-12-05). A multiple of 64 below ``block_k`` (0: none, the default; 64 of a 128-key
    block: half its exponentials on each pipe). Where a call's
    plan cannot honour it (fp8 values, ``overlap_softmax``, a block the plan narrowed to
    that many keys or fewer) a `jax_paged_attn.plans.ConfigFieldDroppedWarning` says so.
    Off in the package's configs: on an H100 (2026-12-07, 64 of 128 keys) it made the
    kernel 6-8 % slower at head sizes 64 and 128 alike (benchmarks/NOTES.md).

    The class default is the stock attention_mgpu kernel's shape (a producer and 2
    compute warpgroups of 64 rows, 2-slot ring) with 64-key blocks; the package runs it
    with the fields measured fastest per head size (`mosaic_prefill_config`,
    `MOSAIC_PREFILL_BY_HEAD_SIZE`).
    """

    block_k: int = 64
    num_stages: int = 2
    compute_warpgroups: int = 2
    warp_specialized: bool = True
    pingpong: bool = True
    longest_first: bool = True
    nonfinite_check: str = "product"
    fence_softmax: bool = False
    persistent_programs: int = 0
    masked_block_k: int = 64
    direct_output: bool = True
    value_work_tile: str = "auto"
    precheck_values: bool = False
    heads_per_program: int = 1
    prefetch_queries: bool = False
    overlap_softmax: bool = False
    pingpong_across_items: bool = False
    exp2_fma_columns: int = 0


MOSAIC_NONFINITE_CHECKS = ("product", "key_flags", "probe")
"""The values of `MosaicPrefillConfig.nonfinite_check`."""

MOSAIC_VALUE_WORK_TILES = ("auto", "own", "query")
"""The values of `MosaicPrefillConfig.value_work_tile`."""

MOSAIC_PREFILL_CONFIG = MosaicPrefillConfig()

# The single-warpgroup form (no producer): the Mosaic GPU interpreter runs it in one
# thread, several times faster than the warp-specialized form's threads.
MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP = MosaicPrefillConfig(compute_warpgroups=1, warp_specialized=False)


H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"

MOSAIC_PREFILL_HEAD_SIZES: dict[str, frozenset[int]] = {REFERENCE_DEVICE_KIND: frozenset({128, 256}),
                                                       H100_DEVICE_KIND: frozenset({128, 256})}
"""Head sizes at which auto runs prefill through the Mosaic GPU kernel instead of the
Triton one, per GPU model: where it was measured faster (benchmarks/NOTES.md, H200,
jax 0.11.2; 2026-12-01: at D 128 1.18x / 1.76x on dense causal B8 S2048 / B1 S16384,
1.12x on 16 mixed lengths, 2.0x on a cached prefix; 2026-12-02, with the kernel's
direct output store: 1.41x / 1.84x at D 128, 1.04x at D 256 (B4 S4096), 0.80x at D 64,
which stays on Triton, as every unmeasured head size and GPU does; 12:58 UTC, with the
per-head-size configs: 1.50x / 2.22x at D 128, 1.26x at D 256, 0.89x at D 64;
2026-12-04, D 64 with 128-key blocks: 0.92x on packed keys (B16 S1024), 1.09x over a paged
cache with 512 new tokens on 3,584 cached; 2026-12-05, whole calls, alternating rounds: 1.03x
dense B16 S1024, 1.10x over the paged cache, but 0.66x on the engine's prompt step, 8 fresh
prompts of 292-1,797 tokens (8,218) over the paged cache they were written to, Hq32 Hk4:
0.310 ms against the Triton kernel's 0.205: there a Mosaic GPU program is one head's 128
positions over a few blocks, mostly fixed cost and the causal diagonal, one program an
SM, where the Triton kernel's tiles hold 16 positions of a KV group's 8 heads, two
programs an SM. D 64 stays on Triton: the engine's prefills are that call).

The H100 (80GB HBM3; benchmarks/NOTES.md, 2026-12-06 15:50 UTC, one `bench_attention.py`
run, jax 0.11.2, the Triton kernels on the H100's own tables, tuned that hour): the
Mosaic GPU kernel x1.29 / x1.45 at D 128 (dense causal B8 S2048 / B1 S16384), x1.88 on a
cached prefix (B8 q512 on ctx4096), x1.10 on the engine's prompt step (8 fresh prompts,
Hq32 Hk8), x1.14 at D 256 (B4 S4096); x1.02 at D 64 (B16 S1024), where the engine's
prompt step (x0.66 on the H200) has not been measured through it: D 64 stays on Triton."""


def auto_prefers_mosaic_prefill(head_size: int, device: TuningDevice | None = None) -> bool:
    """Whether auto should run a prefill of ``head_size`` through the Mosaic GPU kernel on
    ``device`` (default: `target_device`), by `MOSAIC_PREFILL_HEAD_SIZES`."""
    device = target_device() if device is None else device
    return head_size in MOSAIC_PREFILL_HEAD_SIZES.get(device.kind, frozenset())


def mosaic_prefill_config(head_size: int, dtype_name: str, paged: bool = False,
                          interpret: bool = False) -> MosaicPrefillConfig:
    """The Mosaic GPU prefill kernel's config: the default with the fields measured
    fastest for the head size (`MOSAIC_PREFILL_BY_HEAD_SIZE`).

    In interpret mode the default is the single-warpgroup form
    (`MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP`): the Mosaic GPU interpreter compiles each
    warpgroup's program anew for every grid point, so the warp-specialized form takes
    about ten times longer on a CPU; everything but the producer / consumer hand-off is
    the same code. An explicit ``config=`` interprets the specialized form.
    """
    del dtype_name, paged
    if interpret:
        return MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP
    fields = MOSAIC_PREFILL_BY_HEAD_SIZE.get(-(-head_size // 64) * 64)
    return dataclasses.replace(MOSAIC_PREFILL_CONFIG, **fields) if fields else MOSAIC_PREFILL_CONFIG


MOSAIC_PREFILL_BY_HEAD_SIZE: dict[int, dict[str, object]] = {
    64: dict(block_k=128, masked_block_k=64, nonfinite_check="probe", precheck_values=True, heads_per_program=0,
             prefetch_queries=True),
    128: dict(block_k=128, masked_block_k=64, nonfinite_check="probe", precheck_values=True, heads_per_program=0,
              prefetch_queries=True),
    192: dict(nonfinite_check="key_flags", precheck_values=True, heads_per_program=0),
    256: dict(nonfinite_check="key_flags", precheck_values=True, heads_per_program=0),
}
"""Head size (rounded up to a multiple of 64) -> `MosaicPrefillConfig` fields where they
differ from the default. The H200 sweep of 2026-12-02 (bench_attention.py, prefill
suite, jax 0.11.2, 13:30 UTC): D 128 with 128-key blocks whose masked ones run in 64-key
parts and the "probe" check, 3.65 ms at B1 S16384 (602 TFLOP/s) and 0.91 ms at B8 S2048
against 4.63 / 1.03 with the default; D 64 (B16 S1024) with "probe", 0.44 against 0.47
ms, and (2026-12-04, alternating rounds, `prefill_parts.py --versus`) with 128-key blocks
in 64-key masked parts 0.299 against 0.327 ms (256-key blocks 0.560, three compute
warpgroups 0.328-0.337, 2 or 8 heads a program and a third slot within 2 % or slower);
over a paged cache (prefix, page 16) 0.395-0.413 against 0.445; D 256 (B4 S4096) with
"key_flags", 1.32 ms (two compute warpgroups, the masked blocks in the query tile) against 5.3 with "product" or "probe" (their second 64 x D
f32 product tile spills registers; `plans.MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE`). D 192
takes "key_flags" for the same register count, not measured. ``precheck_values``
(H100 80GB HBM3, 2026-12-02, `benchmarks/prefill_parts.py` timelines): the masked tail
of a D 128 work item 4.24 -> 2.52 µs, the kernel's span -8 % at B8 S2048; -10 % at D 256
(B4 S4096), -3.5 % at D 64; D 192 takes it with its neighbours, not measured. ``heads_per_program``
0 (auto): see `MosaicPrefillConfig`. ``prefetch_queries`` at D 64 and 128 (the H200,
2026-12-05, the kernel alone in 5 alternating rounds, `prefill_parts.py --versus`): 0.648
against 0.685 ms at B8 S2048 D128 (x1.056), 0.266 against 0.279 at B16 S1024 D64 (x1.052),
2.141 against 2.254 ms for the whole call on the varlen suite's 16 mixed sequences
(`bench_attention.py --suite varlen`, the ``ours_mosaic_gpu`` sweep, one measurement each);
where a program has one head (B1 S16384, paged keys) the plan leaves it out, and those
shapes measured the same (x0.98-1.005). Earlier forms of the kernel measured it slower
(2026-12-03: 0.835 against 0.721 ms at B8 S2048 D128); D 256 has no room for it."""


# device kind -> {table name -> {key -> config}}: the measured entries of each GPU model.
MEASURED_TABLES: dict[str, dict[str, dict[tuple, object]]] = {}


TABLE_SOURCES = ("user", "shipped")
"""The tables a lookup consults before the defaults, first first: the user table of the
GPU (`user_table`), the shipped measured one (`MEASURED_TABLES`). A lookup given fewer
(``tables=``) skips the others: the tuner sweeps from the defaults with ``()`` and
compares a user table with the shipped one through ``("shipped",)``."""


def _lookup(name: str, defaults: dict, key: tuple, fallback, device: TuningDevice | None,
            tables: tuple[str, ...] = TABLE_SOURCES):
    device = target_device() if device is None else device
    user = user_table(device.kind) if "user" in tables else None
    if user is not None and key in user.tables.get(name, {}):
        return user.tables[name][key]
    measured = MEASURED_TABLES.get(device.kind) if "shipped" in tables else {}
    if measured is None:
        if device.kind != REFERENCE_DEVICE_KIND and user is None:
            _warn_untuned(device)
        measured = {}
    table = measured.get(name, {})
    return table[key] if key in table else defaults.get(key, fallback)


def prefill_config(head_size: int, dtype_name: str, paged: bool = False,
                   device: TuningDevice | None = None, *,
                   tables: tuple[str, ...] = TABLE_SOURCES) -> PrefillConfig:
    """The varlen kernel's config for ``device`` (default: `target_device`): the user
    table's entry (`user_table`), else the shipped measured one, else `PREFILL_TABLE`'s,
    else `PrefillConfig()`. ``tables``: which tables to consult (`TABLE_SOURCES`)."""
    key = (next_power_of_2(head_size), dtype_name, bool(paged))
    return _lookup("PREFILL_TABLE", PREFILL_TABLE, key, PrefillConfig(), device, tables)


def decode_config(head_size: int, block_size: int, group_size: int,
                  device: TuningDevice | None = None, *,
                  tables: tuple[str, ...] = TABLE_SOURCES) -> DecodeConfig:
    """The decode kernel's config for ``device`` (default: `target_device`): the user
    table's entry, else the shipped measured one, else `DECODE_TABLE`'s, else the entry
    (user or measured) of the nearest key with the same head size
    (`nearest_decode_key`), else `DecodeConfig()`. ``tables``: which tables to consult
    (`TABLE_SOURCES`)."""
    key = (next_power_of_2(head_size), block_size, next_power_of_2(group_size))
    config = _lookup("DECODE_TABLE", DECODE_TABLE, key, None, device, tables)
    if config is not None:
        return config
    device = target_device() if device is None else device
    user = user_table(device.kind) if "user" in tables else None
    shipped = MEASURED_TABLES.get(device.kind, {}) if "shipped" in tables else {}
    known = {**DECODE_TABLE, **shipped.get("DECODE_TABLE", {}),
             **(user.tables.get("DECODE_TABLE", {}) if user is not None else {})}
    nearest = nearest_decode_key(key, known)
    return DecodeConfig() if nearest is None else known[nearest]


def nearest_decode_key(key: tuple[int, int, int], known: Iterable[tuple[int, int, int]]
                       ) -> tuple[int, int, int] | None:
    """The measured `DECODE_TABLE` key nearest to ``key`` ``(head size, block size, group
    size)`` among those of the same head size: the closest block size, then the closest
    group size, both on a log scale (ties: the smaller). None when no key has that head size.

    An unmeasured GQA group or page size then takes a config measured on this GPU for
    the same head size rather than the generic default. On the H200 the default
    (4 warps, 3 stages, no page-id prefetch) read K/V at 60 % of the DRAM bandwidth at
    B256 ctx1024 Hq32 Hk4 D64 (a group of 8, no table entry; Nsight Compute, 2026-12-04)
    where torch's cuDNN read at 81 %."""
    head_size, block_size, group_size = key
    same_head = [k for k in known if k[0] == head_size]
    if not same_head:
        return None

    def distance(k: tuple[int, int, int]) -> tuple[float, float, int, int]:
        return (abs(math.log2(k[1] / block_size)), abs(math.log2(k[2] / group_size)), k[1], k[2])

    return min(same_head, key=distance)


MOSAIC_DECODE_MEASURED = MosaicDecodeConfig(num_stages=4, target_programs=512, compute_warpgroups=1,
                                            items_per_program=0)
"""The Mosaic GPU decode kernel's measured config: a producer warpgroup and one compute
warpgroup, 4 stages, programs attending one wave's worth of sequences each. On the H200
(benchmarks/NOTES.md, 2026-12-03 05:59 UTC, D 128, page 16, alternating rounds in one
process) 3-5 % faster than `MosaicDecodeConfig()` on every decode shape of the
benchmark (3,495-3,622 GB/s against 3,349-3,519)."""


def mosaic_decode_config(head_size: int, block_size: int, group_size: int) -> MosaicDecodeConfig:
    """The Mosaic GPU decode kernel's config: `MOSAIC_DECODE_MEASURED` for every shape (the
    plan fits its stages to shared memory: fewer at D 256 or with fp8 upcast buffers; the
    arguments are the key a per-shape table will use, as `decode_config`'s)."""
    del head_size, block_size, group_size
    return MOSAIC_DECODE_MEASURED


@dataclasses.dataclass(frozen=True)
class CacheWriteConfig:
    """Tiling of the cache-write kernel (`jax_paged_attn.kernels.triton_cache`).

    tokens_per_program: tokens (rows) per program, a power of 2; cols_per_program:
    columns of a ``Hk * D`` row per program, a power of 2 (the last column block is
    masked when it passes ``Hk * D``); num_warps: Triton launch parameter.
    """

    tokens_per_program: int
    cols_per_program: int
    num_warps: int = 4


CACHE_WRITE_MAX_COLS = 2048
CACHE_WRITE_ELEMENTS_PER_PROGRAM = 4096  # of key (and of value): 4 tokens of Hk * D = 1024


def cache_write_config(num_tokens: int, row_size: int) -> CacheWriteConfig:
    """Whole rows (up to 2048 columns) and about 4096 elements of key per program:
    small enough to keep many programs in flight on a decode step of a few hundred
    tokens, large enough that each program moves a few KiB per tensor (1581 GB/s on a
    32k-token bf16 prefill write on an H200, benchmarks/RESULTS.md)."""
    cols = min(next_power_of_2(row_size), CACHE_WRITE_MAX_COLS)
    tokens = max(1, CACHE_WRITE_ELEMENTS_PER_PROGRAM // cols)
    tokens = min(tokens, next_power_of_2(max(num_tokens, 1)))
    return CacheWriteConfig(tokens_per_program=tokens, cols_per_program=cols)


ROTARY_CACHE_WRITE_ELEMENTS_PER_PROGRAM = 1024
"""Query elements (tokens x padded group x padded head size) one program of the fused
rotary + cache-write kernel rotates: a decode step's few dozen tokens spread over tens
of programs, so the step's latency is one program's loads, not a queue of them."""

ADD_RMS_NORM_ELEMENTS_PER_PROGRAM = 2048
"""Row elements one program of the fused residual add + RMSNorm handles (whole rows, at
least one): a decode step normalizes a few dozen rows of a few thousand elements, so
one row per program keeps every row's latency to one program's loads."""

ADD_RMS_NORM_LOADS_PER_WARP = 1024
"""Elements of the partial products each warp of the fused residual add + RMSNorm loads
(32 per thread): a decode row of 2,048 summed over 8 split-K partials takes 16 warps."""



@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling of the weight-streaming matmul (`jax_paged_attn.matmul`).

    block_n: output columns per program (``block_n`` contiguous weight elements per
    row read); block_k: weight rows per loop step; split_k: ranges of ``K`` computed
    by separate programs and summed afterwards, 0 = the fewest (a power of 2) that
    give at least ``target_programs`` programs while each range keeps at least
    ``min_k_steps`` steps; num_warps / num_stages: Triton launch parameters;
    eviction_policy: the weight loads' L2 hint ("evict_first": weights are read once
    per step; "" for none).
    """

    block_n: int = 64
    block_k: int = 128
    split_k: int = 0
    target_programs: int = 256
    min_k_steps: int = 4
    num_warps: int = 4
    num_stages: int = 4
    eviction_policy: str = "evict_first"


MATMUL_MAX_ROWS = 128
"""The weight-streaming matmul's largest row count: its float32 accumulator is
``rows x block_n`` registers per program, and past a few hundred rows a product is no
longer bound by its weight reads (XLA's GEMMs take it)."""

MATMUL_TABLE: dict[tuple[int, int, int], MatmulConfig] = {
    # (K, N, rows rounded up to a power of 2 >= 16) -> the sweep's best config on an H200
    # (`benchmarks/bench_matmul.py`, 2026-12-02, jax 0.11.2). Comments: us per product
    # in that benchmark's chains, ours / XLA's dot. Inside the engine's decode step the
    # same products ran level with XLA's GEMMs; auto takes the kernel there for the work
    # it folds in (the fused decoder layers: benchmarks/NOTES.md, "Fused decoder
    # layers"; `jax_paged_attn.matmul.auto_takes_kernel`).
    (2048, 3072, 16): MatmulConfig(target_programs=512),  # 8.5 / 16.7
    (2048, 3072, 32): MatmulConfig(block_n=128, target_programs=512, num_stages=3),  # 9.3 / 16.5
    (2048, 3072, 128): MatmulConfig(block_n=128, target_programs=512, num_stages=3),  # 13.9 / 19.3
    (2048, 2048, 16): MatmulConfig(block_n=32),  # 7.3 / 11.5
    (2048, 2048, 32): MatmulConfig(num_stages=3),  # 7.9 / 11.6
    (2048, 16384, 32): MatmulConfig(block_k=64, num_stages=6),  # 22.3 / 29.4
}


MATMUL_KERNEL_MEASURED: dict[str, str] = {
    REFERENCE_DEVICE_KIND: "0.88 / 1.01 ms per decode step at batch 1 / 32 against 0.89 / 1.07 with XLA's dot for "
                           "the ~1B Llama, 2026-12-02",
    H100_DEVICE_KIND: "1.05 / 1.29 ms per decode step at batch 1 / 32 against 1.07 / 1.37 with XLA's dot for the "
                      "~1B Llama, 2026-12-07",
}
"""GPU models on which auto runs decode-sized projections through the weight-streaming
kernel and its fused decoder layers, each with the engine measurement that chose it
(benchmarks/NOTES.md, "Fused decoder layers"); every other GPU keeps XLA's dot until
the same comparison (`bench_engine.py --matmul-implementation weight_streaming` against
``xla``) is made on it (`jax_paged_attn.matmul.auto_takes_kernel`)."""


def matmul_config(num_rows: int, depth: int, num_cols: int, device: TuningDevice | None = None) -> MatmulConfig:
    """The weight-streaming matmul's config for ``[num_rows, depth] @ [depth, num_cols]`` on
    ``device`` (default: `target_device`): `MATMUL_TABLE`'s entry on the H200, else the
    default config."""
    device = target_device() if device is None else device
    rows = max(16, next_power_of_2(num_rows))
    if device.kind == REFERENCE_DEVICE_KIND and (depth, num_cols, rows) in MATMUL_TABLE:
        return MATMUL_TABLE[(depth, num_cols, rows)]
    return MatmulConfig()


# --------------------------------------------------------------------------- measured tables
MEASURED_TABLES_FILE = "tuned_tables.json"
"""Package data written by `benchmarks/apply_tuning.py` from a sweep on a GPU
(`bench_attention.py --tune`); each entry names the GPU model it was measured on
(``"device"``) with the shapes, date and jax version, and overrides the defaults above for
the same key on that GPU model only (`MEASURED_TABLES`)."""


def entry_device_kind(entry: dict) -> str:
    """The GPU model of a measured entry: its ``"device"``, else the ``device_kind`` part
    of ``measured.gpu`` (``"NVIDIA H200 (gpu, 1 device(s))"``)."""
    if entry.get("device"):
        return entry["device"]
    gpu = entry.get("measured", {}).get("gpu", "")
    return gpu.split(" (")[0] or REFERENCE_DEVICE_KIND


def load_measured_tables(path) -> dict[str, dict[str, dict[tuple, object]]]:
    """The measured tables in a `MEASURED_TABLES_FILE` (``{}`` when there is none), by GPU
    model and table name. A config field this version does not know (a file written by
    another version) is ignored with a warning naming it."""
    path = pathlib.Path(path)
    tables: dict[str, dict[str, dict[tuple, object]]] = {}
    if not path.exists():
        return tables
    data = json.loads(path.read_text())
    for name, config_type in (("PREFILL_TABLE", PrefillConfig), ("DECODE_TABLE", DecodeConfig)):
        known = {f.name for f in dataclasses.fields(config_type)}
        for entry in data.get(name, []):
            device = entry_device_kind(entry)
            unknown = sorted(set(entry["config"]) - known)
            if unknown:
                warnings.warn(f"{path.name}: the {name} entry {entry['key']} measured on {device} has config "
                              f"fields this version of jax_paged_attn does not know, ignored: {unknown}.",
                              stacklevel=2)
            fields = {k: v for k, v in entry["config"].items() if k in known}
            tables.setdefault(device, {}).setdefault(name, {})[tuple(entry["key"])] = config_type(**fields)
    return tables


MEASURED_TABLES.update(load_measured_tables(pathlib.Path(__file__).with_name(MEASURED_TABLES_FILE)))


def table_entry(device: str, key: Iterable, config: dict[str, Any], score: float | None,
                shapes: list[str], measured: dict[str, Any]) -> dict[str, Any]:
    """One entry of a table file (`MEASURED_TABLES_FILE` or a user table): the GPU model,
    the table key, the config's fields, its score (geometric mean of the per-shape best
    time over its time), the shapes it was chosen on and where the numbers come from."""
    return {"device": device, "key": list(key), "config": dict(config),
            "score": None if score is None else round(score, 4), "shapes": list(shapes), "measured": dict(measured)}


# --------------------------------------------------------------------------- user tables
TUNE_COMMAND = "python3 -m jax_paged_attn.tune"
"""The command that measures a user table (`jax_paged_attn.tune`)."""

USER_TABLES_ENV = "JAX_PAGED_ATTN_TUNING_DIR"
"""Environment variable: the folder of the user tables (default: `user_tables_dir`), or
``off``: no user table is read (the shipped tables and defaults only)."""

USER_TABLE_FORMAT = "jax_paged_attn user tuning table"
USER_TABLE_VERSION = 1
"""The user table file's ``format`` and ``version``: a file of another format or version
is not read (warned, then the shipped tables and defaults apply)."""

TABLE_NAMES = ("PREFILL_TABLE", "DECODE_TABLE")
_CONFIG_TYPES = {"PREFILL_TABLE": PrefillConfig, "DECODE_TABLE": DecodeConfig}
_QUERY_DTYPES = ("bfloat16", "float16", "float32")
# Integer config fields that must be powers of 2, and the least value of each (else 0):
# what the kernels' own checks (`jax_paged_attn.plans`) refuse at call time.
_POWER_OF_2_FIELDS = frozenset({"block_q", "block_k", "masked_block_k", "num_warps", "max_q_rows"})
_LEAST = {"block_q": 16, "block_k": 16, "masked_block_k": 16, "max_q_rows": 16, "num_stages": 1,
          "num_stages_paged": 1, "pages_per_step": 1, "target_programs": 1, "num_warps": 1}


class UserTableWarning(UserWarning):
    """A user table file is not used (malformed, an invalid entry, written for another
    GPU or JAX version); said once per file, with the command that writes a new one."""


def device_slug(device_kind: str) -> str:
    """``"NVIDIA H100 PCIe"`` -> ``"nvidia-h100-pcie"``: a GPU model as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"


def user_tables_dir() -> pathlib.Path | None:
    """The folder of the user tables: ``$JAX_PAGED_ATTN_TUNING_DIR``, else
    ``$XDG_CACHE_HOME/jax_paged_attn/tuning`` (``~/.cache/jax_paged_attn/tuning``, beside
    the engine's compilation cache in ``jax_paged_attn/xla``); None when the variable is
    ``off``."""
    chosen = os.environ.get(USER_TABLES_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jax_paged_attn" / "tuning"


def user_table_path(device_kind: str, directory: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The user table file of a GPU model: ``<directory>/<device_slug>.json`` (directory
    default: `user_tables_dir`; None when user tables are off)."""
    folder = user_tables_dir() if directory is None else pathlib.Path(directory)
    return None if folder is None else folder / f"{device_slug(device_kind)}.json"


@dataclasses.dataclass(frozen=True)
class UserTable:
    """A user table as loaded: its file, the GPU model and JAX version it was measured
    with, when and by which command, and its configs by table name and key."""

    path: pathlib.Path
    device_kind: str
    jax_version: str
    date: str
    command: str
    tables: dict[str, dict[tuple, Any]]


def _is_power_of_2(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def config_from_fields(table: str, fields: Any) -> PrefillConfig | DecodeConfig:
    """The config of a table entry's ``"config"`` fields, every field checked against the
    config dataclass (known name, type, range); ValueError naming the field otherwise."""
    config_type = _CONFIG_TYPES[table]
    if not isinstance(fields, dict):
        raise ValueError(f"config must be an object of {config_type.__name__} fields, got {fields!r}")
    types = {f.name: f.type for f in dataclasses.fields(config_type)}
    unknown = sorted(set(fields) - set(types))
    if unknown:
        raise ValueError(f"{config_type.__name__} has no field(s) {unknown}")
    for name, value in fields.items():
        if value is None and "None" in types[name]:
            continue
        wanted = bool if types[name] == "bool" else int
        if type(value) is not wanted:  # (a bool is an int; 2.0 is not)
            raise ValueError(f"config.{name} must be {types[name]}, got {value!r}")
        if wanted is int and (value < _LEAST.get(name, 0)
                              or (name in _POWER_OF_2_FIELDS and not _is_power_of_2(value))):
            raise ValueError(f"config.{name}={value!r} is out of range")
    return config_type(**fields)


def key_from_list(table: str, key: Any) -> tuple:
    """A table key from its JSON list, checked: PREFILL_TABLE ``[head size (a power of 2),
    query dtype name, paged]``, DECODE_TABLE ``[head size, block size, query heads per KV
    head (powers of 2 but the block size)]``; ValueError otherwise."""
    if table == "PREFILL_TABLE":
        ok = (isinstance(key, list) and len(key) == 3 and type(key[0]) is int and _is_power_of_2(key[0])
              and key[1] in _QUERY_DTYPES and type(key[2]) is bool)
    else:
        ok = (isinstance(key, list) and len(key) == 3 and all(type(k) is int and k >= 1 for k in key)
              and _is_power_of_2(key[0]) and _is_power_of_2(key[2]))
    if not ok:
        raise ValueError(f"{table} key {key!r} is not a valid key")
    return tuple(key)


def read_user_table(path: str | os.PathLike, device_kind: str | None = None,
                    jax_version: str | None = None) -> UserTable:
    """The user table in ``path``, checked whole: its format and version, the GPU model
    (``device_kind`` if given), the JAX version (``jax_version`` if given) and every
    entry's key and config fields. Raises ValueError (or OSError) saying what is wrong:
    a table is used entire or not at all."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(data, dict) or data.get("format") != USER_TABLE_FORMAT:
        raise ValueError(f"not a user tuning table (no \"format\": {USER_TABLE_FORMAT!r})")
    if data.get("version") != USER_TABLE_VERSION:
        raise ValueError(f"format version {data.get('version')!r}, this jax_paged_attn reads {USER_TABLE_VERSION}")
    for field in ("device_kind", "jax_version", "date", "command"):
        if not isinstance(data.get(field), str):
            raise ValueError(f"no {field!r} string")
    if device_kind is not None and data["device_kind"] != device_kind:
        raise ValueError(f"measured on a {data['device_kind']}, not this {device_kind}")
    if jax_version is not None and data["jax_version"] != jax_version:
        raise ValueError(f"measured with jax {data['jax_version']}, this process runs jax {jax_version}")
    tables: dict[str, dict[tuple, Any]] = {}
    for name in TABLE_NAMES:
        entries = data.get(name, [])
        if not isinstance(entries, list):
            raise ValueError(f"{name} must be a list of entries")
        for i, entry in enumerate(entries):
            try:
                if not isinstance(entry, dict):
                    raise ValueError("not an object")
                if entry.get("device") != data["device_kind"]:
                    raise ValueError(f"device {entry.get('device')!r} is not the table's {data['device_kind']!r}")
                key = key_from_list(name, entry.get("key"))
                tables.setdefault(name, {})[key] = config_from_fields(name, entry.get("config"))
            except ValueError as e:
                raise ValueError(f"{name} entry {i}: {e}") from e
    return UserTable(path, data["device_kind"], data["jax_version"], data["date"], data["command"], tables)


_user_tables: dict[str, UserTable | None] = {}


def user_table(device_kind: str) -> UserTable | None:
    """The user table of a GPU model (`user_table_path`), read on the first call for it
    and kept: None where there is no file, user tables are off, or the file cannot be
    used (malformed, an invalid entry, another GPU model or JAX version), which a
    `UserTableWarning` names once with the file's path and the command to re-tune."""
    if device_kind in _user_tables:
        return _user_tables[device_kind]
    table, path = None, user_table_path(device_kind)
    if path is not None and path.exists():
        import jax

        try:
            table = read_user_table(path, device_kind, jax.__version__)
        except (OSError, ValueError) as e:
            warnings.warn(f"the user tuning table {path} is not used: {e}. The shipped tables and defaults apply; "
                          f"`{TUNE_COMMAND}` measures a new table for this GPU and JAX version.",
                          UserTableWarning, stacklevel=4)
    _user_tables[device_kind] = table
    return table


def forget_user_tables() -> None:
    """Read the user tables again on the next lookup (after a tuning run wrote one)."""
    _user_tables.clear()


def user_table_document(device_kind: str, jax_version: str, date: str, command: str,
                        entries: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The JSON document of a user table (`read_user_table` reads it back); ``entries``:
    `table_entry` dicts by table name."""
    return {"format": USER_TABLE_FORMAT, "version": USER_TABLE_VERSION, "device_kind": device_kind,
            "jax_version": jax_version, "date": date, "command": command,
            **{name: sorted(entries.get(name, []), key=lambda e: json.dumps(e["key"])) for name in TABLE_NAMES}}


def write_user_table(path: str | os.PathLike, document: dict[str, Any]) -> pathlib.Path:
    """Writes a user table document to ``path`` atomically (a temporary file in the same
    folder, then `os.replace`): a process reading it sees the old file or the new one,
    never half of one. Returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(document, indent=1) + "\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path
