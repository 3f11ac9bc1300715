"""The varlen (prefill) Pallas kernel in interpret mode against `reference.varlen_attention`.

* Main grid: the public `flash_attn_varlen_func(..., implementation="triton",
  interpret=True)`, packed and paged, over GQA / MQA, head sizes, masks, ALiBi,
  soft-cap, fp8 caches, ragged lengths and padding rows. Problems come from
  conftest's builders: NaN in every unused cache slot and padding row, randomly
  permuted block tables.
* Tilings: `prefill.varlen_attention` with explicit configs (GQA packing on / off,
  small tiles, lengths at tile boundaries, a group that does not divide block_q, one
  KV loop or three, page ids prefetched or read in the step).
* The tile plan in isolation, checked exhaustively against the mask rules.
* Cross-lowering for CUDA on this CPU host finds the Triton call.

Every case is jitted once (interpret mode run eagerly would compile op by op).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn
from conftest import (VarlenProblem, alibi_slopes, assert_nonfinite_rows_match_oracle, lower_for_cuda,
                      covering_cases, make_varlen_problem, poison_keys, profiled_trace_events)
from jax_paged_attn import plans, prefill, reference, tuning
from jax_paged_attn.spec import UNBOUNDED, AttentionSpec

pytestmark = pytest.mark.covering  # products: a covering subset by default, all with --full (conftest.py)

TRITON_CALL = "__gpu$xla.gpu.triton"

# Max |kernel - reference| allowed, by query dtype. The kernel rounds the probabilities
# to the input dtype before the P.V product (as flash-attention does); the reference
# keeps them in float32. Outputs are O(1).
TOLERANCE = {jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float16): 4e-3, jnp.dtype(jnp.float32): 1e-4}


def _attention_kwargs(problem: VarlenProblem, attention: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(attention)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = alibi_slopes(problem.q.shape[1])
    return kwargs


def _api(problem: VarlenProblem, implementation: str, attention: dict[str, Any]) -> jax.Array:
    """`flash_attn_varlen_func` on the problem, jitted with the static arguments bound."""
    kwargs = _attention_kwargs(problem, attention)
    slopes = kwargs.pop("alibi_slopes", None)
    fn = functools.partial(
        jax_paged_attn.flash_attn_varlen_func, max_seqlen_q=problem.max_seqlen_q,
        max_seqlen_k=problem.max_seqlen_k, implementation=implementation,
        interpret=implementation in ("triton", "mosaic_gpu"), **kwargs)
    return jax.jit(fn)(alibi_slopes=slopes, **problem.arrays())


def _assert_matches_reference(out: jax.Array, problem: VarlenProblem, attention: dict[str, Any]) -> None:
    ref = _api(problem, "xla", attention)
    assert out.shape == problem.q.shape and out.dtype == problem.q.dtype
    got = np.asarray(out.astype(jnp.float32))
    want = np.asarray(ref.astype(jnp.float32))
    bad = np.argwhere(~np.isfinite(got))
    assert bad.size == 0, f"non-finite output at (row, head, dim) {bad[:5].tolist()}"
    error = np.abs(got - want)
    worst = float(error.max(initial=0.0))
    allowed = TOLERANCE[jnp.dtype(problem.q.dtype)]
    assert worst <= allowed, (
        f"max |kernel - reference| = {worst:.3g} at {np.unravel_index(np.argmax(error), error.shape)} "
        f"> {allowed}")
    # Rows after cu_seqlens_q[-1] are padding: exactly 0.
    total = int(problem.cu_seqlens_q[-1])
    assert not np.any(got[total:]), "padding rows after cu_seqlens_q[-1] must be 0"


# (id, problem builder kwargs, attention kwargs). Lengths straddle the default tiles
# (block_q 128 rows; with GQA packing 128 / group positions per tile). The GQA-4 cases
# have one KV head (the interpreter's time grows with the heads); the GQA-2 and MHA cases
# keep two, so the kernels' per-KV-head indexing is still checked.
MAIN_GRID = [
    ("packed-gqa4-d64-bf16-causal-ragged",
     dict(q_lens=[1, 31, 32, 33, 65], num_q_heads=4, num_kv_heads=1, head_size=64,
          q_padding_rows=3, k_padding_rows=2),
     dict(causal=True)),
    ("packed-prefix-cached-mqa-d80-f16",  # 5 new tokens on 37 cached ones
     dict(q_lens=[5, 3], k_lens=[37, 3], num_q_heads=4, num_kv_heads=1, head_size=80,
          dtype=jnp.float16, q_padding_rows=2),
     dict(causal=True)),
    ("packed-mha-d128-f32-noncausal",
     dict(q_lens=[17, 40], k_lens=[23, 40], num_q_heads=2, num_kv_heads=2, head_size=128,
          dtype=jnp.float32, q_padding_rows=1),
     dict(causal=False)),
    ("paged-bs16-gqa4-d64-bf16-causal-prefix",
     dict(q_lens=[5, 40, 1], k_lens=[37, 40, 100], num_q_heads=4, num_kv_heads=1, head_size=64,
          paged=True, block_size=16, extra_blocks=24, q_padding_rows=4),
     dict(causal=True)),
    ("paged-bs32-mqa-d128-f16-causal-window",
     dict(q_lens=[20, 3], k_lens=[50, 33], num_q_heads=4, num_kv_heads=1, head_size=128,
          dtype=jnp.float16, paged=True, block_size=32, extra_blocks=6),
     dict(causal=True, window_size=(8, 0))),
    ("paged-bs16-mha-d64-window-both-sides",
     dict(q_lens=[30, 7], k_lens=[45, 7], num_q_heads=2, num_kv_heads=2, head_size=64,
          paged=True, block_size=16, q_padding_rows=2),
     dict(window_size=(16, 4))),
    ("packed-gqa2-d64-window-right-only",
     dict(q_lens=[33, 9], k_lens=[40, 9], num_q_heads=4, num_kv_heads=2, head_size=64),
     dict(window_size=(UNBOUNDED, 3))),
    ("packed-gqa2-d80-window-left-only",
     dict(q_lens=[33, 9], k_lens=[40, 20], num_q_heads=4, num_kv_heads=2, head_size=80),
     dict(window_size=(10, UNBOUNDED))),
    ("packed-gqa2-d64-alibi-causal",
     dict(q_lens=[24, 50], k_lens=[30, 50], num_q_heads=4, num_kv_heads=2, head_size=64,
          q_padding_rows=2),
     dict(causal=True, alibi=True)),
    ("paged-bs16-gqa4-d128-alibi-window-noncausal",
     dict(q_lens=[12, 30], k_lens=[40, 30], num_q_heads=8, num_kv_heads=2, head_size=128,
          paged=True, block_size=16),
     dict(window_size=(20, 6), alibi=True)),
    ("paged-bs32-gqa2-d64-f16-softcap-causal",
     dict(q_lens=[16, 45], k_lens=[70, 45], num_q_heads=4, num_kv_heads=2, head_size=64,
          dtype=jnp.float16, paged=True, block_size=32, extra_blocks=8),
     dict(causal=True, softcap=5.0, softmax_scale=0.3)),
    ("paged-fp8e4m3-bs16-gqa4-d64-bf16-causal",
     dict(q_lens=[5, 33], k_lens=[37, 60], num_q_heads=4, num_kv_heads=1, head_size=64,
          paged=True, block_size=16, cache_dtype=jnp.float8_e4m3fn, k_scale=0.5, v_scale=2.0,
          extra_blocks=10, q_padding_rows=2),
     dict(causal=True)),
    ("paged-fp8e5m2-bs32-mqa-d80-f16-alibi",
     dict(q_lens=[9, 20], k_lens=[40, 20], num_q_heads=4, num_kv_heads=1, head_size=80,
          dtype=jnp.float16, paged=True, block_size=32, cache_dtype=jnp.float8_e5m2,
          k_scale=0.25, v_scale=1.5),
     dict(causal=True, alibi=True)),
    ("paged-bs16-gqa2-d256-bf16-causal",
     dict(q_lens=[7, 20], k_lens=[30, 20], num_q_heads=2, num_kv_heads=1, head_size=256,
          paged=True, block_size=16, q_padding_rows=1),
     dict(causal=True)),
    ("paged-seqused-k-gqa4-d64",  # cu_seqlens_k claims 3 extra keys; seqused_k wins
     dict(q_lens=[6, 17], k_lens=[19, 50], num_q_heads=4, num_kv_heads=1, head_size=64,
          paged=True, block_size=16, use_seqused_k=True),
     dict(causal=True)),
    ("packed-more-queries-than-keys-causal",  # the first 6 rows see no key: 0, not NaN
     dict(q_lens=[10, 2], k_lens=[4, 2], num_q_heads=4, num_kv_heads=2, head_size=64),
     dict(causal=True)),
    ("packed-empty-sequences",  # a sequence without queries, one without keys
     dict(q_lens=[0, 7, 3], k_lens=[5, 0, 9], num_q_heads=4, num_kv_heads=2, head_size=64,
          q_padding_rows=2),
     dict(causal=False)),
    ("packed-lengths-past-max-seqlen",  # flash-attention trusts max_seqlen: rows past it are 0
     dict(q_lens=[10, 4], k_lens=[12, 4], num_q_heads=4, num_kv_heads=2, head_size=64,
          max_seqlen_q=6, max_seqlen_k=9),
     dict(causal=True)),
]


@pytest.mark.parametrize("build, attention", covering_cases([pytest.param(b, a, id=i) for i, b, a in MAIN_GRID]))
def test_kernel_matches_reference(build, attention):
    problem = make_varlen_problem(np.random.default_rng(0), **build)
    out = _api(problem, "triton", attention)
    _assert_matches_reference(out, problem, attention)


# The Mosaic GPU kernel in the Mosaic GPU interpreter (TMA, barriers, the ring and the
# masks as written; the matmuls as dots, see `kernels.mosaic_prefill`): a subset of the
# main grid, each case a few seconds, covering packed and paged (bs 16 and 32), GQA and
# MQA, D 64 / 80 / 128 / 256, f16 and bf16, causal prefixes, windows, ALiBi, soft-cap,
# fp8 keys and values, seqused_k and empty sequences.
MOSAIC_INTERPRET_CASES = [
    "packed-gqa4-d64-bf16-causal-ragged",
    "packed-prefix-cached-mqa-d80-f16",
    "paged-bs16-gqa4-d64-bf16-causal-prefix",
    "paged-bs32-mqa-d128-f16-causal-window",
    "paged-bs16-mha-d64-window-both-sides",
    "packed-gqa2-d80-window-left-only",
    "packed-gqa2-d64-alibi-causal",
    "paged-bs32-gqa2-d64-f16-softcap-causal",
    "paged-fp8e4m3-bs16-gqa4-d64-bf16-causal",
    "paged-bs16-gqa2-d256-bf16-causal",
    "paged-seqused-k-gqa4-d64",
    "packed-more-queries-than-keys-causal",
    "packed-empty-sequences",
]

# ``--full`` cases: ALiBi and soft-cap run in the interpreter by default in `MOSAIC_TILINGS`'
# cases (paged, with ALiBi slopes, a soft-cap, GQA), whose masks and scores are these.
MOSAIC_INTERPRET_FULL_ONLY = {"packed-gqa2-d64-alibi-causal", "paged-bs32-gqa2-d64-f16-softcap-causal"}

# The ``"key_flags"`` and ``"probe"`` masked blocks (`tuning.MosaicPrefillConfig.nonfinite_check`) on a
# few of them: packed with lead keys, paged with a window, fp8 values.
MOSAIC_KEY_FLAG_CASES = [
    "packed-gqa4-d64-bf16-causal-ragged",
    "paged-bs32-mqa-d128-f16-causal-window",
    "paged-fp8e5m2-bs32-mqa-d80-f16-alibi",
]


@pytest.mark.parametrize("build, attention", covering_cases([
    pytest.param(b, a, id=i, marks=[pytest.mark.full] if i in MOSAIC_INTERPRET_FULL_ONLY else [])
    for i, b, a in MAIN_GRID if i in MOSAIC_INTERPRET_CASES]))
def test_mosaic_kernel_matches_reference(build, attention):
    problem = make_varlen_problem(np.random.default_rng(0), **build)
    out = _api(problem, "mosaic_gpu", attention)
    _assert_matches_reference(out, problem, attention)


def test_query_without_keys_is_zero_not_nan():
    problem = make_varlen_problem(np.random.default_rng(1), q_lens=[10], k_lens=[4],
                                  num_q_heads=2, num_kv_heads=1, head_size=32)
    out = np.asarray(_api(problem, "triton", dict(causal=True)).astype(jnp.float32))
    assert np.all(out[:6] == 0.0)  # bottom-right: query i sees keys <= i - 6
    assert np.all(np.isfinite(out)) and np.any(out[6:] != 0.0)


# --------------------------------------------------------------------------- tilings


def _kernel_with_config(problem: VarlenProblem, config: tuning.PrefillConfig,
                        attention: dict[str, Any], interpret: bool = True,
                        lowering: str = prefill.TRITON) -> jax.Array:
    kwargs = _attention_kwargs(problem, attention)
    slopes = kwargs.pop("alibi_slopes", None)
    spec = AttentionSpec.create(problem.q.shape[-1], has_alibi=slopes is not None, **kwargs)
    fn = functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=problem.max_seqlen_q,
                           max_seqlen_k=problem.max_seqlen_k, interpret=interpret, config=config,
                           lowering=lowering)
    a = problem.arrays()
    return jax.jit(fn)(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                       a["block_table"], a["seqused_k"], slopes, a["k_scale"], a["v_scale"])


TILINGS = [
    # Tiles of 16 positions (one head per tile): lengths at multiples of 16 +- 1.
    ("unpacked-bq16-bk16-boundaries",
     tuning.PrefillConfig(block_q=16, block_k=16, pack_gqa=False),
     dict(q_lens=[15, 16, 17, 31, 33], num_q_heads=4, num_kv_heads=2, head_size=32, q_padding_rows=1),
     dict(causal=True)),
    # Packed GQA: 32 rows = 8 positions x 4 heads; lengths at multiples of 8 +- 1.
    ("packed-bq32-bk16-boundaries-window",
     tuning.PrefillConfig(block_q=32, block_k=16, pack_gqa=True),
     dict(q_lens=[7, 8, 9, 23, 25], k_lens=[7, 20, 9, 40, 25], num_q_heads=8, num_kv_heads=2,
          head_size=32, q_padding_rows=3),
     dict(causal=True, window_size=(11, 0))),
    # Group of 3 does not divide 16 rows: 5 positions x 3 heads, one idle row.
    ("packed-group3-bq16",
     tuning.PrefillConfig(block_q=16, block_k=32, pack_gqa=True),
     dict(q_lens=[4, 5, 6, 11], k_lens=[9, 5, 20, 11], num_q_heads=6, num_kv_heads=2,
          head_size=48, q_padding_rows=2),
     dict(causal=True, alibi=True)),
    # MQA group of 32 > block_q 16 rows: packing is impossible, one head per tile.
    ("mqa-group-larger-than-tile-unpacked",
     tuning.PrefillConfig(block_q=16, block_k=16, pack_gqa=True),
     dict(q_lens=[3, 18], k_lens=[20, 18], num_q_heads=32, num_kv_heads=1, head_size=32),
     dict(causal=True)),
    # KV step of 32 keys over 16-token pages, and of 16 keys over 32-token pages.
    ("paged-bk32-over-bs16",
     tuning.PrefillConfig(block_q=32, block_k=32),
     dict(q_lens=[3, 31], k_lens=[47, 33], num_q_heads=4, num_kv_heads=2, head_size=32,
          paged=True, block_size=16, extra_blocks=5),
     dict(causal=True)),
    ("paged-bk16-over-bs32-in-order",
     tuning.PrefillConfig(block_q=16, block_k=16, longest_first=False),
     dict(q_lens=[3, 31], k_lens=[47, 33], num_q_heads=4, num_kv_heads=2, head_size=32,
          paged=True, block_size=32, extra_blocks=5),
     dict(window_size=(9, 2))),
    # Page ids read in the step that loads the K/V (no prefetch), over a left window.
    ("paged-page-ids-in-step-window",
     tuning.PrefillConfig(block_q=32, block_k=16, prefetch_page_ids=False, num_stages_paged=4),
     dict(q_lens=[3, 31, 18], k_lens=[47, 33, 60], num_q_heads=4, num_kv_heads=2, head_size=32,
          paged=True, block_size=16, extra_blocks=5),
     dict(causal=True, window_size=(20, 0))),
    # Masked loops in steps narrower than block_k (2 and 4 per block): the causal
    # diagonal, the left window edge and the key ends, packed and paged.
    ("packed-masked-steps-half-block-window",
     tuning.PrefillConfig(block_q=32, block_k=32, masked_block_k=16),
     dict(q_lens=[7, 40, 17, 70], k_lens=[30, 40, 50, 70], num_q_heads=8, num_kv_heads=2, head_size=32,
          q_padding_rows=2),
     dict(causal=True, window_size=(21, 0), alibi=True)),
    ("paged-masked-steps-quarter-block-prefetched-ids",
     tuning.PrefillConfig(block_q=16, block_k=64, masked_block_k=16, pack_gqa=False),
     dict(q_lens=[5, 33, 70], k_lens=[70, 33, 90], num_q_heads=4, num_kv_heads=2, head_size=32,
          paged=True, block_size=16, extra_blocks=4),
     dict(causal=True)),
    # One KV loop masking every block: causal diagonal, left window edge, key ends.
    ("packed-single-kv-loop-window-alibi",
     tuning.PrefillConfig(block_q=32, block_k=16, single_kv_loop=True),
     dict(q_lens=[7, 40, 17], k_lens=[30, 40, 50], num_q_heads=8, num_kv_heads=2, head_size=32,
          q_padding_rows=2),
     dict(causal=True, window_size=(21, 0), alibi=True)),
    ("paged-single-kv-loop-prefetched-ids-noncausal",
     tuning.PrefillConfig(block_q=16, block_k=32, single_kv_loop=True, pack_gqa=False),
     dict(q_lens=[5, 33], k_lens=[70, 33], num_q_heads=4, num_kv_heads=2, head_size=32,
          paged=True, block_size=16, extra_blocks=4),
     dict(window_size=(13, 5))),
]


@pytest.mark.parametrize("config, build, attention", covering_cases([pytest.param(c, b, a, id=i)
                                                                     for i, c, b, a in TILINGS]))
def test_tilings_match_reference(config, build, attention):
    problem = make_varlen_problem(np.random.default_rng(2), **build)
    out = _kernel_with_config(problem, config, attention)
    _assert_matches_reference(out, problem, attention)


NONFINITE_TILINGS = [
    ("three-loops-bq16-bk16", tuning.PrefillConfig(block_q=16, block_k=16, pack_gqa=False)),
    ("gqa-packed-bq32-bk16-prefetched-ids", tuning.PrefillConfig(block_q=32, block_k=16, pack_gqa=True,
                                                                prefetch_page_ids=True)),
    ("single-kv-loop", tuning.PrefillConfig(block_q=32, block_k=16, single_kv_loop=True)),
    ("masked-steps-half-block", tuning.PrefillConfig(block_q=32, block_k=32, masked_block_k=16)),
]


POISONED_ATTENTION = dict(causal=True, window_size=(12, 0))


def _poisoned_problem(paged: bool) -> VarlenProblem:
    """NaN / inf in K and V at keys on the causal diagonal and the left window edge of
    `POISONED_ATTENTION`, in blocks shared with rows that may not see them (every KV
    head is poisoned alike: one KV head and a GQA group of 2 hold each case)."""
    problem = make_varlen_problem(np.random.default_rng(3), q_lens=[40, 9], k_lens=[40, 30],
                                  num_q_heads=2, num_kv_heads=1, head_size=32, paged=paged,
                                  q_padding_rows=3)
    nan, inf = float("nan"), float("inf")
    # Sequence 0 (window 12): key 5 seen by rows 5..17, key 20 by rows 20..32, key 39 by
    # row 39; sequence 1 (diagonal i + 21): key 25 seen by rows 4..8.
    return poison_keys(problem, {0: [(5, "k", nan), (20, "v", nan), (39, "v", inf)],
                                 1: [(25, "v", inf), (29, "k", nan)]})


def _assert_nonfinite_rows_match(out: jax.Array, problem: VarlenProblem) -> None:
    exact = problem.oracle(**POISONED_ATTENTION)
    low = problem.oracle(emulate_dtype=jnp.dtype(problem.q.dtype), **POISONED_ATTENTION)
    assert_nonfinite_rows_match_oracle(out, exact, low, problem.q.dtype)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu, id="gpu")])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("config", [pytest.param(c, id=i) for i, c in NONFINITE_TILINGS])
def test_nonfinite_values_reach_only_the_rows_that_see_them(config, paged, interpret):
    """NaN / inf in K and V at keys on the causal diagonal and the window's left edge,
    in blocks shared with rows that may not see them: only the rows that do see them
    are non-finite (masked, unmasked and single-loop blocks, GQA-packed tiles)."""
    problem = _poisoned_problem(paged)
    out = _kernel_with_config(problem, config, POISONED_ATTENTION, interpret=interpret)
    _assert_nonfinite_rows_match(out, problem)


# Mosaic GPU kernel: its TMA ring (num_stages slots refilled as blocks are consumed) and
# the paged copies (gcd(block_k, block_size) rows per TMA, several per barrier) over
# tiles that visit more KV blocks than the ring holds, in both forms: one warpgroup that
# refills the ring itself, and warp-specialized (a producer warpgroup, 1 or 2 compute
# warpgroups: the GPU default; the interpreter runs each warpgroup as a thread, ~2 s per
# grid point, so those cases are small: one head, or the fewest the case's feature needs).
_SINGLE = tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP
# Partial warpgroups at sequence ends and after lead rows, 1-row and whole 64-row sequences.
_OUTPUT_STORE_PROBLEM = dict(q_lens=[150, 9, 1, 70, 64], k_lens=[260, 30, 5, 70, 64], num_q_heads=1,
                             num_kv_heads=1, head_size=64, q_padding_rows=3)
MOSAIC_TILINGS = [
    ("single-ring2-packed-window-wraps",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2),
     dict(q_lens=[70, 9], k_lens=[300, 30], num_q_heads=1, num_kv_heads=1, head_size=64, q_padding_rows=2),
     dict(causal=True, window_size=(100, 0))),
    ("single-ring3-paged-bs48-three-copies-per-block",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=3),
     dict(q_lens=[65, 3], k_lens=[260, 50], num_q_heads=2, num_kv_heads=2, head_size=32, paged=True,
          block_size=48, extra_blocks=4),
     dict(causal=True)),
    ("single-ring2-causal-fence-softmax",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2, fence_softmax=True),
     dict(q_lens=[200, 9], k_lens=[260, 30], num_q_heads=1, num_kv_heads=1, head_size=64),
     dict(causal=True)),
    # Split exponentials: the first 64 keys of each unmasked 128- / 192-key block from the
    # FMA polynomial, one P·V wgmma per part (also fenced); masked blocks keep exp2.
    ("single-bk128-exp2fma-causal-fence-softmax",
     dataclasses.replace(_SINGLE, block_k=128, num_stages=2, exp2_fma_columns=64, fence_softmax=True),
     dict(q_lens=[300, 9], k_lens=[400, 30], num_q_heads=1, num_kv_heads=1, head_size=64),
     dict(causal=True)),
    ("specialized-2wg-pingpong-exp2fma-bk192-gqa-softcap",
     tuning.MosaicPrefillConfig(block_k=192, num_stages=2, compute_warpgroups=2, exp2_fma_columns=64),
     dict(q_lens=[200, 9], k_lens=[330, 30], num_q_heads=2, num_kv_heads=1, head_size=64),
     dict(causal=True, softcap=20.0)),
    # Persistent: 3 programs walk the (tile, head) items, ring and barriers reused across
    # items of different lengths (ragged tiles, surplus tiles of the static grid).
    ("single-persistent-3-programs-paged",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2, persistent_programs=3),
     dict(q_lens=[150, 9, 70], k_lens=[260, 30, 70], num_q_heads=2, num_kv_heads=1, head_size=64, paged=True,
          block_size=32, extra_blocks=2),
     dict(causal=True)),
    # The kernel writes the packed output: whole warpgroups with one TMA copy, partial
    # ones (a sequence's end; lead rows of a sequence starting off a multiple of 8: 159,
    # 168 below) a copy per owned row; sequences of 1 row and of whole 64-row groups.
    ("single-direct-output-packed",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2, direct_output=True), _OUTPUT_STORE_PROBLEM,
     dict(causal=True)),
    # The slab-per-tile output the wrapper gathers from (direct_output off).
    ("single-slab-output-packed",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2, direct_output=False), _OUTPUT_STORE_PROBLEM,
     dict(causal=True)),
    ("specialized-1wg-direct-output-paged-persistent",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=1, direct_output=True,
                                persistent_programs=3),
     dict(q_lens=[70, 9, 64], k_lens=[100, 30, 64], num_q_heads=2, num_kv_heads=1, head_size=64, paged=True,
          block_size=16, extra_blocks=2),
     dict(causal=True)),
    # 128-key blocks whose masked ones run in two 64-key parts (masked_block_k).
    ("single-bk128-masked-parts-packed-window",
     dataclasses.replace(_SINGLE, block_k=128, num_stages=2, masked_block_k=64),
     dict(q_lens=[150, 9], k_lens=[260, 30], num_q_heads=2, num_kv_heads=1, head_size=64),
     dict(causal=True, window_size=(100, 0))),
    # Causal, no window: each 64-row tile's diagonal block has one masked 64-key part,
    # the other hidden from its rows (the first tile) or seen whole by them (the second).
    ("single-bk128-masked-parts-causal-hidden-and-whole-parts",
     dataclasses.replace(_SINGLE, block_k=128, num_stages=2, masked_block_k=64),
     dict(q_lens=[200, 9], k_lens=[200, 30], num_q_heads=1, num_kv_heads=1, head_size=64),
     dict(causal=True)),
    ("specialized-1wg-bk128-masked-parts-paged-fp8-keys",
     tuning.MosaicPrefillConfig(block_k=128, num_stages=2, compute_warpgroups=1, masked_block_k=64),
     dict(q_lens=[20, 3], k_lens=[150, 50], num_q_heads=1, num_kv_heads=1, head_size=32, paged=True,
          block_size=32, extra_blocks=2, cache_dtype=jnp.float8_e4m3fn, k_scale=0.5, v_scale=2.0),
     dict(causal=True)),
    ("single-bk128-paged-bs16-eight-copies-softcap-alibi",
     dataclasses.replace(_SINGLE, block_k=128, num_stages=2),
     dict(q_lens=[20], k_lens=[300], num_q_heads=2, num_kv_heads=2, head_size=64, paged=True,
          block_size=16, dtype=jnp.float16),
     dict(causal=True, softcap=10.0, alibi=True)),
    # The GPU default's forms: a producer and two compute warpgroups (ping-pong or not),
    # three at D 64; the interpreter runs each warpgroup as a thread (tests/conftest.py
    # gives XLA's CPU client a thread for each).
    ("specialized-2wg-packed-window-wraps",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=2, pingpong=False),
     dict(q_lens=[130, 9], k_lens=[300, 30], num_q_heads=1, num_kv_heads=1, head_size=32),
     dict(causal=True, window_size=(100, 0))),
    ("specialized-2wg-pingpong-packed-window-wraps",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=2, pingpong=True),
     dict(q_lens=[130, 9], k_lens=[300, 30], num_q_heads=1, num_kv_heads=1, head_size=32),
     dict(causal=True, window_size=(100, 0))),
    # Causal without a window: the second warpgroup sees the first one's diagonal block
    # whole, and runs it unmasked (the tile's plan has it masked); a NaN behind the mask
    # of the first warpgroup's rows must still reach only the rows that see it.
    ("specialized-2wg-causal-whole-blocks",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=2, pingpong=False),
     dict(q_lens=[256, 100], k_lens=[256, 164], num_q_heads=2, num_kv_heads=1, head_size=64),
     dict(causal=True)),
    # A producer's items stream through the ring back to back (the next item's first
    # blocks in the slots the last one frees): 3 slots, items of 0 to 5 blocks, a
    # window's skipped lead blocks, surplus tiles.
    ("specialized-1wg-persistent-3-programs-paged-ring3-window",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=3, compute_warpgroups=1, persistent_programs=3),
     dict(q_lens=[150, 9, 70, 1], k_lens=[300, 30, 70, 130], num_q_heads=1, num_kv_heads=1, head_size=32,
          paged=True, block_size=32, extra_blocks=2),
     dict(causal=True, window_size=(100, 0))),
    # ... and with two query tiles, each item's queries loaded at the previous item's
    # start (surplus tiles load none).
    ("specialized-1wg-persistent-3-programs-prefetch-queries-packed",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=1, persistent_programs=3,
                                prefetch_queries=True),
     dict(q_lens=[150, 9, 70, 1], k_lens=[300, 30, 70, 130], num_q_heads=2, num_kv_heads=1, head_size=32),
     dict(causal=True)),
    ("specialized-1wg-persistent-2-programs-packed",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=1, persistent_programs=2),
     dict(q_lens=[130, 9, 64], k_lens=[300, 30, 64], num_q_heads=2, num_kv_heads=1, head_size=32),
     dict(causal=True, window_size=(100, 0))),
    ("specialized-2wg-pingpong-persistent-5-programs",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=2, persistent_programs=5),
     dict(q_lens=[256, 100, 31], k_lens=[256, 164, 31], num_q_heads=4, num_kv_heads=2, head_size=64),
     dict(causal=True)),
    # D 256: the probe with one compute warpgroup (its second product tile), and two
    # whose masked blocks borrow the query tile (the default's choice).
    ("specialized-1wg-probe-d256",
     tuning.MosaicPrefillConfig(nonfinite_check="probe"),
     dict(q_lens=[300, 77, 1], k_lens=[300, 140, 9], num_q_heads=4, num_kv_heads=2, head_size=256),
     dict(causal=True, window_size=(120, 0))),
    ("specialized-2wg-pingpong-key-flags-query-tile-d256",
     tuning.MosaicPrefillConfig(nonfinite_check="key_flags"),
     dict(q_lens=[300, 77, 1], k_lens=[300, 140, 9], num_q_heads=4, num_kv_heads=2, head_size=256),
     dict(causal=True, window_size=(120, 0))),
    ("specialized-2wg-pingpong-slab-output",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=2, direct_output=False),
     dict(q_lens=[256, 100, 31, 1, 77], k_lens=[256, 164, 31, 9, 77], num_q_heads=4, num_kv_heads=2,
          head_size=64),
     dict(causal=True)),
    # Several heads per program: the ring carries the tile's blocks once per head as one
    # stream (3 slots over 5- and 1-block tiles: the slots wrap across heads), each head
    # its own queries, ALiBi slope and output; a GQA group's heads read the same keys, an
    # MHA program's heads each their own (the stream changes KV head mid-ring).
    ("single-heads-per-program-2-gqa-paged-alibi",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=3, heads_per_program=2),
     dict(q_lens=[70, 9], k_lens=[300, 30], num_q_heads=2, num_kv_heads=1, head_size=64, paged=True,
          block_size=32, extra_blocks=2),
     dict(causal=True, alibi=True)),
    ("single-heads-per-program-3-mha-packed-window",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=3, heads_per_program=3),
     dict(q_lens=[130, 9, 1], k_lens=[300, 30, 5], num_q_heads=3, num_kv_heads=3, head_size=32),
     dict(causal=True, window_size=(100, 0))),
    ("specialized-1wg-heads-per-program-2-packed",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=1, heads_per_program=2),
     dict(q_lens=[130, 9, 64], k_lens=[300, 30, 64], num_q_heads=4, num_kv_heads=2, head_size=32),
     dict(causal=True)),
    # The next head's queries loaded into a second query tile while the current head
    # computes: partial warpgroups' row-by-row output stores (the output tile is the
    # query tile's memory), odd and even heads alternating buffers, a 1-block tile.
    ("single-heads-per-program-3-prefetch-queries-output-rows",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2, heads_per_program=3, prefetch_queries=True),
     dict(_OUTPUT_STORE_PROBLEM, num_q_heads=3, num_kv_heads=1),
     dict(causal=True, alibi=True)),
    ("specialized-1wg-heads-per-program-2-prefetch-queries-query-tile",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=1, heads_per_program=2,
                                prefetch_queries=True, value_work_tile="query", nonfinite_check="key_flags"),
     dict(q_lens=[130, 9], k_lens=[300, 30], num_q_heads=4, num_kv_heads=2, head_size=32),
     dict(causal=True, window_size=(100, 0))),
    ("specialized-2wg-pingpong-heads-per-program-4-prefetch-queries",
     tuning.MosaicPrefillConfig(block_k=128, num_stages=2, compute_warpgroups=2, nonfinite_check="probe",
                                precheck_values=True, heads_per_program=4, prefetch_queries=True),
     dict(q_lens=[256, 100, 31, 1, 77], k_lens=[256, 164, 31, 9, 77], num_q_heads=8, num_kv_heads=2,
          head_size=128),
     dict(causal=True)),
    ("specialized-2wg-pingpong-heads-per-program-4-precheck",
     tuning.MosaicPrefillConfig(block_k=128, num_stages=2, compute_warpgroups=2, nonfinite_check="probe",
                                precheck_values=True, heads_per_program=4),
     dict(q_lens=[256, 100, 31, 1, 77], k_lens=[256, 164, 31, 9, 77], num_q_heads=8, num_kv_heads=2,
          head_size=128),
     dict(causal=True)),
    # The two warpgroups staggered across a program's items, not restaggered at each:
    # several heads a program (the next head's queries prefetched), persistent programs.
    ("specialized-2wg-pingpong-across-items-heads-per-program-4-prefetch-queries",
     tuning.MosaicPrefillConfig(block_k=128, num_stages=2, compute_warpgroups=2, nonfinite_check="probe",
                                precheck_values=True, heads_per_program=4, prefetch_queries=True,
                                pingpong_across_items=True),
     dict(q_lens=[256, 100, 1], k_lens=[256, 164, 9], num_q_heads=4, num_kv_heads=1, head_size=128),
     dict(causal=True)),
    ("specialized-2wg-pingpong-across-items-persistent-5-programs-window",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=2, persistent_programs=5,
                                pingpong_across_items=True),
     dict(q_lens=[256, 100, 31], k_lens=[256, 164, 31], num_q_heads=2, num_kv_heads=2, head_size=64),
     dict(causal=True, window_size=(100, 0))),
    ("specialized-2wg-pingpong-key-flags-query-tile-d256-heads-per-program-2",
     tuning.MosaicPrefillConfig(nonfinite_check="key_flags", heads_per_program=2),
     dict(q_lens=[300, 1], k_lens=[300, 9], num_q_heads=2, num_kv_heads=2, head_size=256),
     dict(causal=True, window_size=(120, 0))),
    # Three compute warpgroups (D 64: 192-row tiles, no ping-pong): the third sees the
    # first two's diagonal blocks whole; sequences shorter than a tile leave warpgroups
    # without rows; several heads per program, packed and paged.
    ("specialized-3wg-causal-whole-blocks-probe-precheck",
     tuning.MosaicPrefillConfig(compute_warpgroups=3, nonfinite_check="probe", precheck_values=True,
                                heads_per_program=2),
     dict(q_lens=[200, 31, 1], k_lens=[200, 31, 9], num_q_heads=2, num_kv_heads=1, head_size=64),
     dict(causal=True)),
    ("specialized-3wg-bk128-masked-parts-paged-window-alibi",
     tuning.MosaicPrefillConfig(compute_warpgroups=3, block_k=128, masked_block_k=64, nonfinite_check="probe"),
     dict(q_lens=[400, 77, 1], k_lens=[520, 140, 9], num_q_heads=4, num_kv_heads=1, head_size=64, paged=True,
          block_size=16, extra_blocks=2),
     dict(causal=True, window_size=(150, 0), alibi=True)),
    # Each unmasked block's softmax beside the previous block's P·V (overlap_softmax): a
    # warpgroup's unmasked run of 0, 1 and several blocks (its first block's scores alone,
    # the last one's P·V after the loop), several heads a program (the ring's stream), a
    # window's masked lead blocks before the run, soft-cap and ALiBi in the softmax.
    ("single-overlap-softmax-packed-softcap-alibi-heads-per-program-2",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=2, heads_per_program=2, overlap_softmax=True),
     dict(q_lens=[300, 9, 70], k_lens=[400, 30, 70], num_q_heads=4, num_kv_heads=2, head_size=32),
     dict(causal=True, softcap=10.0, alibi=True)),
    ("single-overlap-softmax-paged-window-ring3",
     dataclasses.replace(_SINGLE, block_k=64, num_stages=3, overlap_softmax=True),
     dict(q_lens=[150, 9], k_lens=[500, 30], num_q_heads=2, num_kv_heads=1, head_size=32, paged=True,
          block_size=32, extra_blocks=2),
     dict(causal=True, window_size=(200, 0))),
    ("specialized-1wg-overlap-softmax-packed",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=2, compute_warpgroups=1, overlap_softmax=True),
     dict(q_lens=[200, 9], k_lens=[300, 30], num_q_heads=2, num_kv_heads=1, head_size=32),
     dict(causal=True)),
    ("specialized-2wg-pingpong-overlap-softmax-heads-per-program-4-precheck",
     tuning.MosaicPrefillConfig(block_k=128, num_stages=2, compute_warpgroups=2, nonfinite_check="probe",
                                precheck_values=True, heads_per_program=4, overlap_softmax=True),
     dict(q_lens=[700, 256, 100, 31, 1, 77], k_lens=[900, 256, 164, 31, 9, 77], num_q_heads=8,
          num_kv_heads=2, head_size=128),
     dict(causal=True)),
    ("specialized-2wg-pingpong-overlap-softmax-paged-bs16-window-softcap-alibi",
     tuning.MosaicPrefillConfig(block_k=128, num_stages=3, compute_warpgroups=2, masked_block_k=64,
                                nonfinite_check="probe", overlap_softmax=True),
     dict(q_lens=[600, 77, 1], k_lens=[1100, 140, 9], num_q_heads=4, num_kv_heads=2, head_size=128,
          paged=True, block_size=16, extra_blocks=2),
     dict(causal=True, window_size=(500, 0), softcap=20.0, alibi=True)),
    ("specialized-3wg-overlap-softmax-d64-bk128",
     tuning.MosaicPrefillConfig(compute_warpgroups=3, block_k=128, masked_block_k=64, nonfinite_check="probe",
                                overlap_softmax=True),
     # 400 rows: 192-row tiles whose warpgroups' unmasked runs of 128-key blocks are 0
     # (rows 0-127), 1 (rows 128-255) and 2 or 3 (rows 256-399) long; a tile of 31 rows.
     dict(q_lens=[400, 31], k_lens=[400, 31], num_q_heads=1, num_kv_heads=1, head_size=64),
     dict(causal=True)),
    ("specialized-2wg-overlap-softmax-key-flags-d256",
     tuning.MosaicPrefillConfig(nonfinite_check="key_flags", overlap_softmax=True),
     dict(q_lens=[600, 77, 1], k_lens=[600, 140, 9], num_q_heads=4, num_kv_heads=4, head_size=256),
     dict(causal=True)),
    ("specialized-2wg-overlap-softmax-paged-fp8-runs-blocks-one-by-one",
     tuning.MosaicPrefillConfig(block_k=128, masked_block_k=64, nonfinite_check="probe", overlap_softmax=True),
     dict(q_lens=[200, 3], k_lens=[400, 50], num_q_heads=1, num_kv_heads=1, head_size=128, paged=True,
          block_size=16, extra_blocks=2, cache_dtype=jnp.float8_e4m3fn, k_scale=0.5, v_scale=2.0),
     dict(causal=True)),
    ("specialized-1wg-paged-bs48-ring3-fp8",
     tuning.MosaicPrefillConfig(block_k=64, num_stages=3, compute_warpgroups=1),
     dict(q_lens=[60, 3], k_lens=[260, 50], num_q_heads=1, num_kv_heads=1, head_size=32, paged=True,
          block_size=48, extra_blocks=2, cache_dtype=jnp.float8_e4m3fn, k_scale=0.5, v_scale=2.0),
     dict(causal=True)),
]


def _tiling_params(cases):
    """pytest params from (id, config, build, attention) tuples or marked pytest.params of them."""
    params = []
    for case in cases:
        marks = ()
        if hasattr(case, "values"):  # a pytest.param
            case, marks = case.values, case.marks
        case_id, config, build, attention = case
        params.append(pytest.param(config, build, attention, id=case_id, marks=marks))
    return params


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpret"),
                                       pytest.param(False, marks=pytest.mark.gpu, id="gpu")])
@pytest.mark.parametrize("config, build, attention", covering_cases(
    _tiling_params(MOSAIC_TILINGS), keep=["specialized-1wg-persistent-3-programs-paged-ring3-window",
                                          "specialized-2wg-pingpong-across-items-heads-per-program-4-prefetch-queries",
                                          "specialized-2wg-pingpong-across-items-persistent-5-programs-window"]))
def test_mosaic_ring_and_paged_copies_match_reference(config, build, attention, interpret):
    """Each form interpreted (a covering subset by default, `covering_cases`) and compiled
    on a Hopper GPU (every case)."""
    problem = make_varlen_problem(np.random.default_rng(5), **build)
    out = _kernel_with_config(problem, config, attention, lowering=prefill.MOSAIC_GPU, interpret=interpret)
    _assert_matches_reference(out, problem, attention)


def _poisoned_long_problem(paged: bool) -> VarlenProblem:
    """`_poisoned_problem` with a sequence of 100: its 128-key blocks' masked parts."""
    problem = make_varlen_problem(np.random.default_rng(4), q_lens=[100, 9], k_lens=[100, 30],
                                  num_q_heads=2, num_kv_heads=1, head_size=32, paged=paged,
                                  q_padding_rows=3)
    nan, inf = float("nan"), float("inf")
    # Sequence 0 (window 12): key 70 seen by rows 70..82 (rows 64..69 share its 64-key part),
    # key 90 by rows 90..99 and key 99 by row 99 (the second part of block 0).
    return poison_keys(problem, {0: [(70, "v", nan), (90, "k", nan), (99, "v", inf)],
                                 1: [(25, "v", inf)]})


