"""vLLM-compatible attention functions (flash-attention argument conventions).

Both functions are pure and jit-able: every argument that fixes a shape or the
program (``max_seqlen_*``, ``softmax_scale``, ``causal``, ``window_size``,
``softcap``, ``implementation``, ``interpret``) is a Python value; arrays may be
traced. See `jax_paged_attn.spec` for the mask conventions (bottom-right causal).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import checks, dispatch
from jax_paged_attn.spec import UNBOUNDED, AttentionSpec

Array = jax.Array


def flash_attn_varlen_func(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    alibi_slopes: Array | None = None,
    softcap: float = 0.0,
    block_table: Array | None = None,
    seqused_k: Array | None = None,
    k_scale: Array | float = 1.0,
    v_scale: Array | float = 1.0,
    implementation: str | None = None,
    interpret: bool = False,
) -> Array:
    """Attention over variable-length sequences packed along the token axis.

    Args:
      q: ``[total_q, Hq, D]`` float16 / bfloat16 / float32; sequence ``b`` owns rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``. Rows past ``cu_seqlens_q[-1]`` are
        padding and come out as 0.
      k, v: packed ``[total_k, Hk, D]`` (same dtype as q), or, when ``block_table``
        is given, a paged cache ``[num_blocks, block_size, Hk, D]`` in q's dtype or
        fp8 (``float8_e4m3fn`` / ``float8_e5m2``, dequantized as ``x * k_scale``).
        ``Hq`` must be a multiple of ``Hk`` (GQA/MQA: query head h reads KV head
        ``h // (Hq // Hk)``); D a supported head size (`get_supported_head_sizes`).
      cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]``, cumulative query / key lengths
        starting at 0. With a block table, ``cu_seqlens_k`` gives each sequence's key
        count (its tokens are read from the cache, the new ones included).
      max_seqlen_q, max_seqlen_k: static Python ints bounding the lengths: at least every
        sequence's query / key count (sequences without keys, or without queries,
        excepted); checked when the lengths are concrete.
      softmax_scale: scores are ``softmax_scale * q·k``; default ``1/sqrt(D)``.
      causal: bottom-right aligned causal mask (query i sees key j iff
        ``j <= i + Sk - Sq``).
      window_size: ``(left, right)`` sliding window around the aligned diagonal;
        -1 means unbounded. If not (-1, -1), implements sliding-window local attention.
      alibi_slopes: float32 ``[Hq]``; adds ``-slope * |i + Sk - Sq - j|``.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after
        scaling, before ALiBi and the mask).
      block_table: int32 ``[B, max_blocks_per_seq]`` page ids into k / v, or None for
        packed k / v.
      seqused_k: optional int32 ``[B]`` key counts overriding ``cu_seqlens_k``; with packed
        k / v at most each sequence's ``cu_seqlens_k`` segment.
      k_scale, v_scale: float32 scalars; used only with an fp8 cache.
      implementation: None/"auto", "xla" (reference), "triton" or "mosaic_gpu" (Hopper;
        benchmarks/RESULTS.md) (`jax_paged_attn.dispatch`).
      interpret: run Pallas kernels in interpret mode (for CPU tests).

    Returns:
      ``[total_q, Hq, D]`` in q's dtype.

    Checked always (also under jit): ranks, dtypes, head sizes, head counts, the
    ALiBi shape, block size. Checked only on concrete (non-traced) arrays:
    cu_seqlens start at 0 and never decrease, lengths within ``max_seqlen_*`` and
    (packed) ``seqused_k`` within its segment, block ids in range, fp8 scales finite
    and > 0.
    """
    checks.check_ndim(q, 3, "q")
    checks.check_query_dtype(q)
    num_q_heads, head_size = q.shape[1], q.shape[2]
    checks.check_head_size(head_size, "head size of q")
    paged = block_table is not None
    kv_rank = 4 if paged else 3
    for name, x in (("k", k), ("v", v)):
        checks.check_ndim(x, kv_rank, name + (" (a paged cache, since block_table is given)" if paged else ""))
        checks.check_kv_dtype(x, q.dtype, name)
        if x.shape[-1] != head_size:
            raise ValueError(f"{name} has head size {x.shape[-1]}, q has {head_size}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}.")
    if not paged and jnp.dtype(k.dtype) != jnp.dtype(q.dtype):
        raise TypeError("packed k / v must have q's dtype; fp8 is for the paged cache (pass block_table).")
    checks.check_heads(num_q_heads, k.shape[-2], "q", "k")
    max_seqlen_q = checks.check_static_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = checks.check_static_int(max_seqlen_k, "max_seqlen_k")
    checks.check_int_array(cu_seqlens_q, "cu_seqlens_q", (None,))
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError("cu_seqlens_q must have at least 2 entries (one sequence).")
    checks.check_int_array(cu_seqlens_k, "cu_seqlens_k", (batch + 1,))
    checks.check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", total=q.shape[0])
    checks.check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", total=None if paged else k.shape[0])
    if seqused_k is not None:
        checks.check_int_array(seqused_k, "seqused_k", (batch,))
        checks.check_nonnegative_values(seqused_k, "seqused_k")
    if paged:
        checks.check_int_array(block_table, "block_table", (batch, None))
        checks.check_block_size(k.shape[1], "block size of the cache (k.shape[1])")
        if checks.is_concrete(cu_seqlens_k):
            lens = np.diff(np.asarray(cu_seqlens_k)) if seqused_k is None else seqused_k
            checks.check_block_table_values(block_table, k.shape[0], lens, k.shape[1])
    checks.check_varlen_length_values(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                      packed=not paged)
    checks.check_alibi_slopes(alibi_slopes, num_q_heads)
    spec = AttentionSpec.create(
        head_size, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, has_alibi=alibi_slopes is not None,
    )
    return dispatch.varlen_attention(
        q, k, v, cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32),
        None if block_table is None else block_table.astype(jnp.int32),
        None if seqused_k is None else seqused_k.astype(jnp.int32),
        None if alibi_slopes is None else alibi_slopes.astype(jnp.float32),
        checks.scale_array(k_scale, "k_scale"), checks.scale_array(v_scale, "v_scale"),
        spec=spec, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        implementation=implementation, interpret=interpret,
    )


def flash_attn_with_kvcache(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    cache_seqlens: Array,
    block_table: Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    alibi_slopes: Array | None = None,
    softcap: float = 0.0,
    k_scale: Array | float = 1.0,
    v_scale: Array | float = 1.0,
    implementation: str | None = None,
    interpret: bool = False,
) -> Array:
    """Decode attention: Sq new queries per sequence over its paged KV cache.

    Args:
      q: ``[B, Sq, Hq, D]``; Sq >= 1 (several tokens per sequence for speculative
        decoding).
      k_cache, v_cache: ``[num_blocks, block_size, Hk, D]`` in q's dtype or fp8
        (dequantized as ``x * k_scale``); block_size a multiple of 16.
      cache_seqlens: int32 ``[B]``: tokens of each sequence in the cache, *including*
        the Sq new ones (write them first with `reshape_and_cache_flash`). A sequence
        with 0 (batch padding) outputs 0.
      block_table: int32 ``[B, max_blocks_per_seq]``.
      softmax_scale, causal, window_size, alibi_slopes, softcap, k_scale, v_scale,
      implementation, interpret: as in `flash_attn_varlen_func`.

    Returns:
      ``[B, Sq, Hq, D]`` in q's dtype.
    """
    checks.check_ndim(q, 4, "q")
    checks.check_query_dtype(q)
    batch, _, num_q_heads, head_size = q.shape
    checks.check_head_size(head_size, "head size of q")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_ndim(x, 4, name)
        checks.check_kv_dtype(x, q.dtype, name)
        if x.shape[-1] != head_size:
            raise ValueError(f"{name} has head size {x.shape[-1]}, q has {head_size}.")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k_cache.shape} and {v_cache.shape}.")
    checks.check_heads(num_q_heads, k_cache.shape[2], "q", "k_cache")
    checks.check_block_size(k_cache.shape[1], "block size of the cache (k_cache.shape[1])")
    checks.check_int_array(cache_seqlens, "cache_seqlens", (batch,))
    checks.check_int_array(block_table, "block_table", (batch, None))
    checks.check_nonnegative_values(cache_seqlens, "cache_seqlens")
    if checks.is_concrete(cache_seqlens):
        checks.check_block_table_values(block_table, k_cache.shape[0], cache_seqlens, k_cache.shape[1])
    checks.check_alibi_slopes(alibi_slopes, num_q_heads)
    spec = AttentionSpec.create(
        head_size, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, has_alibi=alibi_slopes is not None,
    )
    return dispatch.paged_decode_attention(
        q, k_cache, v_cache, cache_seqlens.astype(jnp.int32), block_table.astype(jnp.int32),
        None if alibi_slopes is None else alibi_slopes.astype(jnp.float32),
        checks.scale_array(k_scale, "k_scale"), checks.scale_array(v_scale, "v_scale"),
        spec=spec, implementation=implementation, interpret=interpret,
    )


def get_supported_head_sizes() -> list[int]:
    """Head sizes supported by every implementation (vLLM backend API)."""
    return checks.supported_head_sizes()
