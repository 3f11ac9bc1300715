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
from typing import Any, Callable

import jax

from jax_paged_attn import reference
from jax_paged_attn.kv_view import materialize
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

AUTO = "auto"
XLA = "xla"
TRITON = "triton"
IMPLEMENTATIONS = (AUTO, XLA, TRITON)


def normalize_implementation(implementation: str | None) -> str:
    impl = AUTO if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}.")
    return impl


def run_implementation(
    implementation: str | None,
    args: tuple,
    *,
    reference_fn: Callable[..., Any],
    kernel_fn: Callable[..., Any],
    unsupported_reason: Callable[[], str | None],
) -> Any:
    """Runs ``reference_fn(*args)`` or ``kernel_fn(*args)`` as ``implementation`` says.

    ``unsupported_reason()`` (looked at only when a kernel may run) names why the kernel
    cannot run these shapes, or None. Auto chooses per lowering platform with
    `jax.lax.platform_dependent` (the kernel on CUDA when supported, else the
    reference); an explicit kernel that cannot run raises `NotImplementedError`.
    """
    impl = normalize_implementation(implementation)
    if impl == XLA:
        return reference_fn(*args)
    reason = unsupported_reason()
    if impl == AUTO:
        if reason:
            return reference_fn(*args)
        return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=reference_fn)
    if reason:
        raise NotImplementedError(f"implementation={impl!r} cannot run this call: {reason}")
    return kernel_fn(*args)


def _on_arrays(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with every `CachePlane` argument materialized (the reference reads
    arrays; inside XLA the slice fuses into its gathers, so nothing is copied)."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return fn(*(materialize(a) for a in args))

    return call


def varlen_attention(
    q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
    block_table: Array | None, seqused_k: Array | None, alibi_slopes: Array | None,
    k_scale: Array, v_scale: Array, *, spec: AttentionSpec, max_seqlen_q: int,
    max_seqlen_k: int, implementation: str | None, interpret: bool,
) -> Array:
    """Dispatches `reference.varlen_attention` or a kernel with the same contract."""
    from jax_paged_attn import prefill

    static = dict(spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes, k_scale, v_scale)
    return run_implementation(
        implementation, args,
        reference_fn=_on_arrays(functools.partial(reference.varlen_attention, **static)),
        kernel_fn=functools.partial(prefill.varlen_attention, lowering=TRITON, interpret=interpret, **static),
        unsupported_reason=lambda: prefill.unsupported_reason(*args, lowering=TRITON, **static),
    )


def paged_decode_attention(
    q: Array, k_cache: Array, v_cache: Array, cache_seqlens: Array, block_table: Array,
    alibi_slopes: Array | None, k_scale: Array, v_scale: Array, *, spec: AttentionSpec,
    implementation: str | None, interpret: bool,
) -> Array:
    """Dispatches `reference.paged_decode_attention` or a kernel with the same contract."""
    from jax_paged_attn import decode

    args = (q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, k_scale, v_scale)
    return run_implementation(
        implementation, args,
        reference_fn=_on_arrays(functools.partial(reference.paged_decode_attention, spec=spec)),
        kernel_fn=functools.partial(decode.paged_decode_attention, spec=spec, lowering=TRITON,
                                    interpret=interpret),
        unsupported_reason=lambda: decode.unsupported_reason(*args, spec=spec, lowering=TRITON),
    )
