"""Cross-lowering on a CPU host: the public functions, with the default (auto)
implementation, lower for CUDA to a module that contains the Pallas Triton kernel, or
the Mosaic GPU prefill kernel where auto prefers it on the H200 (head sizes 128 and 256);
with ``implementation="mosaic_gpu"``, varlen attention lowers to the Mosaic GPU kernel.

This is what keeps the GPU path from silently being the reference: on a CPU the
same jitted function runs the reference, lowered for CUDA it runs the kernel.

The lowering is also where the kernels' element offsets are decided: a section below
records, while lowering, the offset width of every ref access, and checks that an fp8
cache of 2**31 elements and more is addressed with 64-bit offsets
(`jax_paged_attn.kernels.triton_offsets`) and everything else with 32-bit ones.

The Mosaic GPU decode kernel (``implementation="mosaic_gpu"``) is checked the same way:
its Pallas lowering to a Mosaic GPU module runs on the CPU host, so a kernel the
lowering rejects fails here; what only ptxas or the GPU can reject needs ``-m gpu``.

For the Mosaic GPU prefill kernel it is also the only CPU check of its wgmma path (the
CPU tests run it in the interpreter, which computes the matmuls as dots): lowering runs
the whole Pallas -> Mosaic GPU translation (layouts, TMA transforms, wgmma shapes); only
the final PTX compile needs the GPU.
"""
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn as jpa
from jax_paged_attn.kv_view import cache_planes
from conftest import lower_for_cuda

pytestmark = pytest.mark.covering  # products: a covering subset by default, all with --full (conftest.py)

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = re.compile(r"custom_call @mosaic_gpu")
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu"  # @mosaic_gpu_v2 in jax 0.10


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
    text = lower_for_cuda(
        lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True, window_size=(32, 0)),
        q, k, v, lens, table,
    )
    assert TRITON_CALL in text
    assert not MOSAIC_CALL.search(text)  # auto decodes with Triton: the Mosaic GPU kernel measured slower


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
        text = lower_for_cuda(fn, q, k, v, cu, cu_k, table)
    else:
        k = jnp.ones((40, 2, 64), jnp.bfloat16)
        fn = lambda q, k, v, cq: jpa.flash_attn_varlen_func(q, k, v, cq, cq, 33, 33, causal=True)
        text = lower_for_cuda(fn, q, k, k, cu)
    assert TRITON_CALL in text
    assert MOSAIC_GPU_CALL not in text  # at D 64 the Triton kernel measured faster


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

    text = lower_for_cuda(layer, q, k, kv, md)
    assert text.count(TRITON_CALL) >= 3  # cache write, prefill over the cache, decode
    plane_rows = f"tensor<{num_blocks * block_size}x{hk}x{d}xbf16>"
    stacked_rows = f"tensor<{2 * num_blocks * block_size}x{hk}x{d}xbf16>"
    assert stacked_rows in text
    assert plane_rows not in text
    assert f"tensor<{num_blocks}x{block_size}x{hk}x{d}xbf16>" not in text  # no slice of a plane


# --------------------------------------------------------------------------- 64-bit offsets

S = jax.ShapeDtypeStruct
BIG_FP8_BLOCKS = 2**16 + 16  # a stacked [2, n, 16, 8, 128] fp8 cache of 2**31 + 2**21 elements (2.1 GB)
SMALL_BLOCKS = 64


