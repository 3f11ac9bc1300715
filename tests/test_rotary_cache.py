"""The fused rotary embedding + cache write (`jax_paged_attn.cache.rotary_and_cache_flash_kv`)
against NumPy, over its implementations: the XLA path and the Pallas Triton kernel
(interpret mode on CPU, compiled in the ``gpu``-marked tests).

The NumPy semantics are written from the op's contract: each query head and the key of
``qkv [T, Hk, G + 2, D]`` rotated in the rotate-half layout (float32 math, rounded once
to qkv's dtype), the rotated key and the value written at the token's slot (fp8:
``x / scale`` saturated), every other slot untouched. Values and untouched slots are
compared bit for bit; rotated rows within one unit in the last place of their dtype
(float32 math may contract ``a * b + c * d`` differently).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_paged_attn import cache, layer, plans, reference
from jax_paged_attn.cache import PAD_SLOT_ID
from jax_paged_attn.kernels import triton_cache
from conftest import cuda_lowering_target
from test_cache import numpy_fp8

BLOCK_SIZE = 16
IMPLEMENTATIONS = ["xla", "triton"]
TRITON_CALL = "__gpu$xla.gpu.triton"

CASES = [  # (dtype, kv_cache_dtype, Hk, G, D, k_scale, v_scale)
    (jnp.bfloat16, "auto", 2, 4, 64, 1.0, 1.0),
    (jnp.float16, "auto", 3, 3, 80, 1.0, 1.0),  # G and D not powers of 2: padded in-kernel
    (jnp.float32, "auto", 1, 1, 128, 1.0, 1.0),  # MHA: one query head per KV head
    (jnp.bfloat16, "fp8", 2, 7, 96, 0.05, 3.0),
    (jnp.float32, "fp8_e5m2", 2, 2, 32, 0.3, 7.0),
]


def numpy_rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """float64 rotate-half of ``x [T, H, D]`` by ``cos`` / ``sin [T, D]``."""
    half = x.shape[-1] // 2
    x = x.astype(np.float64)
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(np.float64)[:, None] + rotated * sin.astype(np.float64)[:, None]


def make_case(rng, dtype, cache_dtype, num_kv_heads, group, head_size, num_tokens=21, num_blocks=4):
    """qkv, cos / sin of random positions, a cache of random contents, slots with padding
    and out-of-range entries (dropped under jit)."""
    qkv = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, group + 2, head_size)), dtype)
    inv_freq = 10000.0 ** (-np.arange(0, head_size, 2) / head_size)
    angles = rng.integers(0, 4096, num_tokens)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    kv = jnp.array(jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(cache_dtype), copy=True)
    num_slots = num_blocks * BLOCK_SIZE
    slots = rng.permutation(num_slots)[:num_tokens].astype(np.int32)
    if num_tokens > 13:
        slots[[2, 9]] = PAD_SLOT_ID
        slots[[4, 13]] = [num_slots, -5]  # out of range: dropped under jit
    return qkv, cos, sin, kv, jnp.asarray(slots)


def ulp_tolerance(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def assert_rotated_close(got, want64: np.ndarray, dtype) -> None:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    eps = ulp_tolerance(dtype)
    np.testing.assert_allclose(got, want64, rtol=eps, atol=eps)


def expected_cache(qkv, cos, sin, kv, slots):
    """(rotated keys float64 [T, Hk, D] per written token, the cache with values written
    and key rows marked, the written (token, slot) pairs)."""
    group = qkv.shape[2] - 2
    keys = numpy_rotate(np.asarray(qkv[:, :, group].astype(jnp.float32)), np.asarray(cos.astype(jnp.float32)),
                        np.asarray(sin.astype(jnp.float32)))
    values = np.asarray(qkv[:, :, group + 1])
    num_slots = kv.shape[1] * kv.shape[2]
    written = [(t, int(s)) for t, s in enumerate(np.asarray(slots).tolist()) if 0 <= s < num_slots]
    return keys, values, written


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype, kv_cache_dtype, num_kv_heads, group, head_size, k_scale, v_scale", CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_rotates_queries_and_writes_rotated_keys_and_values(implementation, dtype, kv_cache_dtype, num_kv_heads,
                                                            group, head_size, k_scale, v_scale):
    rng = np.random.default_rng(30)
    cache_dtype = cache.get_kv_cache_dtype(kv_cache_dtype, dtype)
    qkv, cos, sin, kv, slots = make_case(rng, dtype, cache_dtype, num_kv_heads, group, head_size)
    before = np.asarray(kv)
    fn = functools.partial(cache.rotary_and_cache_flash_kv, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                           v_scale=v_scale, implementation=implementation, interpret=True)
    query, new_kv = jax.jit(fn)(qkv, cos, sin, kv, slots)

    num_tokens = qkv.shape[0]
    queries = np.asarray(qkv[:, :, :group].astype(jnp.float32)).reshape(num_tokens, num_kv_heads * group, head_size)
    assert query.shape == (num_tokens, num_kv_heads * group, head_size) and query.dtype == dtype
    assert_rotated_close(query, numpy_rotate(queries, np.asarray(cos.astype(jnp.float32)),
                                             np.asarray(sin.astype(jnp.float32))), dtype)

    keys, values, written = expected_cache(qkv, cos, sin, kv, slots)
    got = np.asarray(new_kv).reshape(2, -1, num_kv_heads, head_size)
    untouched = np.ones(got.shape[1], bool)
    fp8 = jnp.dtype(cache_dtype).itemsize == 1
    for token, slot in written:
        untouched[slot] = False
        if fp8:
            want_value = numpy_fp8(values[token], v_scale, cache_dtype)
            # The rotated key is rounded to qkv's dtype, then quantized: within one fp8 step.
            key = got[0, slot].astype(np.float32) * k_scale
            np.testing.assert_allclose(key, keys[token], rtol=2 * float(ml_dtypes.finfo(cache_dtype).eps),
                                       atol=k_scale * float(ml_dtypes.finfo(cache_dtype).smallest_subnormal))
        else:
            want_value = values[token]
            assert_rotated_close(got[0, slot], keys[token], dtype)
        np.testing.assert_array_equal(got[1, slot].view(np.uint8), np.asarray(want_value).view(np.uint8))
    flat_before = before.reshape(2, -1, num_kv_heads, head_size)
    np.testing.assert_array_equal(got[:, untouched].view(np.uint8), flat_before[:, untouched].view(np.uint8))


def test_kernel_matches_the_xla_path_over_a_multi_program_grid():
    """Several token tiles with a partial last one (a tiling smaller than the plan's),
    through the kernel builder; the public function called eagerly (checked slots)."""
    rng = np.random.default_rng(31)
    qkv, cos, sin, kv, slots = make_case(rng, jnp.bfloat16, jnp.bfloat16, 3, 4, 64, num_tokens=23, num_blocks=3)
    valid = jnp.where((slots >= 0) & (slots < 3 * BLOCK_SIZE), slots, PAD_SLOT_ID)
    want_q, want_kv = cache.rotary_and_cache_flash_kv(qkv, cos, sin, kv, valid, implementation="xla")
    tiling = plans.RotaryCacheTiling(tokens_per_program=4, padded_group=4, padded_head_size=64)
    got_q, got_kv = triton_cache.rotary_cache_write_call(qkv[None], cos, sin, slots, None, kv, tiling=tiling,
                                                         dtype=qkv.dtype, interpret=True)
    assert_rotated_close(got_q, np.asarray(want_q.astype(jnp.float32), np.float64), jnp.bfloat16)
    assert_rotated_close(got_kv, np.asarray(want_kv.astype(jnp.float32), np.float64), jnp.bfloat16)
    eager_q, eager_kv = cache.rotary_and_cache_flash_kv(qkv, cos, sin, kv, valid, implementation="triton",
                                                        interpret=True)
    np.testing.assert_array_equal(np.asarray(eager_q), np.asarray(got_q))
    np.testing.assert_array_equal(np.asarray(eager_kv), np.asarray(got_kv))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("splits, kv_cache_dtype", [(4, "auto"), (1, "fp8"), (3, "auto")])
def test_split_k_partials_give_what_their_rounded_sum_gives(implementation, splits, kv_cache_dtype):
    """``partials=True``: float32 partial products ``[S, T, Hk, G + 2, D]`` summed and
    rounded to ``dtype`` as the op loads them, the same queries and cache bits as the
    op on the rounded sum (partials on a 1/256 grid: their float32 sums are exact in any order)."""
    rng = np.random.default_rng(35)
    dtype = jnp.bfloat16
    cache_dtype = cache.get_kv_cache_dtype(kv_cache_dtype, dtype)
    qkv, cos, sin, kv, slots = make_case(rng, dtype, cache_dtype, 2, 3, 64)
    parts = np.round(rng.standard_normal((splits, *qkv.shape)) * 256) / 256 + 0.0  # no -0.0: sums give +0.0
    rounded = jnp.asarray(parts.astype(np.float32).sum(axis=0), jnp.float32).astype(dtype)
    static = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=2.0, implementation=implementation,
                  interpret=True)
    valid = jnp.where((slots >= 0) & (slots < kv.shape[1] * BLOCK_SIZE), slots, PAD_SLOT_ID)
    want_q, want_kv = cache.rotary_and_cache_flash_kv(rounded, cos, sin, jnp.array(kv, copy=True), valid, **static)
    got_q, got_kv = cache.rotary_and_cache_flash_kv(jnp.asarray(parts, jnp.float32), cos, sin, kv, valid,
                                                    partials=True, dtype=dtype, **static)
    assert got_q.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got_q).view(np.uint16), np.asarray(want_q).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got_kv).view(np.uint8), np.asarray(want_kv).view(np.uint8))


def test_plan_covers_one_kv_head_group_per_program():
    tiling = plans.plan_rotary_cache_write(num_tokens=32, group=4, head_size=64)
    assert (tiling.padded_group, tiling.padded_head_size) == (4, 64)
    assert tiling.tokens_per_program * 4 * 64 <= 1024 and tiling.tokens_per_program >= 1
    assert plans.plan_rotary_cache_write(num_tokens=1, group=7, head_size=96).tokens_per_program == 1
    big = plans.plan_rotary_cache_write(num_tokens=3, group=1, head_size=32)
    assert big.tokens_per_program == 4  # at most the batch rounded up to a power of 2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_donated_cache_is_updated_in_place(implementation):
    rng = np.random.default_rng(32)
    qkv, cos, sin, kv, slots = make_case(rng, jnp.bfloat16, jnp.float8_e4m3fn, 2, 4, 64)
    fn = functools.partial(cache.rotary_and_cache_flash_kv, kv_cache_dtype="fp8", k_scale=0.5, v_scale=2.0,
                           implementation=implementation, interpret=True)
    want_q, want_kv = jax.jit(fn)(qkv, cos, sin, jnp.array(kv, copy=True), slots)
    pointer = kv.unsafe_buffer_pointer()
    got_q, got_kv = jax.jit(fn, donate_argnums=3)(qkv, cos, sin, kv, slots)
    assert kv.is_deleted() and got_kv.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(got_kv).view(np.uint8), np.asarray(want_kv).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got_q), np.asarray(want_q))


def test_auto_lowers_to_one_aliased_kernel_for_cuda_and_the_xla_path_on_cpu():
    qkv = jnp.ones((8, 2, 6, 64), jnp.bfloat16)
    cos = sin = jnp.ones((8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, BLOCK_SIZE, 2, 64), jnp.bfloat16)
    slots = jnp.arange(8, dtype=jnp.int32)
    jitted = jax.jit(cache.rotary_and_cache_flash_kv, donate_argnums=3)
    with cuda_lowering_target():
        cuda = jitted.trace(qkv, cos, sin, kv, slots).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count(TRITON_CALL) == 1 and '"rotary_and_cache_flash"' in cuda
    assert "output_operand_aliases" in cuda and "tf.aliasing_output" in cuda
    cpu = jitted.trace(qkv, cos, sin, kv, slots).lower(lowering_platforms=("cpu",)).as_text()
    assert TRITON_CALL not in cpu and "scatter" in cpu


def test_paged_attention_reads_the_keys_the_fused_op_wrote():
    """Decode attention after the fused op (key=None, value=None) equals the unfused
    layer given the rotated keys and values."""
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence

    rng = np.random.default_rng(33)
    num_kv_heads, group, head_size = 2, 2, 64
    scheduled = [ScheduledSequence(is_prompt=False, seq_len=9 + i, context_len=8 + i, query_len=1,
                                   block_table=[i]) for i in range(3)]
    md = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=4).build(scheduled)
    num_tokens = md.num_tokens
    qkv, cos, sin, kv, _ = make_case(rng, jnp.float32, jnp.float32, num_kv_heads, group, head_size,
                                     num_tokens=num_tokens)
    common = dict(num_heads=num_kv_heads * group, head_size=head_size, num_kv_heads=num_kv_heads,
                  scale=head_size ** -0.5)
    query, fused_kv = cache.rotary_and_cache_flash_kv(qkv, cos, sin, kv, md.slot_mapping)
    fused_out, fused_kv = layer.paged_attention(query.reshape(num_tokens, -1), None, None, fused_kv, md, **common)
    key = reference.rotary_embedding(qkv[:, :, group], cos, sin)
    out, new_kv = layer.paged_attention(query.reshape(num_tokens, -1), key.reshape(num_tokens, -1),
                                        qkv[:, :, group + 1].reshape(num_tokens, -1), kv, md, **common)
    # The fused op runs as one jitted program (a kernel call is a jitted callee), whose
    # fused float32 arithmetic may round the last bit differently from the op-by-op
    # rotation: equal to float32 rounding, not bitwise.
    np.testing.assert_allclose(np.asarray(fused_kv), np.asarray(new_kv), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(fused_out), np.asarray(out), rtol=1e-5, atol=1e-6)


def _args(**overrides):
    qkv = jnp.zeros((4, 2, 6, 64), jnp.bfloat16)
    args = dict(qkv=qkv, cos=jnp.zeros((4, 64), jnp.bfloat16), sin=jnp.zeros((4, 64), jnp.bfloat16),
                kv_cache=jnp.zeros((2, 3, BLOCK_SIZE, 2, 64), jnp.bfloat16),
                slot_mapping=jnp.arange(4, dtype=jnp.int32))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, error, match", [
    (dict(qkv=jnp.zeros((4, 2, 6 * 64), jnp.bfloat16)), ValueError, "qkv"),
    (dict(qkv=jnp.zeros((4, 2, 2, 64), jnp.bfloat16)), ValueError, r"qkv.shape\[2\]"),
    (dict(qkv=jnp.zeros((4, 2, 6, 64), jnp.int32)), TypeError, "qkv"),
    (dict(qkv=jnp.zeros((4, 2, 6, 72), jnp.bfloat16)), ValueError, "head size of qkv"),
    (dict(cos=jnp.zeros((4, 32), jnp.bfloat16)), ValueError, "cos must have shape"),
    (dict(sin=jnp.zeros((4, 64), jnp.int32)), TypeError, "sin must be a float"),
    (dict(slot_mapping=jnp.arange(3, dtype=jnp.int32)), ValueError, "slot_mapping must have shape"),
    (dict(slot_mapping=jnp.asarray([0, 1, 2, 999], jnp.int32)), ValueError, "slot_mapping entries"),
    (dict(kv_cache=jnp.zeros((2, 3, BLOCK_SIZE, 3, 64), jnp.bfloat16)), ValueError, "kv_cache holds"),
    (dict(kv_cache=jnp.zeros((3, 3, BLOCK_SIZE, 2, 64), jnp.bfloat16)), ValueError, "kv_cache must have 2"),
    (dict(kv_cache=jnp.zeros((2, 3, BLOCK_SIZE, 2, 64), jnp.float16)), ValueError, "kv_cache has dtype"),
    (dict(dtype=jnp.float16), TypeError, "dtype must be qkv's"),
    (dict(partials=True), ValueError, r"qkv partials \(\[splits"),
    (dict(partials=True, qkv=jnp.zeros((2, 4, 2, 6, 64), jnp.float32)), ValueError, "dtype .* is required"),
    (dict(partials=True, qkv=jnp.zeros((2, 4, 2, 6, 64), jnp.int32), dtype=jnp.bfloat16), TypeError,
     "qkv partials must be a float"),
    (dict(partials=True, qkv=jnp.zeros((2, 4, 2, 6, 64), jnp.float32), dtype=jnp.int8), TypeError, "dtype must be"),
])
def test_errors_name_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        cache.rotary_and_cache_flash_kv(**_args(**overrides))


def test_paged_attention_key_none_errors():
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence

    common = dict(num_heads=2, head_size=64, num_kv_heads=2, scale=0.125)
    prompt = [ScheduledSequence(is_prompt=True, seq_len=4, context_len=0, query_len=4, block_table=[0])]
    md = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=2).build(prompt)
    assert not md.has_block_tables  # prompts attend to their own new keys
    query = jnp.zeros((md.num_tokens, 128), jnp.float32)
    kv = jnp.zeros((2, 2, BLOCK_SIZE, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="both be arrays, or both None"):
        layer.paged_attention(query, query, None, kv, md, **common)
    with pytest.raises(ValueError, match="key=None and value=None"):
        layer.paged_attention(query, None, None, kv, md, **common)
    chunked = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=2, chunked_prefill=True).build(prompt)
    with pytest.raises(ValueError, match="key=None and value=None"):
        layer.paged_attention(query, None, None, jnp.zeros((0,), jnp.float32), chunked, **common)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_kernel_matches_the_xla_path_and_updates_in_place(kv_cache_dtype):
    """Compiled on a CUDA device (decode- and prefill-sized batches, G and D padded and
    not): within one ulp of the XLA path's rotations, values bit-exact, in place."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    for dtype, num_kv_heads, group, head_size, num_tokens in ((jnp.bfloat16, 8, 4, 64, 32),
                                                             (jnp.float16, 3, 3, 80, 1000),
                                                             (jnp.bfloat16, 2, 8, 128, 1)):
        rng = np.random.default_rng(34)
        cache_dtype = cache.get_kv_cache_dtype(kv_cache_dtype, dtype)
        qkv, cos, sin, kv, slots = make_case(rng, dtype, cache_dtype, num_kv_heads, group, head_size,
                                             num_tokens=num_tokens, num_blocks=128)
        static = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.05, v_scale=3.0)
        want_q, want_kv = jax.jit(functools.partial(cache.rotary_and_cache_flash_kv, implementation="xla",
                                                    **static))(qkv, cos, sin, jnp.array(kv, copy=True), slots)
        fused = jax.jit(functools.partial(cache.rotary_and_cache_flash_kv, **static), donate_argnums=3)
        assert TRITON_CALL in fused.lower(qkv, cos, sin, kv, slots).as_text()
        pointer = kv.unsafe_buffer_pointer()
        got_q, got_kv = fused(qkv, cos, sin, kv, slots)
        assert got_kv.unsafe_buffer_pointer() == pointer
        assert_rotated_close(got_q, np.asarray(want_q.astype(jnp.float32), np.float64), dtype)
        got, want = np.asarray(got_kv.astype(jnp.float32)), np.asarray(want_kv.astype(jnp.float32))
        np.testing.assert_array_equal(got[1], want[1])  # values: bit-exact
        if kv_cache_dtype == "auto":
            assert_rotated_close(got[0], want[0].astype(np.float64), dtype)
        else:  # a key one ulp apart before quantization may land one fp8 step apart
            np.testing.assert_allclose(got[0], want[0], rtol=0.13, atol=1e-6)