# The forms the poisoned-key tests run: (interpret, base config) for the single-warpgroup
# form (the interpreter's quickest) and the GPU default (a producer and two ping-ponged
# compute warpgroups, whose second warpgroup runs the first one's diagonal block whole) in
# the Mosaic GPU interpreter, and the default compiled on a Hopper GPU.
MOSAIC_POISONED_FORMS = [
    pytest.param((True, tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP), id="interpret"),
    pytest.param((True, tuning.MOSAIC_PREFILL_CONFIG), id="interpret-default-form"),
    pytest.param((False, tuning.MOSAIC_PREFILL_CONFIG), marks=pytest.mark.gpu, id="gpu"),
]


@pytest.mark.covering(pairs=False)
@pytest.mark.parametrize("form", MOSAIC_POISONED_FORMS)
@pytest.mark.parametrize("nonfinite_check", tuning.MOSAIC_NONFINITE_CHECKS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("masked_parts", [pytest.param(False, id="bk64"), pytest.param(True, id="bk128-parts")])
def test_mosaic_nonfinite_values_reach_only_the_rows_that_see_them(masked_parts, paged, nonfinite_check, form):
    """The Mosaic GPU kernel's masked blocks on the same poisoned keys as the Triton
    test, every way of finding the rows that see a non-finite value (a 0/1 matrix
    product; per-key flags through shared memory; the probe of P·V that redoes the
    block with per-key flags), and 128-key blocks whose masked ones
    run in 64-key parts: the single-warpgroup form and the default (warp-specialized,
    ping-pong) form in the interpreter (by default each check, layout, block size and
    form once; ``--full``: every combination), the default form compiled on a GPU, every
    combination."""
    problem = _poisoned_long_problem(paged) if masked_parts else _poisoned_problem(paged)
    interpret, base = form
    config = dataclasses.replace(base, nonfinite_check=nonfinite_check)
    if masked_parts:
        config = dataclasses.replace(config, block_k=128, masked_block_k=64)
    out = _kernel_with_config(problem, config, POISONED_ATTENTION, interpret=interpret,
                              lowering=prefill.MOSAIC_GPU)
    _assert_nonfinite_rows_match(out, problem)


@pytest.mark.parametrize("form", MOSAIC_POISONED_FORMS)
@pytest.mark.parametrize("nonfinite_check", ["product", "key_flags"])
def test_mosaic_masked_blocks_in_the_borrowed_query_tile(nonfinite_check, form):
    """Masked blocks whose values are rewritten in the compute warpgroup's query tile
    (``value_work_tile="query"``, the default's choice at D 256), the queries reloaded
    after each one that is not the warpgroup's last: a sequence of 100 whose rows 64..99
    see two masked 64-key blocks (the window's left edge, then the causal diagonal), so
    the second one computes with reloaded queries; the poisoned keys reach only the rows
    that see them."""
    problem = _poisoned_long_problem(paged=False)
    interpret, base = form
    config = dataclasses.replace(base, nonfinite_check=nonfinite_check, value_work_tile="query")
    out = _kernel_with_config(problem, config, POISONED_ATTENTION, interpret=interpret,
                              lowering=prefill.MOSAIC_GPU)
    _assert_nonfinite_rows_match(out, problem)


@pytest.mark.parametrize("form", MOSAIC_POISONED_FORMS)
@pytest.mark.parametrize("poisoned", [pytest.param(False, id="finite"), pytest.param(True, id="poisoned")])
def test_mosaic_prechecked_values_run_masked_blocks_whole_only_while_finite(poisoned, form):
    """``precheck_values``: one reduction tells the kernel whether every value is
    finite. Finite, the masked blocks (a window's left edge, the causal diagonal; 128-key
    blocks, whose parts the guarded path would take) run whole with P·V as in an
    unmasked block, and match the reference; poisoned, they keep each non-finite value
    from the rows the mask hides it from, as without the precheck."""
    problem = _poisoned_long_problem(paged=False)
    if not poisoned:
        problem = make_varlen_problem(np.random.default_rng(4), q_lens=[100, 9], k_lens=[100, 30],
                                      num_q_heads=2, num_kv_heads=1, head_size=32, q_padding_rows=3)
    interpret, base = form
    config = dataclasses.replace(base, block_k=128, masked_block_k=64, nonfinite_check="probe",
                                 precheck_values=True)
    out = _kernel_with_config(problem, config, POISONED_ATTENTION, interpret=interpret,
                              lowering=prefill.MOSAIC_GPU)
    if poisoned:
        _assert_nonfinite_rows_match(out, problem)
    else:
        _assert_matches_reference(out, problem, POISONED_ATTENTION)


def test_mosaic_precheck_values_applies_to_packed_keys_only():
    """A paged cache's pages would have to be gathered to be checked: its tiling keeps
    the guarded masked blocks whatever the config asks."""
    config = tuning.MosaicPrefillConfig(precheck_values=True)
    plan = functools.partial(plans.plan_mosaic_prefill_tiling, 128, 2, 2, 2, num_q_heads=1, max_seqlen_q=512,
                             max_seqlen_k=512, config=config)
    assert plan(block_size=None).precheck_values
    assert not plan(block_size=16).precheck_values
    with pytest.raises(ValueError, match="precheck_values"):
        plans.check_mosaic_prefill_config(dataclasses.replace(config, precheck_values=1))


@pytest.mark.covering(pairs=False)
@pytest.mark.parametrize("nonfinite_check", ["key_flags", "probe"])
@pytest.mark.parametrize("build, attention", [pytest.param(b, a, id=i) for i, b, a in MAIN_GRID
                                              if i in MOSAIC_KEY_FLAG_CASES])
def test_mosaic_other_nonfinite_checks_match_reference(build, attention, nonfinite_check):
    """The ``"key_flags"`` and ``"probe"`` masked blocks on finite inputs (ragged packed
    and paged sequences, a window, fp8 values): the same attention as the reference. By
    default each problem runs once and each check on at least one of them (``--full``:
    every pair)."""
    problem = make_varlen_problem(np.random.default_rng(0), **build)
    config = dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP, nonfinite_check=nonfinite_check)
    out = _kernel_with_config(problem, config, attention, lowering=prefill.MOSAIC_GPU)
    _assert_matches_reference(out, problem, attention)