@pytest.fixture
def offset_widths(monkeypatch):
    """``{(ref shape, ref dtype): {offset bit widths}}`` of every element-offset tensor
    Pallas' Triton lowering computes while the test lowers (the installed offsets
    function, spied on from outside)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering

    from jax_paged_attn.kernels import triton_offsets

    assert triton_offsets.INSTALLED, triton_offsets.REASON
    installed = lowering._compute_offsets_from_indices
    seen: dict = {}

    def spy(block_info, nd_indexer):
        offsets = installed(block_info, nd_indexer)
        kind = offsets.type
        element = ir.RankedTensorType(kind).element_type if isinstance(kind, ir.RankedTensorType) else kind
        aval = block_info.full_shape_dtype
        seen.setdefault((tuple(aval.shape), jnp.dtype(aval.dtype)), set()).add(ir.IntegerType(element).width)
        return offsets

    monkeypatch.setattr(lowering, "_compute_offsets_from_indices", spy)
    return seen


def _widths_of_refs_with(widths: dict, elements: int, dtype) -> set:
    found = [w for (shape, dt), w in widths.items() if math.prod(shape) == elements and dt == jnp.dtype(dtype)]
    assert found, f"no ref of {elements} {jnp.dtype(dtype).name} elements was addressed: {sorted(widths)}"
    return set().union(*found)


def _stacked_fp8(num_blocks: int, dtype=jnp.float8_e4m3fn) -> S:
    return S((2, num_blocks, 16, 8, 128), dtype)


def _lower_kernel(kind: str, kv: S) -> str:
    """CUDA text of the cache write, decode or paged prefill on the stacked cache ``kv``
    (abstract inputs: nothing is allocated) through the Triton kernels: the default
    implementation, except for a prefill of a cache under 2**31 elements, which auto
    runs through the Mosaic GPU kernel at this head size (128)."""
    table = S((4, 64), jnp.int32)
    if kind == "cache_write":
        tokens = S((64, 8, 128), jnp.bfloat16)
        name = {jnp.dtype(jnp.float8_e4m3fn): "fp8_e4m3", jnp.dtype(jnp.float8_e5m2): "fp8_e5m2"}[kv.dtype]
        fn = lambda k, v, kv, s: jpa.reshape_and_cache_flash_kv(k, v, kv, s, kv_cache_dtype=name, k_scale=0.5,
                                                                 v_scale=0.5)
        args = (tokens, tokens, kv, S((64,), jnp.int32))
    elif kind == "decode":
        fn = lambda q, kv, n, t: jpa.flash_attn_with_kvcache(q, *cache_planes(kv), n, t, causal=True,
                                                             k_scale=0.5, v_scale=0.5)
        args = (S((4, 1, 32, 128), jnp.bfloat16), kv, S((4,), jnp.int32), table)
    else:
        fn = lambda q, kv, cq, ck, t: jpa.flash_attn_varlen_func(
            q, *cache_planes(kv), cq, ck, 64, 1024, causal=True, block_table=t, k_scale=0.5, v_scale=0.5,
            implementation="triton")
        args = (S((256, 32, 128), jnp.bfloat16), kv, S((5,), jnp.int32), S((5,), jnp.int32), table)
    text = lower_for_cuda(fn, *args)
    assert TRITON_CALL in text  # the kernel, not the reference
    return text


@pytest.mark.parametrize("kind", ["cache_write", "decode", "paged_prefill"])
def test_kernels_address_an_fp8_cache_of_2_31_elements_with_64_bit_offsets(kind, offset_widths):
    """A stacked fp8 cache of 2**31 + 2**21 elements (2.1 GB: Pallas alone would pick
    32-bit offsets, sized in bytes) is addressed with 64-bit element offsets by every
    kernel; the other refs of the same kernels keep 32-bit ones."""
    kv = _stacked_fp8(BIG_FP8_BLOCKS)
    elements = math.prod(kv.shape)
    assert 2**31 < elements and elements <= 2**32
    _lower_kernel(kind, kv)
    # The kernels view the stacked cache as rows [2 * num_blocks * 16, Hk * D or Hk, D]: same elements.
    assert _widths_of_refs_with(offset_widths, elements, kv.dtype) == {64}
    others = {w for (shape, _), ws in offset_widths.items() if math.prod(shape) != elements for w in ws}
    assert others == {32}


@pytest.mark.parametrize("kind", ["cache_write", "decode", "paged_prefill"])
def test_kernels_keep_32_bit_offsets_for_a_small_fp8_cache(kind, offset_widths):
    """The widening touches only refs of 2**31 elements and more: with a small cache
    every offset of every kernel stays 32-bit (no extra registers)."""
    kv = _stacked_fp8(SMALL_BLOCKS, jnp.float8_e5m2)
    _lower_kernel(kind, kv)
    assert _widths_of_refs_with(offset_widths, math.prod(kv.shape), kv.dtype) == {32}
    assert {w for ws in offset_widths.values() for w in ws} == {32}


def _read_16_elements(x):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(min(x_ref.shape[0], 2**31) - 16, 16)].astype(jnp.float32)

    return pl.pallas_call(kernel, out_shape=S((16,), jnp.float32), compiler_params=plgpu.CompilerParams())(x)


@pytest.mark.parametrize("elements,dtype,width", [
    (2**31 - 16, jnp.float8_e4m3fn, 32),  # every offset fits in 31 bits
    (2**31, jnp.float8_e4m3fn, 64),  # the rule's boundary (Pallas alone: 32)
    (2**32, jnp.int8, 64),  # exactly 4 GiB (Pallas alone: 32, its test is "> 2**32 bytes")
    (2**31, jnp.bfloat16, 64),  # exactly 4 GiB of 2-byte elements (Pallas alone: 32)
    (2**31 + 16, jnp.bfloat16, 64),  # past 4 GiB: Pallas' own 64 bits, unchanged
    (2**30, jnp.float32, 32),  # 4 GiB of 4-byte elements: offsets below 2**30
])
def test_offset_width_follows_the_element_count(elements, dtype, width, offset_widths):
    """The rule at its edges, on a one-ref kernel that reads 16 elements (the last ones,
    or those just below 2**31: a static slice must fit in 32 bits)."""
    lower_for_cuda(_read_16_elements, S((elements,), dtype))
    assert offset_widths[((elements,), jnp.dtype(dtype))] == {width}


def test_the_offsets_fix_is_installed_once():
    from jax._src.pallas.triton import lowering

    from jax_paged_attn.kernels import triton_offsets

    assert triton_offsets.INSTALLED and triton_offsets.REASON == ""
    installed = lowering._compute_offsets_from_indices
    assert triton_offsets.install() is True
    assert lowering._compute_offsets_from_indices is installed  # not wrapped twice


def _offsets_of_another_jax(block_info, nd_indexer):
    full_size = math.prod(block_info.full_shape_dtype.shape)  # sized in elements: nothing to fix
    return 64 if full_size >= 2**31 else 32


def test_the_offsets_fix_is_not_installed_over_an_unexpected_lowering(monkeypatch):
    """A JAX whose offsets function differs from the checked one is left alone, and
    the reason is kept for the support checks."""
    from jax._src.pallas.triton import lowering

    from jax_paged_attn.kernels import triton_offsets

    monkeypatch.setattr(lowering, "_compute_offsets_from_indices", _offsets_of_another_jax)
    monkeypatch.setattr(triton_offsets, "INSTALLED", True)
    monkeypatch.setattr(triton_offsets, "REASON", "")
    assert triton_offsets.install() is False
    assert lowering._compute_offsets_from_indices is _offsets_of_another_jax
    assert "no longer chooses the offset width" in triton_offsets.REASON


@pytest.mark.covering(pairs=False)  # each value once by default; every case with --full
@pytest.mark.parametrize(
    "dtype,head_size,block_size,group,num_q_tokens,options",
    [
        (jnp.bfloat16, 64, 16, 1, 1, dict(causal=True)),
        (jnp.float16, 128, 32, 4, 1, dict(causal=True, window_size=(100, 0), softcap=30.0, alibi=True)),
        (jnp.bfloat16, 256, 16, 8, 1, dict(causal=True)),
        (jnp.bfloat16, 128, 16, 4, 1, dict(causal=True, splits=True)),
        (jnp.float16, 64, 32, 8, 4, dict(causal=False)),
        (jnp.bfloat16, 128, 64, 32, 3, dict(causal=False, splits=True)),  # 96 rows: two row blocks
        (jnp.bfloat16, 128, 16, 4, 3, dict(causal=True, window_size=(30, 0))),  # non-finite quarantine
        (jnp.float16, 256, 32, 2, 2, dict(window_size=(40, 3), splits=True)),
        (jnp.bfloat16, 192, 16, 4, 1, dict(causal=True, splits=True)),  # output in 64-column chunks
        # head sizes that are not multiples of 64: 64- / 32-byte swizzles, P's matching V's
        (jnp.bfloat16, 96, 32, 4, 1, dict(causal=True, splits=True)),
        (jnp.float16, 80, 16, 4, 3, dict(causal=True, window_size=(30, 0), softcap=30.0)),
        (jnp.bfloat16, 160, 16, 2, 1, dict(causal=True, alibi=True, splits=True)),  # 32-column chunks
        (jnp.bfloat16, 32, 16, 8, 1, dict(causal=True)),
        # block sizes that do not divide 128: 16-row runs within pages, 128-row page slices
        (jnp.bfloat16, 128, 48, 4, 3, dict(causal=True, window_size=(30, 0), splits=True)),
        (jnp.float16, 96, 80, 4, 1, dict(causal=True)),
        (jnp.bfloat16, 128, 256, 4, 1, dict(causal=True, splits=True)),
    ],
    ids=["bf16-d64-bs16-g1", "f16-d128-bs32-g4-window-softcap-alibi", "bf16-d256-bs16-g8",
         "bf16-d128-bs16-g4-splits", "f16-d64-bs32-g8-sq4", "bf16-d128-bs64-g32-sq3-rowblocks-splits",
         "bf16-d128-bs16-g4-sq3-causal-window", "f16-d256-bs32-g2-sq2-two-sided-window-splits",
         "bf16-d192-bs16-g4-splits", "bf16-d96-bs32-g4-splits", "f16-d80-bs16-g4-sq3-window-softcap",
         "bf16-d160-bs16-g2-alibi-splits", "bf16-d32-bs16-g8", "bf16-d128-bs48-g4-sq3-window-splits",
         "f16-d96-bs80-g4", "bf16-d128-bs256-g4-splits"],
)
def test_decode_lowers_to_mosaic_gpu_kernel(dtype, head_size, block_size, group, num_q_tokens, options):
    """implementation="mosaic_gpu" lowers for CUDA to one Mosaic GPU kernel (no Triton
    call) that reads the stacked cache in place (the whole [2, ...] array, no plane slice)."""
    options = dict(options)
    num_kv_heads, num_blocks = 2, 64
    # A long table makes the split choice use several KV splits (the merge then runs in XLA).
    max_blocks = 48 if options.pop("splits", False) else 4
    kv = jnp.zeros((2, num_blocks, block_size, num_kv_heads, head_size), dtype)
    q = jnp.ones((2, num_q_tokens, group * num_kv_heads, head_size), dtype)
    lens = jnp.array([5, 40], jnp.int32)
    table = jnp.zeros((2, max_blocks), jnp.int32)
    slopes = jnp.ones((group * num_kv_heads,), jnp.float32) if options.pop("alibi", False) else None

    def fn(q, kv, lens, table, slopes):
        k, v = cache_planes(kv)
        return jpa.flash_attn_with_kvcache(q, k, v, lens, table, alibi_slopes=slopes,
                                           implementation="mosaic_gpu", **options)

    text = lower_for_cuda(fn, q, kv, lens, table, slopes)
    assert len(MOSAIC_CALL.findall(text)) == 1
    assert TRITON_CALL not in text
    assert f"tensor<2x{num_blocks}x{block_size}x{num_kv_heads}x{head_size}x" in text
    assert f"tensor<{num_blocks}x{block_size}x{num_kv_heads}x{head_size}x" not in text  # no plane slice


@pytest.mark.parametrize("items_per_program", [1, 2])
@pytest.mark.parametrize("compute_warpgroups", [1, 2])
@pytest.mark.parametrize(
    "cache_dtype,head_size,block_size,num_q_tokens,num_splits",
    [(jnp.bfloat16, 128, 16, 1, 1), (jnp.bfloat16, 128, 16, 3, 2), (jnp.float8_e4m3fn, 64, 32, 1, 1),
     (jnp.bfloat16, 256, 16, 1, 2)],
    ids=["bf16-d128", "bf16-d128-sq3-quarantine-splits", "e4m3-d64-bs32", "bf16-d256-splits"],
)
def test_specialized_decode_lowers_to_mosaic_gpu_kernel(compute_warpgroups, items_per_program, cache_dtype,
                                                        head_size, block_size, num_q_tokens, num_splits):
    """The warp-specialized decode forms (a producer warpgroup, one or two compute
    warpgroups merging through shared memory, one sequence a program or two) lower for CUDA to one Mosaic GPU kernel
    (jax 0.10 needs the merge buffer swizzled: a plain f32 tile has no bank-conflict-free
    transfer in the wgmma layout there)."""
    from jax_paged_attn import decode
    from jax_paged_attn.spec import AttentionSpec
    from jax_paged_attn.tuning import MosaicDecodeConfig

    k, v = _paged_cache(num_blocks=64, block_size=block_size, head_size=head_size, dtype=cache_dtype)
    q = jnp.ones((2, num_q_tokens, 8, head_size), jnp.bfloat16)
    lens, table = jnp.array([5, 40], jnp.int32), jnp.zeros((2, 48), jnp.int32)
    config = MosaicDecodeConfig(compute_warpgroups=compute_warpgroups, num_stages=4, num_splits=num_splits,
                                items_per_program=items_per_program)
    fn = lambda q, k, v, n, t: decode.paged_decode_attention(
        q, k, v, n, t, None, 0.5, 0.25, spec=AttentionSpec.create(head_size, causal=True, window_size=(30, 0)),
        lowering="mosaic_gpu", config=config)
    text = lower_for_cuda(fn, q, k, v, lens, table)
    assert len(MOSAIC_CALL.findall(text)) == 1 and TRITON_CALL not in text


@pytest.mark.parametrize(
    "q_dtype,head_size,block_size,num_q_heads,num_q_tokens,num_splits,tile_keys,options",
    [(jnp.bfloat16, 128, 16, 8, 1, 1, 64, {}),
     (jnp.bfloat16, 64, 16, 16, 1, 2, 64, dict(softcap=30.0)),
     (jnp.float16, 256, 32, 8, 1, 1, 128, dict(window_size=(30, 0), alibi=True)),
     (jnp.bfloat16, 128, 64, 8, 3, 2, 128, dict(causal=False)),
     (jnp.bfloat16, 64, 16, 64, 1, 1, 64, {}),
     (jnp.bfloat16, 128, 16, 8, 1, 2, 64, dict(cache_dtype=jnp.float8_e4m3fn)),
     (jnp.float16, 64, 32, 16, 1, 1, 128, dict(cache_dtype=jnp.float8_e5m2, softcap=30.0)),
     (jnp.bfloat16, 128, 16, 8, 1, 2, 64, dict(compute_warpgroups=1, window_size=(30, 0))),
     (jnp.bfloat16, 64, 16, 16, 1, 1, 128, dict(compute_warpgroups=1, items_per_program=2,
                                                cache_dtype=jnp.float8_e4m3fn)),
     (jnp.float16, 64, 16, 32, 1, 1, 64, dict(compute_warpgroups=1, items_per_program=0,
                                              cache_dtype=jnp.float8_e5m2, softcap=30.0))],
    ids=["bf16-d128-16rows", "bf16-d64-32rows-softcap-splits", "f16-d256-bs32-window-alibi-128keys",
         "bf16-d128-bs64-sq3-noncausal-splits", "bf16-d64-64rows", "bf16-e4m3-d128-splits",
         "f16-e5m2-d64-bs32-32rows-128keys", "producer-bf16-d128-window-splits", "producer-items2-e4m3-d64",
         "producer-items-auto-e5m2-d64-32rows"],
)
def test_keys_as_m_decode_lowers_to_mosaic_gpu_kernel(q_dtype, head_size, block_size, num_q_heads, num_q_tokens,
                                                      num_splits, tile_keys, options):
    """The keys-as-M decode form (``MosaicDecodeConfig.keys_as_m``: S^T = K Q^T, O^T += V^T
    P^T) lowers for CUDA to one Mosaic GPU kernel at 16, 32 and 64 query rows (the values'
    swizzle 32, 64 and 128 bytes), every mask and split kind it takes, head sizes 64-256,
    fp8 pages (upcast into the operands' swizzles), alone or with a compute warpgroup
    beside a producer (one sequence a program, two, or one wave's worth)."""
    from jax_paged_attn import decode
    from jax_paged_attn.spec import AttentionSpec
    from jax_paged_attn.tuning import MosaicDecodeConfig

    options = dict(options)
    alibi = jnp.linspace(0.1, 0.5, num_q_heads, dtype=jnp.float32) if options.pop("alibi", False) else None
    k, v = _paged_cache(num_blocks=64, block_size=block_size, head_size=head_size,
                        dtype=options.pop("cache_dtype", q_dtype))
    q = jnp.ones((2, num_q_tokens, num_q_heads, head_size), q_dtype)
    lens, table = jnp.array([5, 40], jnp.int32), jnp.zeros((2, 48), jnp.int32)
    config = MosaicDecodeConfig(keys_as_m=True, num_splits=num_splits, tile_keys=tile_keys, num_stages=3,
                                compute_warpgroups=options.pop("compute_warpgroups", 0),
                                items_per_program=options.pop("items_per_program", 1))
    spec = AttentionSpec.create(head_size, causal=options.pop("causal", True), has_alibi=alibi is not None,
                                **options)
    fn = lambda q, k, v, n, t: decode.paged_decode_attention(q, k, v, n, t, alibi, 1.0, 1.0, spec=spec,
                                                             lowering="mosaic_gpu", config=config)
    text = lower_for_cuda(fn, q, k, v, lens, table)
    assert len(MOSAIC_CALL.findall(text)) == 1 and TRITON_CALL not in text


@pytest.mark.parametrize(
    "q_dtype,cache_dtype,head_size,block_size",
    [(jnp.bfloat16, jnp.float8_e4m3fn, 128, 16), (jnp.float16, jnp.float8_e5m2, 64, 16),
     (jnp.bfloat16, jnp.float8_e4m3fn, 256, 32), (jnp.bfloat16, jnp.float8_e4m3fn, 192, 16),
     (jnp.bfloat16, jnp.float8_e4m3fn, 80, 16), (jnp.float16, jnp.float8_e5m2, 96, 32),
     (jnp.bfloat16, jnp.float8_e4m3fn, 128, 144)],
    ids=["bf16-e4m3-d128", "f16-e5m2-d64", "bf16-e4m3-d256-bs32", "bf16-e4m3-d192",
         "bf16-e4m3-d80-unswizzled", "f16-e5m2-d96", "bf16-e4m3-d128-bs144"],
)
def test_decode_fp8_pages_lower_to_mosaic_gpu_kernel(q_dtype, cache_dtype, head_size, block_size):
    """fp8 pages arrive as fp8 and are upcast in the kernel (to bf16 through f32, which
    the lowering requires): the module still holds one Mosaic GPU kernel and no copy of
    the cache."""
    k, v = _paged_cache(num_blocks=64, block_size=block_size, head_size=head_size, dtype=cache_dtype)
    q = jnp.ones((3, 1, 8, head_size), q_dtype)
    lens = jnp.array([5, 17, 40], jnp.int32)
    table = jnp.zeros((3, 40), jnp.int32)
    fn = lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True, k_scale=0.5, v_scale=0.25,
                                                           implementation="mosaic_gpu")
    text = lower_for_cuda(fn, q, k, v, lens, table)
    assert len(MOSAIC_CALL.findall(text)) == 1 and TRITON_CALL not in text


@pytest.mark.covering(pairs=False)  # each value once by default; every case with --full
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
        text = lower_for_cuda(fn, q, k, v, cu, cu_k, table, slopes)
    else:
        k = jnp.ones((150, 2, head_size), kv_dtype)
        cu_k = jnp.array([0, 60, 150], jnp.int32)
        fn = lambda q, k, v, cq, ck, a: jpa.flash_attn_varlen_func(
            q, k, v, cq, ck, 100, 90, alibi_slopes=a, k_scale=0.5, v_scale=2.0, **kwargs)
        text = lower_for_cuda(fn, q, k, k, cu, cu_k, slopes)
    assert MOSAIC_GPU_CALL in text
    assert TRITON_CALL not in text


@pytest.mark.covering(pairs=False)  # each value once by default; every case with --full
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("masking", [dict(causal=False), dict(causal=False, window_size=(7, 3)),
                                     dict(causal=False, window_size=(-1, 2)), dict(causal=False, window_size=(4, -1)),
                                     dict(causal=True)],
                         ids=["full", "window-both", "window-right", "window-left", "causal"])
def test_mosaic_varlen_masks_of_every_kind_lower(masking, paged):
    """Each kind of mask (none, a two-sided, right or left window, causal) lowers in the
    Mosaic GPU kernel's masked blocks (each key against its row's interval of visible
    keys: with no bound on the right the interval ends at the key count), over packed
    keys and a paged cache."""
    q = jnp.ones((40, 8, 128), jnp.bfloat16)
    cu = jnp.array([0, 7, 40], jnp.int32)
    cu_k = jnp.array([0, 60, 150], jnp.int32)
    kwargs = dict(implementation="mosaic_gpu", **masking)
    if paged:
        k, v = _paged_cache(num_blocks=12, block_size=16, head_size=128, dtype=jnp.bfloat16)
        table = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
        fn = lambda q, k, v, cq, ck, t: jpa.flash_attn_varlen_func(q, k, v, cq, ck, 100, 90, block_table=t, **kwargs)
        text = lower_for_cuda(fn, q, k, v, cu, cu_k, table)
    else:
        k = jnp.ones((150, 2, 128), jnp.bfloat16)
        fn = lambda q, k, v, cq, ck: jpa.flash_attn_varlen_func(q, k, v, cq, ck, 100, 90, **kwargs)
        text = lower_for_cuda(fn, q, k, k, cu, cu_k)
    assert MOSAIC_GPU_CALL in text


def test_kvcache_with_mosaic_gpu_lowers_to_the_mosaic_decode_kernel():
    """flash_attn_with_kvcache(implementation="mosaic_gpu") runs the Mosaic GPU decode
    kernel, not the Triton one."""
    k, v = _paged_cache()
    q = jnp.ones((3, 1, 8, 64), jnp.bfloat16)
    lens = jnp.array([5, 17, 40], jnp.int32)
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    fn = lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True, implementation="mosaic_gpu")
    text = lower_for_cuda(fn, q, k, v, lens, table)
    assert MOSAIC_GPU_CALL in text and TRITON_CALL not in text


