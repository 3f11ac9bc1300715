"""Float64 NumPy oracle for the attention semantics of `jax_paged_attn`.

Written from the semantics stated in README.md and `jax_paged_attn.spec`'s docstring,
independently of `jax_paged_attn.reference` (no code is shared): one Python loop per
sequence and per query head, the mask spelled out key by key. Slow, obvious and
exact; tests compare every implementation, the reference included, against it.

Rules (flash-attention 2 as vLLM uses it), for one sequence with Sq queries and Sk keys:

* scores ``s[i, j] = softmax_scale * q[i] . k[j]`` (default scale ``1/sqrt(D)``);
* soft-cap: ``s = c * tanh(s / c)`` when ``c > 0``;
* ALiBi: ``s -= slope[h] * |i + Sk - Sq - j|``;
* query i is aligned with key ``d = i + Sk - Sq`` (bottom-right); key j is visible iff
  ``j <= d`` when causal, ``j >= d - left`` when ``left >= 0`` and ``j <= d + right``
  when ``right >= 0`` (``window_size = (left, right)``, -1 = unbounded);
* GQA / MQA: query head h reads KV head ``h // (Hq // Hk)``;
* softmax over the visible keys; a query that sees no key outputs 0;
* a NaN / inf in the values, or a NaN / +inf score, of a key a query sees makes that
  (query, head) row NaN in every channel (plain arithmetic would make only some
  channels non-finite); nothing a query does not see reaches it;
* fp8 caches hold ``x / scale``: the oracle reads ``cache * scale``.

``emulate_dtype`` turns the oracle into the *low-precision reference* of
FlashAttention-3's tests: it rounds where a flash-attention kernel working in that
dtype rounds (scores to float32, the dequantized fp8 K/V and the unnormalized
probabilities to ``emulate_dtype`` before the P·V product, the output to
``emulate_dtype``). Its distance to the exact oracle measures how much error the
dtype itself forces, and tests allow a kernel a small multiple of it.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

UNBOUNDED = -1  # a window side that does not limit attention (flash-attention's -1)


def as_float64(x: Any) -> np.ndarray:
    """Exact float64 copy of a JAX / NumPy array of any float dtype (fp8 and bf16 included)."""
    return np.asarray(x).astype(np.float64)


def is_fp8(x: Any) -> bool:
    """True for float8_e4m3fn / float8_e5m2 (ml_dtypes) arrays."""
    return np.dtype(x.dtype).name.startswith("float8")


def key_is_visible(i: int, j: int, q_len: int, k_len: int, *, causal: bool,
                   window_size: Sequence[int]) -> bool:
    """Whether key j of a sequence is visible to its query i (the rules of the module docstring)."""
    left, right = window_size
    diagonal = i + k_len - q_len
    if not (0 <= i < q_len and 0 <= j < k_len):
        return False
    if causal and j > diagonal:
        return False
    if left != UNBOUNDED and j < diagonal - left:
        return False
    if right != UNBOUNDED and j > diagonal + right:
        return False
    return True


def visibility_matrix(q_len: int, k_len: int, *, causal: bool = False,
                      window_size: Sequence[int] = (UNBOUNDED, UNBOUNDED)) -> np.ndarray:
    """bool ``[q_len, k_len]``: entry (i, j) tells whether query i sees key j."""
    mask = np.zeros((q_len, k_len), dtype=bool)
    for i in range(q_len):
        for j in range(k_len):
            mask[i, j] = key_is_visible(i, j, q_len, k_len, causal=causal, window_size=window_size)
    return mask


def _round(x: np.ndarray, dtype: Any | None) -> np.ndarray:
    return x if dtype is None else x.astype(dtype).astype(np.float64)


def attention_one_sequence(
    q: np.ndarray,  # f64[Sq, Hq, D]
    k: np.ndarray,  # f64[Sk, Hk, D], already dequantized
    v: np.ndarray,  # f64[Sk, Hk, D], already dequantized
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,  # f64[Hq]
    emulate_dtype: Any | None = None,
) -> np.ndarray:  # f64[Sq, Hq, D]
    """Attention of one sequence's queries over its keys, exactly (or emulating a dtype)."""
    q_len, num_q_heads, head_size = q.shape
    k_len, num_kv_heads = k.shape[0], k.shape[1]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if softmax_scale is None else float(softmax_scale)
    mask = visibility_matrix(q_len, k_len, causal=causal, window_size=window_size)
    score_dtype = None if emulate_dtype is None else np.float32
    out = np.zeros((q_len, num_q_heads, head_size), np.float64)
    for h in range(num_q_heads):
        kv_head = h // group
        scores = _round(scale * (q[:, h, :] @ k[:, kv_head, :].T), score_dtype)  # [Sq, Sk]
        if softcap > 0:
            scores = softcap * np.tanh(scores / softcap)
        if alibi_slopes is not None:
            for i in range(q_len):
                for j in range(k_len):
                    scores[i, j] -= alibi_slopes[h] * abs(i + k_len - q_len - j)
        for i in range(q_len):
            seen = mask[i]
            if not seen.any():
                continue  # a query that sees no key outputs 0
            row = scores[i, seen]
            unnormalized = np.exp(row - row.max())
            weights = _round(unnormalized, emulate_dtype)
            row_out = (weights @ v[seen, kv_head, :]) / unnormalized.sum()
            out[i, h, :] = row_out if np.isfinite(row_out).all() else np.nan
    return _round(out, emulate_dtype)


