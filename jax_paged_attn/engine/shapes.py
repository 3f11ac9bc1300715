"""The static shapes of an engine's compiled programs, fixed when the engine starts.

A jitted program compiles once per distinct set of static shapes, so the engine pads
every batch to one of a few sizes chosen here, and `LLMEngine.warmup` compiles each of
them before the first request (a server must not stall a request for a compilation):

* **block-table width**: one width, the blocks of ``max_model_len`` (or the largest of
  ``block_table_width_buckets``' sizes that a window batch rounds to). The kernels read
  only each row's own blocks, and the decode kernel splits the keys a row actually has,
  so a wide table costs its upload, not attention time.
* **decode rows** (the persistent batch of decode windows): powers of two from
  `MIN_DECODE_ROWS` up to ``max_num_seqs``'s (or ``batch_buckets``). A batch that runs
  beside prompt sections takes the largest (`mixed_rows`): a padding row costs little
  there (no keys, a few more rows in a product the prompt tokens already make
  compute-bound), and each row count would be one more program per prompt shape.
* **prompt chunks** of a mixed step: ``(tokens, sequences)`` pairs, token counts every
  fourth power of two counted down from ``max_num_batched_tokens`` to 1/64 of it
  (padding tokens cost compute, so the ladder is finer than the rows'), each with room
  for one sequence per 16 tokens plus a padding sequence (padding sequences cost a
  grid tile).
* **stop-id columns**: `MIN_STOP_ID_COLUMNS` (a request with more stop ids than that
  widens a batch, and compiles, on first use).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jax_paged_attn.builder import pad_to_bucket
from jax_paged_attn.engine.model_runner import MIN_DECODE_ROWS, decode_batch_rows
from jax_paged_attn.tuning import next_power_of_2

MIN_STOP_ID_COLUMNS = 8
"""Stop-id columns of a persistent batch row (EOS ids and ``stop_token_ids``), at least."""

MIN_PROMPT_TOKENS = 16
"""Smallest token count of a mixed step's prompt section."""

TOKENS_PER_PROMPT_ROW = 16
"""A prompt section of ``T`` tokens has room for ``T // 16 + 1`` sequences."""


def _ladder(top: int, bottom: int, ratio: int) -> tuple[int, ...]:
    """``top, top / ratio, top / ratio**2, ...`` down to ``bottom`` (kept), ascending."""
    sizes, size = {bottom}, top
    while size > bottom:
        sizes.add(size)
        size //= ratio
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class ProgramShapes:
    """Static shapes of an engine's programs (see the module docstring).

    Attributes:
      block_table_width: block-table columns of every prompt section and of the batches
        that admit prompts.
      window_widths: block-table widths a decode-only batch may take (the smallest that
        holds its rows' final lengths).
      decode_rows: row counts a persistent batch may take, ascending.
      mixed_rows: the subset of ``decode_rows`` that batches admitting prompts take.
      prompt_shapes: ``(tokens, sequences)`` of a mixed step's prompt section, ascending.
      num_stop_id_columns: stop-id columns the warm-up compiles for.
    """

    block_table_width: int
    window_widths: tuple[int, ...]
    decode_rows: tuple[int, ...]
    mixed_rows: tuple[int, ...]
    prompt_shapes: tuple[tuple[int, int], ...]
    num_stop_id_columns: int = MIN_STOP_ID_COLUMNS

    @staticmethod
    def of(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
           batch_buckets: Sequence[int] | None, token_buckets: Sequence[int] | None,
           block_table_width_buckets: Sequence[int] | None) -> "ProgramShapes":
        max_blocks = -(-max_model_len // block_size)
        width = pad_to_bucket(max_blocks, block_table_width_buckets)
        if block_table_width_buckets:
            window_widths = tuple(sorted({w for w in block_table_width_buckets if w < width} | {width}))
        else:
            window_widths = (width,)
        top_rows = decode_batch_rows(max_num_seqs, batch_buckets)
        if batch_buckets:
            rows = tuple(sorted({max(MIN_DECODE_ROWS, b) for b in batch_buckets if b < top_rows} | {top_rows}))
        else:
            rows = _ladder(top_rows, MIN_DECODE_ROWS, 2)
        if token_buckets:
            tokens = tuple(sorted({t for t in token_buckets if t < max_num_batched_tokens}
                                  | {pad_to_bucket(max_num_batched_tokens, token_buckets)}))
        else:
            top = max_num_batched_tokens
            tokens = _ladder(top, min(top, max(MIN_PROMPT_TOKENS, top // 64)), 4)
        max_prompts = min(max_num_seqs, max(1, max_num_batched_tokens // TOKENS_PER_PROMPT_ROW))
        prompt_shapes = tuple((t, min(t // TOKENS_PER_PROMPT_ROW + 1, max_prompts) + 1) for t in tokens)
        return ProgramShapes(block_table_width=width, window_widths=window_widths, decode_rows=rows,
                             mixed_rows=(top_rows,), prompt_shapes=prompt_shapes)

    @property
    def max_prompts_per_step(self) -> int:
        """Most prompt chunks one mixed step holds (one sequence stays for padding)."""
        return self.prompt_shapes[-1][1] - 1

    def prompt_shape(self, num_tokens: int, num_prompts: int) -> tuple[int, int]:
        """The smallest ``(tokens, sequences)`` holding ``num_prompts`` chunks of
        ``num_tokens`` tokens in all, with a padding sequence for the padding tokens."""
        for tokens, seqs in self.prompt_shapes:
            if tokens >= num_tokens and seqs >= num_prompts + (tokens > num_tokens):
                return tokens, seqs
        raise ValueError(
            f"{num_prompts} prompt chunks of {num_tokens} tokens exceed the largest prompt section "
            f"{self.prompt_shapes[-1]} (this is a bug: the scheduler caps both).")

    def rows_for(self, num_requests: int, *, mixing: bool) -> int:
        """Rows of a persistent batch for ``num_requests`` requests."""
        ladder = self.mixed_rows if mixing else self.decode_rows
        n = max(MIN_DECODE_ROWS, num_requests)
        return next((r for r in ladder if r >= n), pad_to_bucket(n, None))

    def window_width(self, num_blocks: int) -> int:
        """Block-table width of a decode-only batch whose rows need ``num_blocks`` blocks."""
        return next((w for w in self.window_widths if w >= num_blocks), pad_to_bucket(num_blocks, None))


def stop_id_columns(num_stop_ids: int) -> int:
    """Stop-id columns of a batch whose rows have at most ``num_stop_ids`` stop ids."""
    return max(MIN_STOP_ID_COLUMNS, next_power_of_2(max(1, num_stop_ids)))