@pytest.mark.covering(pairs=False)  # each value once by default; every case with --full
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("form", ["single-warpgroup", "key-flags", "fence-softmax", "persistent", "slab-output",
                                  "masked-parts", "probe", "probe-masked-parts", "precheck-values",
                                  "heads-per-program", "prefetch-queries", "persistent-prefetch-queries",
                                  "pingpong-across-items", "persistent-pingpong-across-items"])
def test_other_mosaic_forms_lower(paged, form):
    """The single-warpgroup form (the CPU tests' interpret default), and the default form
    with per-key non-finite flags in its masked blocks, with the softmax fenced before
    the ping-pong barrier, persistent (132 programs walking the work items), writing
    one output slab per tile, with 128-key blocks whose masked ones run in 64-key
    parts, or probing its masked blocks' P·V for non-finite values (the redo a branch
    around wgmma), or with its values checked once and masked blocks run whole while all
    are finite (a branch per masked block; paged: off), or running 4 heads per program
    (one ring stream through them; with the next head's queries prefetched), or
    persistent with the next item's queries prefetched, or with the ping-pong's
    warpgroups staggered across a program's heads or persistent items, lower too."""
    import dataclasses

    from jax_paged_attn import prefill, tuning
    from jax_paged_attn.spec import AttentionSpec

    config = {"single-warpgroup": tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP,
              "key-flags": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, nonfinite_check="key_flags"),
              "fence-softmax": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, fence_softmax=True),
              "persistent": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, persistent_programs=132),
              "slab-output": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, direct_output=False),
              "masked-parts": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, block_k=128, masked_block_k=64),
              "probe": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, nonfinite_check="probe"),
              "probe-masked-parts": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, nonfinite_check="probe",
                                                        block_k=128, masked_block_k=64),
              "precheck-values": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, nonfinite_check="probe",
                                                     block_k=128, masked_block_k=64, precheck_values=True),
              "heads-per-program": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, heads_per_program=4),
              "prefetch-queries": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, heads_per_program=4,
                                                      prefetch_queries=True),
              "persistent-prefetch-queries": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, persistent_programs=132,
                                                                 prefetch_queries=True),
              "pingpong-across-items": dataclasses.replace(tuning.MOSAIC_PREFILL_CONFIG, heads_per_program=4,
                                                           prefetch_queries=True, pingpong_across_items=True),
              "persistent-pingpong-across-items": dataclasses.replace(
                  tuning.MOSAIC_PREFILL_CONFIG, persistent_programs=132, pingpong_across_items=True)}[form]

    sds = jax.ShapeDtypeStruct
    q = sds((40, 8, 128), jnp.bfloat16)
    kv = sds((12, 32, 2, 128), jnp.float8_e4m3fn) if paged else sds((150, 2, 128), jnp.bfloat16)
    cu = sds((3,), jnp.int32)
    table = sds((2, 6), jnp.int32) if paged else None
    scale = sds((), jnp.float32)
    spec = AttentionSpec.create(128, causal=True, window_size=(100, 0), softcap=30.0, has_alibi=True)
    fn = lambda *a: prefill.varlen_attention(*a, spec=spec, max_seqlen_q=100, max_seqlen_k=90,
                                             lowering="mosaic_gpu", config=config)
    text = lower_for_cuda(fn, q, kv, kv, cu, cu, table, None, sds((8,), jnp.float32), scale, scale)
    assert MOSAIC_GPU_CALL in text


