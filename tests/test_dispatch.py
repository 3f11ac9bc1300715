"""`jax_paged_attn.dispatch`: auto says once, with the reason, when it runs the reference
where a kernel was expected, and says nothing on a CPU, where the reference is the
intended path. The platform of the default device is substituted (this host is a CPU);
the calls are only traced, never run.
"""
from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_paged_attn as jpa
from jax_paged_attn import dispatch
from jax_paged_attn.kv_view import cache_planes
from conftest import lower_for_cuda

S = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu"  # @mosaic_gpu_v2 in jax 0.10


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


_WITHOUT_TRITON = r"""
import sys, warnings
import importlib.abc


class HideTriton(importlib.abc.MetaPathFinder):
    # A future JAX without the (deprecated) Pallas Triton lowering.
    def find_spec(self, name, path=None, target=None):
        if name == "jax.experimental.pallas.triton" or name.startswith("jax._src.pallas.triton"):
            raise ImportError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, HideTriton())
import jax, jax.numpy as jnp, numpy as np
import jax_paged_attn as jpa
from jax_paged_attn import dispatch

q = jax.random.normal(jax.random.key(0), (6, 2, 32))
cu = jnp.array([0, 6], jnp.int32)
want = jpa.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True, implementation="xla")
with warnings.catch_warnings():
    warnings.simplefilter("error")  # on a CPU the reference is the intended path: nothing to say
    got = jax.jit(lambda q: jpa.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True))(q)
# (jit and eager may round differently: jax 0.11's CPU compiler differs by an ulp)
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
try:
    jpa.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True, implementation="triton", interpret=True)
except NotImplementedError as error:
    print("explicit:", error)
print("reason:", dispatch.lowering_unavailable_reason("triton"))
from flax import nnx
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, jit_forward_dense
model = LlamaForCausalLM(LlamaConfig.tiny(hidden_size=128, intermediate_size=256), rngs=nnx.Rngs(0))
# (jitted: one compile, where eagerly each of its ops compiles alone)
print("llama dense forward:", jit_forward_dense(model)(jnp.array([[1, 2, 3]])).shape)
from jax_paged_attn import matmul
try:
    matmul.weight_streaming_matmul(jnp.ones((2, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16))
except NotImplementedError as error:
    print("matmul:", error)
from jax_paged_attn import norm
x = jnp.ones((2, 128), jnp.bfloat16)
print("norm auto:", norm.add_rms_norm(x, x, jnp.ones(128), eps=1e-5)[1].shape)
try:
    norm.add_rms_norm(x, x, jnp.ones(128), eps=1e-5, implementation="triton")
except NotImplementedError as error:
    print("norm:", error)
print("triton imported:", "jax.experimental.pallas.triton" in sys.modules)
"""


