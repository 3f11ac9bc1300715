"""Host-side construction of `FlashAttentionMetadata` (vLLM's `FlashAttentionMetadataBuilder`).

The builder runs in numpy once per step, before the jitted model step (FlashInfer's
``plan``), and is the only place that looks at Python values. It ports vLLM 0.6's
FlashAttention metadata builder and its helpers (``compute_slot_mapping``,
``compute_slot_mapping_start_idx``, the model runner's sliding-window truncation), checks
that no block is given to two owners in a step, and adds bucketed padding, the
counterpart of vLLM's CUDA-graph padding: a jitted step compiles once per distinct set of
static fields, so every count is rounded up to one of a few bucket sizes.

Padding layout (see `jax_paged_attn.metadata` for the picture). The prefill and the
decode sections are padded separately, because ``num_prefills`` and
``num_prefill_tokens`` are static split points:

* sequences: ``num_prefills`` and ``num_decodes`` round up to a batch bucket;
* tokens: each section's token count rounds up to a token bucket. Plain decodes (one
  token each) use the batch bucket instead, so that decode token row ``i`` belongs to
  decode sequence ``i`` (the layout ``flash_attn_with_kvcache`` needs);
* block-table width rounds up to a width bucket, and ``max_decode_seq_len`` is that width
  times ``block_size``, so `advance_step` keeps it fixed;
* padding sequences have ``seq_len == 0``, ``context_len == 0`` and a block-table row of
  zeros, and own their section's padding tokens (split as evenly as possible; a section
  with padding tokens always gets at least one padding sequence), whose slot is
  `PAD_SLOT_ID`. They attend to nothing, output 0 and write nothing to the cache.

Buckets default to powers of two; explicit lists can be given, and counts above the
largest listed bucket fall back to the next power of two. ``pad=False`` builds exact,
unpadded metadata with vLLM's exact maxima (every new batch size then compiles).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jax_paged_attn import checks
from jax_paged_attn.tuning import next_power_of_2
from jax_paged_attn.metadata import FlashAttentionMetadata
from jax_paged_attn.spec import PAD_SLOT_ID

_INT32_MAX = np.iinfo(np.int32).max


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1); 0 for 0."""
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}.")
    return 0 if n == 0 else next_power_of_2(n)


def pad_to_bucket(n: int, buckets: Sequence[int] | None = None) -> int:
    """Smallest bucket >= n; 0 stays 0.

    ``buckets`` is a sorted tuple of positive sizes, or None for powers of two. Above the
    largest bucket the next power of two is used, so any size has a bucket.
    """
    n = int(n)
    if n <= 0:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}.")
        return 0
    if buckets:
        for size in buckets:
            if size >= n:
                return int(size)
    return next_power_of_two(n)


