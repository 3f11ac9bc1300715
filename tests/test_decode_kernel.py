"""The paged decode kernels (`jax_paged_attn.decode`: Pallas Triton, and the Mosaic GPU
first cut) against the reference.

Every kernel run here is in Pallas interpret mode on the CPU; cross-lowering for CUDA
checks that the Triton lowering accepts the kernel. The Mosaic GPU kernel runs in the
Mosaic GPU interpreter (on jax 0.10.2 too: the package teaches that interpreter what it
lacks); its cross-lowering tests are in tests/test_lowering.py. Unused cache pages are
filled with NaN and block-table entries past a sequence hold garbage ids, so a kernel that
reads outside a sequence's keys shows up as NaN or as a wrong value.

Tolerance (FlashAttention-3 style): the kernel's error against the float32 reference
(queries upcast) must be within twice the reference's own error in the query dtype,
plus a small absolute term for the kernel's low-precision softmax probabilities.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn
from jax_paged_attn import decode, plans, reference, tuning
from jax_paged_attn.kernels import mosaic_decode, triton_decode
from jax_paged_attn.spec import UNBOUNDED, AttentionSpec
from jax_paged_attn.tuning import DecodeConfig, MosaicDecodeConfig
from conftest import CompileCounter, covering_cases, lower_for_cuda, profiled_trace_events

pytestmark = pytest.mark.covering  # products: a covering subset by default, all with --full (conftest.py)

# Absolute slack on top of 2x the reference's own rounding error: the kernel rounds
# the softmax probabilities to the input dtype before the P @ V dot (as FlashAttention does).
ABS_SLACK = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3}
K_SCALE, V_SCALE = 0.5, 0.25
GARBAGE_PAGE_IDS = (-1, 1 << 30)
MIN_TILE = decode.MIN_DOT_ROWS


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode scenario; unused pages of a cache of ``num_blocks`` pages are NaN."""

    name: str
    dtype: str = "bfloat16"
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 128
    block_size: int = 16
    num_q_tokens: int = 1
    seqlens: tuple[int, ...] = (0, 1, 37, 100)
    max_blocks: int = 8
    num_blocks: int = 64
    causal: bool = True
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    softcap: float = 0.0
    alibi: bool = False
    cache_dtype: str | None = None  # an fp8 dtype name, or None for the query dtype
    config: DecodeConfig | MosaicDecodeConfig | None = None  # None: the tuning table's default
    lowering: str = decode.TRITON

    def __str__(self) -> str:
        return self.name


def make_inputs(case: Case, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    batch = len(case.seqlens)
    shape = (case.num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    q = rng.standard_normal((batch, case.num_q_tokens, case.num_q_heads, case.head_size))
    k = rng.standard_normal(shape)
    v = rng.standard_normal(shape)
    pages = rng.permutation(case.num_blocks)
    assert batch * case.max_blocks <= case.num_blocks
    block_table = pages[: batch * case.max_blocks].reshape(batch, case.max_blocks).astype(np.int32)
    used = np.zeros(case.num_blocks, bool)
    for b, n in enumerate(case.seqlens):
        n_pages = -(-n // case.block_size)
        assert n_pages <= case.max_blocks, case
        used[block_table[b, :n_pages]] = True
        # Entries past the sequence: alternately NaN pages and ids outside the cache.
        for j in range(n_pages, case.max_blocks, 2):
            block_table[b, j] = GARBAGE_PAGE_IDS[(b + j) % 2]
        # Slots past the sequence in its last page are garbage too.
        if n % case.block_size:
            k[block_table[b, n_pages - 1], n % case.block_size:] = np.nan
            v[block_table[b, n_pages - 1], n % case.block_size:] = np.nan
    k[~used] = np.nan
    v[~used] = np.nan
    dtype = jnp.dtype(case.dtype)
    if case.cache_dtype is None:
        k_cache, v_cache = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        k_scale = v_scale = 1.0
    else:
        # fp8 stores x / scale; readers compute x * scale.
        k_cache = jnp.asarray(k / K_SCALE, jnp.float32).astype(case.cache_dtype)
        v_cache = jnp.asarray(v / V_SCALE, jnp.float32).astype(case.cache_dtype)
        k_scale, v_scale = K_SCALE, V_SCALE
    alibi = None
    if case.alibi:
        alibi = jnp.asarray(2.0 ** (-8.0 * np.arange(1, case.num_q_heads + 1) / case.num_q_heads), jnp.float32)
    return dict(
        q=jnp.asarray(q, dtype), k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=jnp.asarray(case.seqlens, jnp.int32), block_table=jnp.asarray(block_table),
        alibi_slopes=alibi, k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale),
    )


def spec_of(case: Case) -> AttentionSpec:
    return AttentionSpec.create(case.head_size, causal=case.causal, window_size=case.window,
                                softcap=case.softcap, has_alibi=case.alibi)


INPUT_NAMES = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "alibi_slopes", "k_scale", "v_scale")


def run_kernel(case: Case, inputs: dict, *, interpret: bool = True) -> jax.Array:
    """Through the decode wrapper (explicit config), jitted: one compile per case."""
    fn = functools.partial(decode.paged_decode_attention, spec=spec_of(case), interpret=interpret,
                           config=case.config, lowering=case.lowering)
    return jax.jit(fn)(*(inputs[n] for n in INPUT_NAMES))


@functools.partial(jax.jit, static_argnames="spec")
def _references(q, *args, spec: AttentionSpec) -> tuple[jax.Array, jax.Array]:
    """(float32 reference from upcast queries, reference in q's dtype upcast to float32)."""
    ref_hi = reference.paged_decode_attention(q.astype(jnp.float32), *args, spec=spec)
    ref_lo = reference.paged_decode_attention(q, *args, spec=spec).astype(jnp.float32)
    return ref_hi, ref_lo


def assert_matches_reference(case: Case, inputs: dict, out: jax.Array) -> None:
    q = inputs["q"]
    ref_hi, ref_lo = map(np.asarray, _references(q, *(inputs[n] for n in INPUT_NAMES[1:]), spec=spec_of(case)))
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out)), f"{case}: non-finite output"
    for b, n in enumerate(case.seqlens):
        if n == 0:
            np.testing.assert_array_equal(out[b], 0.0, err_msg=f"{case}: empty sequence {b} must output 0")
    ref_err = np.max(np.abs(ref_lo - ref_hi))
    err = np.max(np.abs(out - ref_hi))
    tol = 2 * ref_err + ABS_SLACK[case.dtype]
    assert err <= tol, f"{case}: max error {err:.3g} > {tol:.3g} (reference's own error {ref_err:.3g})"


GRID = [
    Case("gqa4-d128-bs16-causal-bf16-3splits", config=DecodeConfig(pages_per_step=2, num_splits=3)),
    Case("mqa-d80-bs32-sq3-window-alibi-f16-2splits", dtype="float16", num_q_heads=4, num_kv_heads=1,
         head_size=80, block_size=32, num_q_tokens=3, seqlens=(3, 90, 0, 1, 64), window=(24, 0),
         alibi=True, max_blocks=4, config=DecodeConfig(pages_per_step=1, num_splits=2)),
    Case("mha-d64-softcap-noncausal-f32", dtype="float32", num_q_heads=2, num_kv_heads=2, head_size=64,
         causal=False, softcap=20.0, seqlens=(70, 1, 0)),
    Case("gqa8-d256-sq3-fp8e4m3-bf16", num_q_heads=16, num_kv_heads=2, head_size=256, num_q_tokens=3,
         seqlens=(100, 3, 17), cache_dtype="float8_e4m3fn", num_blocks=32,
         config=DecodeConfig(pages_per_step=4, num_splits=2)),
    Case("gqa4-d64-bs32-fp8e5m2-window-alibi-softcap-f16", dtype="float16", head_size=64, block_size=32,
         causal=False, window=(40, 6), softcap=10.0, alibi=True, cache_dtype="float8_e5m2",
         seqlens=(0, 120, 55, 1), max_blocks=4, config=DecodeConfig(pages_per_step=2, num_splits=4)),
    Case("gqa8-d128-fp8e4m3-window-alibi-bf16-prefetched-ids", num_q_heads=16, num_kv_heads=2,
         cache_dtype="float8_e4m3fn", window=(70, 0), alibi=True, seqlens=(128, 90, 0, 17),
         config=DecodeConfig(pages_per_step=2, num_splits=2, num_stages=4, prefetch_page_ids=True)),
    Case("gqa4-d80-bs16-sq3-fp8e4m3-f32", dtype="float32", head_size=80, num_q_tokens=3,
         cache_dtype="float8_e4m3fn", window=(50, 0), seqlens=(128, 60, 3)),
]


