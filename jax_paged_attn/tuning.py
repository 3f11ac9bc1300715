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
    """Tiling of the varlen (prefill) kernel.

    block_q: query rows per program; block_k: keys per inner-loop step (a multiple
    of the cache block size for paged KV); num_warps / num_stages: Triton launch
    parameters.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


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
    programs; num_warps / num_stages: Triton launch parameters.
    """

    pages_per_step: int = 4
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 3
    max_q_rows: int = 64
    target_programs: int = 1024
    min_tiles_per_split: int = 4


# Shared memory the decode kernel's pipelined K/V tiles may take (H200: 227 KiB per
# block); larger tiles are shrunk to fit.
DECODE_SHARED_MEMORY_BUDGET = 160 * 1024


# key: (head_size rounded up to a power of 2, query dtype name) -> PrefillConfig
PREFILL_TABLE: dict[tuple[int, str], PrefillConfig] = {}

# key: (head_size rounded up to a power of 2, block_size, query heads per KV head rounded
# up to a power of 2) -> DecodeConfig
DECODE_TABLE: dict[tuple[int, int, int], DecodeConfig] = {}


def prefill_config(head_size: int, dtype_name: str) -> PrefillConfig:
    return PREFILL_TABLE.get((next_power_of_2(head_size), dtype_name), PrefillConfig())


def decode_config(head_size: int, block_size: int, group_size: int) -> DecodeConfig:
    key = (next_power_of_2(head_size), block_size, next_power_of_2(group_size))
    return DECODE_TABLE.get(key, DecodeConfig())
