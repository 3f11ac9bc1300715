"""Bad input to the public functions raises ValueError / TypeError naming the argument.

Each case starts from a valid call (checked to succeed in `test_valid_base_calls`) and
breaks exactly one thing. Static checks (shapes, dtypes, Python values) also raise
under `jax.jit`; value checks (cu_seqlens order, block ids) run on concrete arrays.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 16, 4


def packed_call() -> dict[str, Any]:
    """A valid packed call: two sequences of 4 and 6 tokens."""
    q = jnp.zeros((10, HEADS, HEAD_SIZE), jnp.bfloat16)
    kv = jnp.zeros((10, KV_HEADS, HEAD_SIZE), jnp.bfloat16)
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    return dict(q=q, k=kv, v=kv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6,
                causal=True)


def paged_call() -> dict[str, Any]:
    """A valid paged call: 4 + 6 new tokens over 20 + 10 cached ones (pages 0,1 and 2)."""
    cache = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), jnp.bfloat16)
    return dict(q=jnp.zeros((10, HEADS, HEAD_SIZE), jnp.bfloat16), k=cache, v=cache,
                cu_seqlens_q=jnp.asarray([0, 4, 10], jnp.int32),
                cu_seqlens_k=jnp.asarray([0, 20, 30], jnp.int32), max_seqlen_q=6, max_seqlen_k=20,
                block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32), causal=True)


def kvcache_call() -> dict[str, Any]:
    """A valid decode call: one new token for each of two sequences of 20 and 10 tokens."""
    cache = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), jnp.bfloat16)
    return dict(q=jnp.zeros((2, 1, HEADS, HEAD_SIZE), jnp.bfloat16), k_cache=cache, v_cache=cache,
                cache_seqlens=jnp.asarray([20, 10], jnp.int32),
                block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32), causal=True)


BASES: dict[str, tuple[Callable[..., jax.Array], Callable[[], dict[str, Any]]]] = {
    "packed": (jax_paged_attn.flash_attn_varlen_func, packed_call),
    "paged": (jax_paged_attn.flash_attn_varlen_func, paged_call),
    "kvcache": (jax_paged_attn.flash_attn_with_kvcache, kvcache_call),
}


def zeros(shape, dtype=jnp.bfloat16) -> Callable[[], jax.Array]:
    return lambda: jnp.zeros(shape, dtype)


def ints(values) -> Callable[[], jax.Array]:
    return lambda: jnp.asarray(values, jnp.int32)


def case(base: str, error: type, match: str, id: str, **changes: Any):
    """One bad call: `base` with `changes` (callables are called to build arrays)."""
    return pytest.param(base, changes, error, match, id=f"{base}-{id}")


PAGED_CACHE = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)

CASES = [
    # --- head size, head counts, block size
    case("packed", ValueError, r"head size of q=40 is not supported", "head_size_40",
         q=zeros((10, HEADS, 40)), k=zeros((10, KV_HEADS, 40)), v=zeros((10, KV_HEADS, 40))),
    case("paged", ValueError, r"head size of q=512", "head_size_512",
         q=zeros((10, HEADS, 512)), k=zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 512)),
         v=zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 512))),
    case("kvcache", ValueError, r"head size of q=16", "head_size_16",
         q=zeros((2, 1, HEADS, 16)), k_cache=zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 16)),
         v_cache=zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 16))),
    case("packed", ValueError, r"query heads of q \(4\).*KV heads of k \(3\)", "heads_not_divisible",
         k=zeros((10, 3, HEAD_SIZE)), v=zeros((10, 3, HEAD_SIZE))),
    case("kvcache", ValueError, r"query heads of q \(4\).*KV heads of k_cache \(3\)", "heads_not_divisible",
         k_cache=zeros((NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_SIZE)),
         v_cache=zeros((NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_SIZE))),
    case("paged", ValueError, r"block size of the cache \(k\.shape\[1\]\)=8", "block_size_8",
         k=zeros((8, 8, KV_HEADS, HEAD_SIZE)), v=zeros((8, 8, KV_HEADS, HEAD_SIZE)),
         block_table=ints([[0, 1, 2], [3, 4, 5]])),
    case("kvcache", ValueError, r"block size of the cache \(k_cache\.shape\[1\]\)=24", "block_size_24",
         k_cache=zeros((NUM_BLOCKS, 24, KV_HEADS, HEAD_SIZE)),
         v_cache=zeros((NUM_BLOCKS, 24, KV_HEADS, HEAD_SIZE))),
    # --- dtypes
    case("packed", TypeError, r"^k has dtype float16", "k_dtype_mismatch",
         k=zeros((10, KV_HEADS, HEAD_SIZE), jnp.float16)),
    case("paged", TypeError, r"^v has dtype float32", "v_dtype_mismatch", v=zeros(PAGED_CACHE, jnp.float32)),
    case("kvcache", TypeError, r"^k_cache has dtype int8", "k_cache_int8", k_cache=zeros(PAGED_CACHE, jnp.int8)),
    case("packed", TypeError, r"^q must be float16, bfloat16 or float32, got int32", "int_q",
         q=zeros((10, HEADS, HEAD_SIZE), jnp.int32)),
    case("kvcache", TypeError, r"^q must be float16, bfloat16 or float32, got int8", "int_q",
         q=zeros((2, 1, HEADS, HEAD_SIZE), jnp.int8)),
    case("packed", TypeError, r"packed k / v must have q's dtype", "fp8_packed_k",
         k=zeros((10, KV_HEADS, HEAD_SIZE), jnp.float8_e4m3fn),
         v=zeros((10, KV_HEADS, HEAD_SIZE), jnp.float8_e4m3fn)),
    case("packed", TypeError, r"cu_seqlens_q must be an integer array", "float_cu_seqlens",
         cu_seqlens_q=lambda: jnp.asarray([0.0, 4.0, 10.0])),
    case("kvcache", TypeError, r"cache_seqlens must be an integer array", "float_cache_seqlens",
         cache_seqlens=lambda: jnp.asarray([20.0, 10.0])),
    case("kvcache", TypeError, r"block_table must be an integer array", "float_block_table",
         block_table=lambda: jnp.zeros((2, 2), jnp.float32)),
    # --- shapes and ranks
    case("packed", ValueError, r"k and v must have the same shape", "k_v_shapes",
         v=zeros((12, KV_HEADS, HEAD_SIZE))),
    case("kvcache", ValueError, r"k_cache and v_cache must have the same shape", "k_v_shapes",
         v_cache=zeros((NUM_BLOCKS + 1, BLOCK_SIZE, KV_HEADS, HEAD_SIZE))),
    case("packed", ValueError, r"^k has head size 64, q has 32", "k_head_size",
         k=zeros((10, KV_HEADS, 64))),
    case("kvcache", ValueError, r"^v_cache has head size 64, q has 32", "v_head_size",
         v_cache=zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 64))),
    case("packed", ValueError, r"^q must have rank 3", "q_rank", q=zeros((10, HEADS * HEAD_SIZE))),
    case("paged", ValueError, r"^k \(a paged cache, since block_table is given\) must have rank 4",
         "packed_k_with_block_table", k=zeros((30, KV_HEADS, HEAD_SIZE)), v=zeros((30, KV_HEADS, HEAD_SIZE))),
    case("kvcache", ValueError, r"^q must have rank 4", "q_rank", q=zeros((2, HEADS, HEAD_SIZE))),
    case("kvcache", ValueError, r"^k_cache must have rank 4", "cache_rank",
         k_cache=zeros((NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_SIZE)),
         v_cache=zeros((NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_SIZE))),
    case("packed", ValueError, r"cu_seqlens_k must have shape \[3\]", "cu_seqlens_k_length",
         cu_seqlens_k=ints([0, 10])),
    case("packed", ValueError, r"cu_seqlens_q must have at least 2 entries", "cu_seqlens_q_one_entry",
         cu_seqlens_q=ints([0])),
    case("paged", ValueError, r"seqused_k must have shape \[2\]", "seqused_k_shape", seqused_k=ints([20, 10, 5])),
    case("paged", ValueError, r"block_table must have shape \[2, \?\]", "block_table_batch",
         block_table=ints([[0, 1], [2, 3], [0, 0]])),
    case("kvcache", ValueError, r"cache_seqlens must have shape \[2\]", "cache_seqlens_shape",
         cache_seqlens=ints([20])),
    case("packed", ValueError, r"alibi_slopes must have shape \[num_q_heads\] = \[4\]", "alibi_shape",
         alibi_slopes=lambda: jnp.ones((KV_HEADS,), jnp.float32)),
    case("kvcache", ValueError, r"alibi_slopes must have shape \[num_q_heads\] = \[4\]", "alibi_rank",
         alibi_slopes=lambda: jnp.ones((1, HEADS), jnp.float32)),
    # --- cu_seqlens values (concrete arrays)
    case("packed", ValueError, r"cu_seqlens_q must be non-decreasing", "decreasing_cu_seqlens_q",
         cu_seqlens_q=ints([0, 6, 4])),
    case("paged", ValueError, r"cu_seqlens_k must be non-decreasing", "decreasing_cu_seqlens_k",
         cu_seqlens_k=ints([0, 20, 10])),
    case("packed", ValueError, r"cu_seqlens_q must start at 0, got 1", "cu_seqlens_q_start",
         cu_seqlens_q=ints([1, 4, 10])),
    case("packed", ValueError, r"cu_seqlens_k must start at 0", "cu_seqlens_k_start",
         cu_seqlens_k=ints([2, 4, 10])),
    case("packed", ValueError, r"cu_seqlens_q\[-1\] = 12 exceeds the 10 rows", "cu_seqlens_q_past_q",
         cu_seqlens_q=ints([0, 4, 12])),
    case("packed", ValueError, r"cu_seqlens_k\[-1\] = 11 exceeds the 10 rows", "cu_seqlens_k_past_k",
         cu_seqlens_k=ints([0, 4, 11])),
    # --- lengths against the static bounds (concrete arrays): nothing is silently dropped
    case("packed", ValueError, r"max_seqlen_q=5 is below the 6 queries of sequence 1 \(cu_seqlens_q\)",
         "max_seqlen_q_too_small", max_seqlen_q=5),
    case("packed", ValueError, r"max_seqlen_k=4 is below the 6 keys of sequence 1 \(cu_seqlens_k\)",
         "max_seqlen_k_too_small", max_seqlen_k=4),
    case("paged", ValueError, r"max_seqlen_k=20 is below the 21 keys of sequence 1 \(seqused_k\)",
         "max_seqlen_k_below_seqused_k", seqused_k=ints([5, 21])),
    case("paged", ValueError, r"max_seqlen_q=3 is below the 4 queries of sequence 0", "paged_max_seqlen_q_too_small",
         max_seqlen_q=3),
    case("packed", ValueError, r"seqused_k\[0\] = 5 exceeds the 4 keys of sequence 0 in cu_seqlens_k",
         "packed_seqused_k_past_segment", seqused_k=ints([5, 6])),
    # --- block ids (concrete arrays)
    case("paged", ValueError, r"block_table\[0\] uses block ids outside \[0, 4\): \[7\]", "block_id_too_large",
         block_table=ints([[0, 7], [2, 3]])),
    case("paged", ValueError, r"block_table\[1\] uses block ids outside \[0, 4\): \[-1\]", "block_id_negative",
         block_table=ints([[0, 1], [-1, 3]])),
    case("kvcache", ValueError, r"block_table\[0\] uses block ids outside \[0, 4\)", "block_id_too_large",
         block_table=ints([[0, 4], [2, 3]])),
    case("paged", ValueError, r"sequence 0 has 20 tokens, needing 2 blocks, but block_table has only 1",
         "block_table_too_narrow", block_table=ints([[0], [2]])),
    case("paged", ValueError, r"sequence 0 has 40 tokens, needing 3 blocks, but block_table", "seqused_k_too_long",
         seqused_k=ints([40, 10])),
    case("kvcache", ValueError, r"sequence 1 has 33 tokens, needing 3 blocks, but block_table",
         "cache_seqlens_too_long", cache_seqlens=ints([20, 33])),
    case("kvcache", ValueError, r"sequence 0 has 20 tokens, needing 2 blocks, but block_table has only 0 columns",
         "table_without_columns", block_table=lambda: jnp.zeros((2, 0), jnp.int32)),
    case("paged", ValueError, r"block_table\[0\] uses block ids outside \[0, 0\)", "cache_without_blocks",
         k=zeros((0, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)), v=zeros((0, BLOCK_SIZE, KV_HEADS, HEAD_SIZE))),
    case("kvcache", ValueError, r"cache_seqlens must be >= 0", "negative_cache_seqlens", cache_seqlens=ints([20, -1])),
    case("paged", ValueError, r"seqused_k must be >= 0", "negative_seqused_k", seqused_k=ints([20, -3])),
    # --- static Python arguments
    case("packed", TypeError, r"max_seqlen_q must be a Python int", "float_max_seqlen_q", max_seqlen_q=6.0),
    case("packed", TypeError, r"max_seqlen_k must be a Python int", "array_max_seqlen_k",
         max_seqlen_k=lambda: jnp.int32(6)),
    case("paged", ValueError, r"max_seqlen_q must be >= 1, got 0", "zero_max_seqlen_q", max_seqlen_q=0),
    case("packed", TypeError, r"window_size must be a pair of ints", "window_one_int", window_size=(3,)),
    case("kvcache", TypeError, r"window_size must be a pair of ints", "window_float", window_size=(1.5, 0)),
    case("kvcache", TypeError, r"window_size must be a pair of ints", "window_int", window_size=4),
    case("paged", ValueError, r"window_size entries must be >= -1", "window_negative", window_size=(-2, 0)),
    case("packed", ValueError, r"softcap must be >= 0", "negative_softcap", softcap=-1.0),
    case("kvcache", ValueError, r"softcap must be >= 0", "nan_softcap", softcap=float("nan")),
    case("packed", ValueError, r"softmax_scale must be a positive finite number", "negative_softmax_scale",
         softmax_scale=-0.1),
    case("packed", ValueError, r"implementation must be one of", "bad_implementation", implementation="cuda"),
    case("kvcache", ValueError, r"implementation must be one of", "bad_implementation", implementation="Triton"),
    # --- fp8 scales
    case("paged", ValueError, r"k_scale must be a scalar", "k_scale_vector", k_scale=lambda: jnp.ones((2,))),
    case("kvcache", ValueError, r"v_scale must be a scalar", "v_scale_matrix",
         v_scale=lambda: jnp.ones((1, 1))),
    case("kvcache", ValueError, r"k_scale must be > 0", "k_scale_zero", k_scale=0.0),
    case("paged", ValueError, r"k_scale must be > 0 and finite, got inf", "k_scale_inf", k_scale=float("inf")),
    case("paged", ValueError, r"v_scale must be > 0 and finite, got inf", "v_scale_inf_array",
         v_scale=lambda: jnp.float32(np.inf)),
    case("kvcache", ValueError, r"v_scale must be > 0 and finite, got nan", "v_scale_nan", v_scale=float("nan")),
    case("kvcache", ValueError, r"k_scale must be > 0 and finite, got -inf", "k_scale_minus_inf",
         k_scale=lambda: jnp.asarray([-np.inf], jnp.float32)),
]


def build_call(base: str, changes: dict[str, Any]) -> tuple[Callable[..., jax.Array], dict[str, Any]]:
    fn, make_args = BASES[base]
    args = make_args()
    args.update({name: value() if callable(value) else value for name, value in changes.items()})
    return fn, args


@pytest.mark.parametrize("base", list(BASES))
def test_valid_base_calls(base):
    fn, args = build_call(base, {})
    out = fn(**args, implementation="xla")
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype


@pytest.mark.parametrize("base, changes, error, match", CASES)
def test_bad_input_raises_naming_the_argument(base, changes, error, match):
    fn, args = build_call(base, changes)
    args.setdefault("implementation", "xla")
    with pytest.raises(error, match=match):
        fn(**args)


STATIC_CASES = [
    c for c in CASES
    if c.id.split("-", 1)[1] in {"head_size_40", "heads_not_divisible", "block_size_24", "k_dtype_mismatch",
                                 "int_q", "k_v_shapes", "q_rank", "alibi_shape", "k_scale_vector",
                                 "cu_seqlens_k_length", "block_table_batch"}
]


@pytest.mark.parametrize("base, changes, error, match", STATIC_CASES)
def test_static_checks_raise_under_jit(base, changes, error, match):
    fn, args = build_call(base, changes)
    arrays = {name: value for name, value in args.items() if isinstance(value, jax.Array)}
    static = {name: value for name, value in args.items() if name not in arrays}

    @jax.jit
    def call(arrays):
        return fn(**arrays, **static)

    with pytest.raises(error, match=match):
        jax.eval_shape(call, arrays)


def test_bounds_may_exclude_sequences_that_attend_nothing():
    # Padding sequences (no keys, or no queries) may exceed max_seqlen_*: dropping their
    # rows or keys changes nothing, so the call succeeds and their rows are 0.
    fn, args = build_call("packed", dict(cu_seqlens_k=ints([0, 4, 4]), max_seqlen_q=4, max_seqlen_k=4))
    out = np.asarray(fn(**args, implementation="xla").astype(jnp.float32))
    assert out.shape == (10, HEADS, HEAD_SIZE) and not out[4:].any()
    fn, args = build_call("packed", dict(cu_seqlens_q=ints([0, 4, 4]), cu_seqlens_k=ints([0, 4, 10]),
                                         max_seqlen_q=4, max_seqlen_k=4, causal=False))
    assert fn(**args, implementation="xla").shape == (10, HEADS, HEAD_SIZE)


def test_value_checks_need_concrete_arrays():
    # Under jit the cu_seqlens values are unknown: the call traces (documented behaviour),
    # while the same values passed concretely are rejected.
    fn, args = build_call("packed", dict(cu_seqlens_q=ints([0, 6, 4])))
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        fn(**args)
    static = {name: args.pop(name) for name in ("max_seqlen_q", "max_seqlen_k", "causal")}
    out = jax.eval_shape(lambda a: fn(**a, **static, implementation="xla"), args)
    assert out.shape == args["q"].shape
    assert np.dtype(out.dtype) == np.dtype(jnp.bfloat16)
