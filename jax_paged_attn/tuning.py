"""Kernel configurations and the tables that choose them, shared by every lowering.

Kernel files never pick their own block sizes: the wrappers in `jax_paged_attn.prefill`
and `jax_paged_attn.decode` ask this module, and an explicit ``config=`` argument
overrides the table (benchmarks sweep configs that way).

Table keys are rounded to powers of two before lookup (so nearby shapes share an
entry); a missing key falls back to the default config. Entries were chosen by
measurement on an H200 with `benchmarks/bench_attention.py --tune` (see
benchmarks/RESULTS.md); the key layout is documented on each table.
"""
from __future__ import annotations

import dataclasses


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
    pipeliner spends stages on that load too, so a paged call may want more.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = True
    longest_first: bool = True
    num_stages_paged: int | None = None


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
    programs; num_warps / num_stages: Triton launch parameters. The K/V addresses come
    from a block-table load in the same step, so Triton's pipeliner splits num_stages
    between the two loads: K/V get ``(num_stages - 1) // 2`` buffers (at least 1), i.e.
    num_stages 3 and 4 prefetch one tile ahead, 5 and 6 two, 7 three.
    """

    pages_per_step: int = 4
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 3
    max_q_rows: int = 64
    target_programs: int = 1024
    min_tiles_per_split: int = 4


# Shared memory the decode kernel may take (H200: 227 KiB per block); a key tile whose
# estimate (`jax_paged_attn.decode.estimate_shared_memory`) exceeds it is halved.
DECODE_SHARED_MEMORY_BUDGET = 200 * 1024


# key: (head_size rounded up to a power of 2, query dtype name) -> PrefillConfig
PREFILL_TABLE: dict[tuple[int, str], PrefillConfig] = {
    # Starting points reasoned for the H200 (228 KiB shared memory per SM, 64K
    # registers), to be replaced by the measured sweep: 128-row tiles keep the MMA
    # busy at D <= 128; at D = 256 a 128 x 256 f32 accumulator would spill, so 64 rows.
    # Shared memory per stage ~ 2 * block_k * Dp * 2 bytes (K and V tiles).
    **{(d, dt): PrefillConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
       for d in (32, 64) for dt in ("bfloat16", "float16")},
    **{(128, dt): PrefillConfig(block_q=128, block_k=64, num_warps=8, num_stages=3)
       for dt in ("bfloat16", "float16")},
    **{(256, dt): PrefillConfig(block_q=64, block_k=64, num_warps=8, num_stages=2)
       for dt in ("bfloat16", "float16")},
    # float32 runs IEEE f32 dots (FMA, not tensor cores) and doubles every tile's bytes.
    **{(d, "float32"): PrefillConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
       for d in (32, 64, 128, 256)},
}

# key: (head_size rounded up to a power of 2, block_size, query heads per KV head rounded
# up to a power of 2) -> DecodeConfig
DECODE_TABLE: dict[tuple[int, int, int], DecodeConfig] = {
    # Measured 2026-11-29 on an H200 (jax 0.11.2), `bench_attention.py --tune --suite decode`:
    # 24 configs on B64 ctx4096 / B8 ctx32768 / B256 ctx1024 (group 4) and B32 ctx8192
    # (group 8), D128 page 16 bf16; best geomean 0.404-0.409 ms per shape (2.6 TB/s).
    (128, 16, 4): DecodeConfig(pages_per_step=4, num_warps=4, num_stages=2),
    (128, 16, 8): DecodeConfig(pages_per_step=4, num_warps=4, num_stages=2),
}


def prefill_config(head_size: int, dtype_name: str) -> PrefillConfig:
    return PREFILL_TABLE.get((next_power_of_2(head_size), dtype_name), PrefillConfig())


def decode_config(head_size: int, block_size: int, group_size: int) -> DecodeConfig:
    key = (next_power_of_2(head_size), block_size, next_power_of_2(group_size))
    return DECODE_TABLE.get(key, DecodeConfig())
