"""The prefill, varlen and prefix suites' implementations: ours and its peers.

Owns: the runners of causal attention over packed queries (dense prefill, mixed lengths,
new tokens over a paged cache): ours, auto, our Mosaic GPU tier, our XLA reference, JAX's
stock Pallas kernels (Triton ``mha``, Mosaic GPU ``attention_mgpu`` in fp16), cuDNN
(dense, padded, paged with its two masks), XLA, torch SDPA and torch ``varlen_attn``;
and their columns (`PREFILL_IMPLS`, `VARLEN_IMPLS`, `PREFIX_IMPLS`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from peers import Impl, _ours_api, _softmax_scale, _torch_causal_kwargs, _torch_sdpa, _torch_varlen_attn, auto_kernel
from suites import AttentionCase, AttentionInputs
from sweeps import mosaic_prefill_grid
from timing import Context, Measurement, Unavailable, to_numpy, torch_to_numpy

Array = jax.Array


XLA_REFERENCE_MAX_BYTES = 16 << 30
"""The XLA reference materializes [B, Hq, max_q, max_k] f32 scores (a few copies);
bigger shapes are skipped rather than run out of memory."""


# --------------------------------------------------------------------------- prefill / varlen / prefix


def _attention_call(ctx: Context, x: AttentionInputs, implementation: str | None
                    ) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """`flash_attn_varlen_func` jitted with ``implementation``, and its arguments."""
    api = _ours_api()
    fn = jax.jit(functools.partial(
        api.flash_attn_varlen_func, max_seqlen_q=x.max_q, max_seqlen_k=x.max_k, causal=True,
        implementation=implementation, interpret=ctx.interpret))
    return fn, (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k), dict(block_table=x.block_table)


def attention_ours(ctx: Context, case: AttentionCase, x: AttentionInputs, implementation: str | None = None
                   ) -> Measurement:
    fn, args, kwargs = _attention_call(ctx, x, implementation or ctx.ours_implementation)
    return ctx.time_jax(lambda: fn(*args, **kwargs), to_numpy)


def attention_auto(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    """What a user's call runs: `flash_attn_varlen_func` with ``implementation=None``
    (auto), checked against ours."""
    fn, args, kwargs = _attention_call(ctx, x, None)
    return ctx.time_jax(lambda: fn(*args, **kwargs), to_numpy,
                        note=f"auto ran the {auto_kernel(fn, *args, **kwargs)}")


def attention_ours_mosaic_gpu(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    """Our Mosaic GPU prefill tier beside the default (Triton) one
    (`prefill.varlen_attention`, lowering='mosaic_gpu'), best of `mosaic_prefill_grid`
    (every config's time is kept in the row's sweep); its output is checked against
    ours like a peer's."""
    from jax_paged_attn import prefill
    from jax_paged_attn.spec import AttentionSpec

    spec = AttentionSpec.create(case.head_dim, causal=True)

    def make_call(config):
        fn = jax.jit(functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=x.max_q,
                                       max_seqlen_k=x.max_k, lowering="mosaic_gpu", interpret=ctx.interpret,
                                       config=config))
        return lambda: fn(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.block_table, None, None, 1.0, 1.0)

    # The interpreter (CPU dry runs) takes the package's interpret default alone: the
    # warp-specialized forms run there about ten times slower.
    configs = [None] if ctx.interpret else mosaic_prefill_grid(ctx.quick, case.head_dim)
    return ctx.sweep(configs, make_call, repr, to_numpy)


def attention_xla_reference(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    scores_bytes = 3 * 4 * case.batch * case.q_heads * x.max_q * x.max_k
    if scores_bytes > XLA_REFERENCE_MAX_BYTES:
        raise Unavailable(f"would materialize ~{scores_bytes / 2**30:.0f} GiB of f32 scores")
    return attention_ours(ctx, case, x, implementation="xla")


def _dense(x: Array, case: AttentionCase) -> Array:
    """Packed [B*S, H, D] -> [B, S, H, D] (a free reshape)."""
    return x.reshape(case.batch, case.q_lens[0], *x.shape[1:])


def prefill_jax_dpa(implementation: str):
    def run(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
        q, k, v = _dense(x.q, case), _dense(x.k, case), _dense(x.v, case)
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation=implementation))
        return ctx.time_jax(lambda: fn(q, k, v), lambda o: to_numpy(o).reshape(x.q.shape))

    return run


