"""Attention metadata of one batch as an immutable JAX pytree (vLLM's `FlashAttentionMetadata`).

One `FlashAttentionMetadata` describes a batch of sequences whose new tokens are packed
into one ``[num_tokens, ...]`` array, prefills first, then decodes, each section followed
by its padding (see `jax_paged_attn.builder` for how padding is chosen)::

    token rows:  |<-------- num_prefill_tokens -------->|<-------- num_decode_tokens -------->|
                 | prefill_0 | ... | prefill_p-1 | pad  | decode_0 | ... | decode_d-1 |  pad  |
    sequences:   | real prefills | padding prefills   | real decodes   | padding decodes   |
                 |<------- num_prefills -------->|<------ num_decodes = num_seqs - num_prefills ->|

Definitions (vLLM 0.6's FlashAttention backend's)::

    |---------- context_len ----------|-- query_len --|   context_len: tokens already in the
    |------------------- seq_len ---------------------|   cache; query_len: tokens computed now

What is a leaf and what is static
---------------------------------
Arrays are pytree *leaves*: they are traced under `jax.jit`, so new values reuse the
compiled program. The integer counts are *static* (pytree aux data): they fix shapes
(``num_prefill_tokens`` is where the token array is split, ``num_prefills`` where the
block table is split) and the ``max_*`` bounds are the static ``max_seqlen_q/k`` the
kernels size their grids and loops with. Changing a static value compiles a new program;
that is why the builder rounds every count up to a few bucket sizes, and why the bounds
are *upper bounds*, not exact maxima:

* ``max_decode_seq_len`` is ``block_tables.shape[1] * block_size`` for padded metadata:
  the most keys a block-table row can address. It stays fixed while `advance_step` grows
  the sequences (a sequence outgrowing its row needs a wider table, hence a new bucket
  anyway), so a jitted decode loop compiles once per bucket, not once per step.
* ``max_query_len``, ``max_decode_query_len`` and ``max_prefill_seq_len`` are rounded up
  to powers of two. They bound every sequence with ``seq_len > 0``; padding sequences
  (``seq_len == 0``) can own more query rows, which see no key and come out as 0 (the
  kernels' contract for rows past ``max_seqlen_q`` and for empty sequences).

``block_size`` is static too (None when unknown): the builder records the block size the
slots and block tables were computed with, so that `advance_step` cannot silently use
another one.

Differences from vLLM's FlashAttentionMetadata
----------------------------------------------
* Immutable and functional: `advance_step` returns new metadata instead of updating in
  place, `prefill_metadata` / `decode_metadata` are pure slicing views (not cached).
* The Python list ``seq_lens`` is gone (a pytree holds arrays, and a list would make
  every length static); ``seq_lens`` is vLLM's ``seq_lens_tensor``. Where vLLM
  used ``max(seq_lens)`` the static ``max_prefill_seq_len`` bound serves.
  ``context_lens`` is vLLM's ``context_lens_tensor``; ``use_cuda_graph`` is gone (every
  step is compiled; padding plays the role of CUDA-graph padding).
* All arrays are int32 (vLLM's slot mapping is int64; JAX runs with 32-bit ints).
* Padding sequences own the padding tokens of their section, so ``query_start_loc``
  gives the true row of every sequence in the packed array (``query_start_loc[-1] ==
  num_tokens``) and one varlen call can cover the whole batch.
* The decode view rebases ``query_start_loc`` / ``seq_start_loc`` to start at 0 (vLLM
  leaves them offset by the prefills, which is only harmless because it never mixes
  prefills with multi-token decodes), and keeps ``context_lens`` (vLLM drops it).
* `advance_step` does not implement vLLM's ``turn_prefills_into_decodes``; build
  decode metadata with the builder after a mixed step instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import checks
from jax_paged_attn.spec import PAD_SLOT_ID

Array = Any  # jax.Array, or np.ndarray for host-side metadata from the builder

ARRAY_FIELDS = ("slot_mapping", "seq_lens", "query_start_loc", "seq_start_loc", "context_lens",
                "block_tables")
"""Pytree leaves of `FlashAttentionMetadata` (traced under jit)."""

STATIC_FIELDS = ("num_prefills", "num_prefill_tokens", "num_decode_tokens", "max_query_len",
                 "max_decode_query_len", "max_prefill_seq_len", "max_decode_seq_len", "block_size")
"""Pytree aux data of `FlashAttentionMetadata` (part of the jit cache key)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlashAttentionMetadata:
    """Metadata of one batch for the FlashAttention backend (see the module docstring).

    Leaves (int32; ``B = num_seqs`` counts padding sequences, ``T = num_tokens`` padding
    tokens, ``W`` is the block-table width, 0 when no sequence uses a block table):
      slot_mapping: ``[T]``: cache slot (``block * block_size + offset``) each new token's
        K/V is written to; `PAD_SLOT_ID` for tokens not written.
      seq_lens: ``[B]``: keys each sequence attends to (context + new tokens; for a
        sliding-window decode the truncated length); 0 for padding sequences.
      query_start_loc: ``[B + 1]``: sequence ``b`` owns token rows
        ``query_start_loc[b]:query_start_loc[b + 1]``; ``query_start_loc[-1] == T``.
      seq_start_loc: ``[B + 1]``: cumulative ``seq_lens``, starting at 0.
      context_lens: ``[B]``: tokens already computed (in the cache) before this step.
      block_tables: ``[B, W]``: physical block ids of each sequence, padded with 0.

    Static fields (Python ints):
      num_prefills: prefill sequences, padding ones included (the first ``num_prefills``
        rows of every per-sequence array).
      num_prefill_tokens: token rows of the prefill section, padding included.
      num_decode_tokens: token rows of the decode section, padding included.
      max_query_len: bound on the query length of every sequence with ``seq_len > 0``.
      max_decode_query_len: same for the decode sequences; 1 means plain decoding
        (one token per sequence, ``num_decode_tokens == num_decodes``), more means
        speculative / multi-token decoding. 0 when there are no decodes (vLLM's
        builder says 1 there but its prefill view 0; 0 keeps the two the same).
      max_prefill_seq_len: bound on ``seq_lens`` of the prefills; 0 without prefills.
      max_decode_seq_len: bound on ``seq_lens`` of the decodes; 0 without decodes.
      block_size: tokens per cache block that ``slot_mapping`` and ``block_tables`` were
        computed with (the builder sets it), or None when unknown. `advance_step` and
        `validate_metadata` check a ``block_size`` argument against it.
    """

    slot_mapping: Array  # i32[num_tokens]
    seq_lens: Array  # i32[num_seqs]
    query_start_loc: Array  # i32[num_seqs + 1]
    seq_start_loc: Array  # i32[num_seqs + 1]
    context_lens: Array  # i32[num_seqs]
    block_tables: Array  # i32[num_seqs, max_blocks_per_seq]
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int
    max_decode_query_len: int
    max_prefill_seq_len: int
    max_decode_seq_len: int
    block_size: int | None = None

    def __post_init__(self) -> None:
        # Only the static fields are checked here: JAX rebuilds pytrees with arbitrary
        # leaves (tracers, sentinels), so leaf checks live in `validate_metadata`.
        for name in STATIC_FIELDS:
            value = getattr(self, name)
            if name == "block_size":
                if value is not None:
                    object.__setattr__(self, name, checks.check_static_int(value, "metadata.block_size"))
                continue
            # Normalized to int so that equal metadata hashes equally (jit cache key).
            object.__setattr__(self, name, checks.check_static_int(value, f"metadata.{name}", minimum=0))

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch, padding included (static: a shape)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_decodes(self) -> int:
        """Decode sequences, padding included (static)."""
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        """Token rows of the batch, padding included (static)."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def has_block_tables(self) -> bool:
        """False when the block table has no column (a profiling run, or prompts without
        chunked prefill / prefix caching): prefill attention then reads the new keys
        themselves, not the cache (vLLM's ``block_tables.numel() == 0`` test)."""
        return int(self.block_tables.shape[1]) > 0

    @property
    def prefill_metadata(self) -> FlashAttentionMetadata | None:
        """`prefill_metadata` of this batch."""
        return prefill_metadata(self)

    @property
    def decode_metadata(self) -> FlashAttentionMetadata | None:
        """`decode_metadata` of this batch."""
        return decode_metadata(self)


jax.tree_util.register_dataclass(
    FlashAttentionMetadata, data_fields=list(ARRAY_FIELDS), meta_fields=list(STATIC_FIELDS))


def prefill_metadata(metadata: FlashAttentionMetadata) -> FlashAttentionMetadata | None:
    """The prefill part of a batch (vLLM's ``prefill_metadata``); None without prefills.

    Slices the first ``num_prefills`` sequences and ``num_prefill_tokens`` token rows;
    ``query_start_loc`` / ``seq_start_loc`` already start at 0. Decode fields become 0.
    """
    md = metadata
    if md.num_prefills == 0:
        return None
    p, tp = md.num_prefills, md.num_prefill_tokens
    return FlashAttentionMetadata(
        slot_mapping=md.slot_mapping[:tp],
        seq_lens=md.seq_lens[:p],
        query_start_loc=md.query_start_loc[:p + 1],
        seq_start_loc=md.seq_start_loc[:p + 1],
        context_lens=md.context_lens[:p],
        block_tables=md.block_tables[:p],
        num_prefills=p,
        num_prefill_tokens=tp,
        num_decode_tokens=0,
        max_query_len=md.max_query_len,
        max_decode_query_len=0,
        max_prefill_seq_len=md.max_prefill_seq_len,
        max_decode_seq_len=0,
        block_size=md.block_size,
    )


def decode_metadata(metadata: FlashAttentionMetadata) -> FlashAttentionMetadata | None:
    """The decode part of a batch (vLLM's ``decode_metadata``); None without decodes.

    Slices the sequences after ``num_prefills`` and the token rows after
    ``num_prefill_tokens``. ``query_start_loc`` and ``seq_start_loc`` are rebased to start
    at 0 so they index the view's own rows (cu_seqlens must start at 0).
    """
    md = metadata
    if md.num_decode_tokens == 0:
        return None
    p, tp = md.num_prefills, md.num_prefill_tokens
    if p == 0:
        query_start_loc, seq_start_loc = md.query_start_loc, md.seq_start_loc
    else:
        query_start_loc = md.query_start_loc[p:] - md.query_start_loc[p]
        seq_start_loc = md.seq_start_loc[p:] - md.seq_start_loc[p]
    return FlashAttentionMetadata(
        slot_mapping=md.slot_mapping[tp:],
        seq_lens=md.seq_lens[p:],
        query_start_loc=query_start_loc,
        seq_start_loc=seq_start_loc,
        context_lens=md.context_lens[p:],
        block_tables=md.block_tables[p:],
        num_prefills=0,
        num_prefill_tokens=0,
        num_decode_tokens=md.num_decode_tokens,
        max_query_len=md.max_query_len,
        max_decode_query_len=md.max_decode_query_len,
        max_prefill_seq_len=0,
        max_decode_seq_len=md.max_decode_seq_len,
        block_size=md.block_size,
    )


def concatenate_sections(prefill: FlashAttentionMetadata, decode: FlashAttentionMetadata) -> FlashAttentionMetadata:
    """One batch of ``prefill``'s sequences followed by ``decode``'s (jnp; traceable).

    The inverse of `prefill_metadata` / `decode_metadata`: ``prefill`` holds prefills only
    and ``decode`` decodes only, with block tables of the same width and the same
    ``block_size``. An engine builds the prefill part on the host and the decode part on
    the device (its persistent decode batch) and runs both in one forward.
    """
    if prefill.num_decode_tokens or decode.num_prefills:
        raise ValueError(
            f"concatenate_sections takes a prefill-only and a decode-only batch, got "
            f"{prefill.num_decode_tokens} decode tokens in prefill and {decode.num_prefills} prefills in decode.")
    if prefill.block_tables.shape[1] != decode.block_tables.shape[1]:
        raise ValueError(
            f"the sections' block tables differ in width: {prefill.block_tables.shape[1]} (prefill) and "
            f"{decode.block_tables.shape[1]} (decode).")
    if prefill.block_size != decode.block_size:
        raise ValueError(f"the sections' block_size differ: {prefill.block_size} and {decode.block_size}.")
    tp = prefill.num_prefill_tokens
    return FlashAttentionMetadata(
        slot_mapping=jnp.concatenate([prefill.slot_mapping, decode.slot_mapping]),
        seq_lens=jnp.concatenate([prefill.seq_lens, decode.seq_lens]),
        query_start_loc=jnp.concatenate([prefill.query_start_loc, tp + decode.query_start_loc[1:]]),
        seq_start_loc=jnp.concatenate([prefill.seq_start_loc, prefill.seq_start_loc[-1] + decode.seq_start_loc[1:]]),
        context_lens=jnp.concatenate([prefill.context_lens, decode.context_lens]),
        block_tables=jnp.concatenate([prefill.block_tables, decode.block_tables]),
        num_prefills=prefill.num_prefills,
        num_prefill_tokens=tp,
        num_decode_tokens=decode.num_decode_tokens,
        max_query_len=max(prefill.max_query_len, decode.max_query_len),
        max_decode_query_len=decode.max_decode_query_len,
        max_prefill_seq_len=prefill.max_prefill_seq_len,
        max_decode_seq_len=decode.max_decode_seq_len,
        block_size=prefill.block_size,
    )


# --------------------------------------------------------------------------- validation


def _check_leaf(x: Any, name: str, shape: tuple[int | None, ...]) -> None:
    checks.check_int_array(x, f"metadata.{name}", shape)


def _resolve_block_size(md: FlashAttentionMetadata, block_size: Any, *, required: bool) -> int | None:
    """The block size to use: the argument, checked against ``metadata.block_size``."""
    if block_size is None:
        if required and md.block_size is None:
            raise ValueError("block_size is required: metadata.block_size is None (metadata not made by the builder).")
        return md.block_size
    block_size = checks.check_static_int(block_size, "block_size")
    if md.block_size is not None and block_size != md.block_size:
        raise ValueError(
            f"block_size={block_size} disagrees with metadata.block_size={md.block_size}, the block size "
            f"its slot_mapping and block_tables were built with.")
    return block_size


def validate_metadata(metadata: FlashAttentionMetadata, *, block_size: int | None = None,
                      num_blocks: int | None = None) -> None:
    """Checks that `metadata` is consistent; raises ValueError / TypeError naming the field.

    Static checks (shapes, dtypes, counts; safe under jit) always run. Value checks
    (cumulative offsets, bounds, slot and block-id ranges) run when the arrays are
    concrete (host metadata from the builder, or eager device arrays). ``block_size``
    (default: ``metadata.block_size``; when both are given they must agree) enables the
    block-table checks: every row covers its ``seq_len``, and every slot other than
    `PAD_SLOT_ID` is its token's position through its sequence's row (token ``j`` of a
    sequence is position ``seq_len - query_len + j``). ``block_size`` with
    ``num_blocks`` enables the range checks of slots and block ids.
    """
    md = metadata
    if not isinstance(md, FlashAttentionMetadata):
        raise TypeError(f"metadata must be a FlashAttentionMetadata, got {type(md).__name__}.")
    block_size = _resolve_block_size(md, block_size, required=False)
    if num_blocks is not None:
        num_blocks = checks.check_static_int(num_blocks, "num_blocks")
    checks.check_ndim(md.seq_lens, 1, "metadata.seq_lens")
    b = md.num_seqs
    _check_leaf(md.slot_mapping, "slot_mapping", (md.num_tokens,))
    _check_leaf(md.seq_lens, "seq_lens", (b,))
    _check_leaf(md.query_start_loc, "query_start_loc", (b + 1,))
    _check_leaf(md.seq_start_loc, "seq_start_loc", (b + 1,))
    _check_leaf(md.context_lens, "context_lens", (b,))
    _check_leaf(md.block_tables, "block_tables", (b, None))
    if md.num_prefills > b:
        raise ValueError(
            f"metadata.num_prefills={md.num_prefills} exceeds the {b} sequences of metadata.seq_lens.")
    if (md.num_prefills == 0) != (md.num_prefill_tokens == 0):
        raise ValueError(
            f"metadata.num_prefills={md.num_prefills} and metadata.num_prefill_tokens="
            f"{md.num_prefill_tokens} must both be 0 or both be positive.")
    if (md.num_decodes == 0) != (md.num_decode_tokens == 0):
        raise ValueError(
            f"metadata has {md.num_decodes} decode sequences and metadata.num_decode_tokens="
            f"{md.num_decode_tokens}; both must be 0 or both positive.")
    if md.num_decodes and md.max_decode_query_len == 1 and md.num_decode_tokens != md.num_decodes:
        raise ValueError(
            f"metadata.max_decode_query_len=1 (one token per decode) needs num_decode_tokens == "
            f"num_decodes, got {md.num_decode_tokens} tokens for {md.num_decodes} decode sequences.")
    if md.max_query_len < 1:
        raise ValueError(f"metadata.max_query_len must be >= 1, got {md.max_query_len}.")
    if md.num_decodes and md.max_decode_query_len < 1:
        raise ValueError(
            f"metadata.max_decode_query_len must be >= 1 with decodes, got {md.max_decode_query_len}.")

    leaves = [getattr(md, name) for name in ARRAY_FIELDS]
    if not all(checks.is_concrete(x) for x in leaves):
        return
    slots, seq_lens, qsl, ssl, ctx, tables = (np.asarray(x).astype(np.int64) for x in leaves)
    checks.check_cu_seqlens_values(qsl, "metadata.query_start_loc", total=md.num_tokens)
    if qsl[-1] != md.num_tokens:
        raise ValueError(
            f"metadata.query_start_loc[-1] = {qsl[-1]} must equal the {md.num_tokens} token rows "
            f"(padding sequences own the padding tokens).")
    if qsl[md.num_prefills] != md.num_prefill_tokens:
        raise ValueError(
            f"metadata.query_start_loc[num_prefills] = {qsl[md.num_prefills]} must equal "
            f"num_prefill_tokens = {md.num_prefill_tokens} (decode rows follow the prefill rows).")
    if np.any(seq_lens < 0):
        raise ValueError(f"metadata.seq_lens must be >= 0, got {seq_lens.tolist()}.")
    if np.any(ctx < 0):
        raise ValueError(f"metadata.context_lens must be >= 0, got {ctx.tolist()}.")
    if not np.array_equal(ssl, np.concatenate([[0], np.cumsum(seq_lens)])):
        raise ValueError(
            f"metadata.seq_start_loc = {ssl.tolist()} is not the cumulative sum of "
            f"metadata.seq_lens = {seq_lens.tolist()}.")
    query_lens = np.diff(qsl)
    live = seq_lens > 0
    is_prefill = np.arange(b) < md.num_prefills
    bounds = (
        ("max_query_len", query_lens, live),
        ("max_prefill_seq_len", seq_lens, live & is_prefill),
        ("max_decode_seq_len", seq_lens, live & ~is_prefill),
        ("max_decode_query_len", query_lens, live & ~is_prefill),
    )
    for name, values, mask in bounds:
        if np.any(values[mask] > getattr(md, name)):
            raise ValueError(
                f"metadata.{name}={getattr(md, name)} is below the true maximum "
                f"{int(values[mask].max())}; static bounds must be >= the true values.")
    if np.any((slots < 0) & (slots != PAD_SLOT_ID)):
        raise ValueError(f"metadata.slot_mapping holds negative slots other than PAD_SLOT_ID={PAD_SLOT_ID}.")
    if block_size is not None and num_blocks is not None:
        bad = slots[slots >= num_blocks * block_size]
        if bad.size:
            raise ValueError(
                f"metadata.slot_mapping holds slots {bad[:5].tolist()} outside the cache's "
                f"num_blocks * block_size = {num_blocks * block_size} slots.")
    if block_size is not None and md.has_block_tables:
        if num_blocks is not None:
            checks.check_block_table_values(tables, num_blocks, seq_lens, block_size, "metadata.block_tables")
        needed = -(-seq_lens // block_size)
        short = np.nonzero(needed > tables.shape[1])[0]
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"sequence {i} has seq_len {seq_lens[i]}, needing {needed[i]} blocks of {block_size}, "
                f"but metadata.block_tables has only {tables.shape[1]} columns.")
        _check_slots_lie_in_block_tables(slots, seq_lens, query_lens, qsl, tables, block_size,
                                         block_size_unrecorded=md.block_size is None)


def _check_slots_lie_in_block_tables(slots: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                                     qsl: np.ndarray, tables: np.ndarray, block_size: int, *,
                                     block_size_unrecorded: bool) -> None:
    """Each written token's slot is its position's slot through its sequence's table row.

    A sequence's new tokens are the last ``query_len`` of its ``seq_len`` keys, so token
    ``j`` sits at ``seq_len - query_len + j`` of the row; that holds for prefill chunks,
    prefix-cache hits and sliding-window decodes alike (a truncated row and its shortened
    ``seq_len`` drop the same leading blocks). A slot elsewhere would write the token's
    K/V where its attention never reads it (another sequence's block, possibly). For
    metadata that does not record its block size, a mismatch most likely means the
    ``block_size`` argument is not the one it was built with, and the error says so.
    Vectorized over tokens: one pass of NumPy, no per-token Python.
    """
    written = np.nonzero(slots != PAD_SLOT_ID)[0]
    if written.size == 0:
        return
    seq_of_token = np.searchsorted(qsl, written, side="right") - 1
    position = (seq_lens - query_lens)[seq_of_token] + written - qsl[seq_of_token]
    column = position // block_size
    inside = (position >= 0) & (position < seq_lens[seq_of_token]) & (column < tables.shape[1])
    expected = np.full(written.shape, -1, np.int64)
    expected[inside] = (tables[seq_of_token[inside], column[inside]] * block_size
                        + position[inside] % block_size)
    wrong = np.nonzero(expected != slots[written])[0]
    if wrong.size == 0:
        return
    k = int(wrong[0])
    i, b, pos = int(written[k]), int(seq_of_token[k]), int(position[k])
    live_blocks = tables[b, :-(-int(seq_lens[b]) // block_size)].tolist()
    where = (f"block {slots[i] // block_size} is not in its table {live_blocks}"
             if slots[i] // block_size not in live_blocks else f"position {pos} there is slot {expected[k]}")
    problem = (f"metadata.slot_mapping[{i}] = {slots[i]} is not where sequence {b}'s token at position {pos} "
               f"of metadata.block_tables[{b}] goes with block_size={block_size}: {where}.")
    if block_size_unrecorded:
        raise ValueError(f"block_size={block_size} does not match the metadata: {problem} Pass the block size "
                         f"the metadata was built with.")
    raise ValueError(f"{problem} Its K/V would be written where its attention never reads it.")


# --------------------------------------------------------------------------- advance_step


def _check_num_queries(num_queries: Any, num_seqs: int, num_sampled: int) -> Any:
    """Returns an int (static) or an int32 scalar array (traced) after the checks it allows."""
    if isinstance(num_queries, (int, np.integer)) and not isinstance(num_queries, bool):
        num_queries = checks.check_static_int(num_queries, "num_queries", minimum=0)
        if num_queries > num_seqs:
            raise ValueError(f"num_queries={num_queries} exceeds the {num_seqs} sequences of the metadata.")
        if num_queries > num_sampled:
            raise ValueError(
                f"num_queries={num_queries} exceeds the {num_sampled} rows of sampled_token_ids.")
        return num_queries
    if not hasattr(num_queries, "dtype") or getattr(num_queries, "ndim", None) != 0 \
            or not jnp.issubdtype(num_queries.dtype, jnp.integer):
        raise TypeError(
            f"num_queries must be a Python int (static) or an integer scalar array (traced), "
            f"got {getattr(num_queries, 'shape', type(num_queries).__name__)}.")
    if checks.is_concrete(num_queries):
        n = int(np.asarray(num_queries))
        if not 0 <= n <= min(num_seqs, num_sampled):
            raise ValueError(
                f"num_queries={n} must be in [0, {min(num_seqs, num_sampled)}] (sequences of the "
                f"metadata: {num_seqs}, rows of sampled_token_ids: {num_sampled}).")
    return jnp.asarray(num_queries, jnp.int32)


def advance_step(
    metadata: FlashAttentionMetadata,
    sampled_token_ids: Array,  # int[num_sampled] or int[num_sampled, 1]
    *,
    block_size: int | None = None,
    num_queries: int | Array,
) -> tuple[FlashAttentionMetadata, Array, Array]:
    """Decode metadata of the next step, given the tokens sampled in this one.

    The functional port of vLLM's ``FlashAttentionMetadata.advance_step`` and its
    ``ops.advance_step_flashattn`` kernel (multi-step decoding without going back to the
    host). For each of the first ``num_queries`` sequences ``i`` (the real ones; the rest
    are batch padding), with ``L = seq_lens[i]``:

    * the next input token is ``sampled_token_ids[i]`` and its position ``L``;
    * ``seq_lens[i] = L + 1``, ``context_lens[i] += 1``;
    * ``slot_mapping[i] = block_tables[i, L // block_size] * block_size + L % block_size``.

    Sequences ``i >= num_queries`` keep their lengths, get slot `PAD_SLOT_ID`, input token
    0 and position 0 (as the kernel does for CUDA-graph padding). ``seq_start_loc`` is
    recomputed; ``query_start_loc`` (one token per sequence) is unchanged.

    The input tokens / positions of the step are not arguments: the kernel overwrites all
    of them, so the pure function returns them instead. Host metadata (NumPy leaves, as
    `FlashAttentionMetadataBuilder.build_host` makes) with NumPy ``sampled_token_ids``
    and an int ``num_queries`` advances on the host and stays NumPy; otherwise the
    arrays are JAX arrays.

    Static fields stay the same (so a jitted loop compiles once), except that
    ``max_decode_seq_len`` grows by one while it is below ``block_tables.shape[1] *
    block_size`` (exact, unpadded metadata; padded metadata already holds that bound).

    Args:
      metadata: decode-only metadata (``num_prefills == 0``, one query token per
        sequence: ``max_query_len == 1``), e.g. from the builder or a previous call.
      sampled_token_ids: integer ``[N]`` or ``[N, 1]`` (vLLM's layout), ``num_queries <= N
        <= num_seqs``; rows past ``num_queries`` are ignored.
      block_size: tokens per cache block (static); default ``metadata.block_size``. It must
        be the block size the metadata was built with: ValueError when it disagrees with
        ``metadata.block_size`` or, for metadata without one (None) and concrete arrays,
        when this step's slots do not follow the block tables with it.
      num_queries: real sequences: a Python int (static) or an integer scalar array, which
        lets one compiled program serve any number of live sequences in the bucket.

    Returns:
      ``(new_metadata, next_input_tokens, next_input_positions)``: the tokens have
      ``sampled_token_ids``' dtype, the positions int32, both ``[num_seqs]``.

    A sequence whose next position lies past its block-table row raises ValueError when
    the arrays are concrete; under jit (where values cannot be checked) its slot becomes
    `PAD_SLOT_ID`, so nothing is written outside its blocks. Preallocate the blocks of
    the steps to come (vLLM's lookahead slots). With a sliding window the builder's
    truncated tables are only valid for the step they were built for.
    """
    md = metadata
    if not isinstance(md, FlashAttentionMetadata):
        raise TypeError(f"metadata must be a FlashAttentionMetadata, got {type(md).__name__}.")
    block_size = _resolve_block_size(md, block_size, required=True)
    if md.num_prefills != 0 or md.num_prefill_tokens != 0 or md.max_prefill_seq_len != 0:
        raise ValueError(
            f"advance_step needs decode-only metadata, got num_prefills={md.num_prefills}, "
            f"num_prefill_tokens={md.num_prefill_tokens}, max_prefill_seq_len={md.max_prefill_seq_len} "
            f"(turning prefills into decodes is not supported: rebuild the metadata).")
    if md.max_query_len != 1 or md.max_decode_query_len != 1:
        raise ValueError(
            f"advance_step needs one query token per sequence, got metadata.max_query_len="
            f"{md.max_query_len}, metadata.max_decode_query_len={md.max_decode_query_len}.")
    validate_metadata(md, block_size=block_size)  # static checks; value checks when concrete
    num_seqs, width = md.num_seqs, int(md.block_tables.shape[1])
    if num_seqs == 0 or md.num_decode_tokens != num_seqs:
        raise ValueError(
            f"advance_step needs num_decode_tokens == num_seqs >= 1, got {md.num_decode_tokens} "
            f"and {num_seqs}.")
    if width == 0:
        raise ValueError("metadata.block_tables has no column; decoding needs block tables.")
    if not hasattr(sampled_token_ids, "dtype") or not jnp.issubdtype(sampled_token_ids.dtype, jnp.integer):
        raise TypeError(
            f"sampled_token_ids must be an integer array, got "
            f"{getattr(sampled_token_ids, 'dtype', type(sampled_token_ids).__name__)}.")
    shape = tuple(sampled_token_ids.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] > num_seqs:
        raise ValueError(
            f"sampled_token_ids must have shape [N] or [N, 1] with N <= num_seqs = {num_seqs}, got {shape}.")
    num_sampled = shape[0]
    num_queries = _check_num_queries(num_queries, num_seqs, num_sampled)
    if checks.is_concrete(md.seq_lens) and checks.is_concrete(md.block_tables) \
            and checks.is_concrete(num_queries):
        lens = np.asarray(md.seq_lens)[: int(np.asarray(num_queries))]
        over = np.nonzero(lens // block_size >= width)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"sequence {i} would write position {lens[i]}, block {lens[i] // block_size}, but "
                f"metadata.block_tables has only {width} columns ({width * block_size} tokens); "
                f"allocate the next block first.")

    # Host metadata (the builder's NumPy arrays) advances on the host with NumPy, so the
    # engine's decode loop needs no device round trip; device or traced metadata with jnp.
    on_host = all(isinstance(x, np.ndarray) for x in (md.seq_lens, md.context_lens, md.block_tables,
                                                       md.slot_mapping, sampled_token_ids)) \
        and not isinstance(num_queries, jax.Array)
    xp = np if on_host else jnp
    sampled = xp.asarray(sampled_token_ids).reshape(num_sampled)
    if num_sampled < num_seqs:
        sampled = xp.pad(sampled, (0, num_seqs - num_sampled))
    seq_lens = xp.asarray(md.seq_lens)
    active = xp.arange(num_seqs, dtype=np.int32) < num_queries  # bool[num_seqs]
    position = seq_lens  # the sampled token follows the L tokens of the sequence
    block_index = position // block_size
    in_table = block_index < width
    block_tables = xp.asarray(md.block_tables)
    block = xp.take_along_axis(block_tables, xp.minimum(block_index, width - 1)[:, None], axis=1)[:, 0]
    slot = xp.where(active & in_table, block * block_size + position % block_size, PAD_SLOT_ID)
    context_lens = xp.asarray(md.context_lens)
    new_seq_lens = xp.where(active, seq_lens + 1, seq_lens)
    new_context_lens = xp.where(active, context_lens + 1, context_lens)
    seq_start_loc = xp.concatenate(
        [xp.zeros((1,), new_seq_lens.dtype), xp.cumsum(new_seq_lens, dtype=new_seq_lens.dtype)])
    capacity = width * block_size
    max_decode_seq_len = md.max_decode_seq_len if md.max_decode_seq_len >= capacity \
        else md.max_decode_seq_len + 1
    new_md = dataclasses.replace(
        md,
        slot_mapping=slot.astype(xp.asarray(md.slot_mapping).dtype),
        seq_lens=new_seq_lens,
        seq_start_loc=seq_start_loc.astype(xp.asarray(md.seq_start_loc).dtype),
        context_lens=new_context_lens,
        query_start_loc=xp.asarray(md.query_start_loc),
        block_tables=block_tables,
        max_decode_seq_len=max_decode_seq_len,
    )
    next_input_tokens = xp.where(active, sampled, xp.zeros_like(sampled))
    next_input_positions = xp.where(active, position, 0).astype(np.int32)
    return new_md, next_input_tokens, next_input_positions
