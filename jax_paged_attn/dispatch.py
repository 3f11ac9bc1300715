"""The one place that picks an implementation for an attention call.

Implementations (the ``implementation=`` argument of the public functions):

* ``"xla"``: `jax_paged_attn.reference`, plain jax.numpy, any backend.
* ``"triton"``: Pallas kernels lowered through Triton (NVIDIA GPUs, Ampere and newer;
  CPU with ``interpret=True``).
* ``None`` / ``"auto"``: the Pallas kernel when the call is lowered for CUDA and the
  kernel supports the call, else ``"xla"``. The choice is made per lowering platform
  with `jax.lax.platform_dependent`, so one jitted function runs the kernel on a GPU
  and the reference on a CPU, and cross-lowering for CUDA on a CPU host shows the
  kernel in the compiled module.

An explicit kernel implementation that cannot run the call raises `NotImplementedError`
with the reason; ``auto`` falls back to the reference instead.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

from jax_paged_attn import reference
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

AUTO = "auto"
XLA = "xla"
TRITON = "triton"
IMPLEMENTATIONS = (AUTO, XLA, TRITON)
KERNEL_IMPLEMENTATIONS = (TRITON,)


def normalize_implementation(implementation: str | None) -> str:
    impl = AUTO if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}.")
    return impl


def _with_auto(kernel_fn: Callable[..., Array] | None, reference_fn: Callable[..., Array],
               args: tuple) -> Array:
    """Runs the kernel on CUDA and the reference elsewhere, chosen at lowering time."""
    if kernel_fn is None:
        return reference_fn(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=reference_fn)


def varlen_attention(
    q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
    block_table: Array | None, seqused_k: Array | None, alibi_slopes: Array | None,
    k_scale: Array, v_scale: Array, *, spec: AttentionSpec, max_seqlen_q: int,
    max_seqlen_k: int, implementation: str | None, interpret: bool,
) -> Array:
    """Dispatches `reference.varlen_attention` or a kernel with the same contract."""
    impl = normalize_implementation(implementation)
    static = dict(spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes, k_scale, v_scale)
    reference_fn = functools.partial(reference.varlen_attention, **static)
    if impl == XLA:
        return reference_fn(*args)
    from jax_paged_attn import prefill

    reason = prefill.unsupported_reason(*args, lowering=TRITON, **static)
    kernel_fn = functools.partial(prefill.varlen_attention, lowering=TRITON, interpret=interpret, **static)
    if impl == AUTO:
        return _with_auto(None if reason else kernel_fn, reference_fn, args)
    if reason:
        raise NotImplementedError(f"implementation={impl!r} cannot run this call: {reason}")
    return kernel_fn(*args)


def paged_decode_attention(
    q: Array, k_cache: Array, v_cache: Array, cache_seqlens: Array, block_table: Array,
    alibi_slopes: Array | None, k_scale: Array, v_scale: Array, *, spec: AttentionSpec,
    implementation: str | None, interpret: bool,
) -> Array:
    """Dispatches `reference.paged_decode_attention` or a kernel with the same contract."""
    impl = normalize_implementation(implementation)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, k_scale, v_scale)
    reference_fn = functools.partial(reference.paged_decode_attention, spec=spec)
    if impl == XLA:
        return reference_fn(*args)
    from jax_paged_attn import decode

    reason = decode.unsupported_reason(*args, spec=spec, lowering=TRITON)
    kernel_fn = functools.partial(decode.paged_decode_attention, spec=spec, lowering=TRITON, interpret=interpret)
    if impl == AUTO:
        return _with_auto(None if reason else kernel_fn, reference_fn, args)
    if reason:
        raise NotImplementedError(f"implementation={impl!r} cannot run this call: {reason}")
    return kernel_fn(*args)