@pytest.mark.parametrize("head_size, fields", [
    (256, dict(nonfinite_check="key_flags")),
    (128, dict(block_k=128, masked_block_k=64)),
    (128, dict(block_k=128, masked_block_k=64, nonfinite_check="probe")),
    (128, dict(nonfinite_check="product", value_work_tile="query")),
], ids=["d256-key-flags-query-tile", "d128-bk128", "d128-bk128-probe", "d128-product-query-tile"])
def test_two_compute_warpgroups_lower_where_the_work_tile_leaves_room(head_size, fields):
    """The tilings that take two compute warpgroups only because the value work tile
    shrank or gave way to the query tile (`plans.mosaic_work_rows`) lower for CUDA,
    Mosaic GPU's own shared-memory check included."""
    from jax_paged_attn import plans, tuning

    config = tuning.MosaicPrefillConfig(**fields)
    tiling = plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, num_q_heads=1, max_seqlen_q=2048, max_seqlen_k=2048,
                                              block_size=None, config=config)
    assert tiling.compute_warpgroups == 2
    assert MOSAIC_GPU_CALL in _lower_packed_causal_prefill(head_size, 2048, config)


def _lower_packed_causal_prefill(head_size: int, max_seqlen: int, config) -> str:
    """The CUDA lowering of a causal Mosaic GPU prefill of two packed bf16 sequences of up
    to ``max_seqlen`` (8 query heads, 2 KV heads) with ``config``."""
    from jax_paged_attn import prefill
    from jax_paged_attn.spec import AttentionSpec

    sds = jax.ShapeDtypeStruct
    q = sds((2 * max_seqlen, 8, head_size), jnp.bfloat16)
    kv = sds((2 * max_seqlen, 2, head_size), jnp.bfloat16)
    cu = sds((3,), jnp.int32)
    spec = AttentionSpec.create(head_size, causal=True)
    fn = lambda q, k, v, cq, ck: prefill.varlen_attention(q, k, v, cq, ck, None, None, None, 1.0, 1.0, spec=spec,
                                                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                          lowering="mosaic_gpu", config=config)
    return lower_for_cuda(fn, q, kv, kv, cu, cu)


