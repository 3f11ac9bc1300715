"""The host inputs of the engine's programs: a scheduled step's packed, bucketed batch
(metadata, token ids, positions, sampling arrays) from a `SchedulerOutput`, the prompt
sections in the engine's fixed prompt shapes, padding inputs of those shapes (warm-up),
the `Penalties` rows of a step's sampling sequences, and the static ``num_logprobs`` of
a program sampling for some requests.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from jax_paged_attn.builder import (
    FlashAttentionMetadataBuilder,
    ScheduledSequence,
    input_positions,
    pack_per_token,
    sequence_rows,
)
from jax_paged_attn.engine.penalties import Penalties, PenaltyTokens, StepPenalties, fill_penalties, fill_tokens
from jax_paged_attn.engine.request import Request, SchedulerOutput
from jax_paged_attn.engine.sampling import logprobs_bucket
from jax_paged_attn.engine.shapes import ProgramShapes, stop_id_columns
from jax_paged_attn.metadata import FlashAttentionMetadata
from jax_paged_attn.spec import PAD_SLOT_ID


class StepInputs:
    """Builds the host inputs of a scheduled step with the engine's metadata builder,
    padded to the buckets and prompt shapes of its `ProgramShapes`."""

    def __init__(self, builder: FlashAttentionMetadataBuilder, shapes: ProgramShapes, *, block_size: int,
                 coarse_length_bounds: bool) -> None:
        self.builder = builder
        self.shapes = shapes
        self.block_size = block_size
        self.coarse_length_bounds = coarse_length_bounds

    def prepare(self, out: SchedulerOutput) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray,
                                                               tuple[np.ndarray, ...]]:
        """Host inputs of a scheduled step: metadata, token ids, positions, metadata row
        of each scheduled request, sampling arrays (NumPy, padded to the metadata's buckets)."""
        sequences = [
            ScheduledSequence(is_prompt=item.is_prefill, seq_len=item.seq_len, context_len=item.start,
                              query_len=item.num_new_tokens, block_table=item.request.block_table)
            for item in out.scheduled
        ]
        if out.num_prefills == len(out.scheduled):
            metadata = self.prompt_section(sequences)
        else:
            metadata = self.builder.build_host(sequences)
        if self.coarse_length_bounds and metadata.num_prefills and metadata.num_decode_tokens:
            capacity = int(metadata.block_tables.shape[1]) * self.block_size
            metadata = dataclasses.replace(
                metadata, max_query_len=max(metadata.max_query_len, metadata.num_prefill_tokens),
                max_prefill_seq_len=max(metadata.max_prefill_seq_len, capacity))
        token_ids = pack_per_token(metadata, sequences,
                                   [token_slice(item.request, item.start, item.seq_len) for item in out.scheduled])
        positions = input_positions(metadata, sequences)
        rows = sequence_rows(metadata, sequences)
        return metadata, token_ids, positions, rows, self.sampling_arrays(out, rows, metadata.num_seqs)

    def prompt_section(self, sequences: list[ScheduledSequence]) -> Any:
        """Host metadata of prompt chunks in one of the engine's prompt shapes
        (`ProgramShapes.prompt_shape`), with the static length bounds its shape can hold
        (so the shape alone selects the program)."""
        num_tokens, num_seqs = self.shapes.prompt_shape(sum(s.query_len for s in sequences), len(sequences))
        width = self.shapes.block_table_width
        builder = dataclasses.replace(self.builder, batch_buckets=(num_seqs,), token_buckets=(num_tokens,),
                                      block_table_width_buckets=(width,))
        metadata = builder.build_host(sequences)
        return dataclasses.replace(metadata, max_query_len=num_tokens,
                                   max_prefill_seq_len=width * self.block_size)

    def sampling_arrays(self, out: SchedulerOutput, rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, ...]:
        temperature = np.zeros(num_rows, np.float32)  # padding rows: greedy, ignored
        top_p = np.ones(num_rows, np.float32)
        top_k = np.full(num_rows, -1, np.int32)
        seed = np.zeros(num_rows, np.uint32)
        counter = np.zeros(num_rows, np.int32)
        for item, row in zip(out.scheduled, rows):
            request = item.request
            params = request.sampling_params
            temperature[row], top_p[row], top_k[row] = params.temperature, params.top_p, params.top_k
            seed[row], counter[row] = request.seed, len(request.output_token_ids)
        return temperature, top_p, top_k, seed, counter

    def penalties(self, out: SchedulerOutput, rows: np.ndarray, num_rows: int,
                  stop_token_ids: Callable[[Request], Sequence[int]]) -> StepPenalties:
        """Host penalties of a step's ``num_rows`` sequences (``rows``: each scheduled
        item's, as `prepare` gives them): the sampling ones' from their requests, the
        others neutral; their counts come as token ids (`PenaltyTokens`).
        ``stop_token_ids``: a request's stop ids (the scheduler's)."""
        items = [(item.request, row) for item, row in zip(out.scheduled, rows) if item.samples]
        stops = [stop_token_ids(request) for request, _ in items]
        penalties, tokens = self.neutral_penalties(num_rows, max([len(ids) for ids in stops] + [1]))
        for (request, row), ids in zip(items, stops):
            fill_penalties(penalties, row, request, ids)
            fill_tokens(tokens, row, request)
        return penalties, tokens

    def neutral_penalties(self, num_rows: int, num_stop_ids: int = 1) -> StepPenalties:
        """Host penalties of ``num_rows`` neutral step sequences (their stop-id columns
        `stop_id_columns` of ``num_stop_ids``; the tokens as wide as the longest sequence)."""
        return (Penalties.neutral(num_rows, None, stop_id_columns(num_stop_ids)),
                PenaltyTokens.empty(num_rows, self.shapes.block_table_width * self.block_size))

    def padding_prompt_inputs(self, num_tokens: int, num_seqs: int) -> tuple[Any, ...]:
        """``(token_ids, positions, metadata, sampling)`` of a prompt section of that shape
        holding padding sequences only (they read no key and write no slot), with the
        leaves and static fields `prompt_section` gives real steps."""
        width, bs = self.shapes.block_table_width, self.block_size
        owned = [num_tokens // num_seqs + (k < num_tokens % num_seqs) for k in range(num_seqs)]
        zeros = np.zeros(num_seqs, np.int32)
        metadata = FlashAttentionMetadata(
            slot_mapping=np.full(num_tokens, PAD_SLOT_ID, np.int32), seq_lens=zeros,
            query_start_loc=np.concatenate([[0], np.cumsum(owned)]).astype(np.int32),
            seq_start_loc=np.zeros(num_seqs + 1, np.int32), context_lens=zeros,
            block_tables=np.zeros((num_seqs, width), np.int32), num_prefills=num_seqs,
            num_prefill_tokens=num_tokens, num_decode_tokens=0, max_query_len=num_tokens,
            max_decode_query_len=0, max_prefill_seq_len=width * bs, max_decode_seq_len=0, block_size=bs)
        sampling = (np.zeros(num_seqs, np.float32), np.ones(num_seqs, np.float32), np.full(num_seqs, -1, np.int32),
                    np.zeros(num_seqs, np.uint32), np.zeros(num_seqs, np.int32))
        tokens = np.zeros(num_tokens, np.int32)
        return tokens, tokens, metadata, sampling


def uses_penalties(requests: Sequence[Request]) -> bool:
    """Whether a program sampling for ``requests`` must apply `Penalties` (one of them
    sets a penalty, ``logit_bias``, ``min_tokens`` or ``min_p``)."""
    return any(r.sampling_params.processes_logits for r in requests)


def program_greedy(requests: Sequence[Request], penalized: bool) -> bool:
    """Whether a program sampling for ``requests`` is the greedy variant: every request
    greedy and no `Penalties` (penalized rows run in the sampled program, whose greedy
    rows take the argmax of their processed logits: one penalties variant a shape)."""
    return not penalized and all(r.sampling_params.greedy for r in requests)


def program_num_logprobs(requests: Sequence[Request], vocab_size: int) -> int | None:
    """Static ``num_logprobs`` of a program sampling for ``requests``: None when none
    asks for logprobs (the programs without them), else a bucket of the largest ask."""
    asks = [r.sampling_params.logprobs for r in requests if r.sampling_params.logprobs is not None]
    return logprobs_bucket(max(asks), vocab_size) if asks else None


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of ``prompt + output`` without building the whole list."""
    prompt, output, n = request.prompt_token_ids, request.output_token_ids, len(request.prompt_token_ids)
    if start >= n:
        return output[start - n:end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[:end - n]