@pytest.mark.parametrize("case", covering_cases(GRID))
def test_public_api_matches_reference(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn_with_kvcache(implementation="triton") over the scenario grid."""
    if case.config is not None:
        # The public API takes no config: route the case's config through the table.
        key = (tuning.next_power_of_2(case.head_size), case.block_size,
               tuning.next_power_of_2(case.num_q_heads // case.num_kv_heads))
        measured = tuning.MEASURED_TABLES[tuning.target_device().kind]
        monkeypatch.setitem(measured, "DECODE_TABLE", {**measured.get("DECODE_TABLE", {}), key: case.config})
    inputs = make_inputs(case)
    out = jax_paged_attn.flash_attn_with_kvcache(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"], inputs["block_table"],
        causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=inputs["alibi_slopes"],
        k_scale=inputs["k_scale"], v_scale=inputs["v_scale"], implementation="triton", interpret=True,
    )
    assert_matches_reference(case, inputs, out)


@pytest.mark.parametrize("num_splits,pages_per_step,prefetch",
                         [(1, 1, False), (2, 4, False), (5, 2, False), (16, 1, False), (5, 2, True), (16, 1, True)])
def test_split_counts_agree(num_splits: int, pages_per_step: int, prefetch: bool) -> None:
    """Splits divide each sequence's tiles; more splits than tiles leave some empty.

    Non-causal two-sided window with 2 query tokens: both window edges need masking.
    Prefetched ids: each split starts its id vector at its own first tile."""
    case = Case(f"splits{num_splits}-pps{pages_per_step}", num_q_heads=4, num_kv_heads=1, head_size=64,
                num_q_tokens=2, seqlens=(127, 5, 64, 0), causal=False, window=(70, 5),
                config=DecodeConfig(pages_per_step=pages_per_step, num_splits=num_splits,
                                    prefetch_page_ids=prefetch))
    inputs = make_inputs(case, seed=1)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


@pytest.mark.parametrize("prefetch", [False, True], ids=["ids-in-step", "ids-prefetched"])
@pytest.mark.parametrize("causal,window", [(True, (18, 0)), (False, (18, 1))], ids=["causal", "two-sided"])
def test_every_tile_boundary(causal: bool, window: tuple[int, int], prefetch: bool) -> None:
    """Lengths 0..49 with 16-key tiles and a window wide enough for unmasked tiles: the
    window and causal edges fall on every offset of the tile grid, so an off-by-one in
    the masked / unmasked split shows up for some length. With prefetched page ids the
    id vector carried across the three loops must stay in step with the tile index,
    and the read one step past the last tile (beyond the table for length 49 + 15)
    must stay harmless."""
    case = Case(f"boundaries-{causal}", num_q_heads=2, num_kv_heads=1, head_size=32, num_q_tokens=3,
                seqlens=tuple(range(50)), max_blocks=4, num_blocks=208, causal=causal, window=window,
                config=DecodeConfig(pages_per_step=1, num_splits=1, prefetch_page_ids=prefetch))
    inputs = make_inputs(case, seed=4)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


def test_block_size_not_power_of_two() -> None:
    """block_size 48: steps of 64 keys straddle pages; each key finds its own page."""
    case = Case("bs48-d96-g2", num_q_heads=4, num_kv_heads=2, head_size=96, block_size=48, num_q_tokens=3,
                seqlens=(150, 49, 3), max_blocks=4, num_blocks=16,
                config=DecodeConfig(pages_per_step=1, num_splits=2))
    assert triton_decode_tile(case) == 32
    case = dataclasses.replace(case, config=DecodeConfig(pages_per_step=2, num_splits=2))
    assert triton_decode_tile(case) == 64
    inputs = make_inputs(case, seed=2)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))
    # Prefetched ids of a step that straddles pages: one id per key, read a step early.
    case = dataclasses.replace(case, config=DecodeConfig(pages_per_step=2, num_splits=2, prefetch_page_ids=True))
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


def triton_decode_tile(case: Case) -> int:
    q_shape = (len(case.seqlens), case.num_q_tokens, case.num_q_heads, case.head_size)
    cache_shape = (case.num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    return decode.plan_tiling(q_shape, cache_shape, case.max_blocks, case.dtype, case.dtype, case.config).tile_keys


def test_query_rows_split_over_programs() -> None:
    """MQA with 3 query tokens: 24 rows over row blocks of 16 (second block half padding)."""
    case = Case("rowblocks", num_q_heads=8, num_kv_heads=1, head_size=64, num_q_tokens=3,
                seqlens=(40, 3, 0), window=(10, 0), alibi=True,
                config=DecodeConfig(max_q_rows=16, num_splits=2, pages_per_step=1))
    q_shape = (3, 3, 8, 64)
    tiling = decode.plan_tiling(q_shape, (64, 16, 1, 64), case.max_blocks, "bfloat16", "bfloat16", case.config)
    assert (tiling.rows_per_program, tiling.row_blocks) == (16, 2)
    inputs = make_inputs(case, seed=3)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


def _assert_poisoned_rows_match(cache_dtype: str | None, **kernel: Any) -> None:
    """3 query tokens, causal window of 20, NaN / inf at keys some rows see and others do
    not: the decode kernel (``kernel``: interpret, config, lowering) leaves exactly the
    oracle's rows non-finite."""
    from conftest import assert_nonfinite_rows_match_oracle, make_kvcache_problem, poison_keys

    nan, inf = float("nan"), float("inf")
    problem = make_kvcache_problem(np.random.default_rng(4), [70, 33], 3, num_q_heads=4, num_kv_heads=1,
                                   head_size=64, dtype=jnp.bfloat16, cache_dtype=cache_dtype)
    # Sequence 0: query i sees keys [i + 47, i + 67]; sequence 1: [i + 10, i + 30].
    # Keys 0..46 of sequence 0 lie left of every window (a stale page and the masked tile
    # start); row 1 of both sequences sees none of the values.
    problem = poison_keys(problem, {
        0: [(j, "v", nan) for j in range(47)] + [(47, "v", nan), (69, "v", inf)],
        1: [(10, "k", nan), (32, "v", nan)]})
    attention = dict(causal=True, window_size=(20, 0))
    fn = functools.partial(decode.paged_decode_attention, spec=AttentionSpec.create(64, **attention), **kernel)
    out = jax.jit(fn)(problem.q, problem.k_cache, problem.v_cache, problem.cache_seqlens, problem.block_table,
                      None, problem.k_scale, problem.v_scale)
    exact = problem.oracle(**attention)
    low = problem.oracle(emulate_dtype=jnp.dtype(problem.q.dtype), **attention)
    assert_nonfinite_rows_match_oracle(out, exact, low, problem.q.dtype)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu, id="gpu")])
@pytest.mark.parametrize("config", [DecodeConfig(pages_per_step=1, num_splits=3),
                                    DecodeConfig(pages_per_step=1, num_splits=2, prefetch_page_ids=True)],
                         ids=["3-splits", "2-splits-prefetched-ids"])
def test_nonfinite_values_reach_only_the_rows_that_see_them(config: DecodeConfig, interpret: bool) -> None:
    """3 query tokens, causal window of 20: NaN / inf in K and V at keys that some query
    rows of the tile see and others do not, and a stale NaN page left of every window.
    Only the rows that see them are non-finite, also after the split merge."""
    _assert_poisoned_rows_match(cache_dtype=None, interpret=interpret, config=config)