@pytest.mark.parametrize("head_size, compute_warpgroups", [(64, 2), (64, 3), (128, 2)])
def test_split_exponentials_lower(head_size, compute_warpgroups):
    """The unmasked blocks' exponentials split between the FMA polynomial and exp2 (one
    P·V wgmma per part, `tuning.MosaicPrefillConfig.exp2_fma_columns`) lower for CUDA:
    the polynomial's bit arithmetic on the WGMMA-layout scores and the register operands
    of 64 keys."""
    from jax_paged_attn import plans, tuning

    columns = 64
    config = tuning.MosaicPrefillConfig(compute_warpgroups=compute_warpgroups, block_k=128, masked_block_k=64,
                                        nonfinite_check="probe", exp2_fma_columns=columns)
    tiling = plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, num_q_heads=8, max_seqlen_q=1024,
                                              max_seqlen_k=1024, block_size=None, config=config)
    assert (tiling.exp2_fma_columns, tiling.block_k) == (columns, 128)
    assert MOSAIC_GPU_CALL in _lower_packed_causal_prefill(head_size, 1024, config)


@pytest.mark.parametrize("fields", [dict(nonfinite_check="probe", precheck_values=True, heads_per_program=4),
                                    dict(block_k=128, masked_block_k=64, nonfinite_check="probe")],
                         ids=["d64-default-fields", "d64-bk128-masked-parts"])
