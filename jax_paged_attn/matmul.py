"""Linear layers of decode-sized batches: the weight-streaming matmul and its dispatch.

A decode step multiplies a few rows of activations by every weight of the model, so
its matrix products are bound by reading the weights, and the small ones by how fast a
kernel gets its reads going: XLA's GEMMs read a ~1B Llama's q/k/v and o weights at
650-760 GB/s on an H200. `weight_streaming_matmul` runs a product through
`jax_paged_attn.kernels.triton_matmul` (tiles planned by `plans.plan_matmul`); `linear`
picks it or XLA's dot for each product (`tuning.matmul_config`).
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from jax_paged_attn import dispatch, plans, tuning
from jax_paged_attn.kernels import triton_matmul

Array = jax.Array

logger = logging.getLogger(__name__)

MATMUL_IMPLEMENTATIONS = ("xla", "weight_streaming")
"""`linear`'s implementations; None picks (`linear`)."""

_STREAMING_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _flatten(x: Array, w: Array, x_name: str, w_name: str) -> tuple[int, int, tuple[int, ...]]:
    if x.ndim < 1 or w.ndim < 2:
        raise ValueError(f"{x_name} must be [..., K] and {w_name} [K, *out], got shapes {x.shape} and {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{x_name}'s last axis ({x.shape[-1]}) must equal {w_name}'s first ({w.shape[0]})")
    return math.prod(x.shape[:-1]), w.shape[0], tuple(w.shape[1:])


def streaming_unsupported_reason(x: Array, w: Array, config: tuning.MatmulConfig | None = None) -> str | None:
    """Why `weight_streaming_matmul` cannot run ``x @ w``, or None."""
    rows, depth, out = _flatten(x, w, "x", "w")
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in _STREAMING_DTYPES:
        return f"x and w must both be bfloat16, float16 or float32, got {x.dtype} and {w.dtype}"
    return plans.matmul_unsupported_reason(rows, depth, math.prod(out), config or tuning.MatmulConfig())


def weight_streaming_matmul(x: Array, w: Array, *, config: tuning.MatmulConfig | None = None,
                            interpret: bool = False) -> Array:
    """``x @ w`` through the weight-streaming kernel.

    Args:
      x: ``[..., K]`` activations, bfloat16 or float16 (float32 works, with full-precision
        products, but auto never picks it: not measured), at most
        `tuning.MATMUL_MAX_ROWS` rows in all (leading axes flattened).
      w: ``[K, *out]`` weights of x's dtype (row-major; the trailing axes are merged,
        as a `flax.nnx.LinearGeneral` kernel's are), ``prod(out)`` a multiple of
        ``config.block_n`` and ``K`` of ``config.block_k``.
      config: tiling (`tuning.MatmulConfig`; None: the default).
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      ``[..., *out]`` in x's dtype, accumulated in float32.
    """
    reason = streaming_unsupported_reason(x, w, config)
    if reason is not None:
        raise ValueError(f"weight_streaming_matmul: {reason}")
    rows, depth, out = _flatten(x, w, "x", "w")
    cols = math.prod(out)
    tiling = plans.plan_matmul(rows, depth, cols, config, itemsize=jnp.dtype(x.dtype).itemsize,
                               budget=tuning.target_device().shared_memory_budget)
    x2 = x.reshape(rows, depth)
    if tiling.rows != rows:
        x2 = jnp.pad(x2, ((0, tiling.rows - rows), (0, 0)))
    y = triton_matmul.matmul_call(x2, w.reshape(depth, cols), tiling, out_dtype=x.dtype, interpret=interpret)
    if tiling.split_k > 1:
        y = y.sum(axis=0).astype(x.dtype)
    return y[:rows].reshape(*x.shape[:-1], *out)


def xla_matmul(x: Array, w: Array) -> Array:
    """``x @ w`` as one XLA dot_general over x's last and w's first axis (a
    `flax.nnx.LinearGeneral`'s product)."""
    _flatten(x, w, "x", "w")
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def linear(x: Array, w: Array, *, implementation: str | None = None, interpret: bool = False) -> Array:
    """``x @ w`` for a linear layer, x's dtype in and out (w is cast to it).

    Args:
      x: ``[..., K]`` activations.
      w: ``[K, *out]`` weights (a `flax.nnx.Linear` / `LinearGeneral` kernel).
      implementation: None / "auto": the weight-streaming kernel where
        `tuning.matmul_config` chooses it (lowered for CUDA, measured GPU, few rows,
        16-bit dtypes, shapes it tiles), XLA's dot otherwise (a CPU run included, and ``interpret``);
        "xla": always
        XLA's dot; "weight_streaming": always the kernel (ValueError where it cannot
        run), with `tuning.matmul_config`'s config or the default one.
      interpret: run a forced kernel in Pallas interpret mode.

    Returns:
      ``[..., *out]`` in x's dtype.
    """
    if implementation not in (None, "auto", *MATMUL_IMPLEMENTATIONS):
        raise ValueError(f"implementation must be one of {('auto', *MATMUL_IMPLEMENTATIONS)} or None, "
                         f"got {implementation!r}")
    rows, depth, out = _flatten(x, w, "x", "w")
    w = w.astype(x.dtype)
    if implementation == "xla":
        return xla_matmul(x, w)
    config = tuning.matmul_config(rows, depth, math.prod(out))
    if implementation == "weight_streaming":
        return weight_streaming_matmul(x, w, config=config, interpret=interpret)
    if (config is None or interpret or jnp.dtype(x.dtype).itemsize != 2
            or dispatch.lowering_unavailable_reason(dispatch.TRITON)
            or streaming_unsupported_reason(x, w, config) is not None):
        return xla_matmul(x, w)
    # Per lowering platform, as the attention dispatch does: the kernel where the call is
    # lowered for CUDA, XLA's dot elsewhere (a CPU run, or lowering for another platform).
    return jax.lax.platform_dependent(
        x, w, cuda=lambda a, b: weight_streaming_matmul(a, b, config=config), default=xla_matmul)


def describe_auto() -> str:
    """What auto runs for linear layers on the default device, in words (engine start report)."""
    if dispatch.default_platform() != "cuda":
        return "XLA's dot (no weight-streaming kernel off CUDA)"
    device = tuning.target_device()
    if device.kind != tuning.REFERENCE_DEVICE_KIND:
        return (f"XLA's dot (the weight-streaming matmul is measured on the {tuning.REFERENCE_DEVICE_KIND} "
                f"only, not on {device.kind})")
    return (f"the weight-streaming matmul for products of at most {tuning.MATMUL_MAX_ROWS} rows whose weights "
            f"hold at most {tuning.MATMUL_AUTO_MAX_WEIGHT_ELEMENTS // 2**20} Mi elements or have a measured "
            f"entry (measured faster than XLA's dot there), XLA's dot for the rest")