def test_all_sequences_empty_output_zero() -> None:
    case = Case("empty", seqlens=(0, 0), config=DecodeConfig(num_splits=3))
    inputs = make_inputs(case)
    out = run_kernel(case, inputs)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), 0.0)


def test_jit_with_traced_lengths() -> None:
    """Lengths and tables traced under jit: one compiled kernel serves every batch."""
    case = Case("jit", head_size=64, config=DecodeConfig(num_splits=2, pages_per_step=2))
    inputs = make_inputs(case)
    spec = spec_of(case)
    fn = jax.jit(functools.partial(decode.paged_decode_attention, spec=spec, interpret=True, config=case.config))
    out = fn(*(inputs[n] for n in INPUT_NAMES))
    assert_matches_reference(case, inputs, out)
    # Same shapes, other lengths: the compiled kernel is reused and still correct.
    case2 = dataclasses.replace(case, seqlens=(128, 17, 0, 2))
    inputs2 = make_inputs(case2, seed=5)
    assert_matches_reference(case2, inputs2, fn(*(inputs2[n] for n in INPUT_NAMES)))
    assert fn._cache_size() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRID + [
    Case("gpu-boundaries-causal", num_q_heads=2, num_kv_heads=1, head_size=32, num_q_tokens=3,
         seqlens=tuple(range(50)), max_blocks=4, num_blocks=208, window=(18, 0),
         config=DecodeConfig(pages_per_step=1, num_splits=1)),
    Case("gpu-h200-shape-splits", num_q_heads=32, num_kv_heads=8, seqlens=(4096, 1, 0, 3000, 17),
         max_blocks=256, num_blocks=1300, config=DecodeConfig(pages_per_step=8, num_splits=7, num_stages=5)),
], ids=str)
def test_compiled_on_gpu_matches_reference(case: Case) -> None:
    """The same scenarios compiled by Triton on an NVIDIA GPU (run with ``pytest -m gpu``)."""
    inputs = make_inputs(case)
    assert_matches_reference(case, inputs, run_kernel(case, inputs, interpret=False))


# --- cross-lowering for CUDA (the Triton lowering runs on this CPU host) ---


@pytest.mark.parametrize(
    "dtype,cache_dtype,head_size,block_size,q_heads,kv_heads,num_q_tokens,window,softcap,alibi",
    [
        ("bfloat16", None, 128, 16, 32, 8, 1, (UNBOUNDED, UNBOUNDED), 0.0, False),
        ("float16", "float8_e4m3fn", 80, 32, 64, 8, 3, (128, 0), 30.0, True),
        ("float32", None, 256, 16, 8, 1, 2, (UNBOUNDED, UNBOUNDED), 0.0, False),
        ("bfloat16", "float8_e5m2", 224, 48, 4, 4, 1, (64, 0), 0.0, True),
    ],
)
def test_lowers_to_triton_for_cuda(dtype, cache_dtype, head_size, block_size, q_heads, kv_heads,
                                   num_q_tokens, window, softcap, alibi) -> None:
    batch, max_blocks, num_blocks = 4, 64, 512
    q = jax.ShapeDtypeStruct((batch, num_q_tokens, q_heads, head_size), jnp.dtype(dtype))
    cache = jax.ShapeDtypeStruct((num_blocks, block_size, kv_heads, head_size), jnp.dtype(cache_dtype or dtype))
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    table = jax.ShapeDtypeStruct((batch, max_blocks), jnp.int32)
    slopes = jax.ShapeDtypeStruct((q_heads,), jnp.float32) if alibi else None
    scale = jax.ShapeDtypeStruct((), jnp.float32)

    def fn(q, k, v, lens, table, slopes, k_scale, v_scale):
        return jax_paged_attn.flash_attn_with_kvcache(
            q, k, v, lens, table, causal=True, window_size=window, softcap=softcap, alibi_slopes=slopes,
            k_scale=k_scale, v_scale=v_scale, implementation="triton")

    text = lower_for_cuda(fn, q, cache, cache, lens, table, slopes, scale, scale)
    assert "__gpu$xla.gpu.triton" in text


def test_auto_picks_kernel_on_cuda_only() -> None:
    """implementation=None: the Triton kernel in the CUDA lowering, the reference on CPU."""
    case = Case("auto", head_size=64, seqlens=(20, 0))
    inputs = make_inputs(case)
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")
    fn = lambda q, k, v, lens, table: jax_paged_attn.flash_attn_with_kvcache(q, k, v, lens, table, causal=True)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *(inputs[n] for n in names))
    assert "triton" not in jax.jit(fn).lower(*(inputs[n] for n in names)).as_text()


# --- planning (pure Python) ---


def test_unsupported_reason() -> None:
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    lens, table = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4), jnp.int32)
    spec = AttentionSpec.create(128)
    args = (q, cache, cache, lens, table, None, jnp.float32(1), jnp.float32(1))
    assert decode.unsupported_reason(*args, spec=spec, lowering="triton") is None
    assert "lowering" in decode.unsupported_reason(*args, spec=spec, lowering="rocm")
    odd_head = (q[..., :40], cache[..., :40], cache[..., :40]) + args[3:]
    assert "head size 40" in decode.unsupported_reason(*odd_head, spec=spec, lowering="triton")
    int_cache = cache.astype(jnp.int8)
    assert "dtype" in decode.unsupported_reason(q, int_cache, int_cache, *args[3:], spec=spec, lowering="triton")
    with pytest.raises(NotImplementedError, match="lowering"):
        decode.paged_decode_attention(*args, spec=spec, lowering="rocm")