def test_three_compute_warpgroups_lower_at_head_size_64(fields):
    """Three compute warpgroups (192 query rows a tile, `plans.MOSAIC_THREE_WARPGROUPS_MAX_HEAD_SIZE`)
    lower for CUDA at D 64 with their register split, Mosaic GPU's shared-memory check
    included."""
    from jax_paged_attn import plans, prefill, tuning
    from jax_paged_attn.spec import AttentionSpec

    config = tuning.MosaicPrefillConfig(compute_warpgroups=3, **fields)
    tiling = plans.plan_mosaic_prefill_tiling(64, 2, 2, 2, num_q_heads=8, max_seqlen_q=1024, max_seqlen_k=1024,
                                              block_size=None, config=config)
    assert (tiling.compute_warpgroups, tiling.block_q) == (3, 192)
    sds = jax.ShapeDtypeStruct
    q = sds((2048, 8, 64), jnp.bfloat16)
    kv = sds((2048, 2, 64), jnp.bfloat16)
    cu = sds((3,), jnp.int32)
    spec = AttentionSpec.create(64, causal=True)
    fn = lambda q, k, v, cq, ck: prefill.varlen_attention(q, k, v, cq, ck, None, None, None, 1.0, 1.0, spec=spec,
                                                          max_seqlen_q=1024, max_seqlen_k=1024,
                                                          lowering="mosaic_gpu", config=config)
    assert MOSAIC_GPU_CALL in lower_for_cuda(fn, q, kv, kv, cu, cu)


