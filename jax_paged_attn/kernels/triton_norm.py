"""Residual add + RMSNorm of a decoder layer: the Pallas kernel and its `pallas_call`
(Triton lowering).

A pre-norm block ends with ``hidden = residual + update`` and the next block starts
with ``RMSNorm(hidden)``; in a decode step both are a few rows, so XLA's two kernels
for them (and a third summing a split-K product's partials) cost launches, not bytes.
One program here reads whole rows of every partial product (float32 ``[S, M, N]``, or
one product in the model's dtype), adds the residual, writes the new residual in the
residual's dtype and the normalized rows ``weight * (h / sqrt(mean(h^2) + eps))``.

Numerics follow the model's unfused layers: the sum is rounded once to the residual's
dtype (that is the residual stream), the norm reads the rounded rows in float32,
rounds the normalized rows to the dtype, multiplies by the weight in float32 and
rounds again (`jax_paged_attn.norm.add_rms_norm_reference`). With an update norm (a
sandwich norm, Gemma 2's) the update's sum is rounded and normed the same way before
the residual add.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged_attn.kernels import common
from jax_paged_attn.plans import AddRmsNormTiling

Array = jax.Array


def _add_rms_norm_kernel(*refs, tiling: AddRmsNormTiling, num_rows: int, num_cols: int, has_residual: bool,
                         has_update_norm: bool, eps: float, round_before_scale: bool):
    update_ref, *rest = refs  # [S, M, N]: partial products (float32) or one product (S = 1)
    residual_ref = common.pop_optional(rest, has_residual)  # [M, N] in the output dtype
    update_weight_ref = common.pop_optional(rest, has_update_norm)  # [N] any float
    weight_ref, hidden_ref, normed_ref = rest  # [N] any float; outputs [M, N]
    block_rows, padded_cols = tiling.rows_per_program, tiling.padded_cols
    row = pl.program_id(0) * block_rows + lax.iota(jnp.int32, block_rows)
    col = lax.iota(jnp.int32, padded_cols)
    row_ok = row < num_rows if num_rows % block_rows else None
    col_ok = col < num_cols if padded_cols != num_cols else None
    mask = common.rows_and_cols(row_ok, col_ok, block_rows, padded_cols)

    def load(ref):
        return (plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)).astype(jnp.float32)

    def rms_normed(rows, w_ref):  # rows in the output dtype -> normed, scaled, in the output dtype
        r32 = rows.astype(jnp.float32)  # padded columns are 0: they add nothing to the sum
        inverse_rms = lax.rsqrt(jnp.sum(r32 * r32, axis=1) / num_cols + eps)
        normed = r32 * inverse_rms[:, None]
        if round_before_scale:  # Llama's order; Gemma's scales in float32 and rounds once
            normed = normed.astype(normed_ref.dtype).astype(jnp.float32)
        weight = (plgpu.load(w_ref.at[col]) if col_ok is None
                  else plgpu.load(w_ref.at[col], mask=col_ok, other=0)).astype(jnp.float32)
        return (normed * weight[None, :]).astype(normed_ref.dtype)

    total = load(update_ref.at[0, row[:, None], col[None, :]])
    for split in range(1, update_ref.shape[0]):
        total += load(update_ref.at[split, row[:, None], col[None, :]])
    if update_weight_ref is not None:
        total = rms_normed(total.astype(hidden_ref.dtype), update_weight_ref).astype(jnp.float32)
    if residual_ref is not None:
        total += load(residual_ref.at[row[:, None], col[None, :]])
    hidden = total.astype(hidden_ref.dtype)
    plgpu.store(hidden_ref.at[row[:, None], col[None, :]], hidden, mask=mask)
    plgpu.store(normed_ref.at[row[:, None], col[None, :]], rms_normed(hidden, weight_ref), mask=mask)


def add_rms_norm_call(update: Array, residual: Array | None, weight: Array, *, eps: float, dtype,
                      tiling: AddRmsNormTiling, round_before_scale: bool = True,
                      update_norm_weight: Array | None = None, interpret: bool = False) -> tuple[Array, Array]:
    """``update`` ``[S, M, N]`` (partials summed over ``S``), ``residual`` ``[M, N]`` of
    ``dtype`` or None, ``weight`` ``[N]`` -> (``hidden`` ``[M, N]``, ``normed`` ``[M, N]``),
    both ``dtype``; ``update_norm_weight`` ``[N]``: the update normed with it before the
    add. No argument checks here (see `jax_paged_attn.norm.add_rms_norm`);
    ``tiling`` comes from `plans.plan_add_rms_norm`."""
    _, num_rows, num_cols = update.shape
    inputs = [update]
    common.append_optional(inputs, residual)
    common.append_optional(inputs, update_norm_weight)
    inputs.append(weight)
    kernel = functools.partial(_add_rms_norm_kernel, tiling=tiling, num_rows=num_rows, num_cols=num_cols,
                               has_residual=residual is not None, has_update_norm=update_norm_weight is not None,
                               eps=float(eps),
                               round_before_scale=bool(round_before_scale))
    out = jax.ShapeDtypeStruct((num_rows, num_cols), dtype)
    hidden, normed = pl.pallas_call(
        kernel,
        out_shape=[out, out],
        grid=(pl.cdiv(num_rows, tiling.rows_per_program),),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*inputs)
    return hidden, normed
