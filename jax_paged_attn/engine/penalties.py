"""Penalties, ``logit_bias`` and ``min_tokens`` on the device: the per-row arrays the
programs that apply them take (`Penalties`), building them on the host, and applying
them to a batch of logits inside the jitted step (vLLM V1's sampler semantics).

Which programs pay: a program takes a `Penalties` (a pytree) or None, and the two are
different programs (the tree's structure is part of jit's cache key), so a batch in
which no request sets any of these parameters runs the programs it ran before,
unchanged and compiled at warm-up. A batch with one such request runs the variant that
applies them to every row; the neutral rows' logits pass through unchanged bit for bit
(a bias of 0, a penalty of 0 or 1 and a ``min_tokens`` of 0 are exact no-ops).

The token counts: each persistent-batch row keeps ``output_counts`` i32[V] and
``prompt_mask`` bool[V] on the device (`jax_paged_attn.engine.model_runner.DecodeState`),
filled on the host once when the row is filled and then updated by the decode window
itself, one scatter of the sampled tokens per step. Applying the penalties is then a
few elementwise passes over the logits, which sampling reads anyway, and nothing is
recomputed from the token history per step (that would read ``[R, max_model_len]``
token ids and scatter them every step). The price is ``5 * V`` bytes for every row of the
batch uploaded when a batch starts or rows are inserted (the insert program takes the
batch's whole row count, padded, however few join), paid only by batches that use these
parameters. Scheduled and mixed steps, which run every step while prompts are admitted,
send their sampling rows' token ids instead (`PenaltyTokens`, ``4 * max_model_len``
bytes a row rather than ``5 * V``: 16 KiB against 640 KiB for a 128k vocabulary at a
4k context), and the program counts them (`with_token_counts`); a joining row keeps
those counts.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn.engine.request import Request
from jax_paged_attn.engine.sampling import MAX_LOGIT_BIAS

Array = jax.Array

NO_BIAS_ID = -1
"""Padding of `Penalties.bias_ids`; its column adds nothing (the scatter drops it)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    """What the logits-processing parameters of ``B`` rows need (NumPy on the host, jax
    arrays on the device). Neutral rows (`neutral`) leave their logits unchanged.

    Attributes:
      presence, frequency, repetition, min_p: f32[B]: the rows' ``presence_penalty``,
        ``frequency_penalty``, ``repetition_penalty`` and ``min_p``.
      min_tokens: i32[B]: the stop ids cannot be sampled while fewer tokens were generated.
      stop_ids: i32[B, S]: the ids ``min_tokens`` holds back (the row's stop ids, EOS
        included unless ignored), padded with -1.
      bias_ids: i32[B, MAX_LOGIT_BIAS]: ``logit_bias`` token ids, padded with `NO_BIAS_ID`.
      bias_values: f32[B, MAX_LOGIT_BIAS]: their biases (0 in padding columns).
      output_counts: i32[B, V]: how often each token occurs in the row's output so far.
      prompt_mask: bool[B, V]: the token occurs in the row's prompt.

    A step's host rows leave the last two None: the program counts them from the rows'
    `PenaltyTokens` (`with_token_counts`).
    """

    presence: Array
    frequency: Array
    repetition: Array
    min_p: Array
    min_tokens: Array
    stop_ids: Array
    bias_ids: Array
    bias_values: Array
    output_counts: Array | None
    prompt_mask: Array | None

    @staticmethod
    def neutral(num_rows: int, vocab_size: int | None, num_stop_ids: int) -> "Penalties":
        """Host rows that change nothing, for `fill_penalties` to fill; ``vocab_size``
        None: without the counts (a step's rows, counted from their `PenaltyTokens`)."""
        counted = vocab_size is not None
        return Penalties(
            presence=np.zeros(num_rows, np.float32), frequency=np.zeros(num_rows, np.float32),
            repetition=np.ones(num_rows, np.float32), min_p=np.zeros(num_rows, np.float32),
            min_tokens=np.zeros(num_rows, np.int32), stop_ids=np.full((num_rows, num_stop_ids), -1, np.int32),
            bias_ids=np.full((num_rows, MAX_LOGIT_BIAS), NO_BIAS_ID, np.int32),
            bias_values=np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32),
            output_counts=np.zeros((num_rows, vocab_size), np.int32) if counted else None,
            prompt_mask=np.zeros((num_rows, vocab_size), bool) if counted else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyTokens:
    """The tokens of a step's ``B`` sampling rows, from which the program counts their
    `Penalties` (NumPy on the host, jax arrays on the device).

    Attributes:
      token_ids: i32[B, H]: each row's prompt then output tokens so far, padded (``H``:
        the engine's longest sequence, one shape).
      num_prompt_tokens: i32[B]: the row's prompt length (its first tokens).
      num_tokens: i32[B]: the row's tokens (0: a row that samples nothing).
    """

    token_ids: Array
    num_prompt_tokens: Array
    num_tokens: Array

    @staticmethod
    def empty(num_rows: int, max_tokens: int) -> "PenaltyTokens":
        return PenaltyTokens(np.zeros((num_rows, max_tokens), np.int32), np.zeros(num_rows, np.int32),
                             np.zeros(num_rows, np.int32))


