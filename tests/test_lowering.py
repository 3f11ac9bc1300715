"""Cross-lowering on a CPU host: the public functions, with the default (auto)
implementation, lower for CUDA to a module that contains the Pallas Triton kernel;
with ``implementation="mosaic_gpu"``, varlen attention lowers to the Mosaic GPU kernel.

This is what keeps the GPU path from silently being the reference: on a CPU the
same jitted function runs the reference, lowered for CUDA it runs the kernel. For the
Mosaic GPU kernel it is also the only CPU check of its wgmma path (the CPU tests run
it in the interpreter, which computes the matmuls as dots): lowering runs the whole
Pallas -> Mosaic GPU translation (layouts, TMA transforms, wgmma shapes); only the
final PTX compile needs the GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn as jpa

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu"  # @mosaic_gpu_v2 in jax 0.10


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _paged_cache(num_blocks=12, block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16):
    k = jnp.ones((num_blocks, block_size, num_kv_heads, head_size), dtype)
    return k, k


@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_decode_lowers_to_triton_kernel(head_size, cache_dtype):
    k, v = _paged_cache(head_size=head_size, dtype=cache_dtype)
    q = jnp.ones((3, 1, 8, head_size), jnp.bfloat16)
    lens = jnp.array([5, 17, 40], jnp.int32)
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    text = _cuda_text(
        lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True, window_size=(32, 0)),
        q, k, v, lens, table,
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_lowers_to_triton_kernel(paged):
    q = jnp.ones((40, 8, 64), jnp.bfloat16)
    cu = jnp.array([0, 7, 40], jnp.int32)
    if paged:
        k, v = _paged_cache()
        table = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
        cu_k = jnp.array([0, 30, 70], jnp.int32)
        fn = lambda q, k, v, cq, ck, t: jpa.flash_attn_varlen_func(
            q, k, v, cq, ck, 33, 40, causal=True, block_table=t, softcap=30.0)
        text = _cuda_text(fn, q, k, v, cu, cu_k, table)
    else:
        k = jnp.ones((40, 2, 64), jnp.bfloat16)
        fn = lambda q, k, v, cq: jpa.flash_attn_varlen_func(q, k, v, cq, cq, 33, 33, causal=True)
        text = _cuda_text(fn, q, k, k, cu)
    assert TRITON_CALL in text
    assert MOSAIC_GPU_CALL not in text  # auto keeps Triton until the Mosaic kernel is measured


def test_cpu_lowering_of_auto_is_the_reference():
    k, v = _paged_cache()
    q = jnp.ones((3, 1, 8, 64), jnp.bfloat16)
    lens = jnp.array([5, 17, 40], jnp.int32)
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    fn = lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True)
    text = jax.jit(fn).trace(q, k, v, lens, table).lower(lowering_platforms=("cpu",)).as_text()
    assert TRITON_CALL not in text
    out = jax.jit(fn)(q, k, v, lens, table)
    assert out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()


def test_layer_reads_the_stacked_cache_in_place_for_cuda():
    """The layer passes the whole ``[2, ...]`` cache to every kernel (a free reshape) and
    lets the kernel pick the K or V plane: no ``kv_cache[0]`` slice, which XLA would
    materialize (a copy of half the cache) for each custom call."""
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence

    num_blocks, block_size, hk, d, hq = 37, 16, 2, 64, 4
    kv = jnp.zeros((2, num_blocks, block_size, hk, d), jnp.bfloat16)
    builder = FlashAttentionMetadataBuilder(block_size=block_size, num_blocks=num_blocks, pad=False,
                                            chunked_prefill=True)
    md = builder.build([
        ScheduledSequence(is_prompt=True, seq_len=40, context_len=20, query_len=20, block_table=[3, 4, 5]),
        ScheduledSequence(is_prompt=False, seq_len=9, context_len=8, query_len=1, block_table=[7]),
    ])
    t = md.num_tokens
    q = jnp.ones((t, hq * d), jnp.bfloat16)
    k = jnp.ones((t, hk * d), jnp.bfloat16)

    def layer(q, k, kv, md):
        return jpa.paged_attention(q, k, k, kv, md, num_heads=hq, head_size=d, num_kv_heads=hk, scale=0.125)

    text = _cuda_text(layer, q, k, kv, md)
    assert text.count(TRITON_CALL) >= 3  # cache write, prefill over the cache, decode
    plane_rows = f"tensor<{num_blocks * block_size}x{hk}x{d}xbf16>"
    stacked_rows = f"tensor<{2 * num_blocks * block_size}x{hk}x{d}xbf16>"
    assert stacked_rows in text
    assert plane_rows not in text
    assert f"tensor<{num_blocks}x{block_size}x{hk}x{d}xbf16>" not in text  # no slice of a plane


@pytest.mark.parametrize("paged, head_size, q_dtype, kv_dtype, block_size", [
    (False, 64, jnp.bfloat16, jnp.bfloat16, None),
    (False, 128, jnp.float16, jnp.float16, None),
    (False, 256, jnp.bfloat16, jnp.bfloat16, None),
    (False, 80, jnp.float16, jnp.float16, None),
    (True, 64, jnp.float16, jnp.float16, 16),
    (True, 128, jnp.bfloat16, jnp.bfloat16, 48),
    (True, 256, jnp.bfloat16, jnp.bfloat16, 32),
    (True, 128, jnp.bfloat16, jnp.float8_e4m3fn, 16),
    (True, 64, jnp.float16, jnp.float8_e5m2, 32),
    (True, 96, jnp.bfloat16, jnp.float8_e4m3fn, 16),
    (True, 80, jnp.float16, jnp.float8_e4m3fn, 32),  # fp8 rows of 80 bytes: no swizzle
])
def test_varlen_lowers_to_mosaic_gpu_kernel(paged, head_size, q_dtype, kv_dtype, block_size):
    """Every feature at once (causal window, soft-cap, ALiBi) so that masked and unmasked
    blocks, fp8 conversion and the paged copies all lower, in the default
    warp-specialized form (max_seqlen_q 100: 2 compute warpgroups where shared memory
    allows, 1 at D 256)."""
    q = jnp.ones((40, 8, head_size), q_dtype)
    cu = jnp.array([0, 7, 40], jnp.int32)
    slopes = jnp.ones((8,), jnp.float32)
    kwargs = dict(causal=True, window_size=(100, 0), softcap=30.0, implementation="mosaic_gpu")
    if paged:
        k, v = _paged_cache(num_blocks=12, block_size=block_size, head_size=head_size, dtype=kv_dtype)
        table = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
        cu_k = jnp.array([0, 60, 150], jnp.int32)
        fn = lambda q, k, v, cq, ck, t, a: jpa.flash_attn_varlen_func(
            q, k, v, cq, ck, 100, 90, block_table=t, alibi_slopes=a, k_scale=0.5, v_scale=2.0, **kwargs)
        text = _cuda_text(fn, q, k, v, cu, cu_k, table, slopes)
    else:
        k = jnp.ones((150, 2, head_size), kv_dtype)
        cu_k = jnp.array([0, 60, 150], jnp.int32)
        fn = lambda q, k, v, cq, ck, a: jpa.flash_attn_varlen_func(
            q, k, v, cq, ck, 100, 90, alibi_slopes=a, k_scale=0.5, v_scale=2.0, **kwargs)
        text = _cuda_text(fn, q, k, k, cu, cu_k, slopes)
    assert MOSAIC_GPU_CALL in text
    assert TRITON_CALL not in text


def test_layer_prefill_lowers_to_mosaic_gpu_and_decode_refuses_it():
    """The layer's varlen call takes implementation="mosaic_gpu"; its decode has no Mosaic
    GPU kernel yet and says so (NotImplementedError naming the lowering)."""
    k, v = _paged_cache()
    q = jnp.ones((3, 1, 8, 64), jnp.bfloat16)
    lens = jnp.array([5, 17, 40], jnp.int32)
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    fn = lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True, implementation="mosaic_gpu")
    with pytest.raises(NotImplementedError, match="implementation='mosaic_gpu'.*'mosaic_gpu' lowering"):
        _cuda_text(fn, q, k, v, lens, table)


@pytest.mark.parametrize("paged", [False, True])
def test_single_warpgroup_mosaic_form_lowers(paged):
    """The single-warpgroup form (the CPU tests' interpret default) lowers too."""
    from jax_paged_attn import prefill, tuning
    from jax_paged_attn.spec import AttentionSpec

    sds = jax.ShapeDtypeStruct
    q = sds((40, 8, 128), jnp.bfloat16)
    kv = sds((12, 32, 2, 128), jnp.float8_e4m3fn) if paged else sds((150, 2, 128), jnp.bfloat16)
    cu = sds((3,), jnp.int32)
    table = sds((2, 6), jnp.int32) if paged else None
    scale = sds((), jnp.float32)
    spec = AttentionSpec.create(128, causal=True, window_size=(100, 0), softcap=30.0, has_alibi=True)
    fn = lambda *a: prefill.varlen_attention(*a, spec=spec, max_seqlen_q=100, max_seqlen_k=90,
                                             lowering="mosaic_gpu",
                                             config=tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP)
    text = _cuda_text(fn, q, kv, kv, cu, cu, table, None, sds((8,), jnp.float32), scale, scale)
    assert MOSAIC_GPU_CALL in text