def test_a_jax_without_the_triton_lowering_still_imports_and_runs_the_reference():
    """The Triton lowering is deprecated upstream: without it the package imports, auto
    runs the reference (under jit too: no branch traces a Triton kernel), and an explicit
    ``implementation="triton"`` says why it cannot run."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "explicit: implementation='triton' cannot run this call: the installed jax" in result.stdout
    assert "has no Pallas triton lowering" in result.stdout
    assert "llama dense forward: (1, 3, 128)" in result.stdout
    assert "matmul: weight_streaming_matmul cannot run: the installed jax" in result.stdout
    assert "norm auto: (2, 128)" in result.stdout
    assert "norm: implementation='triton' cannot run this call: the installed jax" in result.stdout
    assert "triton imported: False" in result.stdout


BIG_FP8 = S((2, 2**16 + 16, 16, 8, 128), jnp.float8_e4m3fn)  # 2**31 + 2**21 elements, 2.1 GB, never allocated


def _attention_on(kind: str, kv: S, **kwargs):
    """(fn, args): decode or paged prefill reading both planes of the stacked cache ``kv``."""
    table = S((4, 64), jnp.int32)
    if kind == "decode":
        def fn(q, kv, n, t):
            return jpa.flash_attn_with_kvcache(q, *cache_planes(kv), n, t, causal=True, **kwargs)
        return fn, (S((4, 1, 32, 128), jnp.bfloat16), kv, S((4,), jnp.int32), table)

    def fn(q, kv, cq, ck, t):
        return jpa.flash_attn_varlen_func(q, *cache_planes(kv), cq, ck, 64, 1024, causal=True, block_table=t,
                                          **kwargs)
    return fn, (S((512, 32, 128), jnp.bfloat16), kv, S((5,), jnp.int32), S((5,), jnp.int32), table)


def _cuda_text(fn, args) -> str:
    """CUDA text of ``fn`` traced anew (a fresh function: jit's trace cache would skip
    the dispatch, and with it the warning)."""
    return lower_for_cuda(lambda *a: fn(*a), *args)


@pytest.mark.parametrize("kind,name", [("decode", "k_cache"), ("paged_prefill", "k")])
def test_fp8_cache_of_2_31_elements_without_64_bit_offsets_runs_the_reference(kind, name, fresh_warnings,
                                                                               monkeypatch):
    """Where the 64-bit offsets of `kernels.triton_offsets` could not be installed
    (pretended here), a stacked fp8 cache of 2**31 to 2**32 elements would be read with
    wrapping 32-bit offsets: auto runs the reference and says so once, naming the cache
    and the reason; the explicit kernel raises. With the widening installed (the real
    state) auto runs the kernel and says nothing."""
    from jax_paged_attn.kernels import triton_offsets

    monkeypatch.setattr(dispatch, "default_platform", lambda: "cuda")
    fn, args = _attention_on(kind, BIG_FP8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)
        text = _cuda_text(fn, args)
    assert TRITON_CALL in text

    monkeypatch.setattr(triton_offsets, "INSTALLED", False)
    monkeypatch.setattr(triton_offsets, "REASON", "pretended for the test")
    why = (rf"{name} is a plane of a stacked cache of 2148007936 float8_e4m3fn elements .* signed 32-bit "
           r".* not installed: pretended for the test")
    with pytest.warns(dispatch.ReferenceFallbackWarning, match=why):
        text = _cuda_text(fn, args)
    assert TRITON_CALL not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)  # said once
        _cuda_text(fn, args)
    explicit, _ = _attention_on(kind, BIG_FP8, implementation="triton")
    with pytest.raises(NotImplementedError, match=f"implementation='triton' cannot run this call: {why}"):
        _cuda_text(explicit, args)
    small, small_args = _attention_on(kind, S((2, 64, 16, 8, 128), jnp.float8_e4m3fn))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)  # a small fp8 cache: the kernel
        text = _cuda_text(small, small_args)
    # (auto prefills at head size 128 through the Mosaic GPU kernel, `tuning.MOSAIC_PREFILL_HEAD_SIZES`)
    assert (MOSAIC_GPU_CALL if kind == "paged_prefill" else TRITON_CALL) in text


def test_kernel_implementations_and_their_lowerings():
    assert dispatch.IMPLEMENTATIONS == ("auto", "xla", "triton", "mosaic_gpu")
    assert dispatch.kernel_lowering("mosaic_gpu") == "mosaic_gpu"
    # auto's kernel is Triton's, except where `varlen_attention` takes the Mosaic GPU one
    # (`test_lowering.test_auto_prefills_at_head_sizes_128_and_256_through_the_mosaic_gpu_kernel`).
    for implementation in (None, "auto", "triton"):
        assert dispatch.kernel_lowering(implementation) == "triton"
    with pytest.raises(ValueError, match="implementation must be one of"):
        dispatch.kernel_lowering("mosaic")




def test_an_eager_reference_call_compiles_one_program_and_equal_calls_share_it():
    """implementation="xla" outside jit: the reference runs as one jitted callee (one XLA
    compilation, not one per operation), which a second call of the same shapes and
    static arguments reuses without compiling; the fused norm's callee is shared the
    same way (one entry of the shared table for equal calls)."""
    import numpy as np

    from conftest import CompileCounter
    from jax_paged_attn import norm

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 1, 4, 32)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((6, 16, 2, 32)), jnp.float32)
    lens = jnp.array([5, 17, 30], jnp.int32)
    table = jnp.array([[0, 1], [2, 3], [4, 5]], jnp.int32)
    call = lambda rows=3: jpa.flash_attn_with_kvcache(q[:rows], cache, cache, lens[:rows], table[:rows],
                                                     causal=True, implementation="xla")
    call(rows=2)  # other shapes first: the default scales' conversion (two scalar ops) compiles once
    counter = CompileCounter()
    with counter:
        first = call()
    assert counter.count == 1  # op by op, the reference compiled 51 programs
    with counter:
        again = call()
    assert counter.count == 0
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))

    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    weight = jnp.ones((64,), jnp.float32)
    norm.add_rms_norm(x, x, weight, eps=1e-6, implementation="xla")
    entries = len(dispatch._TRACED_ONCE)
    with counter:
        norm.add_rms_norm(x, x, weight, eps=1e-6, implementation="xla")
    assert len(dispatch._TRACED_ONCE) == entries and counter.count == 0
