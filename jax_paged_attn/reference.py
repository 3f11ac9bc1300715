"""Reference semantics in plain `jax.numpy`: the oracle for every kernel, and the
fallback implementation on any backend (CPU, or a GPU feature no kernel covers).

Every function here is jit-able with the documented static arguments. Scores are
computed in float32 whatever the input dtype; outputs take the query's dtype.

The NaN rule, which every implementation follows: a NaN or inf in a key's V (one channel
is enough) makes the whole (query, head) row of every query that sees that key NaN, in
every channel; K acts through the score, and a score of NaN or +inf does the same (a
score of -inf, or one soft-capped to a finite value, is an ordinary score). Nothing a
query does not see reaches its row, whatever it holds. Whole rows, not the channels
plain arithmetic would give (``sum_k p_k v_k[c]`` is non-finite only in channel ``c``):
a bad score already poisons whole rows through the softmax's max and sum, and a tile
whose mask hides keys from some of its rows keeps their values out cheaply only a row at
a time (a flag per key and row; per channel would take a second matmul there). A
kernel's unmasked tiles compute the plain product and check each output row once, after
the KV loop (`kernels.common.nan_rows_scale`).
The mask conventions are documented in `jax_paged_attn.spec`.

Layouts (vLLM's):
  * packed tokens: ``[num_tokens, num_heads, head_size]``, sequence ``b`` owns rows
    ``cu_seqlens[b] : cu_seqlens[b + 1]``;
  * paged cache: ``[num_blocks, block_size, num_kv_heads, head_size]``; token ``j``
    of sequence ``b`` lives at ``cache[block_table[b, j // block_size], j % block_size]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_paged_attn.spec import AttentionSpec

Array = jax.Array


def dequantize(cache_or_tokens: Array, scale: Array | float) -> Array:
    """Returns ``x * scale`` in float32 for an fp8 array, ``x`` in float32 otherwise."""
    x = cache_or_tokens.astype(jnp.float32)
    if jnp.dtype(cache_or_tokens.dtype).itemsize == 1:
        x = x * jnp.asarray(scale, jnp.float32)
    return x


def rotary_embedding(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half (GPT-NeoX) rotary embedding: ``x * cos + rotate_half(x) * sin``.

    ``x`` ``[..., H, D]`` (any float dtype); ``cos`` / ``sin`` ``[..., D]``, each
    token's angles with the two halves equal (``concat([a, a])``), in any float dtype.
    ``rotate_half(x) = concat([-x[..., D/2:], x[..., :D/2]])``. Computed in float32
    and rounded once to x's dtype, as the fused kernel
    (`jax_paged_attn.kernels.triton_cache`) does.
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    c = cos.astype(jnp.float32)[..., None, :]
    s = sin.astype(jnp.float32)[..., None, :]
    return (x32 * c + rotated * s).astype(x.dtype)


def key_visible(q_pos: Array, k_pos: Array, q_len: Array, k_len: Array, spec: AttentionSpec) -> Array:
    """bool: key ``k_pos`` is visible to query ``q_pos`` under `spec` (all arguments broadcast).

    q_pos / k_pos are positions within the sequence, q_len / k_len its query and key
    counts. Pure elementwise jnp, so Pallas kernels use the same function in-kernel.
    """
    diag = q_pos + (k_len - q_len)  # key aligned with the query (bottom-right)
    visible = (q_pos < q_len) & (k_pos < k_len)
    if spec.causal:
        visible &= k_pos <= diag
    if spec.window_left >= 0:
        visible &= k_pos >= diag - spec.window_left
    if spec.window_right >= 0 and not spec.causal:
        visible &= k_pos <= diag + spec.window_right
    return visible


def hide_masked_nonfinite_values(p: Array, v: Array, visible: Array) -> tuple[Array, Array]:
    """``(p, v)`` for a P·V product where a non-finite value reaches only the rows seeing it.

    p: f32 ``[M, N]`` probabilities (0 where not visible), v: ``[N, D]`` values,
    visible: bool ``[M, N]``. A masked probability is 0, but 0 * NaN = NaN would put
    NaN (or inf) in every row of the product: non-finite values become 0 and the
    probabilities of rows that *see* such a key become NaN, so exactly those rows of
    the product are NaN (in every column). Pure elementwise jnp and row reductions, so
    Pallas kernels run it in-kernel, on the tiles whose mask hides keys from some rows.
    """
    v_finite = jnp.isfinite(v)
    bad_key = jnp.max(jnp.where(v_finite, 0.0, 1.0), axis=1) > 0.0  # [N]; f32 max lowers everywhere
    v = jnp.where(v_finite, v, jnp.zeros_like(v))
    p = jnp.where(visible & bad_key[None, :], jnp.nan, p)
    return p, v


def alibi_distance(q_pos: Array, k_pos: Array, q_len: Array, k_len: Array) -> Array:
    """f32 ``|diag - k_pos|``: ALiBi subtracts ``slope * alibi_distance`` from the score."""
    return jnp.abs(q_pos + (k_len - q_len) - k_pos).astype(jnp.float32)


def _attend_padded(
    q: Array,  # [B, Q, Hq, D]
    k: Array,  # f32[B, K, Hk, D]
    v: Array,  # f32[B, K, Hk, D]
    q_lens: Array,  # i32[B]
    k_lens: Array,  # i32[B]
    alibi_slopes: Array | None,  # f32[Hq]
    spec: AttentionSpec,
) -> Array:  # f32[B, Q, Hq, D]
    batch, max_q, num_q_heads, head_size = q.shape
    max_k, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    # Keys past a sequence's length may be garbage (even NaN) in a paged cache: zero
    # them so that 0-probability * NaN cannot leak into the output.
    k_in_seq = (jnp.arange(max_k)[None, :] < k_lens[:, None])[:, :, None, None]
    k = jnp.where(k_in_seq, k, 0.0)
    v = jnp.where(k_in_seq, v, 0.0)
    # A non-finite value inside the sequence must reach exactly the rows that see its
    # key: P·V over the raw values would give 0 * NaN = NaN in every row. So P·V runs
    # over finite values and the rows that see a non-finite one are poisoned after.
    v_finite = jnp.isfinite(v)
    v_bad_key = ~jnp.all(v_finite, axis=-1)  # [B, K, Hk]
    v = jnp.where(v_finite, v, 0.0)
    qg = q.astype(jnp.float32).reshape(batch, max_q, num_kv_heads, group, head_size)
    # scores: [B, Hk, G, Q, K]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=jax.lax.Precision.HIGHEST)
    s = s * spec.softmax_scale
    if spec.softcap > 0:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    q_pos = jnp.arange(max_q, dtype=jnp.int32)[None, :, None]  # [1, Q, 1]
    k_pos = jnp.arange(max_k, dtype=jnp.int32)[None, None, :]  # [1, 1, K]
    ql = q_lens[:, None, None]
    kl = k_lens[:, None, None]
    visible = key_visible(q_pos, k_pos, ql, kl, spec)  # [B, Q, K]
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        dist = alibi_distance(q_pos, k_pos, ql, kl)  # [B, Q, K]
        s = s - slopes[None, :, :, None, None] * dist[:, None, None, :, :]
    visible = visible[:, None, None, :, :]
    s = jnp.where(visible, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(visible, jnp.exp(s - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # A row that sees no key has denom 0: its output is 0, not NaN.
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    sees_bad = jnp.any(visible & jnp.swapaxes(v_bad_key, 1, 2)[:, :, None, None, :], axis=-1)  # [B, Hk, 1, Q]
    o = jnp.where(jnp.moveaxis(sees_bad, 3, 1)[..., None], jnp.nan, o)
    return o.reshape(batch, max_q, num_q_heads, head_size)


def _gather_packed(x: Array, starts: Array, max_len: int) -> Array:
    """[T, H, D] packed rows -> [B, max_len, H, D], rows past a sequence clamped."""
    idx = starts[:, None] + jnp.arange(max_len, dtype=jnp.int32)[None, :]
    idx = jnp.clip(idx, 0, x.shape[0] - 1)
    return x[idx]


def _gather_paged(cache: Array, block_table: Array, max_len: int) -> Array:
    """[N, bs, H, D] paged cache -> [B, max_len, H, D] via the block table."""
    block_size = cache.shape[1]
    pos = jnp.arange(max_len, dtype=jnp.int32)
    logical_block = jnp.minimum(pos // block_size, block_table.shape[1] - 1)
    blocks = block_table[:, logical_block]  # [B, max_len]
    blocks = jnp.clip(blocks, 0, cache.shape[0] - 1)
    return cache[blocks, (pos % block_size)[None, :]]


def varlen_attention(
    q: Array,  # [Tq, Hq, D]
    k: Array,  # [Tk, Hk, D] packed, or [num_blocks, block_size, Hk, D] with block_table
    v: Array,  # same layout as k
    cu_seqlens_q: Array,  # i32[B + 1]
    cu_seqlens_k: Array,  # i32[B + 1]
    block_table: Array | None,  # i32[B, max_blocks_per_seq] or None
    seqused_k: Array | None,  # i32[B] or None: keys used per sequence (overrides cu_seqlens_k)
    alibi_slopes: Array | None,  # f32[Hq] or None
    k_scale: Array | float,  # f32 scalar, used when k is fp8
    v_scale: Array | float,  # f32 scalar, used when v is fp8
    *,
    spec: AttentionSpec,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> Array:  # [Tq, Hq, D], q.dtype
    """Variable-length attention over packed or paged keys (flash_attn_varlen_func).

    Query rows past ``cu_seqlens_q[-1]`` (padding) come out as 0, and so does every
    row when there is no key (no packed row, no cache block, no block-table column).
    ``max_seqlen_q`` and
    ``max_seqlen_k`` are static bounds: lengths above them are not attended (exactly
    like flash-attention, which trusts the caller; the public API rejects such lengths
    when they are concrete).
    """
    no_keys = k.shape[0] == 0 or (block_table is not None and block_table.shape[1] == 0)
    if q.size == 0 or no_keys:  # zero-size gathers would fail: every row sees nothing
        return jnp.zeros(q.shape, q.dtype)
    batch = cu_seqlens_q.shape[0] - 1
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).astype(jnp.int32)
    if seqused_k is not None:
        k_lens = seqused_k.astype(jnp.int32)
    else:
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).astype(jnp.int32)
    q_lens = jnp.minimum(q_lens, max_seqlen_q)
    k_lens = jnp.minimum(k_lens, max_seqlen_k)
    qp = _gather_packed(q, cu_seqlens_q[:-1].astype(jnp.int32), max_seqlen_q)
    if block_table is None:
        k_starts = cu_seqlens_k[:-1].astype(jnp.int32)
        kp = _gather_packed(dequantize(k, k_scale), k_starts, max_seqlen_k)
        vp = _gather_packed(dequantize(v, v_scale), k_starts, max_seqlen_k)
    else:
        kp = dequantize(_gather_paged(k, block_table, max_seqlen_k), k_scale)
        vp = dequantize(_gather_paged(v, block_table, max_seqlen_k), v_scale)
    o = _attend_padded(qp, kp, vp, q_lens, k_lens, alibi_slopes, spec)  # [B, Q, Hq, D]
    # Scatter back to packed rows; padding rows (and rows past max_seqlen_q) stay 0.
    num_tokens = q.shape[0]
    rows = cu_seqlens_q[:-1, None].astype(jnp.int32) + jnp.arange(max_seqlen_q, dtype=jnp.int32)
    valid = jnp.arange(max_seqlen_q)[None, :] < q_lens[:, None]
    rows = jnp.where(valid, rows, num_tokens)  # out of range -> dropped
    out = jnp.zeros((num_tokens,) + q.shape[1:], jnp.float32)
    out = out.at[rows.reshape(-1)].set(
        o.reshape(batch * max_seqlen_q, *q.shape[1:]), mode="drop"
    )
    return out.astype(q.dtype)


def paged_decode_attention(
    q: Array,  # [B, Sq, Hq, D]
    k_cache: Array,  # [num_blocks, block_size, Hk, D]
    v_cache: Array,  # [num_blocks, block_size, Hk, D]
    cache_seqlens: Array,  # i32[B]: tokens in the cache, the Sq new ones included
    block_table: Array,  # i32[B, max_blocks_per_seq]
    alibi_slopes: Array | None,  # f32[Hq] or None
    k_scale: Array | float,
    v_scale: Array | float,
    *,
    spec: AttentionSpec,
) -> Array:  # [B, Sq, Hq, D], q.dtype
    """Attention of Sq new queries per sequence over its paged cache (flash_attn_with_kvcache).

    A sequence with ``cache_seqlens == 0`` (padding of a batch) outputs 0; without any
    key (no cache block or no block-table column) every row does. Empty q, empty output.
    """
    batch, num_queries = q.shape[0], q.shape[1]
    max_k = block_table.shape[1] * k_cache.shape[1]
    if q.size == 0 or max_k == 0 or k_cache.shape[0] == 0:  # no row, or no key anywhere
        return jnp.zeros(q.shape, q.dtype)
    kp = dequantize(_gather_paged(k_cache, block_table, max_k), k_scale)
    vp = dequantize(_gather_paged(v_cache, block_table, max_k), v_scale)
    q_lens = jnp.full((batch,), num_queries, jnp.int32)
    k_lens = jnp.minimum(cache_seqlens.astype(jnp.int32), max_k)
    o = _attend_padded(q, kp, vp, q_lens, k_lens, alibi_slopes, spec)
    return o.astype(q.dtype)
