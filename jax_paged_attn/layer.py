"""The attention layer: vLLM's ``FlashAttentionImpl.forward`` / ``unified_flash_attention``.

`paged_attention` is the pure-function port: it writes the new keys and values into
the layer's paged cache (`jax_paged_attn.cache.reshape_and_cache_flash_kv`), attends
the prefill tokens with `flash_attn_varlen_func` and the decode tokens with
`flash_attn_with_kvcache` (or the varlen function when decodes have several query
tokens), and returns ``[prefill rows; decode rows]`` with the new cache.
`PagedAttention` is the Flax NNX module around it, for use inside any NNX model.

Token layout (`jax_paged_attn.metadata.FlashAttentionMetadata`)::

    rows: |<----- num_prefill_tokens ----->|<----- num_decode_tokens ----->|
          | prefill_0 | ... | prefill pad  | decode_0 | ... | decode pad   |

Which prefill path runs is decided statically (shapes only), so one jitted program
serves every batch with the same static metadata:

* no cache (a profiling run: ``kv_cache.size == 0``) or a block table without columns
  (``metadata.has_block_tables`` False): attention over the packed new keys and values
  (queries and keys share the rows ``query_start_loc``; ``seq_lens`` keys each);
* otherwise over the paged cache through the block tables, after the new tokens are
  written: this covers prompts with a cached prefix and chunked prefill.

Differences from vLLM 0.6's backend (which the rest follows):

* sliding windows work with the paged cache (vLLM raised); ``sliding_window=w`` lets a
  token see the ``w`` most recent tokens, itself included: flash-attention's
  ``window_size=(w - 1, 0)`` (vLLM >= 0.6.4's convention; Mistral's). Positions are
  relative to the keys a sequence reads, so decode block tables truncated to the window
  (the builder's) are right when they hold the sequence's *last* ``seq_lens`` tokens. A
  prefill that reads through the block table needs every one of its tokens cached, so
  its slots must not be skipped (`PAD_SLOT_ID`) when block tables are given;
* fp8 caches with per-tensor ``k_scale`` / ``v_scale`` (vLLM's FlashAttention backend
  asserted scales of 1);
* ``attn_type="encoder_only"``: bidirectional self-attention over the packed tokens
  (no cache read or write), for encoder models;
* pure: the new cache is returned. Under ``jax.jit`` with the cache donated
  (``donate_argnums``), XLA updates it in place.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged_attn import cache as cache_ops
from jax_paged_attn import checks
from jax_paged_attn.api import flash_attn_varlen_func, flash_attn_with_kvcache
from jax_paged_attn.kv_view import cache_planes
from jax_paged_attn.metadata import FlashAttentionMetadata, validate_metadata
from jax_paged_attn.spec import UNBOUNDED

Array = jax.Array

DECODER = "decoder"
ENCODER_ONLY = "encoder_only"
ATTN_TYPES = (DECODER, ENCODER_ONLY)
"""Supported ``attn_type`` values: causal decoder self-attention, bidirectional encoder self-attention."""


def window_size(sliding_window: int | None, attn_type: str = DECODER) -> tuple[int, int]:
    """flash-attention ``window_size`` for a model's ``sliding_window`` (tokens seen, self included)."""
    if sliding_window is None:
        return (UNBOUNDED, UNBOUNDED)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}.")
    if attn_type == ENCODER_ONLY:
        return (sliding_window - 1, sliding_window - 1)
    return (sliding_window - 1, 0)


def _check_tokens(x: Any, name: str, num_heads: int, head_size: int, num_tokens: int | None) -> None:
    checks.check_ndim(x, 2, f"{name} ([num_tokens, num_heads * head_size])")
    checks.check_query_dtype(x, name)
    if x.shape[1] != num_heads * head_size:
        raise ValueError(
            f"{name} must have {num_heads} heads x {head_size} = {num_heads * head_size} features per "
            f"token, got shape {tuple(x.shape)}."
        )
    if num_tokens is not None and x.shape[0] != num_tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens, query has {num_tokens}.")


