"""The configs the benchmarks sweep, beside the package's tuning sweep (`jax_paged_attn.tune`).

Owns: the grids the swept peers take the best of (`mosaic_decode_grid` and
`mosaic_prefill_grid` for our Mosaic GPU tiers, `stock_paged_grid` for JAX's stock
paged attention), and what ``bench_attention.py --tune`` adds to the package's grid and
timing loop: the tuning table's keys and current choice for a case, the grid it sweeps
per suite (the current choices first) and the calls of our kernels with a given config.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax

from jax_paged_attn import tune
from suites import AttentionCase, AttentionInputs, DecodeCase, DecodeInputs
from timing import Context


# --------------------------------------------------------------------------- the swept peers' grids


def mosaic_decode_grid(quick: bool) -> list[Any]:
    """MosaicDecodeConfigs the ours_mosaic_gpu peer sweeps, the package default first:
    (tile_keys, num_stages, target_programs, compute_warpgroups, items_per_program,
    keys_as_m). Starting points: stage depth (bytes in flight per program) against
    programs per SM (shared memory ~ num_stages * 2 * tile_keys * 256 B at D 128 bf16,
    plus ~40 KiB), the warp-specialized forms and several sequences a program (0: one
    wave) first, the keys as the wgmmas' M side (slower on an H100, 2026-12-07) next to them."""
    from jax_paged_attn.tuning import MOSAIC_DECODE_MEASURED, MosaicDecodeConfig

    choices = ((64, 4, 512, 1, 0, False), (64, 4, 512, 1, 0, True), (64, 4, 512, 2, 1, False)) if quick else (
        (64, 4, 512, 1, 0, False), (64, 4, 512, 1, 0, True), (64, 2, 1024, 0, 1, True), (128, 3, 1024, 0, 1, True),
        (64, 4, 512, 2, 0, False), (64, 4, 512, 1, 4, False), (64, 4, 512, 2, 1, False),
        (64, 4, 1024, 2, 1, False), (64, 4, 1024, 1, 1, False), (64, 2, 1024, 1, 1, False),
        (64, 2, 1024, 2, 1, False), (64, 4, 1024, 1, 0, False), (64, 3, 1024, 0, 1, False),
        (64, 6, 1024, 0, 1, False), (128, 2, 1024, 0, 1, False), (128, 3, 1024, 0, 1, False),
        (64, 4, 512, 0, 1, False), (64, 4, 2048, 0, 1, False), (64, 4, 4096, 0, 1, False),
    )
    grid = [MosaicDecodeConfig(tile_keys=t, num_stages=st, target_programs=p, compute_warpgroups=w,
                               items_per_program=i, keys_as_m=k)
            for t, st, p, w, i, k in choices]
    return list(dict.fromkeys([MOSAIC_DECODE_MEASURED] + grid))


def stock_paged_grid(pages_per_seq: int, quick: bool) -> list[tuple[int, int]]:
    """(k_splits, pages_per_compute_block) pairs the stock kernel accepts for this length.

    It needs k_splits | pages_per_seq and min(block, pages per split) | pages per split;
    pairs that run the same kernel (block clipped to the split) are kept once.
    """
    splits = (16, 32) if quick else (4, 16, 32)
    blocks = (8,) if quick else (8, 16)
    grid = []
    for k_splits, per_block in itertools.product(splits, blocks):
        if pages_per_seq % k_splits:
            continue
        per_split = pages_per_seq // k_splits
        effective = min(per_block, per_split)
        if per_split % effective == 0 and (k_splits, effective) not in grid:
            grid.append((k_splits, effective))
    return grid


