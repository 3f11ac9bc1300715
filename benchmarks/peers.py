"""The decode suite's implementations (ours and its peers) and what every suite's peers share.

Owns: `Impl` (one column of a suite: ``run(ctx, case, inputs) -> Measurement``); the
helpers the peers of several suites use (our public API, the softmax scale, which kernel
``implementation=None`` ran, torch's SDPA and ``varlen_attn`` runners); and the decode
runners: ours, auto, our Mosaic GPU lowering, stock Pallas paged attention, cuDNN paged
and contiguous, XLA's gather, torch SDPA and torch ``varlen_attn`` (`DECODE_IMPLS`).
The prefill, varlen and prefix peers are `prefill_peers.py`'s, the cache-write ones
`cache_peers.py`'s; the grids the swept peers take the best of are `sweeps.py`'s.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from suites import DecodeCase, DecodeInputs, cumulative
from sweeps import mosaic_decode_grid, stock_paged_grid
from timing import Context, Measurement, Unavailable, short_error, to_numpy, torch_to_numpy

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Impl:
    """One column of a suite: ``run(ctx, case, inputs) -> Measurement``."""

    name: str
    describe: str
    run: Callable[..., Measurement]
    is_ours: bool = False


def _ours_api():
    import jax_paged_attn

    return jax_paged_attn


def _softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# --------------------------------------------------------------------------- decode


def _decode_call(ctx: Context, x: DecodeInputs, implementation: str | None) -> tuple[Callable[..., Any], tuple]:
    """`flash_attn_with_kvcache` jitted with ``implementation``, and its arguments."""
    api = _ours_api()
    fn = jax.jit(functools.partial(api.flash_attn_with_kvcache, causal=True, implementation=implementation,
                                   interpret=ctx.interpret))
    return fn, (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)


def decode_ours(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    fn, args = _decode_call(ctx, x, ctx.ours_implementation)
    return ctx.time_jax(lambda: fn(*args), lambda o: to_numpy(o)[:, 0])


def decode_auto(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    """What a user's call runs: `flash_attn_with_kvcache` with ``implementation=None``
    (auto: the kernel the package picks for this GPU), checked against ours."""
    fn, args = _decode_call(ctx, x, None)
    return ctx.time_jax(lambda: fn(*args), lambda o: to_numpy(o)[:, 0], note=f"auto ran the {auto_kernel(fn, *args)}")


def auto_kernel(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Which kernel the jitted ``fn`` runs on ``args``, read from its lowered module (the
    custom calls a Pallas kernel lowers to), so the note says what auto really chose."""
    text = fn.lower(*args, **kwargs).as_text()
    markers = (("Mosaic GPU kernel", "custom_call @mosaic_gpu"), ("Triton kernel", "__gpu$xla.gpu.triton"))
    kernels = [name for name, marker in markers if marker in text]
    return " and ".join(kernels) if kernels else "XLA reference"


