"""Semantics of the public attention functions against the float64 oracle.

Every API test runs once per implementation (`conftest.IMPLEMENTATIONS`): the XLA
reference, the Pallas Triton kernels in interpret mode, and (marked ``gpu``) the same
kernels compiled for a GPU. The decode tests also run the Mosaic GPU decode kernel
(`conftest.DECODE_MOSAIC_IMPLEMENTATIONS`) on what it supports, and check that it
refuses the rest with its reason. Varlen tests at 16-bit dtypes also run the Mosaic GPU
prefill kernel (`conftest.VARLEN_IMPLEMENTATIONS`: in its interpreter, and marked
``gpu`` compiled for a Hopper GPU). Shapes are kept small so the interpret-mode runs stay fast.
The reference module is also checked directly, at float32, with a tight tolerance.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_paged_attn
import oracle
from conftest import (
    DECODE_MOSAIC_IMPLEMENTATIONS,
    MOSAIC_GPU_INTERPRET,
    Implementation,
    KVCacheProblem,
    VarlenProblem,
    alibi_slopes,
    assert_close_to_oracle,
    assert_nonfinite_rows_match_oracle,
    assert_valid_output,
    call_api,
    check_against_oracle,
    compile_and_call,
    cumulative,
    make_kvcache_problem,
    make_varlen_problem,
    MOSAIC_IMPLEMENTATIONS,
    parametrize_impl,
    parametrize_varlen_impl,
    poison_keys,
    random_array,
)
from jax_paged_attn import reference
from jax_paged_attn.spec import AttentionSpec

pytestmark = pytest.mark.covering  # products: a covering subset by default, all with --full (conftest.py)

# The Mosaic GPU prefill kernel's cases here that its grids in test_prefill_kernel.py check
# on the same feature (against the reference, itself checked here against the oracle) run
# with --full (`conftest.mark_covered_by_kernel_grids`).
MOSAIC_PREFILL = "tests/test_prefill_kernel.py::test_mosaic_kernel_matches_reference[{}]"
MOSAIC_OTHER_CHECKS = "tests/test_prefill_kernel.py::test_mosaic_other_nonfinite_checks_match_reference[{}]"
MOSAIC_NONFINITE = [f"tests/test_prefill_kernel.py::test_mosaic_nonfinite_values_reach_only_the_rows_that_see_them[{i}]"
                    for i in ("bk64-False-product-interpret", "bk128-parts-True-key_flags-interpret-default-form")]

# Likewise the Triton kernels' cases (interpret mode) here that the kernel grids of
# test_prefill_kernel.py and test_decode_kernel.py check by default on the same feature
# (the same kernel against the reference, checked here against the oracle by the ``xla``
# cases): each test's or parameter's ``covered_by("triton", ...)`` names them. The cases
# left run an API rule the grids do not (mask pictures, zero sizes, eager and traced calls,
# one-channel NaNs, empty windows, the random problems).
TRITON_PREFILL = "tests/test_prefill_kernel.py::test_kernel_matches_reference[{}]"
TRITON_TILING = "tests/test_prefill_kernel.py::test_tilings_match_reference[{}]"
TRITON_PREFILL_NONFINITE = [f"tests/test_prefill_kernel.py::test_nonfinite_values_reach_only_the_rows_that_see_them[{i}]"
                            for i in ("three-loops-bq16-bk16-False-True", "gqa-packed-bq32-bk16-prefetched-ids-True-True")]
TRITON_DECODE = "tests/test_decode_kernel.py::test_public_api_matches_reference[{}]"
TRITON_DECODE_NONFINITE = [f"tests/test_decode_kernel.py::test_nonfinite_values_reach_only_the_rows_that_see_them[{i}]"
                           for i in ("3-splits-True", "2-splits-prefetched-ids-True")]


def triton_covered_by(*cases: str) -> pytest.MarkDecorator:
    return pytest.mark.covered_by("triton", *cases)


DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
FP8_DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2]


# --------------------------------------------------------------------------- mask pictures
# (query rows, key columns), "1" = attended. The first two are the pictures of the
# `jax_paged_attn.spec` docstring; the others have rows that see no key (output 0).
PICTURES = {
    "causal_sq2_sk5": (dict(causal=True), ["11110",
                                           "11111"]),
    "window_1_0_sq4_sk4": (dict(window_size=(1, 0)), ["1000",
                                                      "1100",
                                                      "0110",
                                                      "0011"]),
    "causal_sq4_sk2": (dict(causal=True), ["00",
                                           "00",
                                           "10",
                                           "11"]),
    "window_1_1_sq6_sk2": (dict(window_size=(1, 1)), ["00",
                                                      "00",
                                                      "00",
                                                      "10",
                                                      "11",
                                                      "11"]),
}


def picture_matrix(rows: list[str]) -> np.ndarray:
    return np.array([[c == "1" for c in row] for row in rows])


@pytest.mark.parametrize("name", list(PICTURES))
def test_oracle_mask_matches_pictures(name):
    attention, rows = PICTURES[name]
    expected = picture_matrix(rows)
    got = oracle.visibility_matrix(*expected.shape, **attention)
    np.testing.assert_array_equal(got, expected)


def test_oracle_hand_computed_example():
    # One query, two keys; scale ln(3) makes the scores (ln 3, 0): weights (3/4, 1/4).
    head_size = 32
    q = np.zeros((1, 1, head_size)); q[0, 0, 0] = 1.0
    k = np.zeros((2, 1, head_size)); k[0, 0, 0] = 1.0
    v = np.zeros((2, 1, head_size)); v[0, 0, 0] = 1.0; v[1, 0, 1] = 1.0
    out = oracle.attention_one_sequence(q, k, v, softmax_scale=math.log(3.0))
    np.testing.assert_allclose(out[0, 0, :2], [0.75, 0.25], rtol=1e-12)
    # Soft-cap 1 then ALiBi slope 0.5 (distances: key 0 is 1 away, key 1 is 0 away).
    out = oracle.attention_one_sequence(q, k, v, softmax_scale=math.log(3.0), softcap=1.0,
                                        alibi_slopes=np.array([0.5]))
    s0, s1 = math.tanh(math.log(3.0)) - 0.5, 0.0
    w0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    np.testing.assert_allclose(out[0, 0, :2], [w0, 1.0 - w0], rtol=1e-12)


def picture_problem(layout: str, q_len: int, k_len: int):
    """q = k = 0 (every visible key gets the same score) and v[j] = e_j, one head.

    Then output row i is the uniform distribution over the keys row i sees.
    """
    head_size, block_size = 32, 16
    q = jnp.zeros((q_len, 1, head_size), jnp.float32)
    v_rows = np.eye(k_len, head_size, dtype=np.float32)[:, None, :]  # [Sk, 1, D]
    if layout == "packed":
        keys = jnp.zeros((k_len, 1, head_size), jnp.float32)
        return VarlenProblem(q, keys, jnp.asarray(v_rows), cumulative([q_len]), cumulative([k_len]),
                             max_seqlen_q=q_len, max_seqlen_k=k_len)
    # The sequence lives in page 2 of 3 NaN-filled pages.
    k_cache = np.full((3, block_size, 1, head_size), np.nan, np.float32)
    v_cache = k_cache.copy()
    k_cache[2, :k_len] = 0.0
    v_cache[2, :k_len] = v_rows
    table = jnp.asarray([[2]], jnp.int32)
    if layout == "paged":
        return VarlenProblem(q, jnp.asarray(k_cache), jnp.asarray(v_cache), cumulative([q_len]),
                             cumulative([k_len]), max_seqlen_q=q_len, max_seqlen_k=k_len,
                             block_table=table)
    return KVCacheProblem(q[None], jnp.asarray(k_cache), jnp.asarray(v_cache),
                          jnp.asarray([k_len], jnp.int32), table)


@parametrize_impl
@pytest.mark.parametrize("layout", ["packed", "paged", "kvcache"])
@pytest.mark.parametrize("name", list(PICTURES))
def test_mask_pictures(impl, layout, name):
    attention, rows = PICTURES[name]
    visible = picture_matrix(rows)
    q_len, k_len = visible.shape
    problem = picture_problem(layout, q_len, k_len)
    out = problem.run(impl, **attention)
    assert_valid_output(out, problem.q)
    out = np.asarray(out).reshape(q_len, -1)
    counts = np.maximum(visible.sum(axis=1, keepdims=True), 1)
    expected = np.zeros_like(out)
    expected[:, :k_len] = visible / counts
    np.testing.assert_allclose(out, expected, atol=1e-6)


# --------------------------------------------------------------------------- the reference itself


REFERENCE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_softcap": dict(window_size=(3, 2), softcap=2.0, softmax_scale=0.5),
    "causal_window_alibi": dict(causal=True, window_size=(5, -1), alibi=True),
    "right_window_only": dict(window_size=(-1, 1)),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
@pytest.mark.parametrize("paged", [False, True])
def test_reference_varlen_matches_oracle(rng, case, paged):
    options = dict(REFERENCE_CASES[case])
    use_alibi = options.pop("alibi", False)
    problem = make_varlen_problem(rng, [3, 0, 17, 1], [9, 4, 30, 1] if paged else None,
                                  num_q_heads=8, num_kv_heads=2, dtype=jnp.float32, paged=paged,
                                  q_padding_rows=2)
    slopes = alibi_slopes(8) if use_alibi else None
    spec = AttentionSpec.create(32, has_alibi=use_alibi, **options)
    static = dict(spec=spec, max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k)
    out = compile_and_call(reference.varlen_attention, static,
                           dict(problem.arrays(), alibi_slopes=slopes))
    assert out.dtype == jnp.float32
    expected = problem.oracle(alibi_slopes=slopes, **options)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
@pytest.mark.parametrize("cache_dtype", [None, jnp.float8_e4m3fn])
def test_reference_decode_matches_oracle(rng, case, cache_dtype):
    options = dict(REFERENCE_CASES[case])
    use_alibi = options.pop("alibi", False)
    problem = make_kvcache_problem(rng, [1, 0, 40, 19], 3, num_q_heads=4, num_kv_heads=1,
                                   dtype=jnp.float32, cache_dtype=cache_dtype, k_scale=0.1,
                                   v_scale=0.05)
    slopes = alibi_slopes(4) if use_alibi else None
    spec = AttentionSpec.create(32, has_alibi=use_alibi, **options)
    out = compile_and_call(reference.paged_decode_attention, dict(spec=spec),
                           dict(problem.arrays(), alibi_slopes=slopes))
    assert out.dtype == jnp.float32
    expected = problem.oracle(alibi_slopes=slopes, **options)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- varlen, packed K/V

VARLEN_LENS = [5, 17, 1, 30]


@triton_covered_by(TRITON_PREFILL.format("packed-mha-d128-f32-noncausal"),
                   TRITON_PREFILL.format("packed-prefix-cached-mqa-d80-f16"),
                   TRITON_PREFILL.format("packed-gqa4-d64-bf16-causal-ragged"))
@parametrize_impl
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_dtypes(rng, impl, dtype, causal):
    problem = make_varlen_problem(rng, VARLEN_LENS, dtype=dtype)
    check_against_oracle(problem, impl, causal=causal)


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("packed-prefix-cached-mqa-d80-f16"))
@triton_covered_by(TRITON_PREFILL.format("packed-prefix-cached-mqa-d80-f16"))
@parametrize_varlen_impl
def test_packed_fewer_queries_than_keys(rng, impl):
    # Bottom-right alignment with Sq < Sk in the packed layout (chunked prefill).
    problem = make_varlen_problem(rng, [3, 1, 12], [20, 9, 12], dtype=jnp.float16)
    check_against_oracle(problem, impl, causal=True)


@triton_covered_by(TRITON_PREFILL.format("paged-bs32-gqa2-d64-f16-softcap-causal"))  # softmax_scale 0.3
@parametrize_impl
@pytest.mark.parametrize("softmax_scale", [0.05, 1.0])
def test_custom_softmax_scale(rng, impl, softmax_scale):
    problem = make_varlen_problem(rng, VARLEN_LENS, dtype=jnp.float32)
    out = check_against_oracle(problem, impl, causal=True, softmax_scale=softmax_scale)
    default = problem.run(impl, causal=True)
    assert np.abs(out - np.asarray(default, np.float64)).max() > 1e-3, "softmax_scale was ignored"


@triton_covered_by(TRITON_PREFILL.format("packed-gqa4-d64-bf16-causal-ragged"))  # the default at D 64
@parametrize_impl
def test_default_softmax_scale_is_inverse_sqrt_head_size(rng, impl):
    problem = make_varlen_problem(rng, [7, 20], head_size=64, dtype=jnp.float32)
    default = problem.run(impl, causal=True)
    explicit = problem.run(impl, causal=True, softmax_scale=1.0 / math.sqrt(64))
    np.testing.assert_array_equal(np.asarray(default), np.asarray(explicit))


@triton_covered_by(TRITON_PREFILL.format("paged-bs32-gqa2-d64-f16-softcap-causal"))
@parametrize_impl
@pytest.mark.parametrize("softcap", [1.0, 20.0])
def test_softcap(rng, impl, softcap):
    # softmax_scale=1 gives scores of size ~sqrt(D), so a cap of 1 changes them a lot.
    problem = make_varlen_problem(rng, VARLEN_LENS, dtype=jnp.float32)
    out = check_against_oracle(problem, impl, causal=True, softmax_scale=1.0, softcap=softcap)
    uncapped = problem.oracle(causal=True, softmax_scale=1.0)
    assert np.abs(out - uncapped).max() > 1e-3, "softcap was ignored"


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("packed-gqa2-d80-window-left-only"),
                        MOSAIC_PREFILL.format("paged-bs16-mha-d64-window-both-sides"))
@triton_covered_by(TRITON_PREFILL.format("packed-gqa2-d80-window-left-only"),
                   TRITON_PREFILL.format("packed-gqa2-d64-window-right-only"),
                   TRITON_PREFILL.format("paged-bs16-mha-d64-window-both-sides"))
@parametrize_varlen_impl
def test_packed_window(rng, impl):
    problem = make_varlen_problem(rng, [9, 30], [14, 30], dtype=jnp.bfloat16)
    check_against_oracle(problem, impl, window_size=(5, 3))


MOSAIC_TILING = "tests/test_prefill_kernel.py::test_mosaic_ring_and_paged_copies_match_reference[{}-interpret]"
# The Mosaic GPU kernel grids' cases at each head size (in its interpreter by default).
MOSAIC_PREFILL_AT_HEAD_SIZE = {
    32: MOSAIC_TILING.format("single-ring3-paged-bs48-three-copies-per-block"),
    64: MOSAIC_PREFILL.format("packed-gqa4-d64-bf16-causal-ragged"),
    80: MOSAIC_PREFILL.format("packed-prefix-cached-mqa-d80-f16"),
    128: MOSAIC_PREFILL.format("paged-bs32-mqa-d128-f16-causal-window"),
    256: MOSAIC_PREFILL.format("paged-bs16-gqa2-d256-bf16-causal"),
}


# The Triton kernel grids' cases at each head size.
TRITON_PREFILL_AT_HEAD_SIZE = {
    32: TRITON_TILING.format("unpacked-bq16-bk16-boundaries"),
    64: TRITON_PREFILL.format("packed-gqa4-d64-bf16-causal-ragged"),
    80: TRITON_PREFILL.format("packed-prefix-cached-mqa-d80-f16"),
    128: TRITON_PREFILL.format("packed-mha-d128-f32-noncausal"),
    256: TRITON_PREFILL.format("paged-bs16-gqa2-d256-bf16-causal"),
}


@parametrize_varlen_impl
@pytest.mark.parametrize("head_size", [pytest.param(d, marks=[pytest.mark.covered_by("mosaic_gpu", case),
                                                              triton_covered_by(TRITON_PREFILL_AT_HEAD_SIZE[d])])
                                       for d, case in MOSAIC_PREFILL_AT_HEAD_SIZE.items()])
def test_packed_head_sizes(rng, impl, head_size):
    problem = make_varlen_problem(rng, [6, 19], num_q_heads=2, num_kv_heads=1, head_size=head_size,
                                  dtype=jnp.bfloat16)
    check_against_oracle(problem, impl, causal=True)


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("packed-empty-sequences"))
@triton_covered_by(TRITON_PREFILL.format("packed-empty-sequences"))
@parametrize_varlen_impl
def test_packed_padded_batch(rng, impl):
    # Empty sequences in the middle and at the end, NaN rows past cu_seqlens_q[-1] and
    # past cu_seqlens_k[-1]: the padding rows of the output are exactly 0.
    problem = make_varlen_problem(rng, [4, 0, 9, 0], [4, 0, 9, 0], dtype=jnp.float16,
                                  q_padding_rows=5, k_padding_rows=7, max_seqlen_q=16,
                                  max_seqlen_k=16)
    out = check_against_oracle(problem, impl, causal=True)
    assert not out[13:].any()


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("packed-gqa4-d64-bf16-causal-ragged"),
                        MOSAIC_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"))
@parametrize_varlen_impl
@pytest.mark.parametrize("paged", [False, True])
def test_rows_outside_every_sequence_are_zero_under_jit(rng, impl, paged):
    # Under jit cu_seqlens_q is not validated: one starting past 0 leaves rows before
    # its first sequence, as the padding after its last. Every implementation writes 0 there.
    problem = make_varlen_problem(rng, [3, 4], [5, 20] if paged else [4, 6], dtype=jnp.float16,
                                  paged=paged, q_padding_rows=5)
    problem = dataclasses.replace(problem, cu_seqlens_q=problem.cu_seqlens_q + 2,  # rows 2..8 of 12
                                  q=random_array(rng, problem.q.shape, problem.q.dtype))
    out = check_against_oracle(problem, impl, causal=True)
    assert not out[:2].any() and not out[9:].any()
    assert out[2:9].all(axis=-1).all()


@parametrize_impl
@pytest.mark.parametrize("paged", [False, True])
def test_length_one_sequences(rng, impl, paged):
    # A single key gets weight 1: the output is that key's value (GQA head mapping included).
    problem = make_varlen_problem(rng, [1, 1, 1], num_q_heads=4, num_kv_heads=2, dtype=jnp.float32,
                                  paged=paged)
    out = check_against_oracle(problem, impl, causal=True)
    if paged:
        table = np.asarray(problem.block_table)
        values = np.stack([np.asarray(problem.v)[table[b, 0], 0] for b in range(3)])
    else:
        values = np.asarray(problem.v)
    np.testing.assert_allclose(out, np.repeat(values, 2, axis=1), atol=1e-6)


# --------------------------------------------------------------------------- rows that see no key


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("packed-more-queries-than-keys-causal"))
@triton_covered_by(TRITON_PREFILL.format("packed-more-queries-than-keys-causal"))
@parametrize_varlen_impl
def test_packed_more_queries_than_keys_causal(rng, impl):
    # Sq=6 > Sk=2: query i aligns with key i - 4, so queries 0..3 see nothing; a
    # sequence with no keys at all outputs 0 too.
    problem = make_varlen_problem(rng, [6, 3], [2, 0], dtype=jnp.bfloat16)
    out = check_against_oracle(problem, impl, causal=True)
    assert not out[:4].any() and out[4:6].all(axis=-1).all()
    assert not out[6:].any()


@parametrize_impl
def test_window_that_excludes_every_key(rng, impl):
    # Non-causal window (1, 1) with Sq=6, Sk=2: queries 0..2 have no key in their window.
    problem = make_varlen_problem(rng, [6], [2], dtype=jnp.float32, paged=True)
    out = check_against_oracle(problem, impl, window_size=(1, 1))
    assert not out[:3].any() and out[3:].all(axis=-1).all()


@parametrize_impl
def test_seqused_k_zero(rng, impl):
    problem = make_varlen_problem(rng, [3, 5], [0, 21], dtype=jnp.float16, paged=True,
                                  use_seqused_k=True)
    out = check_against_oracle(problem, impl, causal=True)
    assert not out[:3].any()


# Lengths 0 (output 0) and 1 under 3 causal queries (2 rows without keys).
@triton_covered_by(TRITON_DECODE.format("mqa-d80-bs32-sq3-window-alibi-f16-2splits"))
@parametrize_impl
def test_kvcache_empty_rows(rng, impl):
    # cache_seqlens 0 (batch padding) outputs 0; cache_seqlens 2 < Sq=4 under causal
    # leaves queries 0 and 1 without keys.
    problem = make_kvcache_problem(rng, [0, 2, 23], 4, dtype=jnp.bfloat16)
    out = check_against_oracle(problem, impl, causal=True)
    assert not out[0].any() and not out[1, :2].any() and out[1, 2:].all(axis=-1).all()


# --------------------------------------------------------------------------- non-finite K / V behind the mask
# A NaN or inf in K or V at a key a query may not see (its causal future, outside its
# window, a stale cache slot) must not change that query's output; a query that sees
# it gets a non-finite row. (key position, "k" / "v", value) per sequence; the
# positions are chosen so that each value is hidden from some rows and seen by others,
# in the same tile as the rows it is hidden from.

NAN, INF = float("nan"), float("inf")


NONFINITE_CASES = {
    # The example: key 7 of 8 is seen by row 7 only (causal).
    "packed-causal": (dict(q_lens=[8, 13]), dict(causal=True),
                      {0: [(7, "v", NAN)], 1: [(6, "k", NAN), (9, "v", INF), (12, "v", NAN)]}),
    # Non-causal window (2, 1): key 3 is seen by rows 2..5.
    "packed-window": (dict(q_lens=[12]), dict(window_size=(2, 1)), {0: [(3, "v", NAN), (9, "k", NAN)]}),
    # Long enough for unmasked interior KV blocks next to the masked diagonal ones.
    "packed-causal-long": (dict(q_lens=[150], dtype=jnp.float32), dict(causal=True),
                           {0: [(20, "v", NAN), (70, "k", NAN), (149, "v", INF)]}),
    # Cached prefix: key 17 of 20 is seen by rows >= 1 of 4, key 35 of 40 by rows >= 4 of 9.
    "paged-prefix-causal": (dict(q_lens=[4, 9], k_lens=[20, 40], paged=True), dict(causal=True),
                            {0: [(17, "v", NAN)], 1: [(35, "v", INF), (38, "k", NAN)]}),
    # A page that held NaN for a previous owner, outside every query's window, and a
    # key at the window's left edge (seen by rows 0 and 1 only).
    "paged-window-stale-page": (
        dict(q_lens=[6], k_lens=[40], paged=True), dict(causal=True, window_size=(5, 0)),
        {0: [(j, "v", NAN) for j in range(16)] + [(j, "k", NAN) for j in range(16)] + [(30, "v", NAN)]}),
    # Decode of 4 tokens: the last key is seen by the last query only.
    "kvcache-causal": (dict(cache_seqlens=[20, 37], num_queries=4), dict(causal=True),
                       {0: [(19, "v", NAN)], 1: [(34, "v", INF), (36, "k", NAN)]}),
    "kvcache-window": (dict(cache_seqlens=[40], num_queries=3), dict(causal=True, window_size=(4, 0)),
                       {0: [(j, "v", NAN) for j in range(33)] + [(33, "k", NAN), (39, "v", NAN)]}),
    # One query token: keys left of its window hold a stale page.
    "kvcache-one-token-window": (dict(cache_seqlens=[40, 9], num_queries=1), dict(window_size=(3, 0)),
                                 {0: [(j, "v", NAN) for j in range(36)], 1: [(8, "v", NAN)]}),
}


# The kernel grids' poisoned-key cases: the Triton prefill kernel's (causal window, NaN /
# inf on the diagonal and the window's edge, packed and paged, every loop form) and the
# decode kernel's (3 causal query tokens, a window, a stale page left of it); the
# non-causal window, the long causal run and the stale page under a prefill window run here.
NONFINITE_TRITON_COVERED_BY = {
    "packed-causal": TRITON_PREFILL_NONFINITE,
    "paged-prefix-causal": TRITON_PREFILL_NONFINITE,
    "kvcache-causal": TRITON_DECODE_NONFINITE,
    "kvcache-window": TRITON_DECODE_NONFINITE,
    "kvcache-one-token-window": TRITON_DECODE_NONFINITE,
}


@parametrize_impl
@pytest.mark.parametrize("name", [pytest.param(name, marks=triton_covered_by(*NONFINITE_TRITON_COVERED_BY[name])
                                               if name in NONFINITE_TRITON_COVERED_BY else ())
                                  for name in NONFINITE_CASES])
def test_nonfinite_keys_reach_only_the_rows_that_see_them(rng, impl, name):
    _assert_poisoned_problem_matches_oracle(rng, impl, *NONFINITE_CASES[name])


# One NaN rule: a non-finite value in ONE channel of V at a visible key makes the whole
# (query, head) row NaN, as a non-finite key does; the product alone would spread it to
# that channel only. Keys seen in unmasked interior tiles, by a single query token (no
# mask hides a loaded key), and at a masked tile's edge. Every implementation, the
# Mosaic GPU kernels (prefill for the packed case, decode for the kvcache ones) too.
ONE_CHANNEL_CASES = {
    "packed-causal-interior": (dict(q_lens=[130, 7]), dict(causal=True),
                               {0: [(3, "v", INF, (0, 5)), (100, "v", NAN, (1, 0))], 1: [(6, "v", INF, (1, 31))]}),
    "kvcache-one-token": (dict(cache_seqlens=[40, 9], num_queries=1), {},
                          {0: [(5, "v", INF, (0, 2))], 1: [(8, "v", NAN, (1, 7))]}),
    "kvcache-causal-three-tokens": (dict(cache_seqlens=[37], num_queries=3), dict(causal=True),
                                    {0: [(2, "v", INF, (0, 4)), (36, "v", INF, (1, 1))]}),
}


@parametrize_varlen_impl
@pytest.mark.parametrize("name", list(ONE_CHANNEL_CASES))
def test_one_nonfinite_channel_makes_whole_rows_nan(rng, impl, name):
    _assert_poisoned_problem_matches_oracle(rng, impl, *ONE_CHANNEL_CASES[name])


def _assert_poisoned_problem_matches_oracle(rng, impl, build, attention, poison):
    if "cache_seqlens" in build:
        build = dict(build)
        problem = make_kvcache_problem(rng, build.pop("cache_seqlens"), build.pop("num_queries"), **build)
    else:
        problem = make_varlen_problem(rng, **build)
    problem = poison_keys(problem, poison)
    out = problem.run(impl, **attention)
    exact = problem.oracle(**attention)
    low = problem.oracle(emulate_dtype=jnp.dtype(problem.q.dtype), **attention)
    assert (~np.isfinite(exact)).any(), "the case must have rows that see a non-finite key"
    assert_nonfinite_rows_match_oracle(out, exact, low, problem.q.dtype)


# The Mosaic GPU prefill kernel on the varlen cases at 16-bit dtypes (it has no decode
# kernel and takes no float32 queries).
MOSAIC_NONFINITE_CASES = [name for name, (build, _, _) in NONFINITE_CASES.items()
                          if "cache_seqlens" not in build and build.get("dtype") != jnp.float32]


@pytest.mark.covered_by("mosaic_gpu", *MOSAIC_NONFINITE)
@pytest.mark.parametrize("impl", MOSAIC_IMPLEMENTATIONS)
@pytest.mark.parametrize("name", MOSAIC_NONFINITE_CASES)
def test_nonfinite_keys_reach_only_the_rows_that_see_them_mosaic(rng, impl, name):
    test_nonfinite_keys_reach_only_the_rows_that_see_them(rng, impl, name)


# --------------------------------------------------------------------------- zero-size inputs
# One behaviour on every implementation: no query gives an empty output, no key
# anywhere (no packed row, no cache block, no block-table column) gives zeros.


def _zero_size_call(name: str):
    """(function, array arguments, static arguments) of one zero-size call."""
    heads, kv_heads, head_size, block_size = 4, 2, 32, 16
    ints = lambda values, shape=None: jnp.asarray(values, jnp.int32).reshape(shape or np.shape(values))
    tokens = lambda n, h: jnp.ones((n, h, head_size), jnp.bfloat16)
    cache = lambda blocks: jnp.full((blocks, block_size, kv_heads, head_size), jnp.nan, jnp.bfloat16)
    kvcache = jax_paged_attn.flash_attn_with_kvcache
    varlen = jax_paged_attn.flash_attn_varlen_func
    decode_args = lambda q, blocks, lens, table: dict(q=q, k_cache=cache(blocks), v_cache=cache(blocks),
                                                      cache_seqlens=ints(lens), block_table=table)
    varlen_args = lambda q, k, cu_q, cu_k, table=None: dict(q=q, k=k, v=k, cu_seqlens_q=ints(cu_q),
                                                            cu_seqlens_k=ints(cu_k), block_table=table)
    bounds = dict(max_seqlen_q=4, max_seqlen_k=4)
    calls = {
        "decode-empty-batch": (kvcache, decode_args(jnp.ones((0, 1, heads, head_size), jnp.bfloat16), 4,
                                                    [], ints([], (0, 2))), {}),
        "decode-no-query-token": (kvcache, decode_args(jnp.ones((2, 0, heads, head_size), jnp.bfloat16), 4,
                                                       [3, 5], ints([[0, 1], [2, 3]])), {}),
        "decode-no-query-head": (kvcache, decode_args(jnp.ones((2, 1, 0, head_size), jnp.bfloat16), 4,
                                                      [3, 5], ints([[0, 1], [2, 3]])), {}),
        "decode-table-without-columns": (kvcache, decode_args(jnp.ones((2, 1, heads, head_size), jnp.bfloat16),
                                                              4, [0, 0], ints([], (2, 0))), {}),
        "decode-cache-without-blocks": (kvcache, decode_args(jnp.ones((2, 1, heads, head_size), jnp.bfloat16),
                                                             0, [0, 0], ints([[0], [0]])), {}),
        "varlen-no-token": (varlen, varlen_args(tokens(0, heads), tokens(0, kv_heads), [0, 0], [0, 0]), bounds),
        "varlen-no-key": (varlen, varlen_args(tokens(3, heads), tokens(0, kv_heads), [0, 3], [0, 0]), bounds),
        "varlen-no-query-head": (varlen, varlen_args(tokens(3, 0), tokens(3, kv_heads), [0, 3], [0, 3]), bounds),
        "paged-no-token": (varlen, varlen_args(tokens(0, heads), cache(4), [0, 0], [0, 0], ints([[0]])), bounds),
        "paged-table-without-columns": (varlen, varlen_args(tokens(3, heads), cache(4), [0, 3], [0, 0],
                                                            ints([], (1, 0))), bounds),
        "paged-cache-without-blocks": (varlen, varlen_args(tokens(3, heads), cache(0), [0, 3], [0, 0],
                                                           ints([[0]])), bounds),
    }
    return calls[name]


ZERO_SIZE_CALLS = ["decode-empty-batch", "decode-no-query-token", "decode-no-query-head",
                   "decode-table-without-columns", "decode-cache-without-blocks", "varlen-no-token",
                   "varlen-no-key", "varlen-no-query-head", "paged-no-token", "paged-table-without-columns",
                   "paged-cache-without-blocks"]


@parametrize_impl
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ZERO_SIZE_CALLS)
def test_zero_size_inputs(impl, name, eager):
    fn, arrays, static = _zero_size_call(name)
    out = call_api(fn, arrays, dict(static, **impl.api_kwargs()), eager=eager, causal=True)
    assert out.shape == arrays["q"].shape and out.dtype == arrays["q"].dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), 0.0)


# --------------------------------------------------------------------------- varlen, paged K/V

PREFIX_Q_LENS = [7, 1, 20, 4]
PREFIX_K_LENS = [7, 33, 45, 16]  # cached prefix + the new tokens; some pages half full


PAGED_DTYPE_TRITON_COVERED_BY = {  # float32: no paged case in the Triton kernel grid
    jnp.float16: TRITON_PREFILL.format("paged-bs32-gqa2-d64-f16-softcap-causal"),
    jnp.bfloat16: TRITON_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"),
}


@parametrize_impl
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=triton_covered_by(PAGED_DTYPE_TRITON_COVERED_BY[d])
                                                if d in PAGED_DTYPE_TRITON_COVERED_BY else ())
                                   for d in DTYPES])
def test_paged_dtypes_output_dtype_and_no_nan_leak(rng, impl, dtype):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, dtype=dtype, paged=True,
                                  extra_blocks=4, max_blocks_per_seq=5)
    check_against_oracle(problem, impl, causal=True)


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"),
                        MOSAIC_PREFILL.format("paged-bs32-mqa-d128-f16-causal-window"))
@triton_covered_by(TRITON_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"),
                   TRITON_PREFILL.format("paged-bs32-gqa2-d64-f16-softcap-causal"))
@parametrize_varlen_impl
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_block_sizes(rng, impl, block_size):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, dtype=jnp.bfloat16, paged=True,
                                  block_size=block_size)
    check_against_oracle(problem, impl, causal=True)


@triton_covered_by(TRITON_PREFILL.format("paged-seqused-k-gqa4-d64"))
@parametrize_impl
def test_paged_seqused_k_overrides_cu_seqlens_k(rng, impl):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, dtype=jnp.float32, paged=True,
                                  use_seqused_k=True)
    check_against_oracle(problem, impl, causal=True)


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"))
@triton_covered_by(TRITON_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"))
@parametrize_varlen_impl
@pytest.mark.parametrize("decode_len", [1, 4])
def test_paged_varlen_decode_batch(rng, impl, decode_len):
    # vLLM's speculative-decode path: a few queries per sequence through the varlen API.
    problem = make_varlen_problem(rng, [decode_len] * 3, [decode_len, 17, 40], dtype=jnp.bfloat16,
                                  paged=True)
    check_against_oracle(problem, impl, causal=True)


WINDOWS = [(3, 0), (0, 0), (4, -1), (-1, 2), (2, 5)]
# The Triton kernel grids' cases with each window's sides (a window of (0, 0) runs here).
WINDOW_TRITON_COVERED_BY = {
    (3, 0): [TRITON_TILING.format("paged-page-ids-in-step-window"), TRITON_TILING.format("packed-bq32-bk16-boundaries-window")],
    (4, -1): [TRITON_PREFILL.format("packed-gqa2-d80-window-left-only")],
    (-1, 2): [TRITON_PREFILL.format("packed-gqa2-d64-window-right-only")],
    (2, 5): [TRITON_PREFILL.format("paged-bs16-mha-d64-window-both-sides"),
             TRITON_TILING.format("paged-bk16-over-bs32-in-order")],
}


@parametrize_impl
@pytest.mark.parametrize("window_size", [pytest.param(w, id=str(w), marks=triton_covered_by(*WINDOW_TRITON_COVERED_BY[w])
                                                      if w in WINDOW_TRITON_COVERED_BY else ())
                                         for w in WINDOWS])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_window(rng, impl, window_size, causal):
    problem = make_varlen_problem(rng, [5, 1, 12], [5, 30, 27], dtype=jnp.float32, paged=True)
    check_against_oracle(problem, impl, causal=causal, window_size=window_size)


@parametrize_impl
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=triton_covered_by(
    TRITON_PREFILL.format("paged-fp8e5m2-bs32-mqa-d80-f16-alibi")))])  # non-causal ALiBi runs here
def test_paged_alibi(rng, impl, causal):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, num_q_heads=8, num_kv_heads=2,
                                  dtype=jnp.float32, paged=True)
    slopes = alibi_slopes(8)
    out = check_against_oracle(problem, impl, causal=causal, alibi_slopes=slopes)
    assert np.abs(out - problem.oracle(causal=causal)).max() > 1e-3, "alibi_slopes were ignored"


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"),
                        MOSAIC_PREFILL.format("paged-bs32-mqa-d128-f16-causal-window"),
                        MOSAIC_PREFILL.format("paged-bs16-mha-d64-window-both-sides"))
@triton_covered_by(TRITON_PREFILL.format("paged-bs16-mha-d64-window-both-sides"),
                   TRITON_PREFILL.format("paged-bs16-gqa4-d64-bf16-causal-prefix"),
                   TRITON_PREFILL.format("paged-fp8e5m2-bs32-mqa-d80-f16-alibi"))
@parametrize_varlen_impl
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(8, 8), (8, 2), (8, 1)])
def test_paged_gqa(rng, impl, num_q_heads, num_kv_heads):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, num_q_heads=num_q_heads,
                                  num_kv_heads=num_kv_heads, dtype=jnp.bfloat16, paged=True)
    check_against_oracle(problem, impl, causal=True)


@pytest.mark.covered_by("mosaic_gpu", MOSAIC_PREFILL.format("paged-fp8e4m3-bs16-gqa4-d64-bf16-causal"),
                        MOSAIC_OTHER_CHECKS.format("paged-fp8e5m2-bs32-mqa-d80-f16-alibi-key_flags"))
@triton_covered_by(TRITON_PREFILL.format("paged-fp8e4m3-bs16-gqa4-d64-bf16-causal"),
                   TRITON_PREFILL.format("paged-fp8e5m2-bs32-mqa-d80-f16-alibi"))
@parametrize_varlen_impl
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_paged_fp8_cache(rng, impl, cache_dtype):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, dtype=jnp.bfloat16, paged=True,
                                  cache_dtype=cache_dtype, k_scale=0.05, v_scale=0.02)
    check_against_oracle(problem, impl, causal=True)


@parametrize_varlen_impl
def test_paged_everything_at_once(rng, impl):
    problem = make_varlen_problem(rng, PREFIX_Q_LENS, PREFIX_K_LENS, num_q_heads=4, num_kv_heads=2,
                                  head_size=80, dtype=jnp.float16, paged=True, block_size=32,
                                  cache_dtype=jnp.float8_e4m3fn, k_scale=0.05, v_scale=0.05)
    check_against_oracle(problem, impl, causal=True, window_size=(9, 0), softcap=3.0,
                         softmax_scale=0.3, alibi_slopes=alibi_slopes(4))


# --------------------------------------------------------------------------- flash_attn_with_kvcache

DECODE_LENS = [1, 17, 40, 33]


@triton_covered_by(TRITON_DECODE.format("gqa4-d128-bs16-causal-bf16-3splits"),
                   TRITON_DECODE.format("mha-d64-softcap-noncausal-f32"),
                   TRITON_DECODE.format("gqa8-d256-sq3-fp8e4m3-bf16"))  # 1 and 3 query tokens
@parametrize_impl
@pytest.mark.parametrize("num_queries", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_decode(rng, impl, num_queries, causal):
    problem = make_kvcache_problem(rng, [max(n, num_queries) for n in DECODE_LENS], num_queries,
                                   dtype=jnp.bfloat16)
    check_against_oracle(problem, impl, causal=causal)


@triton_covered_by(TRITON_DECODE.format("mha-d64-softcap-noncausal-f32"),
                   TRITON_DECODE.format("mqa-d80-bs32-sq3-window-alibi-f16-2splits"),
                   TRITON_DECODE.format("gqa4-d128-bs16-causal-bf16-3splits"))
@parametrize_impl
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_dtypes(rng, impl, dtype):
    problem = make_kvcache_problem(rng, DECODE_LENS, dtype=dtype, extra_blocks=4, max_blocks_per_seq=4)
    check_against_oracle(problem, impl, causal=True)


# The Triton decode grid's cases at each head size (block sizes 16 and 32 among them).
DECODE_TRITON_AT_HEAD_SIZE = {
    64: [TRITON_DECODE.format("mha-d64-softcap-noncausal-f32"),
         TRITON_DECODE.format("gqa4-d64-bs32-fp8e5m2-window-alibi-softcap-f16")],
    80: [TRITON_DECODE.format("mqa-d80-bs32-sq3-window-alibi-f16-2splits")],
    128: [TRITON_DECODE.format("gqa4-d128-bs16-causal-bf16-3splits")],
    256: [TRITON_DECODE.format("gqa8-d256-sq3-fp8e4m3-bf16")],
}


@parametrize_impl
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [pytest.param(d, marks=triton_covered_by(*cases))
                                       for d, cases in DECODE_TRITON_AT_HEAD_SIZE.items()])
def test_decode_head_and_block_sizes(rng, impl, block_size, head_size):
    problem = make_kvcache_problem(rng, [9, 50], num_q_heads=2, num_kv_heads=1, head_size=head_size,
                                   block_size=block_size, dtype=jnp.bfloat16)
    check_against_oracle(problem, impl, causal=True)


@triton_covered_by(TRITON_DECODE.format("mha-d64-softcap-noncausal-f32"),
                   TRITON_DECODE.format("gqa4-d128-bs16-causal-bf16-3splits"),
                   TRITON_DECODE.format("mqa-d80-bs32-sq3-window-alibi-f16-2splits"))
@parametrize_impl
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_decode_gqa(rng, impl, num_q_heads, num_kv_heads):
    problem = make_kvcache_problem(rng, DECODE_LENS, num_q_heads=num_q_heads,
                                   num_kv_heads=num_kv_heads, dtype=jnp.float16)
    check_against_oracle(problem, impl, causal=True)


@triton_covered_by(TRITON_DECODE.format("gqa8-d128-fp8e4m3-window-alibi-bf16-prefetched-ids"),
                   TRITON_DECODE.format("gqa8-d256-sq3-fp8e4m3-bf16"),
                   TRITON_DECODE.format("gqa4-d64-bs32-fp8e5m2-window-alibi-softcap-f16"))
@parametrize_impl
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("num_queries", [1, 4])
def test_decode_fp8_cache(rng, impl, cache_dtype, num_queries):
    problem = make_kvcache_problem(rng, DECODE_LENS, num_queries, dtype=jnp.bfloat16,
                                   cache_dtype=cache_dtype, k_scale=0.05, v_scale=0.02)
    check_against_oracle(problem, impl, causal=True)


# The Triton decode grid's cases with a causal window, a soft-cap, ALiBi; the empty and
# the right-only windows and a custom softmax_scale with all of them run here.
DECODE_FEATURE_TRITON_COVERED_BY = {
    "window_causal": [TRITON_DECODE.format("mqa-d80-bs32-sq3-window-alibi-f16-2splits")],
    "softcap": [TRITON_DECODE.format("mha-d64-softcap-noncausal-f32")],
    "alibi": [TRITON_DECODE.format("mqa-d80-bs32-sq3-window-alibi-f16-2splits"),
              TRITON_DECODE.format("gqa8-d128-fp8e4m3-window-alibi-bf16-prefetched-ids")],
}


@parametrize_impl
@pytest.mark.parametrize(
    "attention",
    [pytest.param(a, id=i, marks=triton_covered_by(*DECODE_FEATURE_TRITON_COVERED_BY[i])
                  if i in DECODE_FEATURE_TRITON_COVERED_BY else ())
     for i, a in [
        ("window_causal", dict(window_size=(8, 0), causal=True)),
        ("window_0_0", dict(window_size=(0, 0))),
        ("window_right", dict(window_size=(-1, 3))),
        ("softcap", dict(softcap=2.0, softmax_scale=1.0)),
        ("alibi", dict(alibi=True, causal=True)),
        ("everything", dict(alibi=True, softcap=5.0, window_size=(20, 0), causal=True, softmax_scale=0.2)),
    ]],
)
def test_decode_features(rng, impl, attention):
    attention = dict(attention)
    if attention.pop("alibi", False):
        attention["alibi_slopes"] = alibi_slopes(8)
    problem = make_kvcache_problem(rng, DECODE_LENS, 2, num_q_heads=8, num_kv_heads=2,
                                   dtype=jnp.float32)
    check_against_oracle(problem, impl, **attention)


MOSAIC_DECODE_SCENARIOS = {
    # name: (make_kvcache_problem arguments, attention options)
    "gqa2-d64-causal": (dict(num_queries=1, head_size=64), dict(causal=True)),
    "mqa-d128-bs32-sq4-noncausal": (dict(num_queries=4, head_size=128, block_size=32, num_q_heads=8,
                                         num_kv_heads=1), dict(causal=False)),
    "gqa2-d64-f16-everything": (dict(num_queries=1, head_size=64, dtype=jnp.float16),
                                dict(alibi=True, softcap=5.0, window_size=(20, 0), causal=True,
                                     softmax_scale=0.2)),
    "gqa2-d128-fp8e4m3-causal": (dict(num_queries=1, head_size=128, cache_dtype=jnp.float8_e4m3fn,
                                      k_scale=0.05, v_scale=0.02), dict(causal=True)),
    "gqa2-d64-fp8e5m2-sq4-noncausal": (dict(num_queries=4, head_size=64, cache_dtype=jnp.float8_e5m2,
                                            dtype=jnp.float16, k_scale=0.05, v_scale=0.02), dict(causal=False)),
    "gqa2-d64-sq4-causal": (dict(num_queries=4, head_size=64), dict(causal=True)),
    "gqa2-d64-sq3-window": (dict(num_queries=3, head_size=64), dict(window_size=(8, 0))),
    # Head sizes that are not multiples of 64: 64- and 32-byte swizzles (P's matches V's).
    "gqa2-d96-causal": (dict(num_queries=1, head_size=96), dict(causal=True)),
    "gqa2-d80-f16-sq3-window-softcap": (dict(num_queries=3, head_size=80, dtype=jnp.float16),
                                        dict(window_size=(8, 0), softcap=5.0)),
    # fp8 rows of 80 bytes: no swizzle fits, loaded in the wgmma layout for the upcast
    "gqa2-d80-fp8e4m3-causal": (dict(num_queries=1, head_size=80, cache_dtype=jnp.float8_e4m3fn,
                                     k_scale=0.05, v_scale=0.02), dict(causal=True)),
    # Block sizes that do not divide 128: 64-key stages of 16-row runs spanning pages (48),
    # and of 32-row runs (96, a stage's second run in the next page half the time).
    "gqa2-d64-bs48-sq3-window": (dict(num_queries=3, head_size=64, block_size=48), dict(window_size=(20, 0))),
    "gqa2-d64-bs96-causal": (dict(num_queries=1, head_size=64, block_size=96), dict(causal=True)),
}


# Scenarios whose features the Mosaic GPU decode grid of test_decode_kernel.py checks (on
# the interpreter, against the reference) run with --full; the head and block sizes only
# these scenarios have run by default.
MOSAIC_DECODE_GRID = "tests/test_decode_kernel.py::test_mosaic_matches_reference_in_interpret_mode[mgpu-{}]"
MOSAIC_DECODE_COVERED_BY = {
    "gqa2-d64-causal": ["gqa4-d64-causal-bf16-3splits-2stages"],
    "mqa-d128-bs32-sq4-noncausal": ["mqa-d128-bs32-window-alibi-softcap-f16-128keys",
                                    "gqa32-d64-sq3-noncausal-2rowblocks"],
    "gqa2-d64-f16-everything": ["mqa-d128-bs32-window-alibi-softcap-f16-128keys"],
    "gqa2-d128-fp8e4m3-causal": ["specialized-1wg-gqa8-d128-fp8e4m3-window-alibi-2splits"],
    "gqa2-d64-fp8e5m2-sq4-noncausal": ["gqa4-d64-bs32-fp8e5m2-softcap-f16", "gqa32-d64-sq3-noncausal-2rowblocks"],
    "gqa2-d64-sq4-causal": ["items3-2wg-gqa4-d128-sq4-causal-window"],
    "gqa2-d64-sq3-window": ["gqa4-d64-sq2-two-sided-window"],
}


@pytest.mark.parametrize("impl", DECODE_MOSAIC_IMPLEMENTATIONS)
@pytest.mark.parametrize("scenario", [
    pytest.param(name, id=name, marks=[pytest.mark.covered_by("mosaic_gpu", *(MOSAIC_DECODE_GRID.format(case)
                                                                               for case in covered))]
                 if (covered := MOSAIC_DECODE_COVERED_BY.get(name)) else [])
    for name in MOSAIC_DECODE_SCENARIOS])
def test_decode_mosaic_gpu(rng, impl, scenario):
    build, attention = (dict(x) for x in MOSAIC_DECODE_SCENARIOS[scenario])
    if attention.pop("alibi", False):
        attention["alibi_slopes"] = alibi_slopes(4)
    problem = make_kvcache_problem(rng, DECODE_LENS, build.pop("num_queries"), **build)
    check_against_oracle(problem, impl, **attention)


@pytest.mark.parametrize(
    "build, attention, reason",
    [
        (dict(head_size=64, dtype=jnp.float32), dict(causal=True), "float16 / bfloat16 queries only"),
    ],
    ids=["float32"],
)
def test_decode_mosaic_gpu_refuses_what_it_lacks(rng, build, attention, reason):
    """implementation="mosaic_gpu" raises NotImplementedError naming what the first cut
    lacks (on any host: the refusal comes before the kernel is traced)."""
    build = dict(build)
    problem = make_kvcache_problem(rng, DECODE_LENS, build.pop("num_queries", 1), **build)
    with pytest.raises(NotImplementedError, match=reason):
        problem.run(MOSAIC_GPU_INTERPRET, **attention)


# --------------------------------------------------------------------------- eager and under jax.jit
# Every other test calls the API inside jit (`conftest.call_api`); these two run it op by
# op (where the value checks of the arguments run too) and under a plain `jax.jit`.


@parametrize_impl
def test_eager_calls(rng, impl):
    varlen = make_varlen_problem(rng, [3, 9], [20, 9], dtype=jnp.bfloat16, paged=True)
    check_against_oracle(varlen, impl, eager=True, causal=True, softcap=4.0)
    decode = make_kvcache_problem(rng, [3, 20], 2, dtype=jnp.bfloat16,
                                  cache_dtype=jnp.float8_e4m3fn, k_scale=0.1, v_scale=0.1)
    check_against_oracle(decode, impl, eager=True, causal=True, alibi_slopes=alibi_slopes(4))


def same_shape_paged_problems(rng):
    """Two paged varlen problems with identical shapes but different lengths and pages."""
    common = dict(num_q_heads=4, num_kv_heads=2, dtype=jnp.bfloat16, paged=True,
                  max_seqlen_q=24, max_seqlen_k=48, max_blocks_per_seq=3,
                  cache_dtype=jnp.float8_e5m2)
    first = make_varlen_problem(rng, [4, 20, 0], [4, 40, 9], q_padding_rows=2, extra_blocks=2,
                                k_scale=0.05, v_scale=0.1, **common)  # 4 + 3 + 1 pages
    second = make_varlen_problem(rng, [1, 1, 24], [33, 1, 24], q_padding_rows=0, extra_blocks=1,
                                 k_scale=0.1, v_scale=0.03, **common)  # 3 + 1 + 2 pages
    assert jax.tree.map(jnp.shape, first.arrays()) == jax.tree.map(jnp.shape, second.arrays())
    return first, second


@parametrize_impl
def test_varlen_jit_with_traced_arrays(rng, impl):
    traces = []

    @functools.partial(jax.jit, static_argnames=("max_seqlen_q", "max_seqlen_k"))
    def attend(arrays, slopes, max_seqlen_q, max_seqlen_k):
        traces.append(None)
        return jax_paged_attn.flash_attn_varlen_func(
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **arrays, causal=True,
            window_size=(30, 0), alibi_slopes=slopes, **impl.api_kwargs())

    slopes = alibi_slopes(4)
    for problem in same_shape_paged_problems(rng):
        out = attend(problem.arrays(), slopes, problem.max_seqlen_q, problem.max_seqlen_k)
        assert_valid_output(out, problem.q)
        exact = problem.oracle(causal=True, window_size=(30, 0), alibi_slopes=slopes)
        low = problem.oracle(causal=True, window_size=(30, 0), alibi_slopes=slopes,
                             emulate_dtype=jnp.dtype(problem.q.dtype))
        assert_close_to_oracle(out, exact, low, problem.q.dtype)
    assert len(traces) == 1, "new lengths / block tables / scales must not retrace"


@parametrize_impl
def test_kvcache_jit_with_traced_arrays(rng, impl):
    traces = []

    @jax.jit
    def attend(arrays):
        traces.append(None)
        return jax_paged_attn.flash_attn_with_kvcache(**arrays, causal=True, softcap=10.0,
                                                      **impl.api_kwargs())

    common = dict(num_q_heads=4, num_kv_heads=1, dtype=jnp.float16, max_blocks_per_seq=4,
                  cache_dtype=jnp.float8_e4m3fn)
    problems = [make_kvcache_problem(rng, [5, 64], 4, extra_blocks=1, k_scale=0.1, v_scale=0.1,
                                     **common),
                make_kvcache_problem(rng, [20, 30], 4, extra_blocks=2, k_scale=0.03, v_scale=0.2,
                                     **common)]
    for problem in problems:
        out = attend(problem.arrays())
        assert_valid_output(out, problem.q)
        exact = problem.oracle(causal=True, softcap=10.0)
        low = problem.oracle(causal=True, softcap=10.0, emulate_dtype=jnp.dtype(problem.q.dtype))
        assert_close_to_oracle(out, exact, low, problem.q.dtype)
    assert len(traces) == 1


# --------------------------------------------------------------------------- property-based

WINDOW_SIDES = st.sampled_from([-1, 0, 1, 3, 8])
# Fixed array shapes (lengths vary below the bounds) keep compilations few.
MAX_BATCH, MAX_Q, MAX_K = 3, 12, 32


@st.composite
def attention_options(draw, num_q_heads: int) -> dict:
    options = dict(
        causal=draw(st.booleans()),
        window_size=(draw(WINDOW_SIDES), draw(WINDOW_SIDES)),
        softcap=draw(st.sampled_from([0.0, 0.5, 5.0])),
        softmax_scale=draw(st.sampled_from([None, 0.3, 1.0])),
    )
    if draw(st.booleans()):
        options["alibi_slopes"] = alibi_slopes(num_q_heads)
    return options


@parametrize_impl
def test_random_varlen_problems(impl: Implementation):
    @settings(max_examples=impl.max_examples)
    @given(data=st.data())
    def check(data):
        batch = data.draw(st.integers(1, MAX_BATCH), label="batch")
        q_lens = data.draw(st.lists(st.integers(0, MAX_Q), min_size=batch, max_size=batch), label="q_lens")
        k_lens = [data.draw(st.integers(max(0, n - 4), MAX_K), label="k_len") for n in q_lens]
        num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
        num_q_heads = num_kv_heads * data.draw(st.sampled_from([1, 2, 4]), label="group")
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        paged = data.draw(st.booleans(), label="paged")
        layout = {}
        if paged:
            block_size = data.draw(st.sampled_from([16, 32]), label="block_size")
            used_pages = sum(-(-n // block_size) for n in k_lens)
            layout = dict(block_size=block_size, max_blocks_per_seq=MAX_K // block_size,
                          extra_blocks=MAX_BATCH * MAX_K // block_size + 1 - used_pages,
                          cache_dtype=data.draw(st.sampled_from([None] + FP8_DTYPES), label="cache_dtype"),
                          use_seqused_k=data.draw(st.booleans(), label="use_seqused_k"),
                          k_scale=0.05, v_scale=0.05)
        else:
            layout = dict(k_padding_rows=MAX_BATCH * MAX_K - sum(k_lens))
        problem = make_varlen_problem(
            np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed")), q_lens, k_lens,
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype, paged=paged,
            q_padding_rows=MAX_BATCH * MAX_Q - sum(q_lens), max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K,
            **layout)
        check_against_oracle(problem, impl, **data.draw(attention_options(num_q_heads), label="options"))

    check()


@parametrize_impl
def test_random_kvcache_problems(impl: Implementation):
    @settings(max_examples=impl.max_examples)
    @given(data=st.data())
    def check(data):
        batch = data.draw(st.integers(1, MAX_BATCH), label="batch")
        cache_seqlens = data.draw(st.lists(st.integers(0, 48), min_size=batch, max_size=batch),
                                  label="cache_seqlens")
        num_queries = data.draw(st.sampled_from([1, 2, 4]), label="num_queries")
        num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
        num_q_heads = num_kv_heads * data.draw(st.sampled_from([1, 2, 4]), label="group")
        block_size = data.draw(st.sampled_from([16, 32]), label="block_size")
        max_blocks = -(-48 // block_size)
        used_pages = sum(-(-n // block_size) for n in cache_seqlens)
        problem = make_kvcache_problem(
            np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed")), cache_seqlens,
            num_queries, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            dtype=data.draw(st.sampled_from(DTYPES), label="dtype"), block_size=block_size,
            cache_dtype=data.draw(st.sampled_from([None] + FP8_DTYPES), label="cache_dtype"),
            k_scale=0.05, v_scale=0.05, max_blocks_per_seq=max_blocks,
            extra_blocks=MAX_BATCH * max_blocks + 1 - used_pages)
        check_against_oracle(problem, impl, **data.draw(attention_options(num_q_heads), label="options"))

    check()
