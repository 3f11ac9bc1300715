"""Linear layers of decode-sized batches: the weight-streaming matmul and the choice of it.

A decode step multiplies a few rows of activations by every weight of the model, so
its matrix products are bound by reading the weights. `weight_streaming_matmul` runs a
product through `jax_paged_attn.kernels.triton_matmul` (tiles planned by
`plans.plan_matmul`, configs from `tuning.matmul_config`); `linear` is what a model's
layer calls. `linear_partials` keeps a split-K product's partials for a consumer that
sums them with its own work (`jax_paged_attn.norm.add_rms_norm`), and `gated_linear`
computes a gated MLP's activation (SwiGLU, GeGLU) inside the gate/up product.

Measured on an H200 (benchmarks/NOTES.md, "Weight-streaming matmul" and "Fused
decoder layers"): inside the engine's compiled decode step the kernel ran each product
in XLA's time, but with the work XLA does not fuse into its GEMMs folded in (the
residual add and norm after a product, the SwiGLU) a step took 0.88 / 1.01 ms at batch
1 / 32 against 0.89 / 1.07 with XLA's dot (on an H100 80GB, 2026-12-07: 1.05 / 1.29
against 1.07 / 1.37); so auto takes the kernel on those two GPU models, and on others
only once the same comparison is made on them (`tuning.MATMUL_KERNEL_MEASURED`,
`auto_takes_kernel`).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jax_paged_attn import dispatch, plans, tuning

Array = jax.Array

MATMUL_IMPLEMENTATIONS = ("xla", "weight_streaming")
"""`linear`'s implementations; None picks (`linear`)."""

IMPLEMENTATION_CHOICES = ("auto", *MATMUL_IMPLEMENTATIONS)
"""Every name `linear` accepts (None too)."""