@pytest.mark.gpu
def test_mosaic_kernel_profile_writes_a_timeline_of_its_regions(tmp_path):
    """With ``profile_dir`` the kernel also writes the Mosaic GPU profiler's trace of its
    named regions (benchmarks/prefill_parts.py --timeline reads it), and computes the
    same output."""
    batch, seq, heads, head_size = 2, 512, 4, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (batch * seq, heads, head_size), jnp.bfloat16) for key in keys)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * seq
    spec = AttentionSpec.create(head_size, causal=True)
    tiling, plan = prefill.plan_mosaic_varlen(q, k, v, cu, cu, None, None, spec=spec, max_seqlen_q=seq,
                                              max_seqlen_k=seq,
                                              config=tuning.mosaic_prefill_config(head_size, "bfloat16"))

    def call(profile_dir):
        return prefill.run_mosaic_varlen(q, k, v, plan, None, None, 1.0, 1.0, spec=spec, tiling=tiling,
                                         profile_dir=profile_dir)

    events = profiled_trace_events(call, tmp_path)
    names = {event["name"] for event in events}
    assert {"setup", "fill", "refill", "drain", "q_wait", "unmasked", "tail_masked", "final_meet", "epilogue"} <= names
    programs = plan.shape[0] * heads // tiling.heads_per_program
    assert len({event["tid"] for event in events}) == programs * (tiling.compute_warpgroups + 1)


