"""The residual add + RMSNorm between a decoder layer's blocks, fused.

A pre-norm transformer block ends with ``hidden = residual + block(...)`` and the next
one starts with ``RMSNorm(hidden)``. `add_rms_norm` does both in one kernel
(`jax_paged_attn.kernels.triton_norm`), and also sums a split-K product's float32
partials (`jax_paged_attn.matmul.linear_partials`), so a decode step runs one small
kernel where XLA runs two or three. The XLA path (`add_rms_norm_reference`) is the
kernel's reference and the CPU's implementation.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_paged_attn import dispatch, plans

Array = jax.Array

NORM_IMPLEMENTATIONS = (None, dispatch.AUTO, dispatch.XLA, dispatch.TRITON)
"""`add_rms_norm`'s implementations (the kernel has a Triton lowering only)."""


def _rms_normed(rows: Array, weight: Array, *, eps: float, dtype: Any, round_before_scale: bool) -> Array:
    """RMSNorm of ``rows`` (already rounded to ``dtype``) as the models compute it."""
    r32 = rows.astype(jnp.float32)
    normed = r32 * jax.lax.rsqrt(jnp.mean(r32 * r32, axis=-1, keepdims=True) + eps)
    if round_before_scale:
        normed = normed.astype(dtype).astype(jnp.float32)
    return (weight.astype(jnp.float32) * normed).astype(dtype)


def add_rms_norm_reference(update: Array, residual: Array | None, weight: Array, *, eps: float,
                           dtype: Any, round_before_scale: bool = True,
                           update_norm_weight: Array | None = None) -> tuple[Array, Array]:
    """`add_rms_norm`'s arithmetic in XLA: ``update`` ``[S, M, N]`` summed over ``S`` in
    float32 (with ``update_norm_weight``: rounded to ``dtype`` and normed with it first),
    plus the residual, rounded once to ``dtype`` (the new residual stream); the norm as
    `jax_paged_attn.models.llama.RMSNorm` computes it from those rounded rows (normalized
    rows rounded to ``dtype`` before the scale, or with ``round_before_scale`` False
    scaled in float32 and rounded once, Gemma's order)."""
    how = dict(eps=eps, dtype=dtype, round_before_scale=round_before_scale)
    total = jnp.sum(update.astype(jnp.float32), axis=0)
    if update_norm_weight is not None:
        total = _rms_normed(total.astype(dtype), update_norm_weight, **how).astype(jnp.float32)
    if residual is not None:
        total = total + residual.astype(jnp.float32)
    hidden = total.astype(dtype)
    return hidden, _rms_normed(hidden, weight, **how)