def paged_attention(
    query: Array,  # [T, Hq * D]
    key: Array | None,  # [T, Hk * D], or None: already in kv_cache
    value: Array | None,  # [T, Hk * D], or None: already in kv_cache
    kv_cache: Array,  # [2, num_blocks, block_size, Hk, D] (cache dtype), or size 0
    metadata: FlashAttentionMetadata,
    *,
    num_heads: int,
    head_size: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: Array | Sequence[float] | None = None,
    logits_soft_cap: float | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Array | float = 1.0,
    v_scale: Array | float = 1.0,
    attn_type: str = DECODER,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """One attention layer over a batch of packed prefill and decode tokens.

    Args:
      query: ``[T, num_heads * head_size]`` float16 / bfloat16 / float32, rows laid out
        as ``metadata`` says (``T == metadata.num_tokens``).
      key, value: ``[T, num_kv_heads * head_size]``, query's dtype: the new tokens' keys
        and values (rotary embedding already applied); or both None when ``kv_cache``
        already holds them at ``metadata.slot_mapping`` (written by
        `jax_paged_attn.cache.rotary_and_cache_flash_kv`): nothing is written then, and
        every prefill must read its keys through the block tables.
      kv_cache: the layer's cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``
        (`jax_paged_attn.cache.get_kv_cache_shape`; index 0 keys, 1 values) in
        ``get_kv_cache_dtype(kv_cache_dtype, query.dtype)``; or an empty array (size 0)
        for a profiling run: nothing is written and prefills attend to the packed keys.
      metadata: the batch's `FlashAttentionMetadata`.
      num_heads, head_size, num_kv_heads: ``Hq``, ``D``, ``Hk`` (``Hq % Hk == 0``; D a
        supported head size).
      scale: softmax scale (``head_size ** -0.5`` for standard attention).
      sliding_window: None, or tokens a query sees, itself included (see `window_size`).
      alibi_slopes: None, or ``[num_heads]`` float slopes.
      logits_soft_cap: None / 0 (off), or ``c > 0``: scores become ``c * tanh(s / c)``.
      kv_cache_dtype: "auto" (cache in query's dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2".
      k_scale, v_scale: positive float32 scalars: an fp8 cache stores ``x / scale`` and
        readers use ``cache * scale``. Ignored for "auto".
      attn_type: "decoder" (causal, with the cache) or "encoder_only" (bidirectional
        over the packed tokens of each sequence; the cache is returned unchanged; the
        batch must hold prefills only).
      implementation, interpret: kernel choice for the attention calls and the cache write
        (see `jax_paged_attn.dispatch`; "xla" keeps every step in plain XLA).

    Returns:
      ``(output [T, num_heads * head_size] in query's dtype, new kv_cache)``. Padding
      rows (of padding sequences, see `FlashAttentionMetadata`) come out as 0.

    ``metadata`` goes through `jax_paged_attn.metadata.validate_metadata` (against the
    cache's block size and block count): its value checks run when its arrays are
    concrete (eager calls), its static checks always.
    """
    if not isinstance(metadata, FlashAttentionMetadata):
        raise TypeError(f"metadata must be a FlashAttentionMetadata, got {type(metadata).__name__}.")
    if attn_type not in ATTN_TYPES:
        raise ValueError(f"attn_type must be one of {ATTN_TYPES}, got {attn_type!r}.")
    num_heads = checks.check_static_int(num_heads, "num_heads")
    num_kv_heads = checks.check_static_int(num_kv_heads, "num_kv_heads")
    head_size = checks.check_static_int(head_size, "head_size")
    checks.check_head_size(head_size)
    checks.check_heads(num_heads, num_kv_heads, "num_heads", "num_kv_heads")
    _check_tokens(query, "query", num_heads, head_size, None)
    num_tokens = query.shape[0]
    cache_written = key is None and value is None
    if not cache_written:
        if key is None or value is None:
            raise ValueError("key and value must both be arrays, or both None (the cache already holds them); "
                             f"got key {'None' if key is None else 'an array'} and value "
                             f"{'None' if value is None else 'an array'}.")
        _check_tokens(key, "key", num_kv_heads, head_size, num_tokens)
        _check_tokens(value, "value", num_kv_heads, head_size, num_tokens)
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise TypeError(f"key and value must have query's dtype {query.dtype}, got {key.dtype} and {value.dtype}.")
    if num_tokens != metadata.num_tokens:
        raise ValueError(
            f"query has {num_tokens} tokens but metadata describes {metadata.num_tokens} "
            f"(num_prefill_tokens={metadata.num_prefill_tokens} + num_decode_tokens={metadata.num_decode_tokens})."
        )
    # Concrete metadata (eager calls) is checked value by value: a bound below a true
    # length or query_start_loc[-1] != T would otherwise silently give rows of zeros.
    # Under jit only its static fields and shapes are.
    cache_dims = {}
    if attn_type == DECODER and kv_cache.size > 0 and kv_cache.ndim == 5:
        cache_dims = dict(num_blocks=int(kv_cache.shape[1]), block_size=int(kv_cache.shape[2]))
    validate_metadata(metadata, **cache_dims)
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes, jnp.float32)
    window = window_size(sliding_window, attn_type)
    softcap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    common = dict(softmax_scale=scale, window_size=window, alibi_slopes=alibi_slopes, softcap=softcap,
                  implementation=implementation, interpret=interpret)

    q = query.reshape(num_tokens, num_heads, head_size)
    if cache_written:
        k = v = None
        if attn_type == ENCODER_ONLY or kv_cache.size == 0 or (
                metadata.num_prefill_tokens and not metadata.has_block_tables):
            raise ValueError(
                "key=None and value=None (the cache already holds them) need a decoder layer with a KV cache "
                "and block tables for every prefill: here the new keys themselves would be attended "
                f"(attn_type={attn_type!r}, kv_cache size {kv_cache.size}, has_block_tables="
                f"{metadata.has_block_tables}).")
    else:
        k = key.reshape(num_tokens, num_kv_heads, head_size)
        v = value.reshape(num_tokens, num_kv_heads, head_size)

    if attn_type == ENCODER_ONLY:
        if metadata.num_decode_tokens:
            raise ValueError(
                f"attn_type='encoder_only' needs prefill-only metadata, got num_decode_tokens="
                f"{metadata.num_decode_tokens}."
            )
        out = flash_attn_varlen_func(
            q, k, v, metadata.query_start_loc, metadata.query_start_loc, metadata.max_query_len,
            metadata.max_query_len, causal=False, seqused_k=metadata.seq_lens, **common,
        )
        return out.reshape(num_tokens, num_heads * head_size), kv_cache

    has_cache = kv_cache.size > 0
    if has_cache:
        checks.check_ndim(kv_cache, 5, "kv_cache ([2, num_blocks, block_size, num_kv_heads, head_size])")
        if kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size):
            raise ValueError(
                f"kv_cache must have shape [2, num_blocks, block_size, {num_kv_heads}, {head_size}], "
                f"got {tuple(kv_cache.shape)}."
            )
        if cache_written:
            cache_ops.check_kv_cache_dtype(kv_cache_dtype, query.dtype, kv_cache.dtype, "kv_cache")
        else:
            # Also checks that kv_cache's dtype is what kv_cache_dtype makes of query.dtype.
            kv_cache = cache_ops.reshape_and_cache_flash_kv(
                k, v, kv_cache, metadata.slot_mapping, kv_cache_dtype, k_scale, v_scale,
                implementation=implementation, interpret=interpret)
    elif metadata.num_decode_tokens:
        raise ValueError("decode tokens need a KV cache, but kv_cache is empty (size 0, a profiling run).")
    cache_scales = dict(k_scale=k_scale, v_scale=v_scale)
    # Views, not slices: ``kv_cache[0]`` would be copied into every kernel call.
    k_plane, v_plane = cache_planes(kv_cache) if has_cache else (None, None)

    outputs = []
    if prefill := metadata.prefill_metadata:
        rows = slice(0, prefill.num_prefill_tokens)
        if not has_cache or not prefill.has_block_tables:
            # Prompts without a cached prefix: queries and keys are the same rows.
            out = flash_attn_varlen_func(
                q[rows], k[rows], v[rows], prefill.query_start_loc, prefill.query_start_loc,
                prefill.max_query_len, max(prefill.max_prefill_seq_len, 1), causal=True,
                seqused_k=prefill.seq_lens, **common,
            )
        else:
            out = flash_attn_varlen_func(
                q[rows], k_plane, v_plane, prefill.query_start_loc, prefill.seq_start_loc,
                prefill.max_query_len, max(prefill.max_prefill_seq_len, 1), causal=True,
                block_table=prefill.block_tables, seqused_k=prefill.seq_lens, **cache_scales, **common,
            )
        outputs.append(out)
    if decode := metadata.decode_metadata:
        if not decode.has_block_tables:
            raise ValueError("decode tokens need block tables, but metadata.block_tables has no column.")
        dq = q[metadata.num_prefill_tokens:]
        if decode.max_decode_query_len > 1:
            out = flash_attn_varlen_func(
                dq, k_plane, v_plane, decode.query_start_loc, decode.seq_start_loc,
                decode.max_decode_query_len, max(decode.max_decode_seq_len, 1), causal=True,
                block_table=decode.block_tables, seqused_k=decode.seq_lens, **cache_scales, **common,
            )
        else:
            out = flash_attn_with_kvcache(
                dq[:, None], k_plane, v_plane, decode.seq_lens, decode.block_tables,
                causal=True, **cache_scales, **common,
            )[:, 0]
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=0)
    return out.reshape(num_tokens, num_heads * head_size), kv_cache