def _normalize_buckets(buckets: Sequence[int] | None, name: str) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"{name} must be a sequence of positive ints or None, got {buckets!r}.")
    sizes = tuple(checks.check_static_int(size, f"{name} entry", minimum=1) for size in buckets)
    if not sizes:
        raise ValueError(f"{name} must not be empty (use None for powers of two).")
    return tuple(sorted(set(sizes)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduledSequence:
    """One sequence of a step, as the scheduler sees it (vLLM's per-sequence builder inputs).

    Attributes:
      is_prompt: the sequence is (still) in its prompt phase: a prefill, or a chunk of it.
      seq_len: tokens of the sequence once this step is done (``context_len + query_len``),
        before any sliding-window truncation.
      context_len: tokens already computed and cached before this step.
      query_len: tokens computed in this step (>= 1; 1 for a plain decode).
      block_table: physical block ids of the whole sequence, ``ceil(seq_len / block_size)``
        or more entries (extra ones are preallocated blocks); None in a profiling run.
      prefix_cache_hit: the prompt's first ``context_len`` tokens come from the prefix
        cache. As in vLLM's builder, one hit in the batch gives every sequence its full block
        table.
    """

    is_prompt: bool
    seq_len: int
    context_len: int
    query_len: int
    block_table: Sequence[int] | None = None
    prefix_cache_hit: bool = False

    @staticmethod
    def prompt(prompt_len: int, block_table: Sequence[int] | None, *, context_len: int = 0,
               prefix_cache_hit: bool = False) -> "ScheduledSequence":
        """A prefill of the prompt's tokens ``context_len .. prompt_len - 1``."""
        return ScheduledSequence(is_prompt=True, seq_len=prompt_len, context_len=context_len,
                                 query_len=prompt_len - context_len, block_table=block_table,
                                 prefix_cache_hit=prefix_cache_hit)

    @staticmethod
    def decode(seq_len: int, block_table: Sequence[int], *, query_len: int = 1) -> "ScheduledSequence":
        """A decode of the last ``query_len`` tokens of a ``seq_len``-token sequence."""
        return ScheduledSequence(is_prompt=False, seq_len=seq_len, context_len=seq_len - query_len,
                                 query_len=query_len, block_table=block_table)


@dataclasses.dataclass
class _Row:
    """Per-sequence host values of the metadata (one real sequence)."""

    seq_len: int  # keys attended (sliding-window truncated for decodes)
    orig_seq_len: int
    context_len: int
    query_len: int
    block_table: np.ndarray  # i64[n], the metadata row (maybe empty / truncated)
    slots: np.ndarray  # i64[query_len]
    full_table: np.ndarray  # i64[m], the sequence's whole block table as given


def _check_sequence(seq: Any, i: int) -> None:
    name = f"sequences[{i}]"
    if not isinstance(seq, ScheduledSequence):
        raise TypeError(f"{name} must be a ScheduledSequence, got {type(seq).__name__}.")
    for field in ("is_prompt", "prefix_cache_hit"):
        if not isinstance(getattr(seq, field), (bool, np.bool_)):
            raise TypeError(f"{name}.{field} must be a bool, got {getattr(seq, field)!r}.")
    checks.check_static_int(seq.seq_len, f"{name}.seq_len", minimum=1)
    checks.check_static_int(seq.query_len, f"{name}.query_len", minimum=1)
    checks.check_static_int(seq.context_len, f"{name}.context_len", minimum=0)
    if seq.query_len > seq.seq_len:
        raise ValueError(f"{name}.query_len={seq.query_len} exceeds {name}.seq_len={seq.seq_len}.")
    if seq.context_len + seq.query_len != seq.seq_len:
        raise ValueError(
            f"{name}: context_len + query_len = {seq.context_len} + {seq.query_len} must equal "
            f"seq_len = {seq.seq_len}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlashAttentionMetadataBuilder:
    """Builds `FlashAttentionMetadata` for a batch of `ScheduledSequence` (host-side, numpy).

    Unlike vLLM's builder, which accumulates sequence groups and then builds, `build` takes the
    whole batch, so one builder serves every step.

    Attributes:
      block_size: tokens per cache block (a multiple of 16, as the cache layout requires).
      num_blocks: blocks in the cache; when given, block ids and slots are range-checked.
      sliding_window: the model's sliding window, or None. Prompt tokens before
        ``max(0, query_len - sliding_window)`` are not written to the cache (slot
        `PAD_SLOT_ID`), and decodes attend only to the blocks covering the window
        (block table truncated, ``seq_len`` shortened), as vLLM's model runner does.
      chunked_prefill: prefills and decodes may share a batch and prompts read their
        context through the block table; without it a batch holds only prompts or only
        decodes, and prompts attend to their own new keys.
      pad: pad counts to buckets (True) or build exact metadata (False).
      batch_buckets, token_buckets, block_table_width_buckets: bucket sizes for sequence
        counts, token counts and block-table widths; None for powers of two.
    """

    block_size: int
    num_blocks: int | None = None
    sliding_window: int | None = None
    chunked_prefill: bool = False
    pad: bool = True
    batch_buckets: Sequence[int] | None = None
    token_buckets: Sequence[int] | None = None
    block_table_width_buckets: Sequence[int] | None = None

    def __post_init__(self) -> None:
        checks.check_static_int(self.block_size, "block_size")
        checks.check_block_size(self.block_size)
        if self.num_blocks is not None:
            checks.check_static_int(self.num_blocks, "num_blocks")
            if self.num_blocks * self.block_size - 1 > _INT32_MAX:
                raise ValueError(
                    f"num_blocks * block_size = {self.num_blocks * self.block_size} slots do not fit "
                    f"the int32 slot mapping.")
        if self.sliding_window is not None:
            checks.check_static_int(self.sliding_window, "sliding_window")
        for name in ("chunked_prefill", "pad"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("batch_buckets", "token_buckets", "block_table_width_buckets"):
            object.__setattr__(self, name, _normalize_buckets(getattr(self, name), name))

    # ------------------------------------------------------------------ per sequence

    def _row(self, seq: ScheduledSequence, i: int, *, profile_run: bool, prefix_cache_hit: bool) -> _Row:
        """Block-table row and slots of one sequence (vLLM's ``_add_seq_group``)."""
        bs = self.block_size
        name = f"sequences[{i}].block_table"
        full = np.zeros((0,), np.int64)
        if not profile_run:
            full = np.asarray(seq.block_table)
            if full.ndim != 1 or (full.size and not np.issubdtype(full.dtype, np.integer)):
                raise ValueError(f"{name} must be a 1-D sequence of int block ids, got {seq.block_table!r}.")
            full = full.astype(np.int64)
            bad = full[(full < 0) | ((full >= self.num_blocks) if self.num_blocks is not None else False)]
            if bad.size:
                upper = "" if self.num_blocks is None else f", {self.num_blocks}"
                raise ValueError(f"{name} holds block ids {bad[:5].tolist()} outside [0{upper}).")
            needed = -(-seq.seq_len // bs)
            if full.size < needed:
                raise ValueError(
                    f"{name} has {full.size} blocks but seq_len={seq.seq_len} needs {needed} blocks of {bs}.")

        # Sliding window for decodes (vLLM's ModelInputForGPUBuilder._compute_for_sliding_window):
        # attend to the blocks covering the window plus the partial last block.
        seq_len, window_blocks = seq.seq_len, 0
        if not seq.is_prompt and self.sliding_window is not None:
            window_blocks = -(-self.sliding_window // bs)
            partial = seq.seq_len % bs
            seq_len = min(seq.seq_len, window_blocks * bs + partial)
            if partial:
                window_blocks += 1

        table = np.zeros((0,), np.int64)
        if not profile_run and (prefix_cache_hit or self.chunked_prefill or not seq.is_prompt):
            if prefix_cache_hit or window_blocks == 0:
                table = full
            else:
                # The blocks ending at the sequence's last block. vLLM slices [-n:], which is
                # the same when the table has no preallocated blocks past the sequence.
                used = -(-seq.seq_len // bs)
                table = full[max(0, used - window_blocks):used]

        # Slot mapping (vLLM's compute_slot_mapping_start_idx / compute_slot_mapping).
        if profile_run:
            slots = np.full(seq.query_len, PAD_SLOT_ID, np.int64)
        else:
            start_idx = 0
            if seq.is_prompt and self.sliding_window is not None and table.size == 0:
                # Prompt tokens that can never be attended to after this step are not cached;
                # like vLLM the start is relative to the query. Only when the prompt attends
                # to its packed keys: a prompt that reads through the cache (chunked prefill)
                # needs every one of its tokens there.
                start_idx = max(0, seq.query_len - self.sliding_window)
            skipped = max(0, start_idx - seq.context_len)
            positions = np.arange(max(start_idx, seq.context_len), seq.seq_len)
            slots = np.concatenate([np.full(skipped, PAD_SLOT_ID, np.int64),
                                    full[positions // bs] * bs + positions % bs])
            if slots.size and slots.max() > _INT32_MAX:
                raise ValueError(f"{name} gives slots up to {slots.max()}, beyond the int32 slot range.")
        return _Row(seq_len=seq_len, orig_seq_len=seq.seq_len, context_len=seq.context_len,
                    query_len=seq.query_len, block_table=table, slots=slots, full_table=full)

    # ------------------------------------------------------------------ batch

    def _check_block_use(self, rows: Sequence[_Row]) -> None:
        """No block is used twice where that would be a bug (see `build`, Raises).

        1. No slot is written twice in the step.
        2. Without a sliding window, a sequence's block table holds distinct blocks: a
           repeat would make two parts of the sequence one physical block. (With a
           sliding window vLLM's block managers reuse blocks on purpose: cyclic tables
           whose positions that left the window are overwritten, or one shared null
           block for them; rule 1 still holds there.)
        3. A block written in this step (it holds a slot of ``slot_mapping``) belongs to
           the sequence writing it: no other sequence writes it, and none has it in its
           block table. Prefix caching does share blocks between sequences, but only full,
           computed ones, which no sequence writes (the writer gets a copy first: vLLM's
           copy-on-write), so shared read-only blocks pass.
        """
        for i, row in enumerate(rows):
            written = row.slots[row.slots >= 0]
            slots, counts = np.unique(written, return_counts=True)
            if np.any(counts > 1):
                raise ValueError(
                    f"sequences[{i}] writes slot {int(slots[counts > 1][0])} more than once in this step "
                    f"(its block_table repeats block {int(slots[counts > 1][0]) // self.block_size}).")
            if self.sliding_window is None:
                blocks, counts = np.unique(row.full_table, return_counts=True)
                if np.any(counts > 1):
                    block = int(blocks[counts > 1][0])
                    where = np.nonzero(row.full_table == block)[0].tolist()
                    raise ValueError(
                        f"sequences[{i}].block_table holds block {block} more than once (entries {where[:8]}); "
                        f"each block of a sequence must be a different block.")
        writer: dict[int, tuple[int, int]] = {}  # block -> (sequence, one slot it writes there)
        for i, row in enumerate(rows):
            written = row.slots[row.slots >= 0]
            blocks, first = np.unique(written // self.block_size, return_index=True)
            for block, slot in zip(blocks.tolist(), written[first].tolist()):
                if block in writer:
                    other, other_slot = writer[block]
                    what = f"slot {slot}" if slot in set(rows[other].slots.tolist()) else \
                        f"slots {other_slot} and {slot}"
                    raise ValueError(
                        f"sequences[{other}] and sequences[{i}] both write block {block} in this step "
                        f"({what}); a block written in a step belongs to one sequence.")
                writer[block] = (i, slot)
        if not writer:
            return
        written_blocks = np.fromiter(writer, np.int64, len(writer))
        order = np.argsort(written_blocks)
        written_blocks = written_blocks[order]
        writers = np.fromiter((w for w, _ in writer.values()), np.int64, len(writer))[order]
        for j, row in enumerate(rows):
            table = row.full_table
            at = np.minimum(np.searchsorted(written_blocks, table), written_blocks.size - 1)
            foreign = (written_blocks[at] == table) & (writers[at] != j)
            if np.any(foreign):
                k = int(np.nonzero(foreign)[0][0])
                block = int(table[k])
                i, slot = writer[block]
                raise ValueError(
                    f"block {block} is written by sequences[{i}] in this step (slot {slot}) and is also entry "
                    f"{k} of sequences[{j}].block_table; a block written in a step belongs to one sequence "
                    f"(share only full, computed blocks; copy a shared block before writing it).")

    def _validate_batch(self, sequences: Sequence[ScheduledSequence]) -> tuple[int, bool, bool]:
        """Returns (num_prompts, profile_run, prefix_cache_hit) after the batch checks."""
        if isinstance(sequences, ScheduledSequence) or not isinstance(sequences, Sequence):
            raise TypeError(f"sequences must be a sequence of ScheduledSequence, got {type(sequences).__name__}.")
        if len(sequences) == 0:
            raise ValueError("sequences must not be empty.")
        for i, seq in enumerate(sequences):
            _check_sequence(seq, i)
        num_prompts = sum(1 for seq in sequences if seq.is_prompt)
        for i, seq in enumerate(sequences):
            if seq.is_prompt and i >= num_prompts:
                raise ValueError(
                    f"sequences[{i}] is a prompt after a decode; prefills must come before decodes.")
        has_table = [seq.block_table is not None for seq in sequences]
        profile_run = not any(has_table)
        if not profile_run and not all(has_table):
            missing = has_table.index(False)
            raise ValueError(
                f"sequences[{missing}].block_table is None while other sequences have block tables; "
                f"only a profiling run (every block_table None) may omit them.")
        num_decodes = len(sequences) - num_prompts
        if profile_run and num_decodes:
            raise ValueError(
                f"a profiling run (every block_table None) must hold only prompts, got {num_decodes} decodes.")
        prefix_cache_hit = any(seq.prefix_cache_hit for seq in sequences)
        if prefix_cache_hit and self.sliding_window is not None:
            raise ValueError("prefix_cache_hit is not supported with sliding_window (as in vLLM's block manager).")
        if not self.chunked_prefill:
            if num_prompts and num_decodes:
                raise ValueError(
                    f"sequences mixes {num_prompts} prompts and {num_decodes} decodes; that needs "
                    f"chunked_prefill=True (prompts would otherwise get no block table).")
            for i, seq in enumerate(sequences):
                if seq.is_prompt and seq.context_len > 0 and not prefix_cache_hit:
                    raise ValueError(
                        f"sequences[{i}] is a prompt with context_len={seq.context_len} > 0; reading a "
                        f"cached context needs chunked_prefill=True or prefix_cache_hit.")
        return num_prompts, profile_run, prefix_cache_hit

    def _padded_sizes(self, num_seqs: int, num_tokens: int, one_token_each: bool) -> tuple[int, int]:
        """(sequences, tokens) of one section after padding."""
        if not self.pad or num_seqs == 0:
            return num_seqs, num_tokens
        padded_seqs = pad_to_bucket(num_seqs, self.batch_buckets)
        if one_token_each:
            return padded_seqs, padded_seqs
        padded_tokens = pad_to_bucket(num_tokens, self.token_buckets)
        if padded_tokens > num_tokens and padded_seqs == num_seqs:
            # Padding tokens need a padding sequence to own them.
            padded_seqs = pad_to_bucket(num_seqs + 1, self.batch_buckets)
        return padded_seqs, padded_tokens

    def _bound(self, n: int, cap: int) -> int:
        """Static upper bound for a maximum length: the next power of two, at most ``cap``
        (itself a bucket, and >= n), when padding; n itself otherwise."""
        if not self.pad or n == 0:
            return n
        return max(n, min(next_power_of_two(n), cap))

    def build_host(self, sequences: Sequence[ScheduledSequence]) -> FlashAttentionMetadata:
        """The metadata of the batch with numpy int32 leaves (see `build`)."""
        num_prompts, profile_run, prefix_cache_hit = self._validate_batch(sequences)
        rows = [self._row(seq, i, profile_run=profile_run, prefix_cache_hit=prefix_cache_hit)
                for i, seq in enumerate(sequences)]
        if not profile_run:
            self._check_block_use(rows)
        sections = (rows[:num_prompts], rows[num_prompts:])
        decode_one_token = all(r.query_len == 1 for r in sections[1])

        seq_lens, query_lens, context_lens, slot_chunks, tables = [], [], [], [], []
        section_sizes = []
        for section, one_token_each in zip(sections, (False, decode_one_token)):
            real_tokens = sum(r.query_len for r in section)
            padded_seqs, padded_tokens = self._padded_sizes(len(section), real_tokens, one_token_each)
            num_padding_seqs = padded_seqs - len(section)
            padding_tokens = padded_tokens - real_tokens
            # Spread the padding tokens evenly over the padding sequences.
            owned = [padding_tokens // num_padding_seqs + (k < padding_tokens % num_padding_seqs)
                     for k in range(num_padding_seqs)] if num_padding_seqs else []
            seq_lens += [r.seq_len for r in section] + [0] * num_padding_seqs
            query_lens += [r.query_len for r in section] + owned
            context_lens += [r.context_len for r in section] + [0] * num_padding_seqs
            slot_chunks += [r.slots for r in section] + [np.full(padding_tokens, PAD_SLOT_ID, np.int64)]
            tables += [r.block_table for r in section] + [np.zeros((0,), np.int64)] * num_padding_seqs
            section_sizes.append((padded_seqs, padded_tokens))
        (num_prefills, num_prefill_tokens), (_, num_decode_tokens) = section_sizes

        width = max(t.size for t in tables)
        if self.pad:
            width = pad_to_bucket(width, self.block_table_width_buckets)
        block_tables = np.zeros((len(tables), width), np.int32)
        for i, table in enumerate(tables):
            block_tables[i, :table.size] = table

        prompts, decodes = sections
        num_tokens = num_prefill_tokens + num_decode_tokens
        capacity = width * self.block_size
        max_query_len = self._bound(max(r.query_len for r in rows), num_tokens)
        max_decode_query_len = 0
        if decodes:
            max_decode_query_len = self._bound(max(r.query_len for r in decodes), num_decode_tokens)
        max_prefill_seq_len = 0
        if prompts:
            # vLLM's max over the unsliced prompt lengths (they are never truncated).
            # Keys come through the block table (capacity) or are the new tokens themselves.
            max_prefill_seq_len = self._bound(max(r.orig_seq_len for r in prompts),
                                              capacity or num_prefill_tokens)
        max_decode_seq_len = 0
        if decodes:
            max_decode_seq_len = capacity if self.pad else max(r.seq_len for r in decodes)

        def as_i32(values: Any) -> np.ndarray:
            return np.asarray(values, np.int64).astype(np.int32)

        return FlashAttentionMetadata(
            slot_mapping=as_i32(np.concatenate(slot_chunks)),
            seq_lens=as_i32(seq_lens),
            query_start_loc=as_i32(np.concatenate([[0], np.cumsum(query_lens)])),
            seq_start_loc=as_i32(np.concatenate([[0], np.cumsum(seq_lens)])),
            context_lens=as_i32(context_lens),
            block_tables=block_tables,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            max_query_len=max_query_len,
            max_decode_query_len=max_decode_query_len,
            max_prefill_seq_len=max_prefill_seq_len,
            max_decode_seq_len=max_decode_seq_len,
            block_size=self.block_size,
        )

    def build(self, sequences: Sequence[ScheduledSequence], device: Any = None) -> FlashAttentionMetadata:
        """The metadata of the batch, its arrays on ``device`` (default device if None).

        Args:
          sequences: the step's sequences, prompts first, then decodes.
          device: a `jax.Device` or `jax.sharding.Sharding` for `jax.device_put`.

        Raises:
          ValueError / TypeError naming the offending ``sequences[i].field`` or builder
          attribute: lengths that do not add up, prompts after decodes, block tables
          too short for ``seq_len``, block ids outside ``[0, num_blocks)``, a batch mixing
          prompts and decodes without chunked prefill, a partial profiling run, ...
          Blocks, with the sequence indices and the block id:

          * a slot written twice in the step;
          * without a sliding window, a block twice in one sequence's ``block_table``
            (with one, vLLM's block managers reuse blocks on purpose: cyclic tables, or
            one null block for the positions that left the window);
          * a block written in this step (one of its slots is in ``slot_mapping``) that
            another sequence also writes or has in its ``block_table``. Sequences may
            share blocks they only read (prefix caching shares full, computed prompt
            blocks; a shared block is copied before it is written, vLLM's copy-on-write).
        """
        return jax.device_put(self.build_host(sequences), device)


# --------------------------------------------------------------------------- packing inputs


def sequence_rows(metadata: FlashAttentionMetadata, sequences: Sequence[ScheduledSequence]) -> np.ndarray:
    """Row of each of `sequences` in the per-sequence arrays of `metadata` (i32[len]).

    Prompts keep their index; decodes move past the padding prefills. Token rows of
    sequence ``k`` are ``query_start_loc[rows[k]] + arange(query_len)``; its last token
    (the one to sample from) is ``query_start_loc[rows[k] + 1] - 1``.
    """
    num_prompts = sum(1 for seq in sequences if seq.is_prompt)
    rows = np.arange(len(sequences), dtype=np.int32)
    rows[num_prompts:] += metadata.num_prefills - num_prompts
    return rows


def pack_per_token(metadata: FlashAttentionMetadata, sequences: Sequence[ScheduledSequence],
                   values: Sequence[Sequence[int]], *, pad_value: int = 0,
                   dtype: Any = np.int32) -> np.ndarray:
    """Lays per-sequence token values (``query_len`` each) out in `metadata`'s token rows.

    Use it for the input token ids and positions of a step; padding rows get
    ``pad_value``. Returns ``[metadata.num_tokens]`` of ``dtype``.
    """
    if len(values) != len(sequences):
        raise ValueError(f"values has {len(values)} entries for {len(sequences)} sequences.")
    starts = np.asarray(metadata.query_start_loc)
    out = np.full(metadata.num_tokens, pad_value, dtype)
    for k, (row, seq, vals) in enumerate(zip(sequence_rows(metadata, sequences), sequences, values)):
        vals = np.asarray(vals)
        if vals.shape != (seq.query_len,):
            raise ValueError(f"values[{k}] must have query_len = {seq.query_len} entries, got shape {vals.shape}.")
        out[starts[row]:starts[row] + seq.query_len] = vals
    return out


def input_positions(metadata: FlashAttentionMetadata, sequences: Sequence[ScheduledSequence]) -> np.ndarray:
    """Position of every token row (``context_len .. seq_len - 1`` per sequence, 0 for padding)."""
    return pack_per_token(metadata, sequences, [range(s.context_len, s.seq_len) for s in sequences])
