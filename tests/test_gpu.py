"""GPU suite (``pytest -m gpu`` on a CUDA host): the compiled Pallas kernels against
the reference, on shapes large enough to exercise tiling, splits and paging.

The prefill cases run both kernel implementations, ``triton`` and ``mosaic_gpu`` (the
Mosaic GPU kernel needs a Hopper GPU, sm_90a; it takes 16-bit queries only, so the
float32 case is Triton's alone).

Deselected on CPU by the README's test command (``-m "not gpu"``); run on the
device in every session that changes a kernel.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn as jpa

pytestmark = pytest.mark.gpu

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module", autouse=True)
def _require_gpu():
    if jax.default_backend() != "gpu":
        pytest.fail("the gpu suite needs a CUDA device; deselect it with -m 'not gpu' on CPU hosts")


def _random_cache(key, num_blocks, block_size, num_kv_heads, head_size, dtype):
    k1, k2 = jax.random.split(key)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k = jax.random.normal(k1, shape, jnp.float32)
    v = jax.random.normal(k2, shape, jnp.float32)
    if jnp.dtype(dtype).itemsize == 1:
        return (k / 2).astype(dtype), (v / 2).astype(dtype), 2.0
    return k.astype(dtype), v.astype(dtype), 1.0


def _tolerance(dtype):
    return {jnp.float32: 2e-3, jnp.float16: 2e-2, jnp.bfloat16: 4e-2}[dtype]


def _assert_close(out, ref, dtype):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=_tolerance(dtype), rtol=_tolerance(dtype))


DECODE_CASES = [
    # batch, q_per_seq, Hq, Hk, D, block_size, cache dtype, kwargs
    (16, 1, 32, 8, 128, 16, jnp.bfloat16, {}),
    (4, 1, 32, 8, 128, 16, jnp.bfloat16, dict(window_size=(700, 0))),
    (8, 1, 16, 16, 64, 32, jnp.float16, dict(softcap=30.0)),
    (8, 1, 8, 1, 80, 16, jnp.bfloat16, dict(alibi=True)),
    (8, 4, 32, 8, 128, 16, jnp.bfloat16, {}),
    (8, 1, 32, 8, 128, 16, jnp.float8_e4m3fn, {}),
    (4, 1, 16, 4, 256, 16, jnp.bfloat16, {}),
    (4, 1, 28, 4, 96, 64, jnp.float32, {}),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}Sq{c[1]}Hq{c[2]}Hk{c[3]}D{c[4]}bs{c[5]}{jnp.dtype(c[6]).name}{sorted(c[7])}")
def test_decode_kernel_matches_reference(case):
    batch, sq, hq, hk, d, bs, cache_dtype, kw = case
    q_dtype = jnp.bfloat16 if jnp.dtype(cache_dtype).itemsize == 1 else cache_dtype
    key = jax.random.key(0)
    max_ctx = 3000
    blocks_per_seq = -(-max_ctx // bs)
    num_blocks = batch * blocks_per_seq + 7
    k_cache, v_cache, scale = _random_cache(key, num_blocks, bs, hk, d, cache_dtype)
    table = jax.random.permutation(jax.random.key(1), num_blocks)[: batch * blocks_per_seq]
    table = table.reshape(batch, blocks_per_seq).astype(jnp.int32)
    lens = jax.random.randint(jax.random.key(2), (batch,), 1, max_ctx + 1).astype(jnp.int32)
    lens = lens.at[0].set(max_ctx).at[-1].set(sq)
    q = jax.random.normal(jax.random.key(3), (batch, sq, hq, d), jnp.float32).astype(q_dtype)
    alibi = kw.pop("alibi", False)
    if alibi:
        kw["alibi_slopes"] = jnp.linspace(0.01, 0.2, hq, dtype=jnp.float32)
    call = functools.partial(jpa.flash_attn_with_kvcache, causal=True, k_scale=scale, v_scale=scale, **kw)
    out = jax.jit(functools.partial(call, implementation="triton"))(q, k_cache, v_cache, lens, table)
    ref = jax.jit(functools.partial(call, implementation="xla"))(q, k_cache, v_cache, lens, table)
    _assert_close(out, ref, q_dtype)


MOSAIC_DECODE_CASES = [
    # batch, q_per_seq, Hq, Hk, D, block_size, dtype, kwargs (causal unless said): the
    # Mosaic GPU (bf16 / f16 queries, any head and block size)
    (16, 1, 32, 8, 128, 16, jnp.bfloat16, {}),
    (4, 1, 32, 8, 128, 16, jnp.bfloat16, dict(window_size=(700, 0))),
    (8, 1, 16, 16, 64, 32, jnp.float16, dict(softcap=30.0)),
    (8, 1, 8, 1, 128, 16, jnp.bfloat16, dict(alibi=True)),
    (8, 4, 32, 8, 128, 16, jnp.bfloat16, dict(causal=False)),
    (8, 4, 32, 8, 128, 16, jnp.bfloat16, {}),
    (4, 1, 16, 4, 256, 16, jnp.bfloat16, {}),
    (4, 1, 64, 8, 128, 64, jnp.bfloat16, {}),
    (8, 1, 32, 8, 128, 16, jnp.float8_e4m3fn, {}),
    (4, 1, 16, 4, 64, 32, jnp.float8_e5m2, dict(window_size=(500, 0))),
    # head sizes that are not multiples of 64 (64- / 32-byte swizzles, chunks of 32-96 columns)
    (8, 1, 32, 8, 96, 16, jnp.bfloat16, {}),
    (4, 3, 16, 4, 80, 32, jnp.float16, dict(window_size=(300, 0), softcap=30.0)),
    (4, 1, 16, 2, 160, 16, jnp.bfloat16, dict(alibi=True)),
    (8, 1, 32, 8, 80, 16, jnp.float8_e4m3fn, {}),  # fp8 rows of 80 bytes: unswizzled
    (4, 1, 8, 2, 32, 16, jnp.bfloat16, {}),
    (4, 4, 16, 4, 112, 16, jnp.float8_e5m2, {}),
    # block sizes that do not divide 128: runs within pages, slices of 256-key pages
    (8, 1, 32, 8, 128, 48, jnp.bfloat16, {}),
    (4, 3, 16, 4, 96, 80, jnp.float16, dict(window_size=(300, 0))),
    (8, 1, 32, 8, 128, 256, jnp.bfloat16, {}),
    (4, 1, 16, 4, 64, 144, jnp.float8_e4m3fn, dict(softcap=30.0)),
]


def _decode_case_id(c) -> str:
    return f"B{c[0]}Sq{c[1]}Hq{c[2]}Hk{c[3]}D{c[4]}bs{c[5]}{jnp.dtype(c[6]).name}{sorted(c[7])}"


@pytest.mark.parametrize("case", MOSAIC_DECODE_CASES, ids=_decode_case_id)
def test_mosaic_decode_kernel_matches_reference(case):
    """implementation="mosaic_gpu": the Mosaic GPU decode kernel, compiled, against the
    reference on contexts up to 3000 keys (several KV splits for the small batches)."""
    batch, sq, hq, hk, d, bs, cache_dtype, kw = case
    kw = dict(kw)
    dtype = jnp.bfloat16 if jnp.dtype(cache_dtype).itemsize == 1 else cache_dtype
    max_ctx = 3000
    blocks_per_seq = -(-max_ctx // bs)
    num_blocks = batch * blocks_per_seq + 7
    k_cache, v_cache, scale = _random_cache(jax.random.key(0), num_blocks, bs, hk, d, cache_dtype)
    table = jax.random.permutation(jax.random.key(1), num_blocks)[: batch * blocks_per_seq]
    table = table.reshape(batch, blocks_per_seq).astype(jnp.int32)
    lens = jax.random.randint(jax.random.key(2), (batch,), 1, max_ctx + 1).astype(jnp.int32)
    lens = lens.at[0].set(max_ctx).at[-1].set(sq)
    q = jax.random.normal(jax.random.key(3), (batch, sq, hq, d), jnp.float32).astype(dtype)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = jnp.linspace(0.01, 0.2, hq, dtype=jnp.float32)
    kw.setdefault("causal", True)
    call = functools.partial(jpa.flash_attn_with_kvcache, k_scale=scale, v_scale=scale, **kw)
    mosaic = jax.jit(functools.partial(call, implementation="mosaic_gpu"))
    assert "custom_call @mosaic_gpu" in mosaic.lower(q, k_cache, v_cache, lens, table).as_text()
    out = mosaic(q, k_cache, v_cache, lens, table)
    ref = jax.jit(functools.partial(call, implementation="xla"))(q, k_cache, v_cache, lens, table)
    _assert_close(out, ref, dtype)


PREFILL_CASES = [
    # seq lens, Hq, Hk, D, dtype, kwargs
    ([1, 17, 256, 1000, 130], 32, 8, 128, jnp.bfloat16, {}),
    ([2048, 3], 16, 16, 64, jnp.float16, dict(window_size=(256, 0))),
    ([500, 77], 8, 1, 80, jnp.bfloat16, dict(alibi=True, softcap=20.0)),
    ([300, 1024], 16, 4, 256, jnp.bfloat16, {}),
    ([129, 64], 4, 2, 112, jnp.float32, dict(causal=False, window_size=(40, 30))),
]


PREFILL_IMPLEMENTATIONS = ["triton", "mosaic_gpu"]


BIG_MEMORY = pytest.mark.gpu_memory
"""Cases that take GBs of GPU memory: `benchmarks/gpu_session.sh` runs them after the
other gpu cases, one at a time in one process with the whole GPU, since N workers
sharing the GPU each get only a share of its memory."""


def _prefill_params(cases, dtype_of, ids):
    """(implementation, case) pairs: every case with Triton, the 16-bit ones with Mosaic GPU;
    cases of 4,096 tokens and more in the `BIG_MEMORY` group."""
    return [pytest.param(impl, case, id=f"{impl}-{ids(case)}", marks=[BIG_MEMORY] if sum(case[0]) >= 4096 else [])
            for case in cases for impl in PREFILL_IMPLEMENTATIONS
            if impl == "triton" or jnp.dtype(dtype_of(case)) != jnp.float32]


@pytest.mark.parametrize("implementation, case", _prefill_params(
    PREFILL_CASES + [([4096, 333], 32, 8, 128, jnp.bfloat16, {}),  # long rings, ragged tail
                     ([777, 64], 8, 8, 48, jnp.float16, dict(window_size=(100, 20), causal=False))],
    lambda c: c[4], lambda c: f"L{c[0]}Hq{c[1]}Hk{c[2]}D{c[3]}{jnp.dtype(c[4]).name}{sorted(c[5])}"))
def test_packed_varlen_kernel_matches_reference(implementation, case):
    lens, hq, hk, d, dtype, kw = case
    kw = dict(kw)
    total = sum(lens)
    cu = jnp.array(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (total + 5, hq, d), jnp.float32).astype(dtype)  # 5 padding rows
    k = jax.random.normal(keys[1], (total, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (total, hk, d), jnp.float32).astype(dtype)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = jnp.linspace(0.01, 0.2, hq, dtype=jnp.float32)
    kw.setdefault("causal", True)
    call = functools.partial(jpa.flash_attn_varlen_func, max_seqlen_q=max(lens), max_seqlen_k=max(lens), **kw)
    out = jax.jit(functools.partial(call, implementation=implementation))(q, k, v, cu, cu)
    ref = jax.jit(functools.partial(call, implementation="xla"))(q, k, v, cu, cu)
    _assert_close(out, ref, dtype)
    assert not np.asarray(out[total:], np.float32).any()


@pytest.mark.parametrize("implementation", PREFILL_IMPLEMENTATIONS)
@pytest.mark.parametrize("block_size,cache_dtype", [(16, jnp.bfloat16), (64, jnp.bfloat16), (16, jnp.float8_e5m2),
                                                    (48, jnp.float8_e4m3fn)])
def test_paged_prefix_prefill_kernel_matches_reference(block_size, cache_dtype, implementation):
    new, cached = [512, 5, 64], [3584, 37, 0]
    hq, hk, d = 32, 8, 128
    seq = [n + c for n, c in zip(new, cached)]
    blocks_per_seq = -(-max(seq) // block_size)
    num_blocks = len(seq) * blocks_per_seq + 3
    k_cache, v_cache, scale = _random_cache(jax.random.key(5), num_blocks, block_size, hk, d, cache_dtype)
    table = jax.random.permutation(jax.random.key(6), num_blocks)[: len(seq) * blocks_per_seq]
    table = table.reshape(len(seq), blocks_per_seq).astype(jnp.int32)
    cu_q = jnp.array(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    cu_k = jnp.array(np.concatenate([[0], np.cumsum(seq)]), jnp.int32)
    q = jax.random.normal(jax.random.key(7), (sum(new), hq, d), jnp.bfloat16)
    call = functools.partial(jpa.flash_attn_varlen_func, max_seqlen_q=max(new), max_seqlen_k=max(seq),
                             causal=True, block_table=table, k_scale=scale, v_scale=scale)
    out = jax.jit(functools.partial(call, implementation=implementation))(q, k_cache, v_cache, cu_q, cu_k)
    ref = jax.jit(functools.partial(call, implementation="xla"))(q, k_cache, v_cache, cu_q, cu_k)
    _assert_close(out, ref, jnp.bfloat16)


def test_auto_implementation_runs_the_kernel_on_gpu():
    q = jnp.ones((2, 1, 8, 64), jnp.bfloat16)
    cache = jnp.ones((8, 16, 2, 64), jnp.bfloat16)
    lens = jnp.array([20, 64], jnp.int32)
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    fn = lambda *a: jpa.flash_attn_with_kvcache(*a, causal=True)
    assert TRITON_CALL in jax.jit(fn).lower(q, cache, cache, lens, table).as_text()
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, cache, cache, lens, table), np.float32), 1.0, atol=1e-2)


@BIG_MEMORY
@pytest.mark.parametrize("kind", ["decode", "paged_prefill"])
@pytest.mark.parametrize("layout", ["stacked_kv", "per_cache"])
def test_kernels_read_an_fp8_cache_of_2_31_to_2_32_elements(layout, kind):
    """fp8 caches of 2**31 to 2**32 elements, which Pallas alone would address with
    wrapping 32-bit offsets: one stacked layer of 2**32 - 2**19 elements (4.3 GB; its
    value plane crosses element 2**31), or a key and a value cache of 2**31 + 2**21
    elements each (2.1 GB apiece; both cross it). The block tables point at the last 256
    blocks of each cache (the stacked layer's values: near element 2**32; the separate
    caches: on both sides of element 2**31); the rest of the cache is zero, so a read at
    a wrapped offset changes the output. Decode and paged prefill with the kernel
    (64-bit offsets, `kernels.triton_offsets`) match the reference."""
    from jax_paged_attn.kv_view import cache_planes

    hq, hk, d, bs, dtype, scale = 32, 8, 128, 16, jnp.float8_e4m3fn, 2.0
    batch, blocks_per_seq = 4, 64
    used = batch * blocks_per_seq
    if layout == "stacked_kv":
        num_blocks = 2**17 - 16
        shape = (2, num_blocks, bs, hk, d)
    else:
        num_blocks = 2**17 + 128
        shape = (num_blocks, bs, hk, d)
    assert 2**31 < np.prod(shape, dtype=np.int64) <= 2**32

    @functools.partial(jax.jit, static_argnums=0)
    def make_cache(seed: int):
        """Zeros, with N(0, 1/4) fp8 values in the last ``used`` blocks (written in place)."""
        tail = jax.random.normal(jax.random.key(seed), (*shape[:-4], used, bs, hk, d), jnp.float32) / scale
        cache = jnp.zeros(shape, dtype)
        return jax.lax.dynamic_update_slice_in_dim(cache, tail.astype(dtype), num_blocks - used, axis=len(shape) - 4)

    if layout == "stacked_kv":
        k_cache, v_cache = cache_planes(make_cache(8))
    else:
        k_cache, v_cache = make_cache(8), make_cache(9)
    table = (num_blocks - used + jax.random.permutation(jax.random.key(10), used)).reshape(batch, blocks_per_seq)
    table = table.astype(jnp.int32)
    max_ctx = blocks_per_seq * bs
    seq = jnp.array([max_ctx, 700, 33, 256], jnp.int32)
    common = dict(causal=True, k_scale=scale, v_scale=scale)
    if kind == "decode":
        q = jax.random.normal(jax.random.key(11), (batch, 1, hq, d), jnp.bfloat16)
        call = functools.partial(jpa.flash_attn_with_kvcache, **common)
        args = (q, k_cache, v_cache, seq, table)
    else:
        new = np.array([300, 1, 33, 64])
        cu_q = jnp.array(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
        cu_k = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(seq)]).astype(jnp.int32)
        q = jax.random.normal(jax.random.key(12), (int(new.sum()), hq, d), jnp.bfloat16)
        call = functools.partial(jpa.flash_attn_varlen_func, max_seqlen_q=int(new.max()), max_seqlen_k=max_ctx,
                                 block_table=table, **common)
        args = (q, k_cache, v_cache, cu_q, cu_k)
    kernel = jax.jit(functools.partial(call, implementation="triton"))
    assert TRITON_CALL in kernel.lower(*args).as_text()
    out = kernel(*args)
    ref = jax.jit(functools.partial(call, implementation="xla"))(*args)
    _assert_close(out, ref, jnp.bfloat16)
    assert np.abs(np.asarray(ref, np.float32)).max() > 0.1  # the values came from the written blocks


MOSAIC_FORMS = {
    # From the simplest form to the default, to bisect a failure of the default.
    "single-warpgroup": dict(compute_warpgroups=1, warp_specialized=False),
    "specialized-1wg": dict(compute_warpgroups=1),
    "specialized-2wg": dict(compute_warpgroups=2, pingpong=False),
    "specialized-2wg-pingpong": dict(compute_warpgroups=2, pingpong=True),
    "specialized-2wg-pingpong-ring3-bk128": dict(compute_warpgroups=2, num_stages=3, block_k=128),
    "specialized-2wg-pingpong-key-flags": dict(compute_warpgroups=2, nonfinite_check="key_flags"),
    "specialized-2wg-pingpong-fence-softmax": dict(compute_warpgroups=2, fence_softmax=True),
    "specialized-2wg-pingpong-persistent": dict(compute_warpgroups=2, persistent_programs=132),
    "specialized-2wg-pingpong-slab-output": dict(compute_warpgroups=2, direct_output=False),
    "specialized-2wg-pingpong-bk128-masked-parts": dict(compute_warpgroups=2, block_k=128, masked_block_k=64),
    "specialized-2wg-pingpong-probe": dict(compute_warpgroups=2, nonfinite_check="probe"),
    "specialized-2wg-pingpong-bk128-masked-parts-probe": dict(compute_warpgroups=2, block_k=128, masked_block_k=64,
                                                              nonfinite_check="probe"),
    # Half of each unmasked block's exponentials from the FMA polynomial, one P·V wgmma per half.
    "specialized-2wg-pingpong-bk128-masked-parts-probe-exp2-fma": dict(
        compute_warpgroups=2, block_k=128, masked_block_k=64, nonfinite_check="probe", exp2_fma_columns=64),
    # The package's D 128 fields with 4 heads a program and the next head's queries
    # prefetched: over the paged cache, the engine's fresh prompts (queries are the keys).
    "package-d128-heads-per-program-4-prefetch-queries": dict(
        compute_warpgroups=2, block_k=128, masked_block_k=64, nonfinite_check="probe", precheck_values=True,
        heads_per_program=4, prefetch_queries=True),
}


@pytest.mark.parametrize("form", list(MOSAIC_FORMS))
@pytest.mark.parametrize("paged", [False, True])
def test_mosaic_forms_match_reference(form, paged):
    """Every form of the Mosaic GPU kernel (`tuning.MosaicPrefillConfig`) on a causal
    windowed, soft-capped GQA problem with ragged lengths, packed and over a paged cache."""
    from jax_paged_attn import prefill, reference, tuning
    from jax_paged_attn.spec import AttentionSpec

    lens, hq, hk, d, bs = [700, 1, 130, 64], 16, 4, 128, 16
    total = sum(lens)
    cu = jnp.array(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    keys = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(keys[0], (total, hq, d), jnp.bfloat16)
    if paged:
        blocks_per_seq = -(-max(lens) // bs)
        num_blocks = len(lens) * blocks_per_seq
        k, v, _ = _random_cache(keys[1], num_blocks, bs, hk, d, jnp.bfloat16)
        table = jax.random.permutation(keys[2], num_blocks).reshape(len(lens), blocks_per_seq).astype(jnp.int32)
    else:
        k = jax.random.normal(keys[1], (total, hk, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (total, hk, d), jnp.bfloat16)
        table = None
    spec = AttentionSpec.create(d, causal=True, window_size=(300, 0), softcap=30.0)
    static = dict(spec=spec, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    config = tuning.MosaicPrefillConfig(**MOSAIC_FORMS[form])
    args = (q, k, v, cu, cu, table, None, None, 1.0, 1.0)
    out = jax.jit(lambda *a: prefill.varlen_attention(*a, lowering="mosaic_gpu", config=config, **static))(*args)
    ref = jax.jit(lambda *a: reference.varlen_attention(*a, **static))(*args)
    _assert_close(out, ref, jnp.bfloat16)