def _repeat_kv(k: Array, q_heads: int) -> Array:
    """Stock kernels without GQA: each KV head repeated for its query heads."""
    return jnp.repeat(k, q_heads // k.shape[-2], axis=-2)


def prefill_stock_mha(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import attention as stock

    q, k, v = _dense(x.q, case), _dense(x.k, case), _dense(x.v, case)
    k, v = _repeat_kv(k, case.q_heads), _repeat_kv(v, case.q_heads)
    fn = jax.jit(functools.partial(stock.mha, segment_ids=None, causal=True,
                                   sm_scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(q, k, v), lambda o: to_numpy(o).reshape(x.q.shape),
                        note="KV heads repeated")


def prefill_mosaic_fp16(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    # fp16 only in jax 0.11.2 (bf16 is rejected); it takes no scale: pre-scale q.
    q = (_dense(x.q, case).astype(jnp.float32) * _softmax_scale(case.head_dim)).astype(jnp.float16)
    k, v = _dense(x.k, case).astype(jnp.float16), _dense(x.v, case).astype(jnp.float16)
    grid = [(64, 128, 2)] if ctx.quick else [(64, 128, 2), (128, 128, 2), (64, 64, 2)]

    def make_call(config):
        block_q, block_kv, steps = config
        tuning = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=True)
        fn = jax.jit(functools.partial(mgpu.attention, config=tuning))
        return lambda: fn(q, k, v)

    result = ctx.sweep(grid, make_call, lambda c: f"block_q={c[0]} block_kv={c[1]} steps={c[2]}",
                       lambda o: to_numpy(o).reshape(x.q.shape))
    result.note = "fp16 inputs; " + result.note
    return result


def varlen_cudnn_padded(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    q = x.padded_q()
    k, v = x.padded_kv()
    q_lens, k_lens = jnp.asarray(x.q_lens, jnp.int32), jnp.asarray(x.k_lens, jnp.int32)
    fn = jax.jit(lambda q, k, v, ql, kl: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="cudnn"))
    return ctx.time_jax(lambda: fn(q, k, v, q_lens, k_lens), x.unpad,
                        note=f"padded to [{case.batch}, {x.max_q}]")


def varlen_stock_mha_segments(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import attention as stock

    block = 128  # the stock kernel's default block; pad the token axis to a multiple
    tokens = x.q.shape[0]
    padded = -(-tokens // block) * block
    pad = ((0, padded - tokens), (0, 0), (0, 0))
    q = jnp.pad(x.q, pad)[None]
    k = jnp.pad(_repeat_kv(x.k, case.q_heads), pad)[None]
    v = jnp.pad(_repeat_kv(x.v, case.q_heads), pad)[None]
    seq_ids = np.repeat(np.arange(case.batch), x.q_lens)
    segments = jnp.asarray(np.concatenate([seq_ids, np.full(padded - tokens, case.batch)]), jnp.int32)[None]
    fn = jax.jit(functools.partial(stock.mha, causal=True, sm_scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(q, k, v, segments), lambda o: to_numpy(o)[0, :tokens],
                        note="all sequences packed in one row with segment_ids; KV heads repeated")


def varlen_torch(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    varlen_attn, params = _torch_varlen_attn(ctx)
    q = ctx.to_torch(x.q)
    k, v = x.keys_values()
    note = ""
    if "enable_gqa" in params:
        extra = {"enable_gqa": True}
    else:
        k, v, extra, note = _repeat_kv(k, case.q_heads), _repeat_kv(v, case.q_heads), {}, "KV heads repeated"
    k, v = ctx.to_torch(k), ctx.to_torch(v)
    cu_q, cu_k = ctx.to_torch(x.cu_seqlens_q), ctx.to_torch(x.cu_seqlens_k)
    return ctx.time_torch(
        lambda: varlen_attn(q, k, v, cu_q, cu_k, x.max_q, x.max_k, **_torch_causal_kwargs(params), **extra),
        torch_to_numpy, note=note)


_CUDNN_PREFIX_NOTES = {
    "CAUSAL": "cuDNN's causal mask is top-left aligned, not vLLM's bottom-right: less work and a "
              "different result (cuDNN's mask alignment)",
    "NO_MASK": "no mask: every query attends all keys, more work than causal and a different "
               "result; brackets what a correct cuDNN paged prefill would take",
}


def prefix_cudnn_paged(mask_name: str):
    def run(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        q = x.padded_q()
        page_table = x.block_table[:, None, :, None]  # [B, 1, pages, 1]
        q_lens, k_lens = jnp.asarray(x.q_lens, jnp.int32), jnp.asarray(x.k_lens, jnp.int32)
        k, v = x.k, x.v
        if k.shape[0] < x.block_table.size:
            # cuDNN wants as many cache pages as the table has entries (its error otherwise:
            # "must have same number of blocks"); unequal lengths leave fewer: zero pages
            # appended, never read, outside the timing.
            pad = ((0, x.block_table.size - k.shape[0]),) + ((0, 0),) * (k.ndim - 1)
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        fn = jax.jit(functools.partial(cudnn.paged_attention, scale=_softmax_scale(case.head_dim),
                                       mask_type=getattr(cudnn.MaskType, mask_name)))
        note = _CUDNN_PREFIX_NOTES[mask_name]
        if mask_name == "CAUSAL" and tuple(x.q_lens) == tuple(x.k_lens):
            note = "nothing cached: cuDNN's top-left causal mask is the bottom-right one here"
        return ctx.time_jax(lambda: fn(q, k, v, q_lens, k_lens, page_table, page_table), x.unpad, note=note)

    return run


def prefix_torch_varlen_paged(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    varlen_attn, params = _torch_varlen_attn(ctx)
    if "block_table" not in params:
        raise Unavailable("this torch's varlen_attn takes no block_table")
    q, kc, vc = ctx.to_torch(x.q), ctx.to_torch(x.k), ctx.to_torch(x.v)
    cu_q, cu_k = ctx.to_torch(x.cu_seqlens_q), ctx.to_torch(x.cu_seqlens_k)
    table, used = ctx.to_torch(x.block_table), ctx.to_torch(jnp.asarray(x.k_lens, jnp.int32))
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}
    return ctx.time_torch(
        lambda: varlen_attn(q, kc, vc, cu_q, cu_k, x.max_q, x.max_k, block_table=table, seqused_k=used,
                            **_torch_causal_kwargs(params), **extra),
        torch_to_numpy)


_OURS_ATTENTION = Impl("ours", "jax_paged_attn.flash_attn_varlen_func (implementation='triton' unless "
                               "--ours-impl), packed tokens; paged cache + block_table for prefix",
                       attention_ours, is_ours=True)
_OURS_MOSAIC_GPU = Impl("ours_mosaic_gpu", "jax_paged_attn.flash_attn_varlen_func(implementation='mosaic_gpu'): "
                                           "our Pallas Mosaic GPU prefill kernel (Hopper; first cut, "
                                           "warp-specialized), same inputs as ours", attention_ours_mosaic_gpu)
_AUTO_ATTENTION = Impl("auto", "jax_paged_attn.flash_attn_varlen_func(implementation=None): the kernel the "
                                "package runs by default on this GPU", attention_auto)
_XLA_REFERENCE = Impl("xla_ref", "jax_paged_attn.flash_attn_varlen_func(implementation='xla'), our reference "
                                 "(skipped when its f32 scores would not fit)", attention_xla_reference)

PREFILL_IMPLS = (
    _OURS_ATTENTION,
    _AUTO_ATTENTION,
    _OURS_MOSAIC_GPU,
    Impl("stock_mha", "jax.experimental.pallas.ops.gpu.attention.mha (Pallas Triton), KV heads repeated",
         prefill_stock_mha),
    Impl("cudnn", "jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)", prefill_jax_dpa("cudnn")),
    Impl("torch_sdpa_cudnn", "torch SDPA, CUDNN_ATTENTION backend, enable_gqa", _torch_sdpa("CUDNN_ATTENTION")),
    Impl("mosaic_fp16", "jax.experimental.pallas.ops.gpu.attention_mgpu (Pallas Mosaic GPU) in fp16 (its only "
                        "dtype in jax 0.11.2), best of a small block sweep", prefill_mosaic_fp16),
    Impl("torch_sdpa_flash", "torch SDPA, FLASH_ATTENTION backend, enable_gqa", _torch_sdpa("FLASH_ATTENTION")),
    Impl("xla", "jax.nn.dot_product_attention(implementation='xla', is_causal=True)", prefill_jax_dpa("xla")),
)
VARLEN_IMPLS = (
    _OURS_ATTENTION,
    _AUTO_ATTENTION,
    _OURS_MOSAIC_GPU,
    Impl("cudnn_padded", "jax.nn.dot_product_attention(implementation='cudnn') on the batch padded to the "
                         "longest sequence, with query/key lengths", varlen_cudnn_padded),
    Impl("stock_mha_segments", "Pallas Triton attention.mha on all tokens as one sequence with segment_ids "
                               "(KV heads repeated)", varlen_stock_mha_segments),
    Impl("torch_varlen", "torch.nn.attention.varlen.varlen_attn (packed, causal)", varlen_torch),
    _XLA_REFERENCE,
)
PREFIX_IMPLS = (
    _OURS_ATTENTION,
    _AUTO_ATTENTION,
    _OURS_MOSAIC_GPU,
    Impl("cudnn_paged", "JAX cuDNN paged_attention, MaskType.CAUSAL (top-left aligned: not the same "
                        "function)", prefix_cudnn_paged("CAUSAL")),
    Impl("cudnn_paged_nomask", "JAX cuDNN paged_attention without a mask (all keys: an upper bracket)",
         prefix_cudnn_paged("NO_MASK")),
    _XLA_REFERENCE,
    Impl("torch_varlen_paged", "torch varlen_attn with block_table (when this torch has it)",
         prefix_torch_varlen_paged),
)
