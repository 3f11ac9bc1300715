"""The one place that picks an implementation for an attention call.

Implementations (the ``implementation=`` argument of the public functions):

* ``"xla"``: `jax_paged_attn.reference`, plain jax.numpy, any backend.
* ``"triton"``: Pallas kernels lowered through Triton (NVIDIA GPUs, Ampere and newer;
  CPU with ``interpret=True``).
* ``"mosaic_gpu"``: Pallas kernels lowered through Mosaic GPU (Hopper, sm_90a: TMA and
  wgmma; CPU with ``interpret=True``, in the Mosaic GPU interpreter): the varlen prefill
  kernel (`jax_paged_attn.kernels.mosaic_prefill`) and the paged decode kernel
  (`jax_paged_attn.kernels.mosaic_decode`); the cache write has no Mosaic GPU kernel
  and runs the Triton one.
* ``None`` / ``"auto"``: a Pallas kernel when the call is lowered for CUDA and a kernel
  supports the call, else ``"xla"``. The kernel is the Triton one, except for prefill
  at the head sizes where the Mosaic GPU kernel was measured faster on the GPU the call
  is planned for (`tuning.MOSAIC_PREFILL_HEAD_SIZES`: D 128 and 256 on the H200 and the H100) when it
  supports the call, the K/V arrays hold fewer than 2**31 elements (larger caches
  have been run through the Triton kernels only) and the sequences average at least
  `MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE` query rows (many short rows stay on the
  Triton kernel, which packs a GQA group's heads into a tile). Decode stays on Triton: its Mosaic
  GPU kernel measured slower on every shape. The choice is made per lowering platform
  with `jax.lax.platform_dependent`, so one jitted function runs the kernel on a GPU
  and the reference on a CPU, and cross-lowering for CUDA on a CPU host shows the
  kernel in the compiled module.

A lowering the installed JAX does not have (the Triton lowering is deprecated since JAX
0.11 and will be removed) makes its kernels unavailable, not the package: importing
`jax_paged_attn` never imports a lowering, and `lowering_unavailable_reason` is the
first reason a kernel cannot run a call.

An explicit kernel implementation that cannot run the call raises `NotImplementedError`
with the reason; ``auto`` falls back to the reference instead, and says so once per
reason (`ReferenceFallbackWarning`) when JAX's default device is a GPU or another
accelerator: a call no kernel runs (the reason the kernel gives), or an accelerator the
kernels are not lowered for (a non-CUDA GPU, a TPU). On a CPU the reference is the
intended path and nothing is said. The default device stands for where the call runs:
the choice itself is made per lowering platform, so a call lowered for another
platform than the default device's (cross-lowering) is not warned about.
"""
from __future__ import annotations

import functools
import importlib
import re
import warnings
from typing import Any, Callable

import jax

from jax_paged_attn import reference
from jax_paged_attn.kv_view import materialize, stored_array
from jax_paged_attn.spec import AttentionSpec

Array = jax.Array

AUTO = "auto"
XLA = "xla"
TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"
IMPLEMENTATIONS = (AUTO, XLA, TRITON, MOSAIC_GPU)


class ReferenceFallbackWarning(UserWarning):
    """``implementation=None`` / ``"auto"`` runs the XLA reference where a kernel was
    expected (see the module docstring); issued once per reason."""


_warned_reasons: set[str] = set()