def add_rms_norm(update: Array, residual: Array | None, weight: Array, *, eps: float, partials: bool = False,
                 dtype: Any = None, round_before_scale: bool = True, update_norm_weight: Array | None = None,
                 implementation: str | None = None, interpret: bool = False) -> tuple[Array, Array]:
    """``hidden = residual + update`` and ``RMSNorm(hidden) * weight``, in one kernel
    (with ``update_norm_weight``: ``hidden = residual + RMSNorm(update) * update_norm_weight``,
    a sandwich norm's sublayer output normed before its residual add, Gemma 2's).

    Args:
      update: the block's output ``[..., N]``; with ``partials=True``, ``[S, ..., N]``:
        partial products summed over the leading axis (float32 split-K partials of
        `jax_paged_attn.matmul.linear_partials`).
      residual: ``[..., N]``, the residual stream, or None (``hidden`` is the sum alone).
      weight: ``[N]``, the norm's scale (any float dtype; multiplied in float32).
      eps: added to the mean square.
      partials: whether ``update`` has the leading partials axis.
      dtype: of both outputs; default the residual's dtype, else update's (float32
        partials without a residual need it).
      round_before_scale: True (Llama's RMSNorm): the normalized rows are rounded to
        ``dtype`` before the multiply by ``weight``; False (Gemma's, scale ``1 + w``):
        multiplied in float32 and rounded once. The same in float32. Both norms follow it.
      update_norm_weight: ``[N]`` or None: the scale of a norm of the update (its sum
        rounded to ``dtype`` first, the normed rows rounded to ``dtype``) before the add.
      implementation: None / "auto": the Triton kernel on CUDA, XLA elsewhere; "xla";
        "triton" (NotImplementedError where the lowering is missing).
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      ``(hidden, normed)``, each ``[..., N]`` in ``dtype``: the new residual stream
      (the sum rounded once) and its normalized, scaled rows.
    """
    if implementation not in NORM_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {NORM_IMPLEMENTATIONS}, got {implementation!r}.")
    if update.ndim < (2 if partials else 1):
        raise ValueError(f"update must be {'[S, ..., N]' if partials else '[..., N]'}, got shape {update.shape}.")
    parts = update if partials else update[None]
    lead, num_cols = parts.shape[1:-1], parts.shape[-1]
    if not jnp.issubdtype(update.dtype, jnp.floating):
        raise TypeError(f"update must be a float array, got {update.dtype}.")
    if residual is not None and tuple(residual.shape) != tuple(parts.shape[1:]):
        raise ValueError(f"residual must have update's shape {tuple(parts.shape[1:])}, got {tuple(residual.shape)}.")
    if tuple(weight.shape) != (num_cols,):
        raise ValueError(f"weight must have shape [N] = [{num_cols}], got {tuple(weight.shape)}.")
    if update_norm_weight is not None and tuple(update_norm_weight.shape) != (num_cols,):
        raise ValueError(f"update_norm_weight must have shape [N] = [{num_cols}], got "
                         f"{tuple(update_norm_weight.shape)}.")
    if dtype is None:
        if residual is None and partials:
            raise ValueError("dtype is required for partials without a residual.")
        dtype = residual.dtype if residual is not None else update.dtype
    dtype = jnp.dtype(dtype)
    if residual is not None and residual.dtype != dtype:
        raise TypeError(f"residual must be {dtype} (the outputs' dtype), got {residual.dtype}.")
    num_rows = math.prod(lead)
    flat = parts.reshape(parts.shape[0], num_rows, num_cols)
    flat_residual = None if residual is None else residual.reshape(num_rows, num_cols)

    # (update, weight, update_norm_weight[, residual]): no None among platform_dependent's
    # operands (an absent update norm is a weight of no columns)
    update_weight = jnp.zeros((0,), weight.dtype) if update_norm_weight is None else update_norm_weight
    args = (flat, weight, update_weight) + (() if flat_residual is None else (flat_residual,))

    # Partials of module-level functions with hashable arguments: `dispatch` shares one
    # jitted callee between equal calls (every layer's norm), where a closure would be
    # a new callee per call.
    round_before_scale = bool(round_before_scale)
    reference = functools.partial(_reference_call, eps=float(eps), dtype=dtype, round_before_scale=round_before_scale)
    kernel = functools.partial(_kernel_call, eps=float(eps), dtype=dtype, interpret=bool(interpret),
                               round_before_scale=round_before_scale,
                               tiling=plans.plan_add_rms_norm(num_rows, num_cols, flat.shape[0]))
    if num_rows == 0:
        hidden, normed = reference(*args)
    else:
        hidden, normed = dispatch.run_implementation(implementation, args, reference_fn=reference,
                                                     kernel_fn=kernel, unsupported_reason=lambda: None)
    return hidden.reshape(*lead, num_cols), normed.reshape(*lead, num_cols)


def _reference_call(flat: Array, weight: Array, update_weight: Array, flat_residual: Array | None = None, *,
                    eps: float, dtype: Any, round_before_scale: bool) -> tuple[Array, Array]:
    """`add_rms_norm_reference` in `dispatch.run_implementation`'s argument order."""
    return add_rms_norm_reference(flat, flat_residual, weight, eps=eps, dtype=dtype,
                                  round_before_scale=round_before_scale,
                                  update_norm_weight=update_weight if update_weight.size else None)


def _kernel_call(flat: Array, weight: Array, update_weight: Array, flat_residual: Array | None = None, *,
                 eps: float, dtype: Any, tiling: Any, round_before_scale: bool, interpret: bool) -> tuple[Array, Array]:
    """The Triton kernel in `dispatch.run_implementation`'s argument order."""
    from jax_paged_attn.kernels import triton_norm

    return triton_norm.add_rms_norm_call(flat, flat_residual, weight, eps=eps, dtype=dtype, tiling=tiling,
                                         round_before_scale=round_before_scale, interpret=interpret,
                                         update_norm_weight=update_weight if update_weight.size else None)
