"""`jax_paged_attn.dispatch`: auto says once, with the reason, when it runs the reference
where a kernel was expected, and says nothing on a CPU, where the reference is the
intended path. The platform of the default device is substituted (this host is a CPU);
the calls are only traced, never run.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_paged_attn as jpa
from jax_paged_attn import dispatch

S = jax.ShapeDtypeStruct


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Every test starts with no reason warned about yet."""
    monkeypatch.setattr(dispatch, "_warned_reasons", set())


def decode_args(head_size: int = 64) -> tuple:
    q = S((3, 1, 8, head_size), jnp.bfloat16)
    cache = S((12, 16, 2, head_size), jnp.bfloat16)
    return q, cache, cache, S((3,), jnp.int32), S((3, 4), jnp.int32)


def trace_decode(*args, **kwargs) -> None:
    jax.jit(lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True, **kwargs)).trace(*args)


def test_default_platform_of_this_host_is_cpu():
    assert dispatch.default_platform() == jax.devices()[0].platform == "cpu"


def test_cpu_runs_the_reference_without_a_word(fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)
        trace_decode(*decode_args())
        jax.jit(jpa.reshape_and_cache_flash_kv).trace(
            S((4, 2, 64), jnp.bfloat16), S((4, 2, 64), jnp.bfloat16), S((2, 12, 16, 2, 64), jnp.bfloat16),
            S((4,), jnp.int32))
    assert dispatch._warned_reasons == set()


def test_non_cuda_accelerator_warns_once(fresh_warnings, monkeypatch):
    monkeypatch.setattr(dispatch, "default_platform", lambda: "rocm")
    with pytest.warns(dispatch.ReferenceFallbackWarning,
                      match=r"runs the XLA reference .* a rocm device .* lowered for CUDA only"):
        trace_decode(*decode_args())
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)
        trace_decode(*decode_args(head_size=128))  # same reason: not said again


def test_cuda_call_no_kernel_runs_warns_once_per_reason(fresh_warnings, monkeypatch):
    monkeypatch.setattr(dispatch, "default_platform", lambda: "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)
        trace_decode(*decode_args())  # the kernel runs this call: nothing to say

    def run(reason):
        return dispatch.run_implementation(None, (jnp.ones(2),), reference_fn=lambda x: x + 1,
                                           kernel_fn=lambda x: x + 2, unsupported_reason=lambda: reason)

    with pytest.warns(dispatch.ReferenceFallbackWarning, match="not a Pallas kernel: reason A"):
        out = run("reason A")
    assert float(out[0]) == 2.0  # the reference ran
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)
        run("reason A")
    with pytest.warns(dispatch.ReferenceFallbackWarning, match="reason B"):
        run("reason B")
    # An explicit kernel that cannot run raises instead.
    with pytest.raises(NotImplementedError, match="implementation='triton' cannot run this call: reason A"):
        dispatch.run_implementation("triton", (jnp.ones(2),), reference_fn=lambda x: x,
                                    kernel_fn=lambda x: x, unsupported_reason=lambda: "reason A")


def test_kernel_implementations_and_their_lowerings():
    assert dispatch.IMPLEMENTATIONS == ("auto", "xla", "triton", "mosaic_gpu")
    assert dispatch.kernel_lowering("mosaic_gpu") == "mosaic_gpu"
    # auto's kernel stays Triton's until the Mosaic GPU kernel is measured on a GPU.
    for implementation in (None, "auto", "triton"):
        assert dispatch.kernel_lowering(implementation) == "triton"
    with pytest.raises(ValueError, match="implementation must be one of"):
        dispatch.kernel_lowering("mosaic")


def test_mosaic_gpu_decode_raises_with_the_reason(fresh_warnings):
    """No Mosaic GPU decode kernel yet: an explicit request says so instead of running
    another implementation."""
    with pytest.raises(NotImplementedError, match="implementation='mosaic_gpu' cannot run this call: "
                                                  "the decode kernel has no 'mosaic_gpu' lowering"):
        trace_decode(*decode_args(), implementation="mosaic_gpu")