def decode_ours_mosaic_gpu(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    """Our decode kernel's Mosaic GPU lowering (`decode.paged_decode_attention`,
    lowering='mosaic_gpu'), best of `mosaic_decode_grid` (every config's time is kept in
    the row's sweep), checked against ours (the Triton tier unless --ours-impl)."""
    from jax_paged_attn import decode
    from jax_paged_attn.spec import AttentionSpec

    spec = AttentionSpec.create(case.head_dim, causal=True)
    scale = jnp.ones((), jnp.float32)

    def make_call(config):
        fn = jax.jit(functools.partial(decode.paged_decode_attention, spec=spec, lowering="mosaic_gpu",
                                       interpret=ctx.interpret, config=config))
        return lambda: fn(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, None, scale, scale)

    return ctx.sweep(mosaic_decode_grid(ctx.quick), make_call, repr, lambda o: to_numpy(o)[:, 0])


def decode_stock_pallas(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import paged_attention as stock

    # Stock layout [Hk, pages, page, D] (same page ids); it has no softmax scale: pre-scale q.
    k_pages = jnp.transpose(x.k_cache, (2, 0, 1, 3))
    v_pages = jnp.transpose(x.v_cache, (2, 0, 1, 3))
    q = (x.q[:, 0].astype(jnp.float32) * _softmax_scale(case.head_dim)).astype(x.q.dtype)

    def make_call(config):
        k_splits, per_block = config
        fn = jax.jit(functools.partial(stock.paged_attention, k_splits=k_splits,
                                       pages_per_compute_block=per_block))
        return lambda: fn(q, k_pages, v_pages, x.block_table, x.seqlens)

    grid = stock_paged_grid(case.pages_per_seq, ctx.quick)
    return ctx.sweep(grid, make_call, lambda c: f"k_splits={c[0]} pages_per_compute_block={c[1]}", to_numpy)


def decode_cudnn_paged(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    page_table = x.block_table[:, None, :, None]  # [B, 1, pages, 1]
    q_lens = jnp.ones((case.batch,), jnp.int32)
    fn = jax.jit(functools.partial(cudnn.paged_attention, scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(x.q, x.k_cache, x.v_cache, q_lens, x.seqlens, page_table, page_table),
                        lambda o: to_numpy(o)[:, 0])


def decode_cudnn_contiguous(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    k, v = x.contiguous(x.k_cache, case.context), x.contiguous(x.v_cache, case.context)
    fn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, implementation="cudnn"))
    return ctx.time_jax(lambda: fn(x.q, k, v, x.seqlens), lambda o: to_numpy(o)[:, 0])


def xla_gather_decode(q: Array, k_cache: Array, v_cache: Array, block_table: Array, seqlens: Array,
                      scale: float) -> Array:
    """Plain XLA decode: gather every page of each sequence, then einsum + softmax."""
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = block_table.shape[1] * k_cache.shape[1]
    k = k_cache[block_table].reshape(batch, keys, kv_heads, head_dim)
    v = v_cache[block_table].reshape(batch, keys, kv_heads, head_dim)
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = jnp.einsum("bhgd,bthd->bhgt", grouped, k, preferred_element_type=jnp.float32) * scale
    in_seq = jnp.arange(keys)[None, :] < seqlens[:, None]  # [B, keys]
    scores = jnp.where(in_seq[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgt,bthd->bhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)


def decode_xla_gather(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    fn = jax.jit(functools.partial(xla_gather_decode, scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(x.q, x.k_cache, x.v_cache, x.block_table, x.seqlens), to_numpy)


def _torch_sdpa(backend_name: str):
    def run(ctx: Context, case: Any, x: Any) -> Measurement:
        torch = ctx.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        mask = None
        if isinstance(case, DecodeCase):
            q = ctx.to_torch(x.q).transpose(1, 2).contiguous()  # [B, Hq, 1, D]
            k = ctx.to_torch(x.contiguous(x.k_cache, case.context)).transpose(1, 2).contiguous()
            v = ctx.to_torch(x.contiguous(x.v_cache, case.context)).transpose(1, 2).contiguous()
            causal, convert = False, lambda o: torch_to_numpy(o)[:, :, 0]
            if case.contexts:  # a ragged batch: each sequence's keys past its length masked out
                visible = ctx.to_torch(jnp.arange(case.context)[None, :] < x.seqlens[:, None])
                mask = visible[:, None, None, :]  # [B, 1, 1, ctx]
        else:  # dense prefill: [B, H, S, D]
            seq = case.q_lens[0]
            q = ctx.to_torch(x.q).reshape(case.batch, seq, case.q_heads, -1).transpose(1, 2).contiguous()
            k = ctx.to_torch(x.k).reshape(case.batch, seq, case.kv_heads, -1).transpose(1, 2).contiguous()
            v = ctx.to_torch(x.v).reshape(case.batch, seq, case.kv_heads, -1).transpose(1, 2).contiguous()
            causal = True
            convert = lambda o: torch_to_numpy(o.transpose(1, 2)).reshape(-1, case.q_heads, case.head_dim)

        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                        enable_gqa=True)

        measured = ctx.time_torch(call, convert)
        if measured.retime is None:  # measured once: free the inputs (kept for the rounds otherwise)
            del q, k, v, call
            torch.cuda.empty_cache()
        return measured

    return run


def _torch_varlen_attn(ctx: Context) -> tuple[Callable[..., Any], set[str]]:
    ctx.torch  # noqa: B018 - raises Unavailable without torch / CUDA
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"torch.nn.attention.varlen.varlen_attn missing: {short_error(e, 200)}") from e
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _torch_causal_kwargs(params: set[str]) -> dict[str, Any]:
    # Newer torch spells causal as window_size=(-1, 0) (bottom-right, flash-attention's).
    return {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}


def decode_torch_varlen_paged(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    varlen_attn, params = _torch_varlen_attn(ctx)
    if "block_table" not in params:
        raise Unavailable("this torch's varlen_attn takes no block_table")
    torch = ctx.torch
    q = ctx.to_torch(x.q[:, 0])  # [B, Hq, D]: one query per sequence
    kc, vc = ctx.to_torch(x.k_cache), ctx.to_torch(x.v_cache)
    cu_q = torch.arange(case.batch + 1, dtype=torch.int32, device="cuda")
    cu_k = ctx.to_torch(cumulative(case.seqlens))
    table, used = ctx.to_torch(x.block_table), ctx.to_torch(x.seqlens)
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}
    return ctx.time_torch(
        lambda: varlen_attn(q, kc, vc, cu_q, cu_k, 1, case.context, block_table=table, seqused_k=used,
                            **_torch_causal_kwargs(params), **extra),
        torch_to_numpy)


DECODE_IMPLS = (
    Impl("ours", "jax_paged_attn.flash_attn_with_kvcache (implementation='triton' unless --ours-impl), "
                 "vLLM cache layout, permuted block table", decode_ours, is_ours=True),
    Impl("auto", "jax_paged_attn.flash_attn_with_kvcache(implementation=None): the kernel the package runs by "
                 "default on this GPU", decode_auto),
    Impl("ours_mosaic_gpu", "our decode kernel's Mosaic GPU lowering (first cut; what "
                            "implementation='mosaic_gpu' runs), best of a MosaicDecodeConfig sweep, same inputs "
                            "as ours", decode_ours_mosaic_gpu),
    Impl("stock_pallas", "jax.experimental.pallas.ops.gpu.paged_attention, layout [Hk, pages, page, D], "
                         "best of a k_splits × pages_per_compute_block sweep (q pre-scaled: it takes no scale)",
         decode_stock_pallas),
    Impl("cudnn_paged", "JAX cuDNN paged attention (internal jax._src.cudnn.fused_attention_stablehlo."
                        "paged_attention), same cache and block table", decode_cudnn_paged),
    Impl("torch_sdpa_cudnn", "torch SDPA, CUDNN_ATTENTION backend, contiguous K/V, enable_gqa",
         _torch_sdpa("CUDNN_ATTENTION")),
    Impl("torch_sdpa_flash", "torch SDPA, FLASH_ATTENTION backend, contiguous K/V, enable_gqa",
         _torch_sdpa("FLASH_ATTENTION")),
    Impl("cudnn_contig", "jax.nn.dot_product_attention(implementation='cudnn') on contiguous [B, ctx, Hk, D] "
                         "K/V (not paged)", decode_cudnn_contiguous),
    Impl("xla_gather", "XLA: gather the pages, einsum, softmax, einsum", decode_xla_gather),
    Impl("torch_varlen_paged", "torch.nn.attention.varlen.varlen_attn with block_table (when this torch "
                               "has it)", decode_torch_varlen_paged),
)