@pytest.mark.parametrize("pages_per_step,num_warps,num_stages", [(2, 4, 4), (4, 2, 3), (1, 8, 6)])
def test_prefetched_ids_lower_for_cuda(pages_per_step: int, num_warps: int, num_stages: int) -> None:
    """The prefetched-id variant (an id vector carried through the three loops) lowers
    to Triton with a window (all three loops present) and fp8 K with a bf16 V."""
    q = jax.ShapeDtypeStruct((4, 2, 16, 128), jnp.bfloat16)
    k_cache = jax.ShapeDtypeStruct((256, 16, 4, 128), jnp.float8_e4m3fn)
    v_cache = jax.ShapeDtypeStruct((256, 16, 4, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    table = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    spec = AttentionSpec.create(128, causal=True, window_size=(100, 0))
    config = DecodeConfig(pages_per_step=pages_per_step, num_warps=num_warps, num_stages=num_stages,
                          prefetch_page_ids=True)
    fn = functools.partial(decode.paged_decode_attention, spec=spec, config=config)
    text = lower_for_cuda(lambda q, k, v, n, t, ks, vs: fn(q, k, v, n, t, None, ks, vs),
                           q, k_cache, v_cache, lens, table, scale, scale)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize(
    "batch,max_keys,expected_splits",
    [(64, 4096, 2), (8, 32768, 16), (256, 1024, 1), (32, 8192, 4), (1, 256, 1), (1, 2048, 8)],
)
def test_split_choice_fills_gpu(batch: int, max_keys: int, expected_splits: int) -> None:
    """Default: about target_programs programs, >= min_tiles_per_split steps per split."""
    config = DecodeConfig()
    assert decode.choose_num_splits(batch, 8, 1, max_keys, 64, config) == expected_splits
    assert decode.choose_num_splits(batch, 8, 1, max_keys, 64, dataclasses.replace(config, num_splits=3)) == 3


def test_tiling_fits_shared_memory() -> None:
    """Head 80 pads to 128; 4 pages of 16 -> 64 keys; f32 head 256 shrinks an 8-page tile."""
    config = DecodeConfig(pages_per_step=4, num_stages=3)
    bf16 = decode.plan_tiling((8, 1, 32, 80), (100, 16, 8, 80), 64, jnp.bfloat16, jnp.bfloat16, config)
    assert (bf16.tile_keys, bf16.padded_head_size, bf16.rows_per_program, bf16.row_blocks) == (64, 128, 16, 1)
    config = DecodeConfig(pages_per_step=8, num_stages=5)
    f32 = decode.plan_tiling((8, 1, 32, 256), (100, 16, 8, 256), 64, jnp.float32, jnp.float32, config)
    assert isinstance(f32, triton_decode.DecodeTiling)
    assert MIN_TILE <= f32.tile_keys < 128
    assert decode.estimate_shared_memory(f32.tile_keys, 256, 4, 4, 5) <= tuning.DECODE_SHARED_MEMORY_BUDGET
    assert decode.estimate_shared_memory(2 * f32.tile_keys, 256, 4, 4, 5) > tuning.DECODE_SHARED_MEMORY_BUDGET
    # Measured with Triton for sm_90: 140288 bytes for 128 keys x 128 bf16, 5 stages.
    assert decode.estimate_shared_memory(128, 128, 2, 2, 5) >= 140288
    # Prefetched page ids (num_stages - 1 K/V buffers), measured the same way (bf16, D 128):
    # 64 keys: 3 stages 71680, 4 stages 104448; 32 keys, 6 stages 87040; 128 keys, 3 stages 139264.
    for keys, stages, measured in ((64, 3, 71680), (64, 4, 104448), (32, 6, 87040), (128, 3, 139264)):
        assert decode.estimate_shared_memory(keys, 128, 2, 2, stages, prefetch_page_ids=True) >= measured
    config = DecodeConfig(pages_per_step=8, num_stages=4, prefetch_page_ids=True)
    tiling = decode.plan_tiling((8, 1, 32, 128), (100, 16, 8, 128), 64, jnp.bfloat16, jnp.bfloat16, config)
    assert tiling.tile_keys == 64 and tiling.prefetch_page_ids  # 3 buffers of 128 keys would not fit


def test_combine_splits_weights_and_empty_rows() -> None:
    """Merging two halves equals attention over the whole; rows with no keys give 0."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal(10)
    values = rng.standard_normal((10, 4))
    halves = [(scores[:4], values[:4]), (scores[4:], values[4:])]
    parts = [np.exp(s - s.max()) @ v / np.exp(s - s.max()).sum() for s, v in halves]
    lses = [np.log(np.exp(s).sum()) for s, _ in halves]
    partial_out = np.zeros((3, 1, 1, 2, 4), np.float32)
    lse = np.full((3, 1, 1, 2), -np.inf, np.float32)
    partial_out[0, 0, 0, 0], partial_out[2, 0, 0, 0] = parts
    lse[0, 0, 0, 0], lse[2, 0, 0, 0] = lses  # split 1 is empty; head 1 saw no key at all
    out = np.asarray(decode.combine_splits(jnp.asarray(partial_out), jnp.asarray(lse), jnp.float32))
    expected = np.exp(scores - scores.max()) @ values / np.exp(scores - scores.max()).sum()
    np.testing.assert_allclose(out[0, 0, 0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[0, 0, 1], 0.0)


def test_scores_below_minus_1e30_still_attend() -> None:
    """Both kernels start the running max at the most negative finite f32
    (`kernels.common.RUNNING_MAX_INIT`): a row whose every visible score is below
    -1e30 (in log2 units) still gets its softmax, as in the reference (a -1e30 start
    would have left it with weight 0, hence output 0)."""
    d, hq, hk = 64, 2, 1
    spec = AttentionSpec.create(d, causal=True)
    q = jnp.full((1, 1, hq, d), 1e16, jnp.float32)  # q.k = -6.4e33 for every key
    k_cache = jnp.full((4, 16, hk, d), -1e16, jnp.float32)
    v_cache = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, hk, d)), jnp.float32)
    lens, table = jnp.array([20], jnp.int32), jnp.array([[2, 0]], jnp.int32)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, lens, table, None, 1.0, 1.0, spec=spec)
    assert np.abs(np.asarray(expected)).max() > 0.01
    got = decode.paged_decode_attention(q, k_cache, v_cache, lens, table, None, 1.0, 1.0, spec=spec,
                                        interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


# --- the Mosaic GPU lowering (first cut) ---

MOSAIC = decode.MOSAIC_GPU
# The GQA-8 cases have one KV head (the interpreter's time grows with the heads); the
# GQA-4 and MHA cases keep two, so the per-KV-head indexing is still checked.
MOSAIC_GRID = [
    Case("mgpu-gqa4-d64-causal-bf16-3splits-2stages", head_size=64, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=3, num_stages=2)),
    Case("mgpu-mqa-d128-bs32-window-alibi-softcap-f16-128keys", dtype="float16", num_q_heads=4, num_kv_heads=1,
         block_size=32, window=(40, 0), softcap=10.0, alibi=True, seqlens=(0, 120, 55, 1), max_blocks=4,
         lowering=MOSAIC, config=MosaicDecodeConfig(tile_keys=128, num_splits=2)),
    Case("mgpu-gqa32-d64-sq3-noncausal-2rowblocks", num_q_heads=64, num_kv_heads=2, head_size=64,
         num_q_tokens=3, causal=False, seqlens=(3, 90, 0), lowering=MOSAIC),
    Case("mgpu-gqa4-d128-sq4-causal-window-2splits", num_q_tokens=4, window=(50, 0), seqlens=(4, 90, 0, 127),
         lowering=MOSAIC, config=MosaicDecodeConfig(num_splits=2)),
    Case("mgpu-gqa4-d64-sq2-two-sided-window", head_size=64, num_q_tokens=2, causal=False, window=(30, 5),
         seqlens=(2, 90, 0, 127), lowering=MOSAIC, config=MosaicDecodeConfig(num_splits=2)),
    Case("mgpu-mha-d256-bs64-window", num_q_heads=2, num_kv_heads=2, head_size=256, block_size=64,
         window=(70, 0), seqlens=(200, 64, 1), max_blocks=4, num_blocks=16, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=1)),
    Case("mgpu-gqa8-d128-fp8e4m3-window-alibi-bf16-2splits", num_q_heads=8, num_kv_heads=1,
         cache_dtype="float8_e4m3fn", window=(70, 0), alibi=True, seqlens=(128, 90, 0, 17), lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=2)),
    Case("mgpu-gqa4-d64-bs32-fp8e5m2-softcap-f16", dtype="float16", head_size=64, block_size=32,
         softcap=10.0, cache_dtype="float8_e5m2", seqlens=(0, 120, 55, 1), max_blocks=4, lowering=MOSAIC),
    Case("mgpu-gqa2-d192-fp8e4m3-2splits", num_q_heads=4, head_size=192, cache_dtype="float8_e4m3fn",
         seqlens=(100, 1, 37), lowering=MOSAIC, config=MosaicDecodeConfig(num_splits=2)),
    # Block sizes that do not divide 128 in the one warpgroup: 16-row runs within pages,
    # their rows recomputed at each refill (only the pages cross the loop): three 64-key
    # tiles through two stages, so the third is a refill.
    Case("mgpu-bs48-runs-refill", block_size=48, seqlens=(0, 47, 191), max_blocks=4, num_blocks=16,
         lowering=MOSAIC, config=MosaicDecodeConfig(num_splits=1, num_stages=2)),
    # Warp-specialized: a producer warpgroup refills the ring; one compute warpgroup, or
    # two taking the tiles in turn and merging (3 and 5 stages round up to 4 and 6: each
    # slot keeps feeding one warpgroup; sequences of 0, 1 and several tiles, so a compute
    # warpgroup may get no tile at all).
    Case("mgpu-specialized-1wg-gqa8-d128-fp8e4m3-window-alibi-2splits", num_q_heads=8, num_kv_heads=1,
         cache_dtype="float8_e4m3fn", window=(70, 0), alibi=True, seqlens=(128, 90, 0, 17), lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=2, num_stages=3, compute_warpgroups=1)),
    Case("mgpu-specialized-2wg-gqa4-d128-sq4-causal-window", num_q_tokens=4, window=(50, 0),
         seqlens=(4, 200, 0, 127), max_blocks=13, num_blocks=64, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=1, num_stages=3, compute_warpgroups=2)),
    Case("mgpu-specialized-2wg-gqa4-d64-bs32-softcap-f16-2splits", dtype="float16", head_size=64, block_size=32,
         softcap=10.0, seqlens=(0, 250, 55, 1), max_blocks=8, num_blocks=40, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=2, num_stages=5, compute_warpgroups=2)),
    # Several sequences a program, their tiles one stream through the ring: the next one's
    # pages and queries load while the last one computes; 5 and 7 sequences leave the
    # last program's last items past the batch (they write nothing).
    Case("mgpu-items3-2wg-gqa4-d128-sq4-causal-window", num_q_tokens=4, window=(50, 0),
         seqlens=(4, 200, 0, 127, 33), max_blocks=13, num_blocks=80, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=1, num_stages=4, compute_warpgroups=2, items_per_program=3)),
    Case("mgpu-items4-1wg-gqa8-d128-fp8e4m3-window-alibi-2splits", num_q_heads=8, num_kv_heads=1,
         cache_dtype="float8_e4m3fn", window=(70, 0), alibi=True, seqlens=(128, 90, 0, 17, 1, 64, 250),
         max_blocks=16, num_blocks=120, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=2, num_stages=3, compute_warpgroups=1, items_per_program=4)),
]


# The keys as the wgmmas' M side (S^T = K Q^T over 16, 32, 48 or 64 query rows, the
# values' swizzle set by them): NaN pages, splits, windows, ALiBi, soft-cap, 128-key
# stages, several query tokens without a causal mask, head sizes 64-256, fp8 pages.
KEYS_AS_M = functools.partial(MosaicDecodeConfig, keys_as_m=True)
MOSAIC_KEYS_AS_M_GRID = [
    Case("mgpu-keys-as-m-gqa4-d64", head_size=64, lowering=MOSAIC, config=KEYS_AS_M(num_splits=1)),
    Case("mgpu-keys-as-m-gqa4-d128-2splits-128keys", lowering=MOSAIC, config=KEYS_AS_M(tile_keys=128, num_splits=2)),
    Case("mgpu-keys-as-m-mqa-d128-bs32-window-alibi-softcap-f16", dtype="float16", num_q_heads=4, num_kv_heads=1,
         block_size=32, window=(40, 0), softcap=10.0, alibi=True, seqlens=(0, 120, 55, 1), max_blocks=4,
         lowering=MOSAIC, config=KEYS_AS_M(tile_keys=128, num_splits=2)),
    Case("mgpu-keys-as-m-gqa32-d64-sq2-noncausal-64rows-3splits", num_q_heads=64, num_kv_heads=2, head_size=64,
         num_q_tokens=2, causal=False, seqlens=(2, 90, 0, 127), lowering=MOSAIC,
         config=KEYS_AS_M(num_splits=3, num_stages=3)),
    Case("mgpu-keys-as-m-mha-d256-bs64-window", num_q_heads=2, num_kv_heads=2, head_size=256, block_size=64,
         window=(70, 0), seqlens=(200, 64, 1), max_blocks=4, num_blocks=16, lowering=MOSAIC,
         config=KEYS_AS_M(num_splits=1)),
    Case("mgpu-keys-as-m-gqa16-d64-sq3-noncausal-48rows-alibi", num_q_heads=16, num_kv_heads=1, head_size=64,
         num_q_tokens=3, causal=False, alibi=True, seqlens=(3, 70, 130), max_blocks=9, num_blocks=40,
         lowering=MOSAIC, config=KEYS_AS_M()),
    Case("mgpu-keys-as-m-gqa8-d128-fp8e4m3-window-alibi-2splits", num_q_heads=8, num_kv_heads=1,
         cache_dtype="float8_e4m3fn", window=(70, 0), alibi=True, seqlens=(128, 90, 0, 17), lowering=MOSAIC,
         config=KEYS_AS_M(num_splits=2)),
    Case("mgpu-keys-as-m-gqa4-d64-bs32-fp8e5m2-softcap-f16", dtype="float16", head_size=64, block_size=32,
         softcap=10.0, cache_dtype="float8_e5m2", seqlens=(0, 120, 55, 1), max_blocks=4, lowering=MOSAIC,
         config=KEYS_AS_M(tile_keys=128)),
    # Beside a producer warpgroup: one sequence a program, or several (their tiles one
    # stream through the ring, queries in two alternating tiles; the last program's last
    # items past the batch).
    Case("mgpu-keys-as-m-producer-gqa4-d128-window-2splits", window=(50, 0), seqlens=(4, 200, 0, 127),
         max_blocks=13, num_blocks=64, lowering=MOSAIC,
         config=KEYS_AS_M(num_splits=2, num_stages=3, compute_warpgroups=1)),
    Case("mgpu-keys-as-m-producer-bs48-runs-2splits", block_size=48, seqlens=(0, 1, 47, 100, 191), max_blocks=5,
         num_blocks=40, lowering=MOSAIC, config=KEYS_AS_M(num_splits=2, num_stages=4, compute_warpgroups=1)),
    Case("mgpu-keys-as-m-producer-d64-bs256-slices-window", head_size=64, block_size=256, seqlens=(300, 1, 0, 257),
         max_blocks=2, num_blocks=12, window=(100, 0), lowering=MOSAIC,
         config=KEYS_AS_M(tile_keys=128, num_stages=2, compute_warpgroups=1)),
    Case("mgpu-keys-as-m-producer-items3-gqa8-d64-fp8e4m3-alibi", num_q_heads=8, num_kv_heads=1, head_size=64,
         cache_dtype="float8_e4m3fn", alibi=True, seqlens=(128, 90, 0, 17, 1, 64, 250), max_blocks=16,
         num_blocks=120, lowering=MOSAIC,
         config=KEYS_AS_M(num_splits=1, num_stages=4, compute_warpgroups=1, items_per_program=3)),
]


@pytest.mark.parametrize("case", covering_cases(MOSAIC_KEYS_AS_M_GRID))
def test_mosaic_keys_as_m_matches_reference_in_interpret_mode(case: Case) -> None:
    """The keys-as-M form in Mosaic GPU interpret mode (CPU) against the reference."""
    inputs = make_inputs(case)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


@pytest.mark.full  # (the form is off by default, measured slower; its grid runs by default, all of it on the GPU)
def test_mosaic_keys_as_m_every_tile_boundary() -> None:
    """Lengths 0..69 with 64-key stages and an 18-key window, one query token: the window
    start and the sequence end fall on every offset of a stage and of a page."""
    case = Case("mgpu-keys-as-m-boundaries", num_q_heads=2, num_kv_heads=1, head_size=64, seqlens=tuple(range(70)),
                max_blocks=5, num_blocks=352, window=(18, 0), lowering=MOSAIC, config=KEYS_AS_M(num_splits=1))
    inputs = make_inputs(case, seed=4)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


def test_mosaic_keys_as_m_refuses_what_it_lacks() -> None:
    """What the keys-as-M form does not take is a ValueError naming ``config.keys_as_m``
    and the reason, never a wrong answer; its plan reads Sq * G rows rounded up to 16."""
    plan = functools.partial(plans.plan_mosaic_decode_tiling, max_blocks=64, q_dtype=jnp.bfloat16)
    # (Sq, Hq, Hk) -> rows Sq * G: 4, 12, 8, 20, 64
    for (num_q_tokens, num_q_heads, num_kv_heads), expected in (((1, 32, 8), 16), ((3, 32, 8), 16),
                                                                ((1, 64, 8), 16), ((5, 32, 8), 32),
                                                                ((2, 64, 2), 64)):
        t = plan((8, num_q_tokens, num_q_heads, 128), (512, 16, num_kv_heads, 128), config=KEYS_AS_M())
        assert (t.keys_as_m, t.query_rows, t.row_blocks) == (True, expected, 1), (num_q_tokens, num_q_heads)
    for q_shape, cache_shape, config, words in (
            ((8, 1, 32, 80), (512, 16, 8, 80), KEYS_AS_M(), "multiple of 64"),
            ((8, 3, 64, 128), (512, 16, 2, 128), KEYS_AS_M(), "at most 64"),
            # (compiled wrong on an H100: two compute warpgroups racing on Mosaic GPU's
            # one cross-warp reduction scratch)
            ((8, 1, 32, 128), (512, 16, 8, 128), KEYS_AS_M(compute_warpgroups=2, num_stages=4),
             "at most one compute warpgroup, got 2.*race")):
        with pytest.raises(ValueError, match=f"config.keys_as_m: .*{words}"):
            plan(q_shape, cache_shape, config=config)
    q = jnp.zeros((2, 2, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    rest = (jnp.array([3, 4], jnp.int32), jnp.zeros((2, 4), jnp.int32), None, 1.0, 1.0)
    with pytest.raises(ValueError, match="config.keys_as_m: several query tokens under a causal"):
        decode.paged_decode_attention(q, cache, cache, *rest, spec=AttentionSpec.create(128, causal=True),
                                      lowering=MOSAIC, config=KEYS_AS_M(), interpret=True)


@pytest.mark.parametrize("case", covering_cases(MOSAIC_GRID))
def test_mosaic_matches_reference_in_interpret_mode(case: Case) -> None:
    """The Mosaic GPU kernel in Mosaic GPU interpret mode (CPU): NaN pages and garbage
    block-table entries past each sequence, splits, windows, ALiBi, soft-cap, row blocks."""
    inputs = make_inputs(case)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


_FRESH_PROCESS_MOSAIC_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import jax_paged_attn

rng = np.random.default_rng(0)
bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
q, k_cache, v_cache = bf16(2, 1, 4, 64), bf16(8, 16, 1, 64), bf16(8, 16, 1, 64)
lens, table = jnp.asarray([20, 5], jnp.int32), jnp.asarray([[3, 1], [6, 0]], jnp.int32)
got, want = [jax_paged_attn.flash_attn_with_kvcache(q, k_cache, v_cache, lens, table, causal=True,
                                                    implementation=name, interpret=name != "xla")
             for name in ("mosaic_gpu", "xla")]
np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2)
print("jax", jax.__version__, "ok")
"""


def test_mosaic_interpret_needs_no_test_code_in_a_fresh_process() -> None:
    """A user's first call, in a process where nothing of the tests ran: Mosaic GPU decode
    in interpret mode runs (and matches the reference) on this jax. (Mosaic GPU prefill
    needs nothing of the interpreter that jax 0.10 lacks: its interpret form has no
    ``layout_cast`` and no transposed operand.)"""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_MOSAIC_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["jax", jax.__version__, "ok"]


def test_mosaic_every_tile_boundary() -> None:
    """Lengths 0..69 with 64-key stages, 3 query tokens and a causal 18-key window: the
    window start, the causal diagonal and the sequence end fall on every offset of a
    stage and of a page. One split a sequence (a program a sequence, half the interpreter's
    work of two): splits, an empty one and ragged last tiles in a split are checked by
    test_mosaic_matches_reference_in_interpret_mode's ``3splits`` and ``2splits`` cases."""
    case = Case("mgpu-boundaries", num_q_heads=2, num_kv_heads=1, head_size=64, num_q_tokens=3,
                seqlens=tuple(range(70)), max_blocks=5, num_blocks=352, window=(18, 0), lowering=MOSAIC,
                config=MosaicDecodeConfig(num_splits=1, num_stages=2))
    inputs = make_inputs(case, seed=4)
    assert_matches_reference(case, inputs, run_kernel(case, inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_GRID + [
    Case("mgpu-gpu-h200-shape-splits", num_q_heads=32, num_kv_heads=8, seqlens=(4096, 1, 0, 3000, 17),
         max_blocks=256, num_blocks=1300, lowering=MOSAIC, config=MosaicDecodeConfig(num_splits=7)),
    Case("mgpu-gpu-h200-shape-one-split", num_q_heads=64, num_kv_heads=8, seqlens=(2048, 77, 1),
         max_blocks=128, num_blocks=400, lowering=MOSAIC, config=MosaicDecodeConfig(num_splits=1, num_stages=6)),
    Case("mgpu-gpu-h200-shape-specialized-2wg", num_q_heads=32, num_kv_heads=8, seqlens=(4096, 1, 0, 3000, 17),
         max_blocks=256, num_blocks=1300, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=3, num_stages=4, compute_warpgroups=2)),
    Case("mgpu-gpu-h200-shape-items-auto-1wg", num_q_heads=32, num_kv_heads=8,
         seqlens=tuple((i * 97) % 1000 for i in range(40)), max_blocks=64, num_blocks=2600, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_stages=4, target_programs=512, compute_warpgroups=1, items_per_program=0)),
    Case("mgpu-gpu-h200-shape-items-2wg-splits", num_q_heads=32, num_kv_heads=8,
         seqlens=tuple((i * 397) % 3000 for i in range(12)), max_blocks=192, num_blocks=2400, lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=3, num_stages=4, compute_warpgroups=2, items_per_program=5)),
    Case("mgpu-gpu-h200-shape-specialized-1wg-fp8", num_q_heads=64, num_kv_heads=8, seqlens=(2048, 77, 1),
         max_blocks=128, num_blocks=400, cache_dtype="float8_e4m3fn", lowering=MOSAIC,
         config=MosaicDecodeConfig(num_splits=1, num_stages=4, compute_warpgroups=1)),
    *MOSAIC_KEYS_AS_M_GRID,
    Case("mgpu-gpu-d64-bs256-slices-window", head_size=64, block_size=256, seqlens=(300, 1, 0, 257),
         max_blocks=2, num_blocks=12, window=(100, 0), lowering=MOSAIC,
         config=MosaicDecodeConfig(tile_keys=128, num_stages=2)),
    Case("mgpu-gpu-keys-as-m-bs48-runs-2splits", block_size=48, seqlens=(0, 1, 47, 100, 191), max_blocks=5,
         num_blocks=40, lowering=MOSAIC, config=KEYS_AS_M(num_splits=2, num_stages=3)),
    Case("mgpu-gpu-keys-as-m-d64-bs256-slices-window", head_size=64, block_size=256, seqlens=(300, 1, 0, 257),
         max_blocks=2, num_blocks=12, window=(100, 0), lowering=MOSAIC, config=KEYS_AS_M(tile_keys=128, num_stages=2)),
    Case("mgpu-gpu-h200-shape-keys-as-m-splits", num_q_heads=32, num_kv_heads=8, seqlens=(4096, 1, 0, 3000, 17),
         max_blocks=256, num_blocks=1300, lowering=MOSAIC, config=KEYS_AS_M(num_splits=5, num_stages=4)),
    Case("mgpu-gpu-h200-shape-keys-as-m-d64-gqa8", num_q_heads=32, num_kv_heads=4, head_size=64,
         seqlens=tuple((i * 397) % 3000 for i in range(12)), max_blocks=192, num_blocks=2400, lowering=MOSAIC,
         config=KEYS_AS_M(tile_keys=128, num_splits=1, num_stages=3)),
    Case("mgpu-gpu-h200-shape-keys-as-m-items-auto-1wg", num_q_heads=32, num_kv_heads=8,
         seqlens=tuple((i * 97) % 1000 for i in range(40)), max_blocks=64, num_blocks=2600, lowering=MOSAIC,
         config=KEYS_AS_M(num_stages=4, target_programs=512, compute_warpgroups=1, items_per_program=0)),
], ids=str)
def test_mosaic_compiled_on_gpu_matches_reference(case: Case) -> None:
    """The Mosaic GPU scenarios compiled for a Hopper GPU (run with ``pytest -m gpu``)."""
    inputs = make_inputs(case)
    assert_matches_reference(case, inputs, run_kernel(case, inputs, interpret=False))