# --------------------------------------------------------------------------- the plan

def _plan(q_lens: np.ndarray, k_lens: np.ndarray, **static: Any) -> np.ndarray:
    """`prefill.plan_tiles` for packed sequences of these lengths, jitted, as NumPy."""
    fn = jax.jit(functools.partial(prefill.plan_tiles, **static))
    return np.asarray(fn(jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                         jnp.asarray(np.concatenate([[0], np.cumsum(k_lens)]), jnp.int32), None))


PLAN_SPECS = [
    dict(causal=False),
    dict(causal=True),
    dict(causal=True, window_size=(5, 0)),
    dict(window_size=(7, 3)),
    dict(window_size=(UNBOUNDED, 2)),
    dict(window_size=(4, UNBOUNDED)),
]


@pytest.mark.parametrize("attention", PLAN_SPECS, ids=lambda a: str(sorted(a.items())))
def test_visible_key_interval_is_the_reference_mask_of_every_row(attention):
    """The Mosaic GPU kernel masks a block by each row's interval of visible keys: for
    every row, rows past the sequence and before its start (an aligned tile's lead) too,
    ``[lo, hi)`` (empty past the sequence) holds exactly the keys `reference.key_visible`
    shows it, less those at negative positions (the lead keys of a packed block 0)."""
    spec = AttentionSpec.create(32, **attention)
    q_len, k_len = 9, 23
    q_pos = jnp.arange(-12, 15)[:, None]
    k_pos = jnp.arange(-12, 30)[None, :]
    lo, hi = plans.visible_key_interval(q_pos, q_len, k_len, spec)
    hi = jnp.where(q_pos < q_len, hi, lo)
    expected = reference.key_visible(q_pos, k_pos, q_len, k_len, spec) & (k_pos >= 0)
    np.testing.assert_array_equal((k_pos >= lo) & (k_pos < hi), expected)
    assert bool(jnp.all(lo >= 0))  # (so over a paged cache, no negative keys, no lower bound without a window)