def mosaic_prefill_grid(quick: bool, head_size: int) -> list[Any]:
    """MosaicPrefillConfigs the ours_mosaic_gpu peer sweeps, the package's default for the
    head size first (`tuning.mosaic_prefill_config`): the warp-specialized form with 2
    ping-ponged compute warpgroups, varying the masked blocks' non-finite check and
    value work tile, ``fence_softmax``, ``direct_output`` (off: the slab per tile),
    128-key blocks whose masked ones run in 64-key parts (block_k is shrunk to fit shared
    memory at large head sizes) and, second, the default with ``prefetch_queries``
    flipped and its warpgroups staggered across heads (``pingpong_across_items``),
    with one persistent program per SM of the device (also with the next item's queries
    prefetched and the stagger across items, and with the softmax beside the previous
    block's P·V) and with ``overlap_softmax``."""
    from jax_paged_attn import tuning
    from jax_paged_attn.tuning import MosaicPrefillConfig

    bk128 = dict(block_k=128, masked_block_k=64)
    choices = [dict(nonfinite_check="probe")] if quick else [
        dict(nonfinite_check="product"), dict(nonfinite_check="key_flags"), dict(nonfinite_check="probe"),
        dict(nonfinite_check="key_flags", value_work_tile="own"),
        dict(direct_output=False), dict(fence_softmax=True), dict(fence_softmax=True, nonfinite_check="probe"),
        dict(bk128, nonfinite_check="probe"), dict(bk128, nonfinite_check="probe", fence_softmax=True),
        dict(bk128, nonfinite_check="key_flags"),
    ]
    default = tuning.mosaic_prefill_config(head_size, "bfloat16")
    # Right after the default: it with its next heads' queries prefetched or not
    # (whichever it does not), its warpgroups staggered across heads (with and without
    # the prefetch), then 1, 4 and 2 heads per
    # program (those the default does not set), then one persistent program per SM (the
    # device's count; the next item's queries prefetched and the stagger across items;
    # the overlapped softmax too), then the default with the overlapped softmax.
    flipped = not default.prefetch_queries
    heads = [dataclasses.replace(default, prefetch_queries=flipped),
             dataclasses.replace(default, pingpong_across_items=True, prefetch_queries=flipped),
             dataclasses.replace(default, pingpong_across_items=True)] + [
        dataclasses.replace(default, heads_per_program=n) for n in (1, 4, 2) if n != default.heads_per_program]
    sms = getattr(jax.devices()[0], "core_count", 0) or 0
    persistent = []
    if sms > 0:
        one_per_sm = dataclasses.replace(default, persistent_programs=sms, heads_per_program=1)
        streaming = dataclasses.replace(one_per_sm, prefetch_queries=True, pingpong_across_items=True)
        persistent = [one_per_sm, streaming, dataclasses.replace(streaming, overlap_softmax=True)]
    overlapped = [dataclasses.replace(default, overlap_softmax=True)]
    grid = [MosaicPrefillConfig(**fields) for fields in choices]
    return list(dict.fromkeys([default] + heads + persistent + overlapped + grid))


# =========================================================================== tuning grids


def decode_table_key(case: DecodeCase) -> str:
    """DECODE_TABLE key: (head_size, block_size, query heads per KV head), rounded as tuning.py does."""
    from jax_paged_attn.tuning import next_power_of_2

    return repr((next_power_of_2(case.head_dim), case.page_size, next_power_of_2(case.q_heads // case.kv_heads)))


def prefill_table_key(case: AttentionCase) -> str:
    """PREFILL_TABLE key: (head_size rounded up to a power of 2, query dtype name, paged)."""
    from jax_paged_attn.tuning import next_power_of_2

    return repr((next_power_of_2(case.head_dim), case.dtype, case.page_size is not None))


def table_choice(suite: str, case: Any) -> Any:
    """The config the current tuning table gives this shape (what `ours` runs)."""
    from jax_paged_attn import tuning

    if suite == "decode":
        return tuning.decode_config(case.head_dim, case.page_size, case.q_heads // case.kv_heads)
    return tuning.prefill_config(case.head_dim, case.dtype, paged=case.page_size is not None)


def tune_grid(suite: str, cases: Sequence[Any], quick: bool) -> list[Any]:
    """The current table's choices first, then the package's grid (`jax_paged_attn.tune`:
    the decode grid, or the varlen kernel's over paged keys for the prefix suite, D 128's
    for varlen, every head size's for prefill), deduplicated, in order."""
    if suite == "decode":
        grid = tune.decode_grid(quick)
    else:
        grid = tune.prefill_grid({"prefix": "paged", "varlen": "varlen"}.get(suite, "dense"), quick)
    return list(dict.fromkeys([table_choice(suite, c) for c in cases] + grid))


def decode_with_config(ctx: Context, case: DecodeCase, x: DecodeInputs, config: Any) -> Callable[[], Any]:
    return tune.decode_call(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, config, ctx.interpret)


def prefill_with_config(ctx: Context, case: AttentionCase, x: AttentionInputs, config: Any) -> Callable[[], Any]:
    return tune.prefill_call(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.block_table, x.max_q, x.max_k,
                             config, ctx.interpret)
