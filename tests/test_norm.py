"""The fused residual add + RMSNorm (`jax_paged_attn.norm.add_rms_norm`) against NumPy,
over its implementations: the XLA path and the Pallas Triton kernel (interpret mode on
CPU, compiled in the ``gpu``-marked test).

The NumPy semantics are the op's contract: the partial products summed in float32 with
the residual and rounded once to the outputs' dtype (``hidden``); ``hidden`` read back
in float32, scaled by ``1 / sqrt(mean(hidden^2) + eps)``, rounded, multiplied by the
weight in float32 and rounded again (``normed``), as the Llama model's unfused
``RMSNorm`` computes it. Both within one unit in the last place (float32 sums in
another order); a single product added to a residual bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_cuda
from jax_paged_attn import norm, plans, tuning
from jax_paged_attn.models.llama import RMSNorm

IMPLEMENTATIONS = ["xla", "triton"]
TRITON_CALL = "__gpu$xla.gpu.triton"
EPS = 1e-5


def numpy_add_rms_norm(update, residual, weight, dtype):
    total = np.asarray(update, np.float32).sum(axis=0)
    if residual is not None:
        total = total + np.asarray(residual, np.float32)
    hidden = total.astype(dtype)
    h32 = hidden.astype(np.float32)
    normed = (h32 / np.sqrt(np.mean(h32 * h32, axis=-1, keepdims=True) + np.float32(EPS))).astype(dtype)
    return hidden, (np.asarray(weight, np.float32) * normed.astype(np.float32)).astype(dtype)


def run(implementation, *args, **kwargs):
    interpret = dict(interpret=True) if implementation == "triton" else {}
    return norm.add_rms_norm(*args, eps=EPS, implementation=implementation, **interpret, **kwargs)


def ulp_diff(a, b, dtype):
    """Largest difference of two arrays in units in the last place of ``dtype`` at b's magnitude."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    spacing = np.spacing(np.abs(b).astype(dtype)).astype(np.float32)
    return float(np.max(np.abs(a - b) / np.maximum(spacing, np.finfo(np.float32).tiny)))