@pytest.mark.parametrize("attention", PLAN_SPECS, ids=lambda a: str(sorted(a.items())))
@pytest.mark.parametrize("longest_first", [True, False])
@pytest.mark.parametrize("align_rows", [1, 8])
def test_plan_covers_rows_and_skips_only_invisible_keys(attention, longest_first, align_rows):
    """Every row is stored by exactly one tile; the visited KV blocks hold every key a
    valid row sees; the unmasked blocks hold only keys every valid row sees. An aligned
    plan (the Mosaic GPU kernel's) starts every tile's rows and every sequence's packed
    keys on a multiple of ``align_rows``, the lead rows and keys in front of position 0."""
    q_lens = np.array([0, 1, 7, 8, 9, 23, 3], np.int32)
    k_lens = np.array([4, 1, 30, 8, 2, 23, 40], np.int32)
    num_q_tokens, positions, block_k = int(q_lens.sum()) + 5, 8, 4 * align_rows // math.gcd(4, align_rows)
    spec = AttentionSpec.create(64, **attention)
    plan = _plan(q_lens, k_lens, num_q_tokens=num_q_tokens, num_packed_keys=int(k_lens.sum()),
                 key_capacity=None, spec=spec, max_seqlen_q=int(q_lens.max()),
                 max_seqlen_k=int(k_lens.max()), positions_per_tile=positions, block_k=block_k,
                 longest_first=longest_first, align_rows=align_rows)
    F = prefill.TileField
    assert plan.shape == (prefill.num_query_tiles(num_q_tokens, len(q_lens), positions, align_rows),
                          prefill.TILE_INFO_WIDTH)
    assert np.all(plan[:, F.Q_ROW0] % align_rows == 0) and np.all(plan[:, F.K_ROW0] % align_rows == 0)
    stored = np.zeros(num_q_tokens, np.int32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(k_lens)])
    for tile in plan:
        owned = [r for i, r in enumerate(range(tile[F.Q_ROW0], tile[F.Q_ROW0] + tile[F.Q_ROWS]))
                 if tile[F.Q_POS0] + i >= 0]
        stored[owned] += 1
        lo, full_lo, full_hi, hi = tile[[F.KB_LO, F.KB_FULL_LO, F.KB_FULL_HI, F.KB_HI]]
        assert lo <= full_lo <= full_hi <= hi
        q_len, k_len, k_lead = tile[F.Q_LEN], tile[F.K_LEN], tile[F.K_LEAD]
        assert 0 <= k_lead < align_rows
        if tile[F.Q_ROWS] and 0 < q_len and tile[F.Q_POS0] < q_len:  # rows of a real sequence
            assert tile[F.Q_ROW0] == cu_q[tile[F.SEQ]] + tile[F.Q_POS0]
            assert tile[F.K_ROW0] + k_lead == cu_k[tile[F.SEQ]]
        elif tile[F.Q_ROWS]:  # a padding segment's (its lead rows: the last sequence's)
            assert q_len == 0 and hi == 0
        positions = np.arange(tile[F.Q_POS0], tile[F.Q_POS0] + tile[F.Q_ROWS])
        positions = positions[(positions >= 0) & (positions < q_len)][:, None]  # the rows that attend
        keys = np.arange(max(k_len, hi * block_k))[None, :]
        visible = np.asarray(reference.key_visible(positions, keys, q_len, k_len, spec))
        index = keys + k_lead  # keys count from the block of the aligned key row
        visited = (index >= lo * block_k) & (index < hi * block_k)
        unmasked = (index >= full_lo * block_k) & (index < full_hi * block_k)
        assert not np.any(visible & ~visited), tile  # no visible key is skipped
        assert np.all(visible | ~unmasked), tile  # unmasked blocks: visible to every row
    assert np.all(stored == 1), stored


