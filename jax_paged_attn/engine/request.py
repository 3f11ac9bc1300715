"""A request's host state and the scheduler's plan of a step: the types the scheduler,
the engine and the decode batch share.

* `Request`: one generation request and its cache state (tokens, block tables, timings),
  with its `RequestStatus` and, once it ends, its `FinishReason`.
* `ScheduledRequest` / `SchedulerOutput`: what one step runs (each request's tokens)
  and the block moves it needs first, as `jax_paged_attn.engine.scheduler.Scheduler`
  decides them.
* `validate_prompt`: the checks every prompt of token ids passes before it is queued.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Sequence

import numpy as np

from jax_paged_attn.engine.sampling import SamplingParams

class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recomputation
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # its blocks live in host memory
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended, as vLLM names it in ``CompletionOutput.finish_reason``."""

    LENGTH = "length"  # max_tokens reached, or the context is full (max_model_len)
    STOP = "stop"  # a stop token or the EOS token was produced
    ABORTED = "abort"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its cache state (host bookkeeping only)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int
    seed: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = dataclasses.field(default_factory=list)  # device block ids
    host_block_table: list[int] = dataclasses.field(default_factory=list)  # while swapped
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full blocks, in order
    num_registered_blocks: int = 0  # leading blocks offered to the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # Tokens it held when last preempted by recomputation (0: never was): its prefill
    # runs through all of them, as vLLM recomputes prompt + output as one prompt.
    num_recomputed_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # set by a stop the host decides (`LLMEngine.stop_request`)
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # With ``sampling_params.logprobs`` set: one {token_id: Logprob} per output token and
    # the sum of the sampled tokens' logprobs (the engine appends them with the tokens).
    output_logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs, self.cumulative_logprob = [], 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True until the request's prefill has run: its prompt, or after a preemption by
        recomputation every token it held then. A prefix-cache hit on readmission may
        leave just the last of those to feed; that one token is still a prefill chunk
        (a prompt-only step may hold it), not a decode of a token sampled before."""
        return self.num_computed_tokens < max(self.num_prompt_tokens, self.num_recomputed_tokens)


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: its tokens ``[start, start + num_new_tokens)``.

    Fixed when the step is scheduled (the request itself moves on in `Scheduler.update`).

    Attributes:
      request: the request.
      start: tokens already in the cache before this step (the context length).
      num_new_tokens: tokens fed in this step (the query length).
      is_prefill: part of the prefill group (a prompt chunk or a recompute), as
        opposed to a one-token decode.
      samples: the chunk reaches the request's last known token, so a token is drawn.
    """

    request: Request
    start: int
    num_new_tokens: int
    is_prefill: bool
    samples: bool

    @staticmethod
    def of(request: Request, num_new_tokens: int) -> "ScheduledRequest":
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new_tokens, request.in_prefill,
                                start + num_new_tokens == request.num_tokens)

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V are in the cache once this step has written its chunk."""
        return self.start + self.num_new_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """What the engine must do in one step, in this order.

    1. ``swap_out``: (device block, host block) pairs, device -> host.
    2. ``copies``: (src, dst) device block pairs for copy-on-write (`copy_blocks`).
    3. ``swap_in``: (host block, device block) pairs, host -> device.
    4. the model step over ``scheduled`` (prefills first, then decodes).

    This order is safe: a block freed by a swap-out or a copy-on-write may be handed
    out again in the same step, but only after its old content has been read.
    """

    scheduled: list[ScheduledRequest]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    preempted: list[str]
    num_prefills: int
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int | None = None) -> list[int]:
    """Checks a prompt of token ids and returns it as a list of Python ints.

    A prompt is a sequence of ints or a one-dimensional integer array (NumPy's, JAX's or
    anything else with ``__array__``). Raises TypeError for anything else (a str,
    floats, a 2-D array) and ValueError for an empty prompt or ids outside
    ``[0, vocab_size)``.
    """
    if isinstance(prompt_token_ids, (str, bytes)):
        raise TypeError("prompt_token_ids must be a sequence of token ids, got a string; tokenize it first.")
    if hasattr(prompt_token_ids, "__array__") and not isinstance(prompt_token_ids, (list, tuple)):
        array = np.asarray(prompt_token_ids)
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
            raise TypeError(f"prompt_token_ids must be a 1-D integer array, got {array.ndim}-D {array.dtype}.")
        prompt_token_ids = array.tolist()
    try:
        tokens = list(prompt_token_ids)
    except TypeError as e:
        raise TypeError(f"prompt_token_ids must be a sequence of ints, got {type(prompt_token_ids).__name__}.") from e
    if not tokens:
        raise ValueError("prompt_token_ids is empty; a request needs at least one prompt token.")
    ids = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"prompt_token_ids must hold ints, got {type(t).__name__} {t!r}.")
        ids.append(int(t))
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"prompt_token_ids has ids outside [0, {vocab_size}): {bad[:8]}.")
    return ids