@pytest.mark.gpu
def test_mosaic_profile_records_every_item_of_a_program(tmp_path) -> None:
    """With ``profile_dir`` the kernel writes the Mosaic GPU profiler's trace of every item
    a program attends (benchmarks/decode_parts.py --timeline reads it): each compute
    warpgroup's ``scores`` region once a tile of each of its items, not the first item's
    alone, and the same output as without the profiler."""
    from jax_paged_attn.kv_view import as_plane

    items, tiles = 4, 4  # 8 sequences of 4 64-key tiles, 4 a program
    case = Case("profile-items", num_q_heads=8, num_kv_heads=2, head_size=64, seqlens=(64 * tiles,) * 8,
                max_blocks=4 * tiles, num_blocks=128, lowering=MOSAIC,
                config=MosaicDecodeConfig(tile_keys=64, num_splits=1, num_stages=4, compute_warpgroups=1,
                                          items_per_program=items))
    inputs = make_inputs(case)
    q, k_cache, v_cache, *rest = (inputs[n] for n in INPUT_NAMES)

    def call(profile_dir):
        return decode.run_mosaic_decode(q, as_plane(k_cache), as_plane(v_cache), *rest, spec=spec_of(case),
                                        config=case.config, profile_dir=profile_dir)

    events = profiled_trace_events(call, tmp_path)
    scores = collections.Counter(event["tid"] for event in events
                                 if event["name"] == "scores" and event["ph"] == "B")
    programs = case.num_kv_heads * len(case.seqlens) // items
    assert len(scores) == programs  # one compute warpgroup a program
    assert set(scores.values()) == {items * tiles}