@pytest.mark.parametrize("align_rows, positions, block_k", [(0, 8, 8), (8, 12, 8), (8, 8, 12)])
def test_plan_refuses_an_alignment_that_does_not_divide_the_tiles(align_rows, positions, block_k):
    with pytest.raises(ValueError, match="align_rows"):
        _plan(np.array([3], np.int32), np.array([3], np.int32), num_q_tokens=3, num_packed_keys=3,
              key_capacity=None, spec=AttentionSpec.create(64), max_seqlen_q=3, max_seqlen_k=3,
              positions_per_tile=positions, block_k=block_k, align_rows=align_rows)


def test_plan_clamps_invalid_lengths():
    """Under jit nobody validates cu_seqlens: out-of-range lengths must not address
    memory outside q (rows) or outside the block table (keys)."""
    spec = AttentionSpec.create(64, causal=False)
    fn = jax.jit(functools.partial(
        prefill.plan_tiles, num_q_tokens=20, num_packed_keys=None, key_capacity=32, spec=spec,
        max_seqlen_q=64, max_seqlen_k=64, positions_per_tile=8, block_k=16))
    cu_q = jnp.array([0, 12, 30], jnp.int32)  # claims 30 rows of a 20-row q
    plan = np.asarray(fn(cu_q, cu_q, jnp.array([50, -3], jnp.int32)))  # 50 keys > 32 addressable
    F = prefill.TileField
    assert np.all(plan[:, F.Q_ROW0] + plan[:, F.Q_ROWS] <= 20)
    assert np.all(plan[:, F.K_LEN] >= 0) and np.all(plan[:, F.K_LEN] <= 32)
    assert np.all(plan[:, F.KB_HI] * 16 <= 32)