def default_platform() -> str:
    """Platform of JAX's default device as lowering names it: ``"cpu"``, ``"cuda"``,
    ``"rocm"``, ``"tpu"``, ... (a GPU's runtime tells CUDA from ROCm, as JAX itself does)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return device.platform
    version = str(getattr(device.client, "platform_version", "")).lower()
    for name in ("cuda", "rocm", "oneapi"):
        if name in version:
            return name
    return "gpu"


def warn_reference_fallback(reason: str) -> None:
    """Warns once per distinct ``reason`` that auto runs the reference."""
    if reason in _warned_reasons:
        return
    _warned_reasons.add(reason)
    warnings.warn(f"implementation=None ('auto') runs the XLA reference here, not a Pallas kernel: {reason}.",
                  ReferenceFallbackWarning, stacklevel=3)


def _auto_fallback_reason(kernel_reason: str | None) -> str | None:
    """Why auto will run the reference on the default device, or None (the kernel runs,
    or the default device is a CPU, where the reference is the intended path)."""
    platform = default_platform()
    if platform == "cpu":
        return None
    if platform != "cuda":
        return (f"JAX's default device is a {platform} device ({jax.devices()[0].device_kind}); the Pallas "
                f"Triton kernels are lowered for CUDA only")
    return kernel_reason


_LOWERING_MODULES = {TRITON: "jax.experimental.pallas.triton", MOSAIC_GPU: "jax.experimental.pallas.mosaic_gpu"}


@functools.cache
def lowering_unavailable_reason(lowering: str) -> str | None:
    """Why the installed JAX cannot lower kernels with ``lowering`` (its Pallas module does
    not import), or None."""
    module = _LOWERING_MODULES[lowering]
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"the installed jax {jax.__version__} has no Pallas {lowering} lowering ({module}: {error})"
    return None


# The Mosaic GPU custom call's target as a serialized StableHLO module stores it: one
# entry of its NUL-separated string table (``mosaic_gpu_v2`` in jax 0.10, ``mosaic_gpu``
# in some versions), not a substring of a source path or function name.
_MOSAIC_GPU_CALL_TARGET = re.compile(rb"\x00mosaic_gpu(?:_v2)?\x00")


def prepare_lowering_runtimes(serialized_module: bytes) -> None:
    """Readies this process to compile ``serialized_module`` (a `jax.export` artifact's
    ``mlir_module_serialized``) when it was not traced here.

    XLA compiles a Mosaic GPU custom call's host code against JAX's Mosaic GPU runtime
    library, which it finds through ``MOSAIC_GPU_RUNTIME_LIB_PATH``; JAX's Mosaic GPU module
    sets that variable when it is imported, which tracing a kernel does and reading a
    stored program does not. Without it the compile prints ``JIT session error: Symbols not
    found: [ mosaic_gpu_init_tma_desc, mosaic_gpu_launch_kernel ]`` (jax 0.11.2, on an H100,
    in a start that read programs an earlier one stored). So a module that holds such a
    call imports that lowering first; any other module imports nothing."""
    if _MOSAIC_GPU_CALL_TARGET.search(serialized_module):
        lowering_unavailable_reason(MOSAIC_GPU)


def normalize_implementation(implementation: str | None) -> str:
    impl = AUTO if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}.")
    return impl


def kernel_lowering(implementation: str | None) -> str:
    """The Pallas lowering a kernel implementation runs through (``"triton"`` or
    ``"mosaic_gpu"``, the names `prefill.LOWERINGS` / `decode.LOWERINGS` use); for auto
    the Triton one, which `varlen_attention` replaces where the module docstring says."""
    return MOSAIC_GPU if normalize_implementation(implementation) == MOSAIC_GPU else TRITON


def run_implementation(
    implementation: str | None,
    args: tuple,
    *,
    reference_fn: Callable[..., Any],
    kernel_fn: Callable[..., Any],
    unsupported_reason: Callable[[], str | None],
    lowering: str = TRITON,
) -> Any:
    """Runs ``reference_fn(*args)`` or ``kernel_fn(*args)`` as ``implementation`` says.

    ``unsupported_reason()`` (looked at only when a kernel may run) names why the kernel
    cannot run these shapes, or None; ``lowering`` names the kernel's Pallas lowering,
    whose absence from the installed JAX comes first (`lowering_unavailable_reason`).
    Auto chooses per lowering platform with
    `jax.lax.platform_dependent` (the kernel on CUDA when supported, else the
    reference) and warns once per reason when the reference runs on an accelerator
    (`ReferenceFallbackWarning`); an explicit kernel that cannot run raises
    `NotImplementedError`.
    """
    impl = normalize_implementation(implementation)
    if impl == XLA:
        return _traced_once(("reference", reference_fn), reference_fn, args)
    reason = lowering_unavailable_reason(lowering) or unsupported_reason()
    if impl == AUTO:
        fallback = _auto_fallback_reason(reason)
        if fallback:
            warn_reference_fallback(fallback)
        if reason:
            return _traced_once(("reference", reference_fn), reference_fn, args)
        return _traced_once(("auto", kernel_fn, reference_fn),
                            lambda *a: jax.lax.platform_dependent(*a, cuda=kernel_fn, default=reference_fn), args)
    if reason:
        raise NotImplementedError(f"implementation={impl!r} cannot run this call: {reason}")
    return _traced_once(("kernel", kernel_fn), kernel_fn, args)


_TRACED_ONCE: dict[Any, Callable[..., Any]] = {}


def _callable_key(fn: Any) -> Any:
    """A hashable description of ``fn`` that two equal calls share: a `functools.partial`
    by its function and bound arguments, a `functools.wraps` wrapper by what it wraps
    (the package's wrappers add no state), another callable by identity."""
    if isinstance(fn, functools.partial):
        return (_callable_key(fn.func), fn.args, tuple(sorted(fn.keywords.items())))
    if hasattr(fn, "__wrapped__"):
        return ("wraps", fn.__qualname__, _callable_key(fn.__wrapped__))
    return fn


def _traced_once(key: tuple, fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(*args)`` through a `jax.jit` shared by every call with the same ``key`` (the
    callables' `_callable_key`s). A model calls the same kernel with the same shapes in
    every layer: as one jitted callee, the kernel is traced and lowered once per
    program instead of once per layer (Pallas tracing and lowering were 80 % of the
    time to lower an engine's decode program, about 10 s on a 16-layer model). An
    eager call compiles one program, not one per operation (the reference's eager
    calls compiled ~50 programs each). Inside a jitted caller XLA inlines the callee,
    so buffers stay in place. Calls whose static arguments are not hashable run ``fn``
    directly."""
    try:
        key = tuple(_callable_key(part) for part in key[1:]) + (key[0],)
        jitted = _TRACED_ONCE.get(key)
    except TypeError:
        return fn(*args)
    if jitted is None:
        jitted = _TRACED_ONCE[key] = jax.jit(fn)
    return jitted(*args)


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
    lowering = kernel_lowering(implementation)
    if normalize_implementation(implementation) == AUTO and _auto_takes_mosaic_prefill(args, static):
        lowering = MOSAIC_GPU
    return run_implementation(
        implementation, args,
        reference_fn=_on_arrays(functools.partial(reference.varlen_attention, **static)),
        kernel_fn=functools.partial(prefill.varlen_attention, lowering=lowering, interpret=interpret, **static),
        unsupported_reason=lambda: prefill.unsupported_reason(*args, lowering=lowering, **static),
        lowering=lowering,
    )


MOSAIC_AUTO_MAX_KV_ELEMENTS = 2**31
"""Auto's Mosaic GPU prefill takes K/V arrays of fewer elements (see the module docstring)."""

MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE = 128
"""Auto's Mosaic GPU prefill takes calls with at least this many query rows per sequence
on average (``Tq / B``, both static): it was measured faster on long query runs (512 to
16,384 per sequence), and it gives every sequence and query head a tile of 64 or 128
rows, where the Triton kernel packs a GQA group's heads into one, so a batch of many
short rows (the decode rows of a mixed prefill + decode step) stays on Triton."""


def _auto_takes_mosaic_prefill(args: tuple, static: dict) -> bool:
    """Whether auto runs this varlen call through the Mosaic GPU kernel (module docstring)."""
    from jax_paged_attn import prefill, tuning

    q, k, v = args[:3]
    shape = getattr(q, "shape", None)
    if not shape or not tuning.auto_prefers_mosaic_prefill(shape[-1]):
        return False
    if max(stored_array(k).size, stored_array(v).size) >= MOSAIC_AUTO_MAX_KV_ELEMENTS:
        return False
    cu_shape = getattr(args[3], "shape", None)  # cu_seqlens_q: [B + 1]
    if not cu_shape or shape[0] < MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE * max(1, cu_shape[0] - 1):
        return False
    return (lowering_unavailable_reason(MOSAIC_GPU) is None
            and prefill.unsupported_reason(*args, lowering=MOSAIC_GPU, **static) is None)


def paged_decode_attention(
    q: Array, k_cache: Array, v_cache: Array, cache_seqlens: Array, block_table: Array,
    alibi_slopes: Array | None, k_scale: Array, v_scale: Array, *, spec: AttentionSpec,
    implementation: str | None, interpret: bool,
) -> Array:
    """Dispatches `reference.paged_decode_attention` or a kernel with the same contract.

    ``implementation="mosaic_gpu"`` runs the decode kernel's Mosaic GPU lowering; auto
    and ``"triton"`` the Triton one (the Mosaic GPU kernel measured slower on the H200).
    """
    from jax_paged_attn import decode

    args = (q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, k_scale, v_scale)
    lowering = kernel_lowering(implementation)
    return run_implementation(
        implementation, args,
        reference_fn=_on_arrays(functools.partial(reference.paged_decode_attention, spec=spec)),
        kernel_fn=functools.partial(decode.paged_decode_attention, spec=spec, lowering=lowering,
                                    interpret=interpret),
        unsupported_reason=lambda: decode.unsupported_reason(*args, spec=spec, lowering=lowering),
        lowering=lowering,
    )