def test_mosaic_unsupported_reason() -> None:
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    lens, table = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4), jnp.int32)
    rest = (lens, table, None, jnp.float32(1), jnp.float32(1))
    causal = AttentionSpec.create(128, causal=True)
    reason = functools.partial(decode.unsupported_reason, spec=causal, lowering=MOSAIC)
    assert reason(q, cache, cache, *rest) is None
    assert reason(q.repeat(3, axis=1), cache, cache, *rest) is None  # Sq 3, causal: quarantined in-kernel
    fp8 = cache.astype(jnp.float8_e4m3fn)
    assert reason(q, fp8, fp8, *rest) is None  # upcast in the kernel
    assert "float16 / bfloat16" in reason(q.astype(jnp.float32), cache.astype(jnp.float32),
                                          cache.astype(jnp.float32), *rest)
    for head_size in (32, 80, 96, 160):  # any supported head size (swizzled to fit its rows)
        assert reason(q[..., :head_size], cache[..., :head_size], cache[..., :head_size], *rest) is None
    for block_size in (48, 80, 256):  # any block size: stages of runs within pages, or page slices
        odd_block = jnp.zeros((4, block_size, 2, 128), jnp.bfloat16)
        assert reason(q, odd_block, odd_block, *rest) is None
    big = jnp.zeros((4, 128, 2, 256), jnp.bfloat16)  # two 128-key stages at D 256: 256 KiB
    assert "shared memory" in reason(q[..., :1].repeat(256, axis=-1), big, big, *rest)
    f32 = (q.astype(jnp.float32), cache.astype(jnp.float32), cache.astype(jnp.float32))
    with pytest.raises(NotImplementedError, match="float16 / bfloat16"):
        decode.paged_decode_attention(*f32, *rest, spec=causal, lowering=MOSAIC)
    with pytest.raises(TypeError, match="MosaicDecodeConfig"):
        decode.paged_decode_attention(q, cache, cache, *rest, spec=causal, lowering=MOSAIC, config=DecodeConfig())


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_tokens,num_q_heads,row_blocks,query_rows", [(3, 64, 2, 64), (3, 8, 1, 16)],
                         ids=["96rows", "12rows"])