@pytest.mark.parametrize("cu_q", [[3, 5, 9], [0, 9, 5], [4, 4, 4]], ids=str)
def test_plan_stores_every_row_once_for_unvalidated_cu_seqlens(cu_q):
    """Under jit cu_seqlens_q may start past 0 or decrease: the rows before the first
    sequence and after the largest offset are padding tiles (written as 0), and no row
    is stored twice (tiles writing the same row in parallel would race)."""
    spec = AttentionSpec.create(64, causal=True)
    fn = jax.jit(functools.partial(
        prefill.plan_tiles, num_q_tokens=12, num_packed_keys=20, key_capacity=None, spec=spec,
        max_seqlen_q=16, max_seqlen_k=16, positions_per_tile=2, block_k=16))
    plan = np.asarray(fn(jnp.asarray(cu_q, jnp.int32), jnp.asarray([0, 4, 10], jnp.int32), None))
    F = prefill.TileField
    stored = np.zeros(12, np.int32)
    for tile in plan:
        stored[tile[F.Q_ROW0]:tile[F.Q_ROW0] + tile[F.Q_ROWS]] += 1
    assert np.all(stored == 1), stored


def test_plan_orders_longest_first():
    spec = AttentionSpec.create(64, causal=True)
    q_lens = np.array([8, 40, 16], np.int32)
    plan = _plan(q_lens, q_lens, num_q_tokens=int(q_lens.sum()), num_packed_keys=int(q_lens.sum()),
                 key_capacity=None, spec=spec, max_seqlen_q=40, max_seqlen_k=40,
                 positions_per_tile=8, block_k=8)
    F = prefill.TileField
    real = plan[plan[:, F.Q_ROWS] > 0]
    assert real[:, F.SEQ].tolist() == [1] * 5 + [2] * 2 + [0]
    assert real[:5, F.Q_POS0].tolist() == [32, 24, 16, 8, 0]  # the diagonal's longest tiles first
    work = real[:, F.KB_HI] - real[:, F.KB_LO]
    assert work[0] == work.max()


@pytest.mark.parametrize("longest_first", [True, False])
def test_plan_has_no_loop_and_no_scatter(longest_first):
    """The plan runs before every prefill kernel call: no loop (XLA runs a loop on the
    GPU with its predicate copied to the host each step, so the call waits for it) and
    no scatter (one kernel each)."""
    spec = AttentionSpec.create(64, causal=True)
    plan = functools.partial(plans.plan_tiles, num_q_tokens=4096, num_packed_keys=4096, key_capacity=None,
                             spec=spec, max_seqlen_q=2048, max_seqlen_k=2048, positions_per_tile=128,
                             block_k=64, longest_first=longest_first, align_rows=8)
    cu = jax.ShapeDtypeStruct((9,), jnp.int32)
    names = {eqn.primitive.name for eqn in jax.make_jaxpr(lambda c: plan(c, c, None))(cu).jaxpr.eqns}
    assert not names & {"while", "scan", "cond", "scatter", "scatter-add"}, names


# --------------------------------------------------------------------------- static checks


def _static_args(paged: bool, head_size: int = 64, dtype=jnp.bfloat16, kv_dtype=None):
    q = jax.ShapeDtypeStruct((40, 8, head_size), dtype)
    kv_dtype = kv_dtype or dtype
    kv_shape = (12, 16, 2, head_size) if paged else (50, 2, head_size)
    kv = jax.ShapeDtypeStruct(kv_shape, kv_dtype)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    table = jax.ShapeDtypeStruct((2, 6), jnp.int32) if paged else None
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    return (q, kv, kv, cu, cu, table, None, None, scale, scale)


def test_unsupported_reason():
    static = dict(spec=AttentionSpec.create(64, causal=True), max_seqlen_q=20, max_seqlen_k=30)
    assert prefill.unsupported_reason(*_static_args(False), lowering="triton", **static) is None
    assert prefill.unsupported_reason(
        *_static_args(True, kv_dtype=jnp.float8_e5m2), lowering="triton", **static) is None
    assert "lowering" in prefill.unsupported_reason(*_static_args(False), lowering="mosaic", **static)
    assert "head size" in prefill.unsupported_reason(*_static_args(False, head_size=72),
                                                     lowering="triton", **static)
    assert "dtype" in prefill.unsupported_reason(*_static_args(False, dtype=jnp.int8),
                                                 lowering="triton", **static)


def test_mosaic_unsupported_reason():  # float16 / bfloat16 queries, any cache dtype and head size
    static = dict(spec=AttentionSpec.create(64, causal=True), max_seqlen_q=20, max_seqlen_k=30,
                  lowering=prefill.MOSAIC_GPU)
    for paged, dtype in ((False, jnp.bfloat16), (True, jnp.float16)):
        assert prefill.unsupported_reason(*_static_args(paged, dtype=dtype), **static) is None
    assert prefill.unsupported_reason(*_static_args(True, 96, kv_dtype=jnp.float8_e4m3fn), **static) is None
    assert "float16 or bfloat16" in prefill.unsupported_reason(*_static_args(False, dtype=jnp.float32), **static)
    assert prefill.unsupported_reason(*_static_args(True, 80, kv_dtype=jnp.float8_e5m2), **static) is None
    problem = make_varlen_problem(np.random.default_rng(4), q_lens=[4], num_q_heads=2, num_kv_heads=1,
                                  head_size=32, dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="mosaic_gpu varlen kernel cannot run this call: .*float32"):
        _kernel_with_config(problem, None, dict(causal=True), lowering=prefill.MOSAIC_GPU)


@pytest.mark.parametrize("bad, error", [
    (tuning.PrefillConfig(), TypeError),  # the Triton tier's config
    (tuning.MosaicPrefillConfig(nonfinite_check="isfinite"), ValueError),
    (tuning.MosaicPrefillConfig(block_k=96), ValueError),
    (tuning.MosaicPrefillConfig(block_k=512), ValueError),
    (tuning.MosaicPrefillConfig(num_stages=1), ValueError),
    (tuning.MosaicPrefillConfig(compute_warpgroups=4), ValueError),
    (tuning.MosaicPrefillConfig(compute_warpgroups=2, warp_specialized=False), ValueError),
])
def test_bad_mosaic_config_is_rejected(bad, error):
    problem = make_varlen_problem(np.random.default_rng(4), q_lens=[4], num_q_heads=2, num_kv_heads=1,
                                  head_size=32)
    with pytest.raises(error, match="config"):
        _kernel_with_config(problem, bad, dict(causal=True), lowering=prefill.MOSAIC_GPU)


@pytest.mark.parametrize("head_size", [32, 64, 80, 128, 192, 256])
@pytest.mark.parametrize("kv_itemsize", [1, 2])
def test_mosaic_tiling_fits_shared_memory(head_size, kv_itemsize):
    """The Mosaic plan shrinks the ring, the compute warpgroups and block_k until the
    tiles fit the budget; the largest config fits at every head size."""
    config = tuning.MosaicPrefillConfig(block_k=256, num_stages=4, compute_warpgroups=2)
    tiling = plans.plan_mosaic_prefill_tiling(head_size, 2, kv_itemsize, kv_itemsize, num_q_heads=1, max_seqlen_q=4096,
                                              max_seqlen_k=4096, block_size=48, config=config)
    used = plans.mosaic_prefill_smem_bytes(tiling.compute_warpgroups, tiling.block_k, head_size,
                                           tiling.num_stages, 2, kv_itemsize, kv_itemsize, tiling.work_rows)
    assert used <= tuning.MOSAIC_SHARED_MEMORY_BUDGET
    assert tiling.block_k % plans.MOSAIC_MIN_BLOCK_K == 0 and tiling.num_stages >= 2
    assert tiling.copy_rows == math.gcd(tiling.block_k, 48) and tiling.block_q == 64 * tiling.compute_warpgroups
    # Short queries take one compute warpgroup, short keys a 64-key block.
    short = plans.plan_mosaic_prefill_tiling(head_size, 2, kv_itemsize, kv_itemsize, num_q_heads=1, max_seqlen_q=64,
                                             max_seqlen_k=40, block_size=None, config=config)
    assert (short.compute_warpgroups, short.block_k, short.copy_rows) == (1, 64, 64)


@pytest.mark.parametrize("head_size, fields", [
    (64, dict(compute_warpgroups=3, block_k=128, masked_block_k=64, nonfinite_check="probe")),
    (128, dict(block_k=128, masked_block_k=64, nonfinite_check="probe", precheck_values=True)),
    (128, dict(block_k=256, num_stages=4)),
    (256, dict(nonfinite_check="key_flags")),
])
def test_mosaic_overlap_softmax_keeps_the_tiling_and_takes_only_16_bit_blocks(head_size, fields, monkeypatch):
    """``overlap_softmax`` (its probabilities in registers) changes nothing else of the
    tiling, and runs only with 16-bit keys and values: fp8 blocks run one by one, which a
    warning says once."""
    monkeypatch.setattr(plans, "_dropped_fields", set())

    def plan(kv_itemsize: int, overlap: bool):
        config = tuning.MosaicPrefillConfig(overlap_softmax=overlap, **fields)
        return plans.plan_mosaic_prefill_tiling(head_size, 2, kv_itemsize, kv_itemsize, num_q_heads=8,
                                                max_seqlen_q=4096, max_seqlen_k=4096, block_size=None, config=config)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said for 16-bit blocks
        without, tiling = plan(2, False), plan(2, True)
    assert tiling.overlap_softmax
    assert dataclasses.replace(tiling, overlap_softmax=False) == without
    with pytest.warns(plans.ConfigFieldDroppedWarning, match="overlap_softmax is off .*fp8"):
        assert not plan(1, True).overlap_softmax
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert not plan(1, True).overlap_softmax