def _auto_varlen_text(head_size: int, paged: bool, q_dtype=jnp.bfloat16, num_sequences: int = 2) -> str:
    """Auto's CUDA text for 256 query rows in ``num_sequences`` sequences."""
    q = jnp.ones((256, 8, head_size), q_dtype)
    cu = jnp.asarray(np.linspace(0, 256, num_sequences + 1).astype(np.int32))
    if paged:
        k, v = _paged_cache(num_blocks=16 * num_sequences, head_size=head_size,
                            dtype=jnp.bfloat16 if q_dtype == jnp.float32 else q_dtype)
        table = jnp.arange(16 * num_sequences, dtype=jnp.int32).reshape(num_sequences, 16)
        fn = lambda q, k, v, cq, ck, t: jpa.flash_attn_varlen_func(q, k, v, cq, ck, 256, 256, causal=True,
                                                                   block_table=t)
        return lower_for_cuda(fn, q, k, v, cu, cu, table)
    k = jnp.ones((256, 2, head_size), q_dtype)
    fn = lambda q, k, v, cq: jpa.flash_attn_varlen_func(q, k, v, cq, cq, 256, 256, causal=True)
    return lower_for_cuda(fn, q, k, k, cu)


@pytest.mark.parametrize("paged", [False, True])
def test_auto_prefills_at_head_sizes_128_and_256_through_the_mosaic_gpu_kernel(paged):
    """Auto takes the Mosaic GPU prefill kernel where it was measured faster
    (`tuning.MOSAIC_PREFILL_HEAD_SIZES`: D 128 and 256 on the H200, the GPU a CPU host
    plans for), the Triton one elsewhere."""
    for head_size in (128, 256):
        text = _auto_varlen_text(head_size, paged)
        assert MOSAIC_GPU_CALL in text and TRITON_CALL not in text
    text = _auto_varlen_text(64, paged)
    assert TRITON_CALL in text and MOSAIC_GPU_CALL not in text


@pytest.mark.parametrize("paged", [False, True])
def test_auto_prefills_many_short_query_runs_through_the_triton_kernel(paged):
    """Fewer than `dispatch.MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE` query rows per
    sequence on average (here 256 rows in 4 sequences: 64 each), as in a step mixing
    decodes with a prefill chunk, stay on the Triton kernel at D 128 too."""
    from jax_paged_attn import dispatch

    assert 256 // 4 < dispatch.MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE <= 256 // 2
    text = _auto_varlen_text(128, paged, num_sequences=4)
    assert TRITON_CALL in text and MOSAIC_GPU_CALL not in text


def test_auto_prefill_keeps_triton_where_the_mosaic_kernel_is_not_measured_or_cannot_run(monkeypatch):
    """float32 queries (the Mosaic GPU kernel takes 16-bit ones) and a GPU without a
    measurement (here an H100 PCIe) run the Triton kernel at D 128; the H100 80GB HBM3,
    measured, runs the Mosaic GPU kernel there."""
    from jax_paged_attn import tuning

    text = _auto_varlen_text(128, paged=False, q_dtype=jnp.float32)
    assert TRITON_CALL in text and MOSAIC_GPU_CALL not in text
    for kind, mosaic in (("NVIDIA H100 PCIe", False), ("NVIDIA H100 80GB HBM3", True)):
        monkeypatch.setattr(tuning, "target_device", lambda kind=kind: tuning.TuningDevice(kind, 227 * 1024))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tuning.UntunedDeviceWarning)  # (no measured tile tables on either)
            text = _auto_varlen_text(128, paged=True)
        assert (MOSAIC_GPU_CALL in text) == mosaic and (TRITON_CALL in text) != mosaic, kind