def _dequantize(x: Any, scale: Any, emulate_dtype: Any | None) -> np.ndarray:
    """f64 copy of packed tokens / a cache; fp8 is multiplied by its scale."""
    values = as_float64(x)
    if is_fp8(x):
        values = values * float(np.asarray(scale, np.float64).reshape(()))
        # A kernel dequantizes fp8 into the dtype it computes in.
        values = _round(values, emulate_dtype)
    return values


def _paged_tokens(cache: np.ndarray, block_table_row: np.ndarray, length: int) -> np.ndarray:
    """Tokens 0..length-1 of one sequence, read one by one through its block table row."""
    block_size = cache.shape[1]
    tokens = [cache[int(block_table_row[j // block_size]), j % block_size] for j in range(length)]
    return np.stack(tokens) if tokens else np.zeros((0,) + cache.shape[2:], np.float64)


def varlen_attention(
    q: Any,  # [Tq, Hq, D]
    k: Any,  # [Tk, Hk, D] packed, or [num_blocks, block_size, Hk, D] with block_table
    v: Any,  # same layout as k
    cu_seqlens_q: Any,  # int[B + 1]
    cu_seqlens_k: Any,  # int[B + 1]
    *,
    block_table: Any | None = None,  # int[B, max_blocks]
    seqused_k: Any | None = None,  # int[B], overrides the key counts of cu_seqlens_k
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0.0,
    alibi_slopes: Any | None = None,  # [Hq]
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    emulate_dtype: Any | None = None,
) -> np.ndarray:  # f64[Tq, Hq, D]
    """Oracle of `flash_attn_varlen_func`; query rows outside every sequence are 0."""
    qs = as_float64(q)
    ks = _dequantize(k, k_scale, emulate_dtype)
    vs = _dequantize(v, v_scale, emulate_dtype)
    cu_q = np.asarray(cu_seqlens_q).astype(np.int64)
    cu_k = np.asarray(cu_seqlens_k).astype(np.int64)
    slopes = None if alibi_slopes is None else as_float64(alibi_slopes)
    out = np.zeros(qs.shape, np.float64)
    for b in range(len(cu_q) - 1):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        k_len = int(cu_k[b + 1] - cu_k[b]) if seqused_k is None else int(np.asarray(seqused_k)[b])
        if block_table is None:
            seq_k = ks[cu_k[b]:cu_k[b] + k_len]
            seq_v = vs[cu_k[b]:cu_k[b] + k_len]
        else:
            row = np.asarray(block_table)[b]
            seq_k = _paged_tokens(ks, row, k_len)
            seq_v = _paged_tokens(vs, row, k_len)
        out[q_start:q_end] = attention_one_sequence(
            qs[q_start:q_end], seq_k, seq_v, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes,
            emulate_dtype=emulate_dtype,
        )
    return out


def kvcache_attention(
    q: Any,  # [B, Sq, Hq, D]
    k_cache: Any,  # [num_blocks, block_size, Hk, D]
    v_cache: Any,  # [num_blocks, block_size, Hk, D]
    cache_seqlens: Any,  # int[B], the Sq new tokens included
    block_table: Any,  # int[B, max_blocks]
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0.0,
    alibi_slopes: Any | None = None,  # [Hq]
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    emulate_dtype: Any | None = None,
) -> np.ndarray:  # f64[B, Sq, Hq, D]
    """Oracle of `flash_attn_with_kvcache`: each sequence's Sq queries over its cache."""
    qs = as_float64(q)
    ks = _dequantize(k_cache, k_scale, emulate_dtype)
    vs = _dequantize(v_cache, v_scale, emulate_dtype)
    lengths = np.asarray(cache_seqlens).astype(np.int64)
    table = np.asarray(block_table)
    slopes = None if alibi_slopes is None else as_float64(alibi_slopes)
    out = np.zeros(qs.shape, np.float64)
    for b in range(qs.shape[0]):
        seq_k = _paged_tokens(ks, table[b], int(lengths[b]))
        seq_v = _paged_tokens(vs, table[b], int(lengths[b]))
        out[b] = attention_one_sequence(
            qs[b], seq_k, seq_v, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes,
            emulate_dtype=emulate_dtype,
        )
    return out