def test_mosaic_value_work_tile_and_what_it_leaves_room_for():
    """The value work tile holds a masked part's keys (64, not a 128-key block's), whole
    blocks with fp8 values, and nothing with the "probe" check (its redo borrows the
    query tile) or where borrowing the query tile lets a second compute warpgroup fit
    (D 256, "key_flags"): that leaves room for two compute warpgroups at D 128 with
    128-key blocks and at D 256; past the budget block_k shrinks before the second
    warpgroup goes. The checks holding a second product tile keep one warpgroup past
    D 128 (`plans.MOSAIC_SECOND_PRODUCT_MAX_HEAD_SIZE`)."""
    def plan(head_size, v_itemsize=2, **fields):
        config = tuning.MosaicPrefillConfig(**fields)
        return plans.plan_mosaic_prefill_tiling(head_size, 2, v_itemsize, v_itemsize, num_q_heads=1, max_seqlen_q=4096,
                                                max_seqlen_k=4096, block_size=None, config=config)

    bk128 = plan(128, block_k=128, masked_block_k=64)
    assert (bk128.compute_warpgroups, bk128.block_k, bk128.work_rows) == (2, 128, 64)
    assert plan(64, 1, block_k=128, masked_block_k=64).work_rows == 128  # fp8: whole blocks converted
    # At D 256 a 64-row work tile per warpgroup leaves no room for the second one: "auto"
    # borrows the query tile instead, "own" keeps the tile and drops the warpgroup, and
    # one warpgroup keeps its own tile (no queries to reload).
    borrowed = plan(256, nonfinite_check="key_flags")
    assert (borrowed.compute_warpgroups, borrowed.block_k, borrowed.work_rows) == (2, 64, 0)
    shrunk = plan(256, nonfinite_check="key_flags", block_k=128)
    assert (shrunk.compute_warpgroups, shrunk.block_k, shrunk.work_rows) == (2, 64, 0)
    own = plan(256, nonfinite_check="key_flags", value_work_tile="own")
    assert (own.compute_warpgroups, own.work_rows) == (1, 64)
    assert plan(256, nonfinite_check="key_flags", compute_warpgroups=1).work_rows == 64
    assert plan(128, value_work_tile="query").work_rows == 0
    assert plan(128).work_rows == 64  # two warpgroups fit with their own tiles
    with pytest.raises(ValueError, match="value_work_tile='query' needs 16-bit values"):
        plan(128, 1, value_work_tile="query")
    with pytest.raises(ValueError, match="config.value_work_tile must be one of"):
        plans.check_mosaic_prefill_config(tuning.MosaicPrefillConfig(value_work_tile="borrowed"))
    # The probe needs no work tile at 64-key parts, at any head size.
    assert plan(128, nonfinite_check="probe").work_rows == 0
    # The checks with a second 64 x D product tile (registers) take one warpgroup past D 128.
    for check in ("product", "probe"):
        assert plan(128, nonfinite_check=check).compute_warpgroups == 2
        assert plan(192, nonfinite_check=check).compute_warpgroups == 1, check
        assert plan(256, nonfinite_check=check).compute_warpgroups == 1, check
    assert plan(64, nonfinite_check="probe", block_k=128, masked_block_k=128).work_rows == 128  # 128-key parts


def test_mosaic_three_compute_warpgroups_only_where_registers_and_rows_allow():
    """Three compute warpgroups (160 registers a thread each) run at head sizes up to
    64 (`plans.MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE`) and for queries longer than two
    warpgroups' rows; otherwise two, and one for queries of at most 64 positions."""
    def plan(head_size, max_seqlen_q=4096, **fields):
        config = tuning.MosaicPrefillConfig(compute_warpgroups=3, **fields)
        return plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, num_q_heads=1, max_seqlen_q=max_seqlen_q,
                                                max_seqlen_k=4096, block_size=None, config=config)

    assert [plan(d).compute_warpgroups for d in (32, 64, 128, 256)] == [3, 3, 2, 1]
    assert plan(64).block_q == 192
    assert [plan(64, max_seqlen_q=n).compute_warpgroups for n in (64, 128, 129)] == [1, 2, 3]
    assert plan(64, nonfinite_check="probe", block_k=128, masked_block_k=64).compute_warpgroups == 3


@pytest.mark.parametrize("head_size", [32, 48, 64, 80, 128, 192, 256])
def test_mosaic_direct_output_only_where_rows_are_tma_aligned(head_size):
    """The kernel writes the packed output itself (the default) only where a 16-bit
    output row is a multiple of 128 bytes (its one-row TMA copies read shared memory
    at each row's start: a head size of 32 faulted with a misaligned address on the
    H200); other head sizes keep the slab per tile, and direct_output=False keeps it
    everywhere."""
    plan = lambda config: plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, num_q_heads=1, max_seqlen_q=4096,
                                                         max_seqlen_k=4096, block_size=None, config=config)
    assert tuning.MOSAIC_PREFILL_CONFIG.direct_output
    assert plan(tuning.MOSAIC_PREFILL_CONFIG).direct_output == (head_size % 64 == 0)
    assert not plan(tuning.MosaicPrefillConfig(direct_output=False)).direct_output


@pytest.mark.parametrize("bad", [dict(block_q=48), dict(block_k=8), dict(masked_block_k=24), dict(num_warps=3),
                                 dict(num_stages=0),
                                 dict(num_stages_paged=0), dict(single_kv_loop=1)])
def test_bad_config_is_rejected(bad):
    problem = make_varlen_problem(np.random.default_rng(4), q_lens=[4], num_q_heads=2,
                                  num_kv_heads=1, head_size=32)
    with pytest.raises(ValueError, match="config"):
        _kernel_with_config(problem, tuning.PrefillConfig(**bad), dict(causal=True))


# --------------------------------------------------------------------------- CUDA lowering


@pytest.mark.parametrize("paged, head_size, kv_dtype, knobs", [
    (False, 80, jnp.bfloat16, dict(pack_gqa=True)),
    (False, 128, jnp.float16, dict(pack_gqa=False, single_kv_loop=True)),
    (True, 64, jnp.float8_e4m3fn, dict(pack_gqa=True)),
    (True, 128, jnp.bfloat16, dict(prefetch_page_ids=False, single_kv_loop=True)),
    (True, 256, jnp.bfloat16, dict(pack_gqa=True)),
])
def test_lowers_for_cuda_to_triton_call(paged, head_size, kv_dtype, knobs):
    """Every feature at once (window, ALiBi, soft-cap) so that every code path lowers."""
    q_dtype = jnp.float16 if kv_dtype == jnp.float16 else jnp.bfloat16
    args = list(_static_args(paged, head_size, q_dtype, kv_dtype))
    args[7] = jax.ShapeDtypeStruct((8,), jnp.float32)  # alibi slopes
    spec = AttentionSpec.create(head_size, causal=True, window_size=(32, 0), softcap=20.0,
                                has_alibi=True)
    config = dataclasses.replace(tuning.prefill_config(head_size, jnp.dtype(q_dtype).name), **knobs)
    fn = functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=20, max_seqlen_k=30,
                           config=config)
    assert TRITON_CALL in lower_for_cuda(fn, *args)


def test_public_api_lowers_for_cuda_to_triton_call():
    q = jnp.ones((40, 8, 96), jnp.bfloat16)
    k = jnp.ones((50, 2, 96), jnp.bfloat16)
    cu_q = jnp.array([0, 7, 40], jnp.int32)
    cu_k = jnp.array([0, 20, 50], jnp.int32)
    fn = lambda q, k, v, cq, ck: jax_paged_attn.flash_attn_varlen_func(
        q, k, v, cq, ck, 33, 30, causal=True, implementation="triton")
    assert TRITON_CALL in lower_for_cuda(fn, q, k, k, cu_q, cu_k)


def test_exp2_fma_matches_exp2_where_the_softmax_uses_it():
    """`common.exp2_fma` (the FMA-pipe exponential of split softmax blocks) against
    float64 2**x over the softmax's range x <= 0, under jit (a compiler folding the
    rounding's add and subtract would give errors up to 41 %): relative error <= 1.02e-4,
    exactly 1 at 0, 2**-126 (not 0, not a wrapped exponent) below -126."""
    from jax_paged_attn.kernels import common

    x = np.concatenate([np.linspace(-126.0, 0.0, 200_001), -np.arange(0, 126, 0.5), [-0.25, -1e-6]])
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(common.exp2_fma)(jnp.asarray(x))).astype(np.float64)
    assert np.abs(got / np.exp2(x.astype(np.float64)) - 1).max() <= 1.02e-4
    edges = np.asarray(jax.jit(common.exp2_fma)(jnp.asarray([0.0, -126.0, -127.5, -1e4], jnp.float32)))
    assert edges[0] == 1.0 and np.all(edges[1:] == np.float32(2.0 ** -126))