def check_implementation(implementation: str | None, argument: str = "implementation") -> None:
    """ValueError naming ``argument`` unless ``implementation`` is None or in `IMPLEMENTATION_CHOICES`."""
    if implementation is not None and implementation not in IMPLEMENTATION_CHOICES:
        raise ValueError(f"{argument} must be one of {IMPLEMENTATION_CHOICES} or None, got {implementation!r}.")

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
                            interpret: bool = False, keep_partials: bool = False) -> Array:
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
      keep_partials: return the split-K partial products unsummed (for a consumer that
        sums them itself, `jax_paged_attn.norm.add_rms_norm`).

    Returns:
      ``[..., *out]`` in x's dtype, accumulated in float32; with ``keep_partials``,
      ``[S, ..., *out]`` whose sum over axis 0 is the product: float32 partials, or
      the product itself (x's dtype) as ``S = 1`` when the plan does not split ``K``.
    """
    reason = streaming_unsupported_reason(x, w, config)
    if reason is not None:
        raise ValueError(f"weight_streaming_matmul: {reason}")
    out = w.shape[1:]
    y, tiling = _run_kernel("weight_streaming_matmul", x, w, math.prod(out), config, interpret, gated=False)
    if tiling.split_k == 1:
        y = y[None]
    if not keep_partials:
        y = y.sum(axis=0).astype(x.dtype) if tiling.split_k > 1 else y[0]
        return y.reshape(*x.shape[:-1], *out)
    return y.reshape(y.shape[0], *x.shape[:-1], *out)


def _run_kernel(name: str, x: Array, w: Array, width: int, config: tuning.MatmulConfig | None, interpret: bool,
                *, gated: bool, activation: str = "silu") -> tuple[Array, plans.MatmulTiling]:
    """The kernel's output for ``x`` ``[..., K]`` and ``w`` ``[K, ...]`` (already checked),
    ``width`` output columns (gated: ``w`` holds twice as many), and its plan."""
    missing = dispatch.lowering_unavailable_reason(dispatch.TRITON)
    if missing is not None:
        raise NotImplementedError(f"{name} cannot run: {missing}")
    # Imported here, as the attention wrappers import their kernels: the package (and
    # the models, whose default is XLA's dot) must import on a JAX without the lowering.
    from jax_paged_attn.kernels import triton_matmul

    rows, depth = math.prod(x.shape[:-1]), x.shape[-1]
    tiling = plans.plan_matmul(rows, depth, width, config, itemsize=jnp.dtype(x.dtype).itemsize,
                               budget=tuning.target_device().shared_memory_budget, gated=gated,
                               activation=activation)
    y = triton_matmul.matmul_call(x.reshape(rows, depth), w.reshape(depth, -1), tiling, out_dtype=x.dtype,
                                  interpret=interpret)
    return y, tiling


def gated_weight_streaming_matmul(x: Array, w: Array, *, activation: str = "silu",
                                  config: tuning.MatmulConfig | None = None, interpret: bool = False) -> Array:
    """A gated MLP's ``act(x @ w[:, 0]) * (x @ w[:, 1])`` through the kernel's gated form:
    the gate and up products stay in registers.

    Args:
      x: ``[..., K]`` activations, as `weight_streaming_matmul`'s.
      w: ``[K, 2, I]`` gate (index 0) and up (1) weights of x's dtype (a fused
        gate/up `flax.nnx.LinearGeneral` kernel), ``I`` a multiple of ``config.block_n``.
      activation: the gate's, by Hugging Face's ``hidden_act`` name (`plans.GATED_ACTIVATIONS`:
        "silu" for SwiGLU, "gelu_pytorch_tanh" for GeGLU).
      config: tiling (`tuning.MatmulConfig`; its ``split_k`` is ignored: never split).
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      ``[..., I]`` in x's dtype (the activation and product in float32, rounded once).
    """
    if w.ndim != 3 or w.shape[1] != 2:
        raise ValueError(f"w must be [K, 2, I] (gate, up), got shape {w.shape}")
    _check_activation(activation)
    reason = streaming_unsupported_reason(x, w[:, 0], config)
    if reason is not None:
        raise ValueError(f"gated_weight_streaming_matmul: {reason}")
    width = w.shape[2]
    y, _ = _run_kernel("gated_weight_streaming_matmul", x, w, width, config, interpret, gated=True,
                       activation=activation)
    return y.reshape(*x.shape[:-1], width)


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
      implementation: "xla": XLA's dot. "weight_streaming": the kernel, with
        `tuning.matmul_config`'s config, for products of at most
        `tuning.MATMUL_MAX_ROWS` rows (`streams`; ValueError where such a product's
        shape does not tile), XLA's dot for larger ones. None / "auto": the kernel for
        such products of 16-bit activations that tile, through CUDA on the GPUs where
        it was measured faster (`auto_takes_kernel`, `auto_choice`); XLA's dot otherwise.
      interpret: run the kernel in Pallas interpret mode.

    Returns:
      ``[..., *out]`` in x's dtype.
    """
    _flatten(x, w, "x", "w")
    w = w.astype(x.dtype)
    if not streams(x, implementation, w):
        return xla_matmul(x, w)
    return weight_streaming_matmul(x, w, config=_table_config(x, w), interpret=interpret)


def _table_config(x: Array, w: Array) -> tuning.MatmulConfig:
    """`tuning.matmul_config`'s config for ``x @ w`` (``w`` ``[K, *out]``)."""
    rows, depth, out = _flatten(x, w, "x", "w")
    return tuning.matmul_config(rows, depth, math.prod(out))


def auto_takes_kernel() -> bool:
    """Auto's choice on JAX's default device: the kernel on the GPUs it was measured
    faster on (`tuning.MATMUL_KERNEL_MEASURED`, through CUDA, with the Triton lowering
    installed), XLA's dot elsewhere (`auto_choice` says which and why)."""
    return _auto_xla_reason() is None


def _auto_xla_reason() -> str | None:
    """Why auto keeps XLA's dot on JAX's default device, or None where it takes the kernel."""
    if dispatch.default_platform() != "cuda":
        return "the weight-streaming kernel runs through CUDA only"
    unavailable = dispatch.lowering_unavailable_reason(dispatch.TRITON)
    if unavailable is not None:
        return unavailable
    kind = tuning.target_device().kind
    if kind not in tuning.MATMUL_KERNEL_MEASURED:
        measured = " and ".join(f"the {k}" for k in tuning.MATMUL_KERNEL_MEASURED)
        return (f"the weight-streaming kernel is measured against it on {measured} only, not on the {kind} "
                "(benchmarks/bench_engine.py --matmul-implementation weight_streaming against xla measures it)")
    return None