def test_mosaic_wrapper_lays_out_query_rows(num_splits: int, num_q_tokens: int, num_q_heads: int, row_blocks: int,
                                            query_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's row layout, with a stand-in kernel that echoes its query rows: 96
    rows per KV head (Sq 3 x G 32) take two 64-row programs, 12 (Sq 3 x G 4) one program
    reading 16 rows (not 64), and the output unpacks back to q exactly (with several
    splits, equal partials with equal log-sum-exps merge to q)."""
    seen = {}

    def echo(q_rows, k_cache, v_cache, lens, table, slopes, scales, *, spec, tiling, num_q_tokens, group_size,
             interpret, profile_dir):
        seen["shape"], seen["tiling"] = q_rows.shape, tiling
        if tiling.num_splits == 1:
            return q_rows
        rows = jnp.broadcast_to(q_rows.astype(jnp.float32), (tiling.num_splits, *q_rows.shape))
        return rows, jnp.zeros(rows.shape[:-1], jnp.float32)

    monkeypatch.setattr(mosaic_decode, "paged_decode_call", echo)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, num_q_tokens, num_q_heads, 64)), jnp.bfloat16)
    cache = jnp.zeros((8, 16, 2, 64), jnp.bfloat16)
    lens, table = jnp.array([5, 9], jnp.int32), jnp.zeros((2, 4), jnp.int32)
    out = decode.paged_decode_attention(q, cache, cache, lens, table, None, 1.0, 1.0,
                                        spec=AttentionSpec.create(64), lowering=MOSAIC,
                                        config=MosaicDecodeConfig(num_splits=num_splits))
    assert seen["shape"] == (2, 2 * row_blocks, query_rows, 64)  # Hk 2 x row blocks
    assert (seen["tiling"].row_blocks, seen["tiling"].query_rows) == (row_blocks, query_rows)
    assert seen["tiling"].num_splits == num_splits
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(q, np.float32))


def test_mosaic_tiling_plan() -> None:
    """Stages shrink to the shared-memory budget (never below 2), a stage holds whole
    pages (a 128-key page makes a 128-key stage), bad configs name the field."""
    plan = functools.partial(plans.plan_mosaic_decode_tiling, max_blocks=64, q_dtype=jnp.bfloat16)
    t = plan((8, 1, 32, 128), (512, 16, 8, 128), config=MosaicDecodeConfig(num_stages=4, num_splits=1))
    assert (t.tile_keys, t.pages_per_tile, t.num_stages, t.row_blocks, t.query_rows) == (64, 4, 4, 1, 8)
    assert plan((8, 3, 32, 128), (512, 16, 8, 128), config=MosaicDecodeConfig()).query_rows == 16  # 12 rows
    t = plan((8, 3, 64, 128), (512, 16, 2, 128), config=MosaicDecodeConfig())  # 96 rows
    assert (t.row_blocks, t.query_rows) == (2, plans.MOSAIC_DECODE_ROWS)
    t = plan((8, 1, 16, 256), (512, 16, 2, 256), config=MosaicDecodeConfig(tile_keys=128, num_stages=8))
    assert 2 <= t.num_stages < 8
    assert plans.estimate_mosaic_decode_shared_memory(
        t.tile_keys, 256, 2, t.num_stages, 2 if t.num_splits == 1 else 4) <= tuning.MOSAIC_SHARED_MEMORY_LIMIT
    t = plan((8, 1, 16, 64), (512, 128, 2, 64), config=MosaicDecodeConfig())
    assert (t.tile_keys, t.pages_per_tile, t.copy_rows) == (128, 1, 128)
    # Block sizes that do not divide 128: runs of gcd(stage, block) rows, each within a page,
    # in every form.
    for block_size, tile_keys, expected in ((48, 64, (64, 4, 16)), (96, 128, (128, 4, 32)),
                                            (256, 128, (128, 1, 128)), (256, 64, (64, 1, 64)),
                                            (80, 128, (128, 8, 16))):
        for workers, keys_as_m in ((1, False), (0, False), (0, True)):
            t = plan((8, 1, 16, 64), (512, block_size, 2, 64),
                     config=MosaicDecodeConfig(tile_keys=tile_keys, compute_warpgroups=workers, keys_as_m=keys_as_m))
            assert (t.tile_keys, t.pages_per_tile, t.copy_rows) == expected, (block_size, workers, keys_as_m)
    # D 256 at 256-key pages: 128-key slices do not fit beside two stages; 64-key ones do.
    t = plan((8, 1, 16, 256), (512, 256, 2, 256),
             config=MosaicDecodeConfig(tile_keys=128, num_stages=2, compute_warpgroups=1))
    assert (t.tile_keys, t.copy_rows) == (64, 64)
    assert [plans.mosaic_output_chunk(d) for d in (64, 128, 192, 256)] == [64, 128, 64, 128]
    # Other head sizes: chunks of whole swizzle tiles of the 16-bit value rows dividing the head.
    assert [plans.mosaic_output_chunk(d) for d in (32, 80, 96, 144, 160, 240)] == [32, 80, 96, 48, 32, 80]
    assert [plans.mosaic_swizzle_bytes(d, 2) for d in (32, 80, 96, 128)] == [64, 32, 64, 128]
    assert [plans.mosaic_swizzle_bytes(d, 1) for d in (80, 96, 128)] == [0, 32, 128]  # fp8 rows
    assert [plans.mosaic_store_chunk(128, size) for size in (2, 4)] == [128, 64]
    assert [plans.mosaic_store_chunk(d, 4) for d in (80, 96, 112)] == [40, 48, 56]  # divisors, 8-column tiles
    # D 128 bf16, two 64-key stages, f32 partials: two programs fit an H200 SM (228 KiB).
    assert 2 * (plans.estimate_mosaic_decode_shared_memory(64, 128, 2, 2, 4) + 1024) <= 228 * 1024
    with pytest.raises(ValueError, match="config.tile_keys"):
        plan((8, 1, 16, 64), (512, 16, 2, 64), config=MosaicDecodeConfig(tile_keys=32))
    with pytest.raises(ValueError, match="config.num_stages"):
        plan((8, 1, 16, 64), (512, 16, 2, 64), config=MosaicDecodeConfig(num_stages=1))


def test_mosaic_specialized_tiling_plan() -> None:
    """Warp specialization: the stages round up to a multiple of the compute warpgroups
    (each slot then feeds one warpgroup) and shrink by that step to fit; where two
    compute warpgroups' buffers do not fit beside the smallest ring (D 256, 64-key
    pages), one does; a bad count names the field."""
    plan = functools.partial(plans.plan_mosaic_decode_tiling, max_blocks=64, q_dtype=jnp.bfloat16)
    q, cache = (8, 1, 32, 128), (512, 16, 8, 128)
    t = plan(q, cache, config=MosaicDecodeConfig(num_stages=3, num_splits=1, compute_warpgroups=2))
    assert (t.num_stages, t.compute_warpgroups, t.warp_specialized) == (4, 2, True)
    t = plan(q, cache, config=MosaicDecodeConfig(num_stages=9, num_splits=1, compute_warpgroups=2))
    assert t.num_stages % 2 == 0 and 2 <= t.num_stages < 9
    smem = plans.estimate_mosaic_decode_shared_memory(64, 128, 2, t.num_stages, 2, None, 2)
    assert smem <= tuning.MOSAIC_SHARED_MEMORY_LIMIT
    assert plans.estimate_mosaic_decode_shared_memory(64, 128, 2, t.num_stages + 2, 2, None, 2) > \
        tuning.MOSAIC_SHARED_MEMORY_LIMIT
    t = plan(q, cache, config=MosaicDecodeConfig(num_stages=3, num_splits=1, compute_warpgroups=1))
    assert (t.num_stages, t.compute_warpgroups) == (3, 1)
    t = plan((8, 1, 16, 256), (512, 64, 2, 256), config=MosaicDecodeConfig(compute_warpgroups=2, num_splits=1))
    assert (t.tile_keys, t.num_stages, t.compute_warpgroups) == (64, 2, 1)
    assert plan(q, cache, config=MosaicDecodeConfig()).warp_specialized is False
    with pytest.raises(ValueError, match="config.compute_warpgroups"):
        plan(q, cache, config=MosaicDecodeConfig(compute_warpgroups=3))
    t = plan(q, cache, config=MosaicDecodeConfig(num_splits=1, compute_warpgroups=2, items_per_program=4))
    assert (t.items_per_program, t.compute_warpgroups) == (4, 2)
    assert plan((3, 1, 32, 128), cache, config=MosaicDecodeConfig(compute_warpgroups=1,
                                                                  items_per_program=8)).items_per_program == 3
    with pytest.raises(ValueError, match="config.items_per_program"):
        plan(q, cache, config=MosaicDecodeConfig(items_per_program=2))  # needs warp specialization
    with pytest.raises(ValueError, match="config.items_per_program"):
        plan(q, cache, config=MosaicDecodeConfig(compute_warpgroups=1, items_per_program=-1))
    # Auto: one wave of programs on the GPU's SMs (B x Hk x splits work items over 132).
    auto = MosaicDecodeConfig(compute_warpgroups=1, num_stages=4, target_programs=512, items_per_program=0)
    cache_1k = (4096, 16, 8, 128)
    assert [plan((b, 1, 32, 128), cache_1k, config=auto, multiprocessors=132).items_per_program
            for b in (256, 64, 8, 1)] == [16, 4, 2, 1]  # 2,048, 512, 64 x 4 splits, 8 x 4 splits items
    assert plan((256, 1, 32, 128), cache_1k, config=auto, multiprocessors=66).items_per_program == 32
    assert plan((256, 1, 32, 128), cache_1k, config=MosaicDecodeConfig(items_per_program=0)).items_per_program == 1


@pytest.mark.parametrize("interpret", [pytest.param(True),
                                       pytest.param(False, marks=pytest.mark.gpu, id="gpu")])
@pytest.mark.parametrize("cache_dtype,num_splits", [(None, 3), ("float8_e5m2", 1)], ids=["bf16-3splits", "fp8-1split"])
def test_mosaic_nonfinite_values_reach_only_the_rows_that_see_them(cache_dtype, num_splits: int,
                                                                   interpret: bool) -> None:
    """The Triton test's scenario through the Mosaic GPU kernel: 3 query tokens, causal
    window of 20, NaN / inf in K and V at keys that some rows see and others do not, a
    stale NaN page left of every window; only the rows that see them are non-finite."""
    _assert_poisoned_rows_match(cache_dtype=cache_dtype, interpret=interpret, lowering=MOSAIC,
                                config=MosaicDecodeConfig(num_splits=num_splits, num_stages=2))



def test_mosaic_interpret_compiles_a_thread_body_once_for_every_program() -> None:
    """The Mosaic GPU interpreter runs each warpgroup of a grid program as a thread with
    its own compiled body; jax 0.10's recompiled that body for every thread of every
    program (48 times here; `kernels.common._run_thread_jaxpr` gives it jax 0.11's
    compile-once). A warp-specialized kernel over 4 sequences x 2 splits, three
    warpgroups a program: the thread body compiles once. Counted with JAX's compile
    events, by the jitted function's name (jax 0.11's interpreter names it ``_run``)."""
    case = next(c for c in MOSAIC_GRID if c.name == "mgpu-specialized-2wg-gqa4-d64-bs32-softcap-f16-2splits")
    inputs = make_inputs(case)
    thread_bodies = []
    active = [True]

    def on_compile(event: str, duration_s: float, **kwargs) -> None:
        if active[0] and event == CompileCounter.EVENT and kwargs.get("fun_name") in (
                "jit(_run)", "jit(_eval_thread_jaxpr)"):
            thread_bodies.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        out = jax.block_until_ready(run_kernel(case, inputs))
    finally:
        active[0] = False
    assert len(thread_bodies) <= 1, thread_bodies  # 0 where an earlier test compiled the same body
    assert_matches_reference(case, inputs, out)