@pytest.mark.gpu
def test_gpu_kernel_sums_split_k_partials():
    """Compiled: the decode step's q/k/v partials (4 splits, 32 tokens, 8 KV heads of a
    group of 4, D 64) give the bits the op gives on their rounded sum."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    rng = np.random.default_rng(36)
    qkv, cos, sin, kv, slots = make_case(rng, jnp.bfloat16, jnp.bfloat16, 8, 4, 64, num_tokens=32, num_blocks=64)
    parts = np.round(rng.standard_normal((4, *qkv.shape)) * 256) / 256 + 0.0
    rounded = jnp.asarray(parts.astype(np.float32).sum(axis=0)).astype(jnp.bfloat16)
    valid = jnp.where((slots >= 0) & (slots < 64 * BLOCK_SIZE), slots, PAD_SLOT_ID)
    fused = jax.jit(functools.partial(cache.rotary_and_cache_flash_kv, implementation="triton"))
    want_q, want_kv = fused(rounded, cos, sin, jnp.array(kv, copy=True), valid)
    with_parts = jax.jit(functools.partial(cache.rotary_and_cache_flash_kv, implementation="triton", partials=True,
                                           dtype=jnp.bfloat16))
    got_q, got_kv = with_parts(jnp.asarray(parts, jnp.float32), cos, sin, kv, valid)
    np.testing.assert_array_equal(np.asarray(got_q).view(np.uint16), np.asarray(want_q).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got_kv).view(np.uint16), np.asarray(want_kv).view(np.uint16))