def auto_choice() -> str:
    """What auto runs for linear layers on JAX's default device, and why, in words (the
    engine's start report)."""
    reason = _auto_xla_reason()
    if reason is not None:
        return f"XLA's dot: {reason}"
    kind = tuning.target_device().kind
    return (f"on the {kind}, products of at most {tuning.MATMUL_MAX_ROWS} rows of 16-bit activations through the "
            "weight-streaming kernel, with the fused decoder layers (residual add + RMSNorm in one kernel, the "
            f"gate's activation inside the gate/up product): {tuning.MATMUL_KERNEL_MEASURED[kind]}; XLA's dot for "
            "larger products, float32 and with a mesh")


def streams(x: Array, implementation: str | None, w: Array | None = None) -> bool:
    """Whether `linear` / `linear_partials` / `gated_linear` run ``x``'s products through
    the kernel: at most `tuning.MATMUL_MAX_ROWS` rows (larger products, a prefill's, are
    XLA's: no longer bound by their weight reads), and ``implementation=
    "weight_streaming"``, or auto with 16-bit ``x`` where `auto_takes_kernel` and (given
    the weight ``w`` ``[K, N]``) the product tiles."""
    check_implementation(implementation)
    if math.prod(x.shape[:-1]) > tuning.MATMUL_MAX_ROWS:
        return False
    if implementation in (None, "auto"):
        if jnp.dtype(x.dtype).itemsize != 2 or not auto_takes_kernel():
            return False
        return w is None or streaming_unsupported_reason(x, w.astype(x.dtype), _table_config(x, w)) is None
    return implementation == "weight_streaming"


def linear_partials(x: Array, w: Array, *, implementation: str | None = None, interpret: bool = False) -> Array:
    """`linear`'s product as partial products ``[S, ..., *out]`` whose sum over axis 0 is
    ``x @ w``: the kernel's float32 split-K partials where `streams` says so, else the
    product itself as ``S = 1`` (x's dtype). For a consumer that sums them with other
    work (`jax_paged_attn.norm.add_rms_norm`), saving the sum's own kernel."""
    _flatten(x, w, "x", "w")
    w = w.astype(x.dtype)
    if not streams(x, implementation, w):
        return xla_matmul(x, w)[None]
    return weight_streaming_matmul(x, w, config=_table_config(x, w), interpret=interpret, keep_partials=True)


def _check_activation(activation: str) -> None:
    if activation not in plans.GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {plans.GATED_ACTIVATIONS}, got {activation!r}.")


GATE_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}
"""A gated MLP's gate activation by Hugging Face's ``hidden_act`` name (`plans.GATED_ACTIVATIONS`),
as XLA computes it outside the kernel (the models' unfused MLP too)."""


def gated_linear(x: Array, w: Array, *, activation: str = "silu", implementation: str | None = None,
                 interpret: bool = False) -> Array:
    """A gated MLP's ``act(x @ w[:, 0]) * (x @ w[:, 1])`` for ``w`` ``[K, 2, I]``
    (``activation``: "silu", SwiGLU, or "gelu_pytorch_tanh", GeGLU): the gated kernel
    where `streams` says so, else XLA's dot then the activation (both products rounded
    to x's dtype first, as the unfused model computes them)."""
    _flatten(x, w, "x", "w")
    _check_activation(activation)
    w = w.astype(x.dtype)
    if w.ndim != 3 or not streams(x, implementation, w[:, 0]):
        gate_up = xla_matmul(x, w)
        return GATE_ACTIVATIONS[activation](gate_up[..., 0, :]) * gate_up[..., 1, :]
    return gated_weight_streaming_matmul(x, w, activation=activation, config=_table_config(x, w), interpret=interpret)