StepPenalties = tuple[Penalties, PenaltyTokens]
"""A step's host penalties: the rows' parameters (`Penalties` without counts) and tokens."""


def fill_penalties(rows: Penalties, i: int, request: Request, stop_ids: Sequence[int]) -> None:
    """Host row ``i`` of ``rows`` from ``request`` as it is now (its prompt and output
    tokens so far, counted where ``rows`` holds counts); ``stop_ids``: the ids that end
    it (`Scheduler.stop_token_ids`)."""
    params = request.sampling_params
    rows.presence[i], rows.frequency[i] = params.presence_penalty, params.frequency_penalty
    rows.repetition[i], rows.min_p[i], rows.min_tokens[i] = params.repetition_penalty, params.min_p, params.min_tokens
    rows.stop_ids[i] = -1
    rows.stop_ids[i, :len(stop_ids)] = stop_ids
    rows.bias_ids[i], rows.bias_values[i] = NO_BIAS_ID, 0.0
    if params.logit_bias:
        ids = list(params.logit_bias)
        rows.bias_ids[i, :len(ids)] = ids
        rows.bias_values[i, :len(ids)] = list(params.logit_bias.values())
    if rows.output_counts is not None:
        counts = np.bincount(np.asarray(request.output_token_ids, np.int64), minlength=rows.output_counts.shape[1])
        rows.output_counts[i] = counts
        rows.prompt_mask[i] = False
        rows.prompt_mask[i, np.asarray(request.prompt_token_ids, np.int64)] = True


def fill_tokens(tokens: PenaltyTokens, i: int, request: Request) -> None:
    """Host row ``i`` of ``tokens`` from ``request``'s prompt and output tokens so far."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    tokens.token_ids[i, :len(prompt)] = prompt
    tokens.token_ids[i, len(prompt):len(prompt) + len(output)] = output
    tokens.num_prompt_tokens[i], tokens.num_tokens[i] = len(prompt), len(prompt) + len(output)


def with_token_counts(p: Penalties, tokens: PenaltyTokens, vocab_size: int) -> Penalties:
    """``p`` (a step's, without counts) with its output counts and prompt mask counted
    from ``tokens`` (jit-able: one scatter of ``[B, H]`` ids into ``[B, V]``)."""
    num_rows, width = tokens.token_ids.shape
    rows = jnp.arange(num_rows)[:, None]
    column = jnp.arange(width)[None, :]
    in_prompt = column < tokens.num_prompt_tokens[:, None]
    in_output = ~in_prompt & (column < tokens.num_tokens[:, None])
    # Ids outside their part point past the vocabulary: the scatters drop them.
    prompt_ids = jnp.where(in_prompt, tokens.token_ids, vocab_size)
    output_ids = jnp.where(in_output, tokens.token_ids, vocab_size)
    prompt_mask = jnp.zeros((num_rows, vocab_size), bool).at[rows, prompt_ids].set(True, mode="drop")
    counts = jnp.zeros((num_rows, vocab_size), jnp.int32).at[rows, output_ids].add(1, mode="drop")
    return dataclasses.replace(p, output_counts=counts, prompt_mask=prompt_mask)


def apply_penalties(logits: Array, p: Penalties, num_generated: Array) -> Array:
    """f32[B, V]: ``logits`` [B, V] after ``logit_bias``, ``min_tokens`` and the
    repetition, frequency and presence penalties, in vLLM V1's order; ``num_generated``
    i32[B]: tokens each row generated before the one sampled from these logits.
    Jit-able, branchless."""
    assert p.output_counts is not None, "a step's penalties are counted first (with_token_counts)"
    logits = logits.astype(jnp.float32)
    num_rows, vocab_size = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    # Padding columns (`NO_BIAS_ID`) point past the vocabulary and are dropped.
    bias_ids = jnp.where(p.bias_ids < 0, vocab_size, p.bias_ids)
    logits = logits.at[rows, bias_ids].add(p.bias_values, mode="drop")
    held_back = jnp.where((num_generated < p.min_tokens)[:, None] & (p.stop_ids >= 0), p.stop_ids, vocab_size)
    logits = logits.at[rows, held_back].set(-jnp.inf, mode="drop")
    seen = p.prompt_mask | (p.output_counts > 0)
    repetition = jnp.where(seen, p.repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - p.frequency[:, None] * p.output_counts.astype(jnp.float32)
    return logits - p.presence[:, None] * (p.output_counts > 0).astype(jnp.float32)


def count_tokens(p: Penalties, tokens: Array, counted: Array) -> Penalties:
    """``p`` with ``tokens`` i32[B] added to the output counts of the rows where
    ``counted`` bool[B] (the rows that sampled them)."""
    counts = p.output_counts.at[jnp.arange(tokens.shape[0]), tokens].add(counted.astype(jnp.int32))
    return dataclasses.replace(p, output_counts=counts)
