"""What the engine hands back, and how a program's sampled tokens reach a request.

* `RequestOutput` / `CompletionOutput`: vLLM's output shapes, from `LLMEngine` and `LLM`
  alike (one `CompletionOutput` per sampled sequence).
* `StopChecker`: `LLMEngine.generate`'s hook for stops the host decides.
* `to_host` / `append_logprobs`: a step's or window's sampled tokens (and logprobs)
  copied to the host, and the logprobs appended to the request that asked for them.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jax_paged_attn.engine.request import FinishReason, Request
from jax_paged_attn.engine.sampling import Logprob, logprob_dicts

StopChecker = Callable[[int, int, "CompletionOutput"], "tuple[int, int | str | None] | None"]
"""`LLMEngine.generate`'s host-side stop hook: ``(prompt index, sequence index, the
sequence so far) -> None`` to go on, or ``(tokens to keep, stop_reason)`` to stop."""


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence of a request (vLLM's ``CompletionOutput``).

    Attributes:
      index: which of the request's ``SamplingParams.n`` sequences (0-based).
      text: the generated text (`LLM` with a tokenizer); None from the bare engine or
        without a tokenizer.
      token_ids: the generated token ids (a stop token or EOS that ended it included).
      cumulative_logprob: the sum of the tokens' logprobs; None without
        ``SamplingParams.logprobs``.
      logprobs: with ``SamplingParams.logprobs`` set, one ``{token_id: Logprob}`` per
        token (the top ``logprobs`` tokens in decreasing order, then the sampled token if
        it is not among them); else None.
      finish_reason: "length" (``max_tokens``), "stop" (EOS, a stop id or a stop
        string), or "abort" (vLLM's names; "length" also when the context reached
        ``max_model_len``); None while it runs.
      stop_reason: what stopped it with "stop": the stop string, or the id from
        ``stop_token_ids``; None for EOS and the other reasons (vLLM's field).
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def of(request: Request, index: int = 0, start: int = 0) -> "CompletionOutput":
        """The sequence an engine request has generated so far, numbered ``index``; with
        ``start``, its tokens (and logprobs) from that index on only."""
        reason = request.finish_reason
        stop_reason = request.stop_reason
        if (stop_reason is None and reason == FinishReason.STOP and request.output_token_ids
                and request.output_token_ids[-1] in request.sampling_params.stop_token_ids):
            stop_reason = request.output_token_ids[-1]
        return CompletionOutput(
            index=index, text=None, token_ids=request.output_token_ids[start:],
            cumulative_logprob=request.cumulative_logprob,
            logprobs=None if request.output_logprobs is None else request.output_logprobs[start:],
            finish_reason=reason.value if reason else None, stop_reason=stop_reason)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A request and what it generated: vLLM's ``RequestOutput`` shape, from both
    `LLMEngine` and `LLM`, so code written against one reads the other
    (``out.outputs[0].token_ids``, ``out.outputs[0].text``).

    Attributes:
      request_id: the engine's id of the request (with ``n`` > 1: of its first sequence).
      prompt: the prompt text (`LLM` with a text prompt); None for token ids.
      prompt_token_ids: the prompt as token ids.
      outputs: one `CompletionOutput` per sequence (``SamplingParams.n``), in index order.
      finished: whether every sequence has finished.
      num_cached_tokens: prompt tokens served from the prefix cache (over the sequences).
      num_preemptions: times a sequence was swapped out or dropped for recomputation.
      time_to_first_token_s: from ``add_request`` to the first token of any sequence.
      latency_s: from ``add_request`` to the end of the last sequence (or now).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    num_preemptions: int
    time_to_first_token_s: float | None
    latency_s: float

    @staticmethod
    def of(request: Request, index: int = 0) -> "RequestOutput":
        """The output of one engine request, its sequence numbered ``index``."""
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[CompletionOutput.of(request, index)],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
            time_to_first_token_s=(None if request.first_token_time is None
                                   else request.first_token_time - request.arrival_time),
            latency_s=(request.finish_time or time.perf_counter()) - request.arrival_time,
        )

    @staticmethod
    def merge(samples: Sequence["RequestOutput"]) -> "RequestOutput":
        """One output of ``n`` sequences sampled from one prompt (each a one-sequence
        output, in index order): request_id and prompt of the first, counts summed."""
        first = samples[0]
        if len(samples) == 1:
            return first
        times = [s.time_to_first_token_s for s in samples if s.time_to_first_token_s is not None]
        return dataclasses.replace(
            first, outputs=[dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)],
            finished=all(s.finished for s in samples),
            num_cached_tokens=sum(s.num_cached_tokens for s in samples),
            num_preemptions=sum(s.num_preemptions for s in samples),
            time_to_first_token_s=min(times) if times else None,
            latency_s=max(s.latency_s for s in samples))


def to_host(result: Any) -> tuple[np.ndarray, Any]:
    """``(tokens, TokenLogprobs | None)`` in NumPy from `ModelRunner.run_step` /
    `ModelRunner.run_decode_window`'s result (waits for it)."""
    if isinstance(result, tuple):
        tokens, logprobs = result
        return np.asarray(tokens), jax.tree_util.tree_map(np.asarray, logprobs)
    return np.asarray(result), None


def append_logprobs(request: Request, tokens: np.ndarray, logprobs: Any, index: Any) -> None:
    """Appends the logprobs of ``tokens`` (about to be recorded for ``request``) when it
    asked for them; ``index`` selects those tokens' entries in ``logprobs`` (NumPy
    `TokenLogprobs`). A request that finished (aborted) records nothing, as its tokens."""
    k = request.sampling_params.logprobs
    if k is None or request.is_finished:
        return
    mine = jax.tree_util.tree_map(lambda x: x[index], logprobs)
    request.output_logprobs.extend(logprob_dicts(tokens, mine, k))
    request.cumulative_logprob += float(mine.sampled_logprob.astype(np.float64).sum())


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What an engine holds now (`LLMEngine.load`): requests running (holding device
    blocks), waiting to be admitted (new or preempted for recomputation) and swapped out
    to host memory, and the fraction of the device KV blocks in use, in [0, 1] (cached
    prefix blocks that no request holds count as free)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