def test_auto_prefills_a_cache_of_2_31_elements_through_the_triton_kernel():
    """Caches of 2**31 elements and more have run through the Triton kernels alone on the
    H200 (`tests/test_gpu.py`): auto keeps them there even at head size 128."""
    kv = _stacked_fp8(BIG_FP8_BLOCKS)
    fn = lambda q, kv, cq, ck, t: jpa.flash_attn_varlen_func(
        q, *cache_planes(kv), cq, ck, 64, 1024, causal=True, block_table=t, k_scale=0.5, v_scale=0.5)
    args = (S((512, 32, 128), jnp.bfloat16), kv, S((5,), jnp.int32), S((5,), jnp.int32), S((4, 64), jnp.int32))
    text = lower_for_cuda(fn, *args)
    assert TRITON_CALL in text and MOSAIC_GPU_CALL not in text
    small = lower_for_cuda(fn, args[0], _stacked_fp8(64), *args[2:])
    assert MOSAIC_GPU_CALL in small and TRITON_CALL not in small


def test_mosaic_prefill_default_takes_the_fields_measured_fastest_per_head_size():
    from jax_paged_attn import tuning

    fields = {d: (c.block_k, c.masked_block_k, c.nonfinite_check)
              for d in (32, 64, 80, 128, 192, 256) for c in [tuning.mosaic_prefill_config(d, "bfloat16")]}
    assert fields == {32: (128, 64, "probe"), 64: (128, 64, "probe"), 80: (128, 64, "probe"),
                      128: (128, 64, "probe"), 192: (64, 64, "key_flags"), 256: (64, 64, "key_flags")}
    assert tuning.mosaic_prefill_config(256, "bfloat16", interpret=True) == \
        tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP  # interpret mode keeps its one form


@pytest.mark.parametrize("head_size, paged", [(128, False), (128, True), (64, False), (64, True)],
                         ids=["d128-packed", "d128-paged-bs16", "d64-packed", "d64-paged-bs16"])
def test_mosaic_prefill_package_config_lowers_without_warnings(head_size, paged, monkeypatch):
    """A call without ``config`` (the package's config: the next head's queries prefetched
    where a program has several heads) lowers for CUDA over packed keys (4 heads a program,
    two query tiles a warpgroup) and a paged cache (one head a program: no prefetch), and
    says nothing about a field it did not honour: the user chose none."""
    from jax_paged_attn import plans, prefill
    from jax_paged_attn.spec import AttentionSpec

    monkeypatch.setattr(plans, "_dropped_fields", set())  # (a warning said earlier is not said again)
    sds = jax.ShapeDtypeStruct
    q = sds((1024, 8, head_size), jnp.bfloat16)
    kv = sds((40, 16, 2, head_size), jnp.bfloat16) if paged else sds((2048, 2, head_size), jnp.bfloat16)
    cu = sds((3,), jnp.int32)
    table = sds((2, 20), jnp.int32) if paged else None
    spec = AttentionSpec.create(head_size, causal=True)
    fn = lambda q, k, v, cq, ck, table: prefill.varlen_attention(
        q, k, v, cq, ck, table, None, None, 1.0, 1.0, spec=spec, max_seqlen_q=512,
        max_seqlen_k=640 if paged else 1024, lowering="mosaic_gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", plans.ConfigFieldDroppedWarning)
        assert MOSAIC_GPU_CALL in lower_for_cuda(fn, q, kv, kv, cu, cu, table)


@pytest.mark.parametrize("head_size, paged, fields", [
    (128, False, dict(block_k=128, masked_block_k=64, nonfinite_check="probe", precheck_values=True,
                      heads_per_program=4)),
    (128, True, dict(block_k=128, masked_block_k=64, nonfinite_check="probe")),
    (64, False, dict(compute_warpgroups=3, block_k=128, masked_block_k=64, nonfinite_check="probe")),
    (256, False, dict(nonfinite_check="key_flags")),
], ids=["d128-packed-heads-per-program-4", "d128-paged-bs16", "d64-three-warpgroups", "d256-two-warpgroups"])
def test_overlapped_softmax_lowers(head_size, paged, fields):
    """``overlap_softmax`` (each unmasked block's softmax beside the previous block's P·V,
    two wgmmas in flight and the scores waited for alone, the probabilities a register
    operand) lowers for CUDA at D 64, 128 and 256 (two compute warpgroups: the package's
    tiling), over packed keys and a paged bf16 cache, with soft-cap and ALiBi in its
    softmax (the plan keeps it: no warning that it dropped it)."""
    import warnings

    from jax_paged_attn import plans, prefill, tuning
    from jax_paged_attn.spec import AttentionSpec


    config = tuning.MosaicPrefillConfig(overlap_softmax=True, **fields)
    sds = jax.ShapeDtypeStruct
    q = sds((1024, 8, head_size), jnp.bfloat16)
    kv = sds((40, 16, 2, head_size), jnp.bfloat16) if paged else sds((2048, 2, head_size), jnp.bfloat16)
    cu = sds((3,), jnp.int32)
    table = sds((2, 20), jnp.int32) if paged else None
    spec = AttentionSpec.create(head_size, causal=True, softcap=30.0, has_alibi=True)
    fn = lambda q, k, v, cq, ck, table, slopes: prefill.varlen_attention(
        q, k, v, cq, ck, table, None, slopes, 1.0, 1.0, spec=spec, max_seqlen_q=512, max_seqlen_k=640 if paged else 1024,
        lowering="mosaic_gpu", config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", plans.ConfigFieldDroppedWarning)
        assert MOSAIC_GPU_CALL in lower_for_cuda(fn, q, kv, kv, cu, cu, table, sds((8,), jnp.float32))