class PagedAttention(nnx.Module):
    """Flax NNX attention layer over a paged KV cache (vLLM's ``Attention`` layer).

    No parameters: the projections belong to the model; this module holds the static
    configuration and calls `paged_attention`. With a ``mesh`` it runs tensor-parallel
    over heads (`jax_paged_attn.parallel.head_parallel`): query / key / value are
    split by head across the mesh's ``tensor_parallel_axis`` and the cache by KV head.

    Args (keyword-only):
      num_heads, head_size: query heads and head size.
      num_kv_heads: KV heads (default ``num_heads``).
      scale: softmax scale (default ``head_size ** -0.5``).
      sliding_window, logits_soft_cap, kv_cache_dtype, attn_type, implementation,
      interpret: as in `paged_attention`.
      alibi_slopes: None or ``num_heads`` floats (kept as a static tuple).
      k_scale, v_scale: default fp8 cache scales (floats), overridable per call.
      mesh, tensor_parallel_axis: tensor parallelism; None for one device.

    Call: ``layer(query, key, value, kv_cache, metadata, *, k_scale=None, v_scale=None)``
    -> ``(output [T, num_heads * head_size], new kv_cache)``.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        num_kv_heads: int | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        alibi_slopes: Sequence[float] | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        attn_type: str = DECODER,
        implementation: str | None = None,
        interpret: bool = False,
        mesh: jax.sharding.Mesh | None = None,
        tensor_parallel_axis: str = "tp",
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        checks.check_static_int(num_heads, "num_heads")
        checks.check_static_int(num_kv_heads, "num_kv_heads")
        checks.check_head_size(head_size)
        checks.check_heads(num_heads, num_kv_heads, "num_heads", "num_kv_heads")
        if attn_type not in ATTN_TYPES:
            raise ValueError(f"attn_type must be one of {ATTN_TYPES}, got {attn_type!r}.")
        window_size(sliding_window, attn_type)  # validates
        if kv_cache_dtype not in cache_ops.KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {cache_ops.KV_CACHE_DTYPES}, got {kv_cache_dtype!r}.")
        if alibi_slopes is not None:
            alibi_slopes = tuple(float(s) for s in alibi_slopes)
            if len(alibi_slopes) != num_heads:
                raise ValueError(f"alibi_slopes must have num_heads = {num_heads} entries, got {len(alibi_slopes)}.")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = float(head_size ** -0.5 if scale is None else scale)
        self.sliding_window = sliding_window
        self.alibi_slopes = alibi_slopes
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        self.attn_type = attn_type
        self.implementation = implementation
        self.interpret = interpret
        self.mesh = mesh
        self.tensor_parallel_axis = tensor_parallel_axis
        if mesh is not None:
            from jax_paged_attn import parallel

            parallel.check_head_divisibility(num_heads, num_kv_heads, mesh.shape[tensor_parallel_axis])

    def _attend(self, query: Array, key: Array, value: Array, kv_cache: Array, metadata: FlashAttentionMetadata,
                alibi_slopes: Array | None, k_scale: Any, v_scale: Any, *, num_heads: int,
                num_kv_heads: int) -> tuple[Array, Array]:
        return paged_attention(
            query, key, value, kv_cache, metadata, num_heads=num_heads, head_size=self.head_size,
            num_kv_heads=num_kv_heads, scale=self.scale, sliding_window=self.sliding_window,
            alibi_slopes=alibi_slopes, logits_soft_cap=self.logits_soft_cap,
            kv_cache_dtype=self.kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, attn_type=self.attn_type,
            implementation=self.implementation, interpret=self.interpret,
        )

    def __call__(
        self,
        query: Array,
        key: Array,
        value: Array,
        kv_cache: Array,
        metadata: FlashAttentionMetadata,
        *,
        k_scale: Array | float | None = None,
        v_scale: Array | float | None = None,
    ) -> tuple[Array, Array]:
        k_scale = self.k_scale if k_scale is None else k_scale
        v_scale = self.v_scale if v_scale is None else v_scale
        slopes = None if self.alibi_slopes is None else jnp.asarray(self.alibi_slopes, jnp.float32)
        if self.mesh is None:
            return self._attend(query, key, value, kv_cache, metadata, slopes, k_scale, v_scale,
                                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        from jax_paged_attn import parallel

        sharded = parallel.head_parallel(
            self._attend, mesh=self.mesh, axis_name=self.tensor_parallel_axis,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        )
        return sharded(query, key, value, kv_cache, metadata, slopes, k_scale, v_scale)