CASES = {  # (partials S or None for a plain update, leading shape, N, residual?, dtype)
    "split_k_4_decode_rows": (4, (32,), 2048, True, jnp.bfloat16),
    "one_row": (2, (1,), 512, True, jnp.bfloat16),
    "padded_row_length": (1, (5,), 96, True, jnp.float16),  # N not a power of 2: masked columns
    "several_rows_per_program": (8, (3, 7), 128, True, jnp.float32),  # 16 rows per program, 21 rows
    "no_residual": (2, (6,), 256, False, jnp.bfloat16),
    "plain_update": (None, (9,), 320, True, jnp.bfloat16),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_add_rms_norm_matches_numpy(implementation, case):
    splits, lead, cols, with_residual, dtype = case
    rng = np.random.default_rng(cols)
    if splits is None:
        update = jnp.asarray(rng.standard_normal((*lead, cols)) * 3, dtype)
        parts = np.asarray(update)[None]
    else:
        update = jnp.asarray(rng.standard_normal((splits, *lead, cols)) * 3, jnp.float32)
        parts = np.asarray(update)
    residual = jnp.asarray(rng.standard_normal((*lead, cols)) * 5, dtype) if with_residual else None
    weight = jnp.asarray(rng.standard_normal(cols), jnp.float32)
    hidden, normed = run(implementation, update, residual, weight, partials=splits is not None, dtype=dtype)
    want_hidden, want_normed = numpy_add_rms_norm(parts, None if residual is None else np.asarray(residual),
                                                  np.asarray(weight), jnp.dtype(dtype))
    assert hidden.shape == normed.shape == (*lead, cols) and hidden.dtype == normed.dtype == dtype
    if dtype == jnp.float32:  # sums of 9 terms in another order: float32 rounding of the terms' size
        magnitude = np.abs(parts).sum(axis=0) + (0 if residual is None else np.abs(np.asarray(residual)))
        np.testing.assert_allclose(np.asarray(hidden), want_hidden, rtol=0, atol=4e-7 * magnitude.max())
        np.testing.assert_allclose(np.asarray(normed), want_normed, rtol=1e-5, atol=1e-6)
    else:  # the float32 sums' last bits may round a 16-bit result differently: one unit
        assert ulp_diff(hidden, want_hidden, jnp.dtype(dtype)) <= 1.0
        assert ulp_diff(normed, want_normed, jnp.dtype(dtype)) <= 1.0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_equals_the_models_residual_add_then_rms_norm(implementation):
    """One bf16 product (no partials) added to a bf16 residual: the same bits as the unfused
    layer's ``x + update`` then `RMSNorm` (bf16 weight)."""
    rng = np.random.default_rng(3)
    x, update = (jnp.asarray(rng.standard_normal((12, 256)), jnp.bfloat16) for _ in range(2))
    layer_norm = RMSNorm(256, eps=EPS, param_dtype=jnp.bfloat16)
    layer_norm.weight[...] = jnp.asarray(rng.standard_normal(256), jnp.bfloat16)
    hidden, normed = run(implementation, update, x, layer_norm.weight[...])
    np.testing.assert_array_equal(np.asarray(hidden, np.float32), np.asarray(x + update, np.float32))
    assert ulp_diff(normed, layer_norm(x + update), jnp.bfloat16) <= 1.0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gemma_norm_scales_in_float32_before_its_one_rounding(implementation):
    """Gemma's norm (``unit_offset``: scale ``1 + weight``) through the fused kernel: the
    normalized rows scaled in float32 and rounded once, as the unfused `RMSNorm` and
    Hugging Face's ``Gemma2RMSNorm``; Llama's order (rounded before the scale) gives other
    bf16 results on these rows."""
    rng = np.random.default_rng(4)
    x, update = (jnp.asarray(rng.standard_normal((12, 256)), jnp.bfloat16) for _ in range(2))
    gemma_norm = RMSNorm(256, eps=EPS, param_dtype=jnp.bfloat16, unit_offset=True)
    gemma_norm.weight[...] = jnp.asarray(rng.standard_normal(256) * 0.5, jnp.bfloat16)
    partials = update[None].astype(jnp.float32)
    hidden, normed = gemma_norm.add_and_norm(partials, x, implementation=implementation,
                                             interpret=implementation == "triton")
    want = np.asarray(gemma_norm(hidden), np.float32)
    llama_order = run(implementation, partials, x, gemma_norm.scale, partials=True)[1]
    assert ulp_diff(normed, want, jnp.bfloat16) <= 1.0
    differing = [int(np.count_nonzero(np.asarray(out, np.float32) != want)) for out in (normed, llama_order)]
    assert differing[0] <= want.size // 100 < differing[1], differing  # the double rounding: many a unit


def check_sandwich_norm(implementation, interpret, rows, cols, splits):
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((rows, cols)), jnp.bfloat16)
    partials = jnp.asarray(rng.standard_normal((splits, rows, cols)), jnp.float32)
    post_norm, next_norm = (RMSNorm(cols, eps=EPS, param_dtype=jnp.bfloat16, unit_offset=True) for _ in range(2))
    for n in (post_norm, next_norm):
        n.weight[...] = jnp.asarray(rng.standard_normal(cols) * 0.5, jnp.bfloat16)
    hidden, normed = next_norm.add_and_norm(partials, x, update_norm=post_norm, implementation=implementation,
                                            interpret=interpret)
    want_hidden = x + post_norm(partials.sum(0).astype(jnp.bfloat16))
    assert ulp_diff(hidden, want_hidden, jnp.bfloat16) <= 1.0
    assert ulp_diff(normed, next_norm(want_hidden), jnp.bfloat16) <= 2.0
    return next_norm


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sandwich_norm_of_the_update_runs_in_the_add_kernel(implementation):
    """Gemma 2's sandwich norm through the fused kernel: ``residual + post_norm(update)``
    (the update's split-K partials summed, rounded, normed, rounded), then the next norm:
    as the unfused norms compute it, in one kernel; a norm of other eps or scaling is
    refused."""
    next_norm = check_sandwich_norm(implementation, implementation == "triton", rows=12, cols=256, splits=2)
    x, partials = jnp.zeros((12, 256), jnp.bfloat16), jnp.zeros((2, 12, 256), jnp.float32)
    other = RMSNorm(256, eps=EPS * 10, param_dtype=jnp.bfloat16, unit_offset=True)
    with pytest.raises(ValueError, match="update_norm must have this norm's unit_offset and eps"):
        next_norm.add_and_norm(partials, x, update_norm=other, implementation=implementation, interpret=False)
    with pytest.raises(ValueError, match=r"update_norm_weight must have shape \[N\] = \[256\], got \(128,\)"):
        norm.add_rms_norm(partials, x, next_norm.scale, eps=EPS, partials=True, update_norm_weight=jnp.ones(128))


@pytest.mark.gpu
def test_compiled_sandwich_norm_matches_unfused_on_the_gpu():
    """Gemma-2-9B's sandwich norm (3,584 columns, split-K partials of a decode batch) in
    the compiled kernel, against the unfused norms."""
    assert jax.default_backend() == "gpu", "the gpu suite needs a GPU"
    for rows in (1, 32):
        check_sandwich_norm("triton", False, rows=rows, cols=3584, splits=4)


def test_plan_takes_whole_rows_and_a_warp_per_1024_loads():
    per_program = tuning.ADD_RMS_NORM_ELEMENTS_PER_PROGRAM
    assert plans.plan_add_rms_norm(32, 2048) == plans.AddRmsNormTiling(
        rows_per_program=max(1, per_program // 2048), padded_cols=2048, num_warps=4)
    assert plans.plan_add_rms_norm(1, 2048, num_partials=4).num_warps == 8
    assert plans.plan_add_rms_norm(1, 2048, num_partials=8).num_warps == 16
    assert plans.plan_add_rms_norm(1, 2048, num_partials=64).num_warps == 16  # at most 16
    wide = plans.plan_add_rms_norm(4, 5000)  # padded to 8192: one row, 8 warps
    assert (wide.rows_per_program, wide.padded_cols, wide.num_warps) == (1, 8192, 8)
    assert plans.plan_add_rms_norm(3, 96).rows_per_program == 4  # at most the rows, rounded up


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(update=np.zeros((4, 8), np.int32)), TypeError, "update must be a float"),
    (dict(update=np.zeros((8,), np.float32), partials=True), ValueError, r"update must be \[S, \.\.\., N\]"),
    (dict(residual=np.zeros((3, 8), np.float32)), ValueError, "residual must have update's shape"),
    (dict(residual=np.zeros((4, 8), np.float16), dtype=jnp.float32), TypeError, "residual must be float32"),
    (dict(weight=np.ones(7, np.float32)), ValueError, r"weight must have shape \[N\] = \[8\]"),
    (dict(residual=None, partials=True, update=np.zeros((2, 4, 8), np.float32)), ValueError, "dtype is required"),
    (dict(implementation="mosaic_gpu"), ValueError, "implementation must be one of"),
])
def test_errors_name_the_argument(kwargs, error, message):
    args = dict(update=np.zeros((4, 8), np.float32), residual=np.zeros((4, 8), np.float32),
                weight=np.ones(8, np.float32), partials=False, implementation="xla")
    args.update(kwargs)
    args = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
    with pytest.raises(error, match=message):
        norm.add_rms_norm(args.pop("update"), args.pop("residual"), args.pop("weight"), eps=EPS, **args)


def test_auto_lowers_to_one_triton_call_for_cuda():
    update = jax.ShapeDtypeStruct((4, 32, 2048), jnp.float32)
    residual = jax.ShapeDtypeStruct((32, 2048), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((2048,), jnp.float32)
    text = lower_for_cuda(lambda u, r, w: norm.add_rms_norm(u, r, w, eps=EPS, partials=True), update, residual,
                          weight)
    assert text.count(TRITON_CALL) == 1 and '"add_rms_norm"' in text


@pytest.mark.gpu
def test_compiled_kernel_matches_numpy_on_the_gpu():
    assert jax.default_backend() == "gpu", "the gpu suite needs a GPU"
    rng = np.random.default_rng(7)
    for splits, rows, cols in [(4, 32, 2048), (1, 1, 2048), (2, 128, 5120)]:
        update = jnp.asarray(rng.standard_normal((splits, rows, cols)), jnp.float32)
        residual = jnp.asarray(rng.standard_normal((rows, cols)), jnp.bfloat16)
        weight = jnp.asarray(rng.standard_normal(cols), jnp.float32)
        hidden, normed = jax.jit(lambda u, r, w: norm.add_rms_norm(u, r, w, eps=EPS, partials=True,
                                                                   implementation="triton"))(update, residual, weight)
        want_hidden, want_normed = numpy_add_rms_norm(np.asarray(update), np.asarray(residual), np.asarray(weight),
                                                      jnp.dtype(jnp.bfloat16))
        assert ulp_diff(hidden, want_hidden, jnp.dtype(jnp.bfloat16)) <= 1.0
        assert ulp_diff(normed, want_normed, jnp.dtype(jnp.bfloat16)) <= 1.0
