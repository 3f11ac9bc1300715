"""`LLMEngine`: continuous-batching generation over the paged KV cache.

The engine is the host-side loop; `jax_paged_attn.engine.model_runner.ModelRunner` owns
the device side (parameters, KV caches, the persistent decode batch, the jitted
programs). Three kinds of step:

* **scheduled step** (the first prompts, swaps, recomputation after a preemption)::

      scheduler.schedule()                 host: who runs, how many tokens, block moves
      swap_blocks / copy_blocks            device: swap-outs, copy-on-write, swap-ins
      FlashAttentionMetadataBuilder        host: packed, bucketed batch description
      runner.run_step                      device: forward + sampling (caches donated)
      scheduler.update(sampled tokens)     host: append tokens, finish requests

* **decode window** (every running request is decoding and nothing can be admitted):
  the running requests become the rows of a persistent batch that stays on the device,
  and ``num_scheduler_steps`` decode steps run in one program (sampling, stop checks
  and the next step's metadata on the device). The host reserves each window's blocks
  ahead (lookahead slots, capped at each request's last position) and dispatches window
  ``n + 1`` *before* it reads window ``n``'s tokens (copied to the host asynchronously),
  so the host's bookkeeping overlaps the device's work and the device never waits for
  the host. Rows that stop mid-window write nothing more; their blocks are freed when
  the host reads the window.

* **mixed step** (``decode_during_prefill``, the default): while prompts are admitted,
  each step runs their chunks (up to ``max_num_batched_tokens`` prompt tokens) and one
  decode step of every row of the persistent batch in one program, so the weights are
  read once for both and no running request waits behind a long prompt (vLLM's
  chunked-prefill scheduling, Sarathi's mixed batches). Requests that finish their
  prompt take free rows of the batch (rows whose request ended, then padding rows)
  in the same program, with the token it just sampled. A mixed step is read like a
  window: with ``async_scheduling`` the host dispatches the next mixed step or window
  before it reads the last one's tokens (the scheduler counts a step's prompt tokens
  as computed at its dispatch), so the device does not idle while the host records a
  step. With ``decode_during_prefill`` False, prompts run in prefill-only steps
  dispatched behind the windows in flight, and their requests take free rows through
  one small device update.

Compilation: a program compiles once per distinct *static* shape of its inputs, and
the engine pads every batch to one of the few shapes `jax_paged_attn.engine.shapes`
fixes at start. `LLMEngine.warmup` (which `LLM` calls) compiles all of them, so no
later call compiles; with ``EngineConfig.compilation_cache`` a second start loads them
instead (the engine's program store, `jax_paged_attn.engine.program_store`, untraced;
anything else from JAX's persistent compilation cache).

Memory: unless ``num_blocks`` is given, the KV cache takes what the device has left
beside the weights and the largest step's activations, up to ``gpu_memory_utilization``
of its memory (vLLM's rule; the activations from XLA's buffer assignment of the largest
step, not from a profiling run's peak, so that every start picks the same count and the
same program shapes), and the engine says what it chose. The caches are donated to
every program, so writes are in place.

Example::

    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16))
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=8))
    print(outputs[0].outputs[0].token_ids, engine.stats.summary())
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jax_paged_attn import cache as cache_ops
from jax_paged_attn.builder import (
    FlashAttentionMetadataBuilder,
    ScheduledSequence,
    input_positions,
    pack_per_token,
    sequence_rows,
)
from jax_paged_attn.engine.model_runner import NO_TOKEN, CausalLM, DecodeState, ModelRunner, check_model
from jax_paged_attn.engine.sampling import (Logprob, SamplingParams, as_bool, logprob_dicts, logprobs_bucket,
                                            params_per_prompt)
from jax_paged_attn.engine.request import FinishReason, Request, SchedulerOutput
from jax_paged_attn.engine.scheduler import Scheduler, SchedulerConfig
from jax_paged_attn.engine.shapes import ProgramShapes, stop_id_columns
from jax_paged_attn.metadata import FlashAttentionMetadata
from jax_paged_attn.spec import PAD_SLOT_ID
from jax_paged_attn.tuning import next_power_of_2

Array = jax.Array

logger = logging.getLogger(__name__)

DEFAULT_SWAP_SPACE_GIB = 4.0
"""Host swap space when `EngineConfig.num_host_blocks` is None (vLLM's default, 4 GiB)."""

DEFAULT_NUM_BLOCKS_WITHOUT_MEMORY_STATS = 256
"""KV cache blocks when ``num_blocks`` is None and the device reports no memory statistics (CPU)."""

StopChecker = Callable[[int, int, "CompletionOutput"], "tuple[int, int | str | None] | None"]
"""`LLMEngine.generate`'s host-side stop hook: ``(prompt index, sequence index, the
sequence so far) -> None`` to go on, or ``(tokens to keep, stop_reason)`` to stop."""

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"  # JAX's tracing, lowering and XLA compilation events
_compile_events = 0
_compile_events_lock = threading.Lock()


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation or cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_backend_compiles = 0
_cache_hits = 0


def _on_jax_event(event: str, duration_s: float, **kwargs: Any) -> None:
    global _compile_events, _backend_compiles
    if event.startswith(_COMPILE_EVENT_PREFIX):
        with _compile_events_lock:
            _compile_events += 1
            _backend_compiles += event == _BACKEND_COMPILE_EVENT


def _on_jax_count(event: str, **kwargs: Any) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        with _compile_events_lock:
            _cache_hits += 1


jax.monitoring.register_event_listener(_on_jax_count)
# Counts every compilation in the process, not only the runner's programs: a step that
# first swaps or copies blocks (or allocates the host swap space) compiles those
# programs too, and its time must not count as serving time.
jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and policies of an `LLMEngine`.

    Attributes:
      num_blocks: blocks of the device KV cache (per layer); None: as many as fit in
        ``gpu_memory_utilization`` of the device's memory beside the weights and the
        activations of the largest step (XLA's buffer assignment of it states them), a
        multiple of `KV_CACHE_BLOCK_QUANTUM` where that many fit. Devices that
        report no memory statistics (CPU) get `DEFAULT_NUM_BLOCKS_WITHOUT_MEMORY_STATS`.
      gpu_memory_utilization: fraction of the device's memory the engine may use in all
        (weights, activations and KV cache) when ``num_blocks`` is None.
      block_size: token slots per block (a multiple of 16).
      num_host_blocks: blocks of host swap space for preemption (allocated, in pinned
        host memory where the backend has it, at the first swap-out); None = as many as
        fit in ``swap_space_gib``, at most ``num_blocks``. 0 disables swapping
        (preempted requests are recomputed instead).
      swap_space_gib: host swap space when ``num_host_blocks`` is None.
      max_num_seqs: requests holding cache blocks at once (batch size bound).
      max_num_batched_tokens: token budget of one scheduled step; prompts longer than
        it are prefilled in chunks across steps.
      max_model_len: longest context (prompt + output); None = the model's
        ``max_position_embeddings``.
      enable_prefix_caching: share full prompt blocks between requests (turned off for
        sliding-window models, whose caches skip tokens outside the window).
      eos_token_id: ends a request (unless its params set ``ignore_eos``); an int or a
        tuple of ints; None: the model config's ``eos_token_id`` if it has one, else
        never.
      seed: engine seed; requests without their own seed get one derived from it and
        their arrival number.
      batch_buckets, token_buckets, block_table_width_buckets: padding buckets of the
        metadata builder (None = powers of two).
      coarse_length_bounds: set the static length bounds of each scheduled step that holds
        prompt chunks and decodes to what its buckets can hold (a step of prompt chunks
        alone always takes the bounds of its `ProgramShapes` prompt shape) (``max_query_len`` = the prefill token rows,
        ``max_prefill_seq_len`` = the block-table capacity) instead of the builder's
        next power of two: only the count and width buckets then select a program
        (fewer compilations), at the price of more padded attention work in prefills.
      num_scheduler_steps: decode steps per decode window (vLLM's multi-step
        scheduling): the steps run back to back on the device, and the host reads the
        window's tokens while the next window runs. Outputs do not depend on it; a
        request that finishes mid-window frees its blocks when the host reads the
        window, and new requests wait up to a window for admission.
      decode_during_prefill: True (default): a step that prefills prompt chunks also
        runs one decode step of every request in the persistent batch, in one program
        (vLLM's chunked-prefill scheduling, Sarathi's mixed batches): the weights are
        read once for both and no decode waits behind a long prompt.
        ``max_num_batched_tokens`` bounds the prompt tokens of such a step; the decode
        rows ride along. False: admissions run prefill-only steps beside the batch's
        decode windows (the running requests' time per output token then rises while
        prompts are admitted).
      async_scheduling: True (default): with ``decode_during_prefill``, the host
        schedules and dispatches mixed step ``n + 1`` (or the next decode window)
        before it reads step ``n``'s tokens, so the device runs the next program while
        the host records the last one (vLLM's asynchronous scheduling); a request whose
        prompt ends in step ``n`` decodes in step ``n + 1`` either way (it joins the
        batch on the device, with the token step ``n`` sampled). Outputs do not depend
        on it; False reads each mixed step before scheduling the next (the device then
        idles for the host's bookkeeping between steps).
      compiler_options: XLA compiler options of the jitted programs (``jax.jit``'s
        ``compiler_options``), e.g. ``{"xla_backend_optimization_level": 0}`` to compile
        faster on a CPU; None for the defaults.
      compilation_cache: keep compiled programs in JAX's persistent compilation cache,
        so a second start loads them instead of compiling (`LLMEngine.warmup`). The
        cache is JAX's, process-wide: an engine keeps a directory the process set
        (``jax_compilation_cache_dir``), leaves the cache off where the process turned it
        off (``jax_enable_compilation_cache=False``), and otherwise turns it on. With
        it the engine also keeps its own compiled programs in the cache directory's
        ``jax_paged_attn_programs`` (`jax_paged_attn.engine.program_store`), keyed by
        the package's and the model's source, JAX and the device, so that a second
        start loads them without tracing or lowering. A process that replaces functions
        of the package at run time should turn this off: such a change is not in the key.
      compilation_cache_dir: its directory; None: ``$XDG_CACHE_HOME/jax_paged_attn/xla``
        (``~/.cache/jax_paged_attn/xla``).
      on_step_failure: what happens to the requests that hold KV blocks (running,
        swapped out) when a step fails (a program raising on the device, an interrupt):
        "abort" (default: they finish with ``finish_reason`` "abort", and a failure that
        repeats cannot loop) or "recompute" (they wait again with their tokens so far and
        are recomputed, as after a preemption). Either way the engine stays usable and
        the step's error is raised to its caller.
    """

    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    num_host_blocks: int | None = None
    swap_space_gib: float = DEFAULT_SWAP_SPACE_GIB
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    eos_token_id: int | tuple[int, ...] | None = None
    seed: int = 0
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    block_table_width_buckets: tuple[int, ...] | None = None
    coarse_length_bounds: bool = False
    num_scheduler_steps: int = 8
    decode_during_prefill: bool = True
    async_scheduling: bool = True
    compiler_options: Mapping[str, Any] | None = None
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    on_step_failure: str = "abort"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            _check_int(getattr(self, name), name, 1)
        for name in ("enable_prefix_caching", "coarse_length_bounds", "decode_during_prefill", "async_scheduling",
                     "compilation_cache"):
            as_bool(getattr(self, name), name)
        if self.num_blocks is not None:
            _check_int(self.num_blocks, "num_blocks", 1)
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}.")
        if self.num_host_blocks is not None:
            _check_int(self.num_host_blocks, "num_host_blocks", 0)
        if self.max_model_len is not None:
            _check_int(self.max_model_len, "max_model_len", 2)
        if self.eos_token_id is not None:
            ids = self.eos_token_id if isinstance(self.eos_token_id, (tuple, list)) else (self.eos_token_id,)
            for token in ids:
                _check_int(token, "eos_token_id", 0)
        _check_int(self.seed, "seed", 0)
        for name in ("gpu_memory_utilization", "swap_space_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
        if self.on_step_failure not in ("abort", "recompute"):
            raise ValueError(f"on_step_failure must be 'abort' or 'recompute', got {self.on_step_failure!r}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


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
    def of(request: Request, index: int = 0) -> "CompletionOutput":
        """The sequence an engine request has generated so far, numbered ``index``."""
        reason = request.finish_reason
        stop_reason = request.stop_reason
        if (stop_reason is None and reason == FinishReason.STOP and request.output_token_ids
                and request.output_token_ids[-1] in request.sampling_params.stop_token_ids):
            stop_reason = request.output_token_ids[-1]
        return CompletionOutput(
            index=index, text=None, token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob,
            logprobs=None if request.output_logprobs is None else list(request.output_logprobs),
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


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine was built (or `LLMEngine.reset_stats`).

    Throughput attribution: a step that contains any prefill chunk counts as a prefill
    step (its time and prefill tokens); a step with only decodes counts as a decode
    step (its time and one token per request). Steps in which anything compiled (a
    model program, or a swap / copy-on-write program, the host swap space's allocation:
    any JAX compilation in the process, seen through `jax.monitoring`) are kept apart
    (``compile_steps``, ``compile_time_s``, their tokens in ``num_generated_tokens``
    only) so compilation does not distort the rates. ``num_compiled_programs`` counts
    the model programs (step and decode window) only. ``num_decode_batches``: persistent
    batches uploaded (each after reading every window in flight);
    ``num_inserted_rows``: requests put into a running batch's free rows instead;
    ``num_mixed_steps``: steps that ran prompt chunks and a decode step of the batch's
    rows in one program (``decode_during_prefill``).
    """

    num_steps: int = 0
    num_prefill_tokens: int = 0
    prefill_time_s: float = 0.0
    num_decode_tokens: int = 0
    decode_time_s: float = 0.0
    num_generated_tokens: int = 0
    num_compiled_programs: int = 0
    compile_steps: int = 0
    compile_time_s: float = 0.0
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_recomputed_requests: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_copied_blocks: int = 0
    num_decode_batches: int = 0
    num_inserted_rows: int = 0
    num_mixed_steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prefill_tokens / self.prefill_time_s if self.prefill_time_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_time_s if self.decode_time_s else 0.0

    def summary(self) -> str:
        def rate(tokens: int, per_s: float) -> str:
            return f"{tokens} tokens, {per_s:,.1f} tok/s" if tokens else "n/a (only in compiling steps)"

        return (
            f"prefill: {rate(self.num_prefill_tokens, self.prefill_tokens_per_s)} | "
            f"decode: {rate(self.num_decode_tokens, self.decode_tokens_per_s)} | "
            f"{self.num_steps} steps, {self.num_compiled_programs} programs compiled "
            f"({self.compile_time_s:.1f} s in {self.compile_steps} compiling steps), "
            f"{self.num_preemptions} preemptions, {self.num_prefix_cache_hit_tokens} prefix-cached tokens"
        )


class _Progress:
    """A tqdm bar over requests, updated every step with the tokens so far and tokens/s
    over the steps that compiled nothing (a compilation stall is shown as such, not
    averaged into the rate)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.tokens = 0
        self.serving_tokens = 0  # generated in steps that compiled nothing ...
        self.serving_time_s = 0.0  # ... and those steps' time
        self.compile_time_s = 0.0
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="req", file=sys.stderr)

    def update(self, finished: int, tokens: int, elapsed_s: float, *, compiled: bool) -> None:
        self.tokens += tokens
        if compiled:
            self.compile_time_s += elapsed_s
        else:
            self.serving_tokens += tokens
            self.serving_time_s += elapsed_s
        if self.bar is None:
            return
        rate = self.serving_tokens / self.serving_time_s if self.serving_time_s else 0.0
        text = f"{self.tokens} tokens, {rate:,.0f} tok/s"
        if self.compile_time_s:
            text += f", compiling {self.compile_time_s:.1f} s" + (" (now)" if compiled else "")
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(finished)
        if not finished:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LLMEngine:
    """Generates tokens for many requests at once over a paged KV cache.

    Args:
      model: a `jax_paged_attn.engine.model_runner.CausalLM` (e.g.
        `jax_paged_attn.models.LlamaForCausalLM`).
      config: `EngineConfig`.

    Public methods: `add_request`, `abort_request`, `stop_request`, `step`,
    `has_unfinished_requests`, `pop_output`, `generate`, `reset_stats`; `stats` holds the
    counters, `kv_caches` the current caches, `start_report` what the engine chose at start.
    Outputs are vLLM's `RequestOutput` / `CompletionOutput`.
    """

    def __init__(self, model: CausalLM, config: EngineConfig | None = None) -> None:
        check_model(model)
        config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}.")
        model_config = model.config
        max_position = int(model_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > max_position:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                f"{max_position}.")
        max_model_len = config.max_model_len or max_position
        self.vocab_size = int(model_config.vocab_size)
        eos = config.eos_token_id
        if eos is None:
            eos = getattr(model_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (tuple, list)) else (int(eos),)
        for token in eos_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"eos_token_id {token} is outside the vocabulary [0, {self.vocab_size}).")
        sliding_window = model_config.sliding_window
        prefix_caching = config.enable_prefix_caching and sliding_window is None
        report = [_use_compilation_cache(config)]
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks, line = _kv_cache_blocks_for_memory(model, config, max_model_len)
            report.append(line)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                                  compiler_options=config.compiler_options,
                                  program_store_dir=_program_store_dir(config))
        report.append(self.runner.program_store_line)
        bytes_per_block = sum(int(c.nbytes) for c in self.runner.kv_caches) // num_blocks
        num_host_blocks = config.num_host_blocks
        if num_host_blocks is None:
            num_host_blocks = min(num_blocks, int(config.swap_space_gib * (1 << 30)) // max(bytes_per_block, 1))
        self.config = dataclasses.replace(config, num_blocks=num_blocks, max_model_len=max_model_len,
                                          num_host_blocks=num_host_blocks, enable_prefix_caching=prefix_caching,
                                          eos_token_id=eos_ids or None)
        self.model_config = model_config
        self.shapes = ProgramShapes.of(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len, block_size=config.block_size, batch_buckets=config.batch_buckets,
            token_buckets=config.token_buckets, block_table_width_buckets=config.block_table_width_buckets)
        """The static shapes of the engine's programs (`warmup` compiles them)."""
        # The scheduler plans prefill-only steps; the engine adds the decode rows (mixed
        # steps) or decodes them in windows between (``decode_during_prefill``).
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                            decode_during_prefill=False, max_num_prefill_seqs=self.shapes.max_prompts_per_step),
            num_device_blocks=num_blocks, num_host_blocks=num_host_blocks, block_size=config.block_size,
            eos_token_id=eos_ids, vocab_size=self.vocab_size,
        )
        self.builder = FlashAttentionMetadataBuilder(
            block_size=config.block_size, num_blocks=num_blocks, sliding_window=sliding_window,
            chunked_prefill=True, pad=True, batch_buckets=config.batch_buckets,
            token_buckets=config.token_buckets,
            block_table_width_buckets=config.block_table_width_buckets or (self.shapes.block_table_width,),
        )
        self._model = model
        self._host_caches: list[Array] | None = None
        self._batch: _DecodeBatch | None = None
        self._num_traces = 0
        self._compile_events_before = _compile_events
        self.stats = EngineStats()
        self._stats_base = self._scheduler_counts()
        self._request_counter = 0
        total_gib = bytes_per_block * num_blocks / (1 << 30)
        report.append(f"KV cache: {num_blocks} blocks of {config.block_size} tokens "
                      f"({num_blocks * config.block_size:,} tokens, {total_gib:.2f} GiB); host swap space "
                      f"{num_host_blocks} blocks")
        report.append(f"attention: {_implementation_report(model)}")
        report.append(f"projections: {_matmul_report(model)}")
        self.start_report = "\n".join(report)
        """What the engine chose at start (cache size, implementations); also logged."""
        logger.info("LLMEngine: %s", self.start_report.replace("\n", "; "))

    @property
    def kv_caches(self) -> list[Array]:
        """The current device caches, one per layer (replaced by every step: donated)."""
        return self.runner.kv_caches

    # ------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request; returns its id. A bad request raises here and nothing else changes.

        Args:
          prompt_token_ids: non-empty sequence of ids in ``[0, vocab_size)``, shorter than
            ``max_model_len``.
          sampling_params: `SamplingParams` (validated when built); default: vLLM's
            defaults (temperature 1, 16 tokens).
          request_id: unique id; default: a counter.

        Raises ValueError / TypeError naming the problem (empty prompt, prompt too long
        for the model's max context, token ids out of range, stop ids outside the
        vocabulary, duplicate id, a request the cache could never hold, ``n`` > 1 or stop
        strings: see below).

        One request is one sequence: ``SamplingParams.n`` > 1 is taken by `generate`
        (which adds ``n`` requests). Stop strings need text, which the engine does not
        have: `LLM` (with a tokenizer) checks them and ends the request with
        `stop_request`.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        if params.n != 1:
            raise ValueError(f"sampling_params.n={params.n}: add_request adds one sequence; LLMEngine.generate "
                             f"and LLM.generate sample n per prompt.")
        if params.stop:
            raise ValueError(f"sampling_params.stop={list(params.stop)!r}: stop strings need text and the engine "
                             f"works on token ids; use LLM (with a tokenizer) or stop_token_ids.")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids {bad} lie outside the vocabulary [0, {self.vocab_size}).")
        if request_id is None:
            while str(self._request_counter) in self.scheduler.requests:
                self._request_counter += 1
            request_id = str(self._request_counter)
            self._request_counter += 1
        seed = params.seed
        if seed is None:  # reproducible per (engine seed, arrival number), independent of batching
            seed = hash((self.config.seed, self.scheduler.next_arrival_index)) & 0xFFFFFFFF
        self.scheduler.add_request(request_id, prompt_token_ids, params, seed=seed)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stops a request and frees its blocks (KeyError for an unknown id).

        A request in the persistent decode batch stops writing before the next window;
        a window already running may still write into its freed blocks, before any later
        program (the device runs them in order) can hand them to another request.
        """
        self.scheduler.abort(request_id)

    def stop_request(self, request_id: str, num_output_tokens: int, stop_reason: int | str | None = None) -> None:
        """Ends a request as stopped after its first ``num_output_tokens`` output tokens,
        for a stop the host decides (`LLM`'s stop strings).

        The later tokens and their logprobs are dropped, ``finish_reason`` becomes "stop"
        and ``stop_reason`` the given one; a running request's blocks are freed as by
        `abort_request`. A request that already finished (by length, EOS, a stop id in
        the same decode window) may be cut back too, until it is popped.

        Raises KeyError for an unknown id, ValueError for an aborted request or a count
        outside ``[1, tokens generated]``.
        """
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}.")
        if request.finish_reason == FinishReason.ABORTED:
            raise ValueError(f"request {request_id!r} was aborted; it cannot be stopped.")
        generated = len(request.output_token_ids)
        if isinstance(num_output_tokens, bool) or not isinstance(num_output_tokens, (int, np.integer)) \
                or not 1 <= num_output_tokens <= generated:
            raise ValueError(f"num_output_tokens must be an int in [1, {generated}] (the tokens request "
                             f"{request_id!r} has generated), got {num_output_tokens!r}.")
        if not request.is_finished:
            self.scheduler.abort(request_id)  # frees its blocks; later windows record nothing for it
        request.finish_reason = FinishReason.STOP
        request.stop_reason = stop_reason
        del request.output_token_ids[num_output_tokens:]
        if request.output_logprobs is not None:
            del request.output_logprobs[num_output_tokens:]
            request.cumulative_logprob = sum(
                entry[token].logprob for token, entry in zip(request.output_token_ids, request.output_logprobs))

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out (or a window is in flight)."""
        return self.scheduler.has_unfinished() or bool(self._batch and self._batch.inflight)

    def pop_output(self, request_id: str) -> RequestOutput:
        """Removes a finished (or aborted) request from the engine and returns its output."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}.")
        if not request.is_finished:
            raise ValueError(f"request {request_id!r} has not finished.")
        return RequestOutput.of(self.scheduler.pop_finished(request_id))

    # ---------------------------------------------------------------- step
    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled for this engine (one per distinct bucket of inputs).

        Engines over models with the same structure share their jitted programs (and
        compiled programs); a program another engine compiled first is not counted.
        """
        return self._num_traces

    def _host_swap_space(self) -> list[Array]:
        if self._host_caches is None:
            # The device caches' head count, not the config's: a tensor-parallel model may
            # store each KV head several times (`LlamaForCausalLM.kv_head_replicas`).
            num_kv_heads, head_dim = self.runner.kv_caches[0].shape[-2:]
            self._host_caches = [
                cache_ops.allocate_host_kv_cache(
                    self.config.num_host_blocks, self.config.block_size, num_kv_heads, head_dim,
                    kv_cache_dtype=self._model.kv_cache_dtype, model_dtype=self._model.dtype, sharding=None,
                )
                for _ in self.runner.kv_caches
            ]
        return self._host_caches

    def _run_block_ops(self, out: SchedulerOutput) -> None:
        """Swap-outs, copy-on-write copies, swap-ins, in the order `SchedulerOutput` requires."""
        runner = self.runner
        if out.swap_out:
            mapping = np.asarray(out.swap_out, np.int32)
            host = self._host_swap_space()
            self._host_caches = [cache_ops.swap_blocks(dev, h, mapping) for dev, h in zip(runner.kv_caches, host)]
        if out.copies:
            n = len(out.copies)
            mapping = np.full((next_power_of_2(n), 2), cache_ops.PAD_BLOCK_ID, np.int32)  # few programs
            mapping[:n] = out.copies
            runner.kv_caches = _copy_blocks_donated(runner.kv_caches, mapping)
            self.stats.num_copied_blocks += n
        if out.swap_in:
            mapping = np.asarray(out.swap_in, np.int32)
            host = self._host_swap_space()
            runner.kv_caches = [cache_ops.swap_blocks(h, dev, mapping) for h, dev in zip(host, runner.kv_caches)]

    def step(self) -> list[RequestOutput]:
        """Runs one decode window, or one scheduled step; returns the requests that finished.

        While every running request decodes and none can be admitted, a call reads the
        tokens of one decode window (after dispatching the next). Otherwise it first
        reads the windows in flight, then runs one scheduled step. Finished requests
        stay retrievable with `pop_output` (`generate` pops its own).

        A step that raises (a program failing on the device, an interrupt) leaves the
        engine usable: the requests that held KV blocks are aborted or queued for
        recomputation (`EngineConfig.on_step_failure`), the KV caches are rebuilt where
        the failed program had consumed them, the prefix cache is emptied (a failed
        program may have left half-written blocks), a warning says so, and the error is
        raised again.
        """
        try:
            return self._step()
        except BaseException as error:
            self._recover_from_failed_step(error)
            raise

    def _recover_from_failed_step(self, error: BaseException) -> None:
        """Puts the engine back in a usable state after ``error`` interrupted a step."""
        self._batch = None
        self.runner.drop_decode_state()
        rebuilt = self.runner.rebuild_kv_caches_if_consumed()
        self._host_caches = None  # swapped-out blocks are dropped with their requests' state
        recompute = self.config.on_step_failure == "recompute"
        affected = self.scheduler.reset_after_failure(recompute=recompute)
        logger.warning(
            "LLMEngine.step failed (%s: %s): %s; %d request(s) that held KV blocks %s "
            "(EngineConfig.on_step_failure=%r); the prefix cache was emptied.",
            type(error).__name__, error,
            "the KV caches it had consumed were allocated anew" if rebuilt else "the KV caches were kept",
            len(affected), "queued for recomputation" if recompute else "aborted", self.config.on_step_failure)

    def _step(self) -> list[RequestOutput]:
        start_time = time.perf_counter()
        traces_before = self.runner.num_traces
        self._compile_events_before = _compile_events  # see `_record`
        if self._decode_window_ready():
            window = self._decode_window_step()
            if window is not None:
                finished, num_tokens = window
                self._record(None, num_tokens, time.perf_counter() - start_time,
                             self.runner.num_traces - traces_before)
                return [RequestOutput.of(r) for r in finished]
        finished: list[Request] = []
        num_drained = 0
        if self._can_mix():
            result = self._mixed_step(start_time, traces_before)
            if isinstance(result, list):
                return result
            finished, num_drained = result  # no mixed step could run: a scheduled one follows
        elif self._can_prefill_beside_batch():
            out = self.scheduler.schedule_prefills()
            if not out.is_empty:
                return self._run_scheduled(out, [], 0, start_time, traces_before, beside_batch=True)
            self._run_block_ops(out)  # a prompt chunk found no blocks: its preemption's swap-outs
        more, n = self._drain()
        finished += more
        num_drained += n
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request (this is a bug).")
            if num_drained:
                self._record(None, num_drained, time.perf_counter() - start_time, 0)
            return [RequestOutput.of(r) for r in finished]
        return self._run_scheduled(out, finished, num_drained, start_time, traces_before, beside_batch=False)

    def _run_scheduled(self, out: SchedulerOutput, finished: list[Request], num_drained: int, start_time: float,
                       traces_before: int, *, beside_batch: bool) -> list[RequestOutput]:
        """Runs a scheduled step (block moves, forward, sampling) and records it; with
        ``beside_batch`` (a prefill-only step while the decode windows stay in flight) the
        requests that finished their prompt join the persistent batch's free rows."""
        self._run_block_ops(out)
        metadata, token_ids, positions, rows, sampling = self._prepare_inputs(out)
        greedy = all(item.request.sampling_params.greedy for item in out.scheduled)
        num_logprobs = self._num_logprobs([item.request for item in out.scheduled if item.samples])
        result = self.runner.run_step(token_ids, positions, metadata, sampling, greedy=greedy,
                                      num_logprobs=num_logprobs)
        if beside_batch and self._batch is not None and len(self._batch.inflight) < 2:
            # The batch's rows decode one more window behind the prefill while the host
            # waits for the prompt's token, so the device does not idle until they join.
            self._dispatch_window()
        tokens, logprobs = _to_host(result)  # waits
        sampled = {item.request.request_id: int(tokens[row]) for item, row in zip(out.scheduled, rows) if item.samples}
        if logprobs is not None:
            for item, row in zip(out.scheduled, rows):
                if item.samples:
                    _append_logprobs(item.request, tokens[row:row + 1], logprobs, np.s_[row:row + 1])
        finished += self.scheduler.update(out, sampled)
        if beside_batch:
            self._join_batch([item.request for item in out.scheduled
                              if item.samples and not item.request.is_finished])
        compiled = self.runner.num_traces - traces_before
        self._record(out, len(sampled) + num_drained, time.perf_counter() - start_time, compiled)
        return [RequestOutput.of(r) for r in finished]

    # ------------------------------------------------------ decode windows
    def _decode_window_ready(self) -> bool:
        """Whether the next step can be a decode window: every unfinished request runs,
        decodes (no prompt token pending), and none can be admitted."""
        sched = self.scheduler
        if sched.swapped or not sched.running:
            return False
        if sched.can_admit():
            return False
        if any(r.in_prefill for r in sched.running):
            return False
        return True

    def _decode_window_step(self) -> tuple[list[Request], int] | None:
        """Dispatches the next window(s) and reads the oldest in flight; None (after
        draining) when no window can run: a request needs blocks the free list lacks."""
        finished, num_tokens = [], 0
        if self._batch is None or self._batch.needs_rebuild(self.shapes):
            finished, num_tokens = self._drain()
            if not self._decode_window_ready():
                return finished, num_tokens
            self._start_batch(list(self.scheduler.running), mixing=False)
        batch = self._batch
        assert batch is not None
        # Keep one window queued behind the one running, so the device never waits for us.
        while len(batch.inflight) < 2 and self._dispatch_window():
            pass
        if not batch.inflight:
            more, n = self._drain()
            return None if not (finished or more) else (finished + more, num_tokens + n)
        more_finished, more_tokens = self._read_window()
        return finished + more_finished, num_tokens + more_tokens

    def _can_mix(self) -> bool:
        """Whether the next step can be a mixed step: ``decode_during_prefill``, nobody
        swapped out (swap-ins are scheduled steps), and a prompt chunk to run."""
        sched = self.scheduler
        if not self.config.decode_during_prefill or sched.swapped:
            return False
        return any(r.in_prefill for r in sched.running) or sched.can_admit()

    def _batch_takes_prompts(self) -> bool:
        """Whether the persistent batch can run beside prompt sections as it is: their
        block-table width and a row count the mixed programs were built for, and every
        decoding request among its rows."""
        batch = self._batch
        if batch is None or batch.wants_wider_table or batch.missing_rows:
            return False
        if batch.width != self.shapes.block_table_width or batch.num_rows not in self.shapes.mixed_rows:
            return False
        members = {r.request_id for r in batch.requests}
        return all(r.in_prefill or r.request_id in members for r in self.scheduler.running)

    def _mixed_step(self, start_time: float, traces_before: int) -> list[RequestOutput] | tuple[list[Request], int]:
        """Runs prompt chunks and one decode step of the persistent batch in one program;
        the prompts that end take free rows of the batch in it.

        The batch is (re)built first when it cannot take part as it is. The step queues
        behind the windows in flight; with ``async_scheduling`` the oldest program in
        flight is read only while another runs. Returns the requests that finished, or,
        when no mixed step could run (a row's next block or the prompts' blocks do not
        fit: the scheduler must preempt), ``(finished, num_tokens)`` of what was read on
        the way, for a scheduled step to follow.
        """
        sched = self.scheduler
        finished: list[Request] = []
        num_read = 0
        if not self._batch_takes_prompts():
            finished, num_read = self._drain()
            self._start_batch([r for r in sched.running if not r.in_prefill], mixing=True)
        batch = self._batch
        assert batch is not None
        update = self._reserve_rows(1)
        if update is None:
            return finished, num_read
        out = sched.schedule_prefills()
        self._run_block_ops(out)
        if out.is_empty:
            return finished, num_read
        keep, block_rows, block_values, live = update
        metadata, token_ids, positions, rows, sampling = self._prepare_inputs(out)
        prompts = [item.request for item in out.scheduled if item.samples]
        greedy = batch.greedy and all(item.request.sampling_params.greedy for item in out.scheduled)
        asks = [k for k in (batch.num_logprobs, self._num_logprobs(prompts)) if k is not None]
        num_logprobs = max(asks) if asks else None
        join_index, join_rows, joining = self._joining_rows(out, rows, metadata.num_seqs)
        prompt_result, rows_result = self.runner.run_mixed(
            keep, block_rows, block_values, token_ids, positions, metadata, sampling, join_index, join_rows,
            greedy=greedy, max_model_len=self.config.max_model_len, num_logprobs=num_logprobs)
        sched.commit(out)  # the next schedule starts each prompt where this step leaves it
        batch.inflight.append(_InFlight(rows_result, list(batch.requests), _PromptTokens(out, prompt_result, rows)))
        batch.next_position[live] += 1
        for row, request in joining:
            self._take_row(row, request, next_position=request.num_tokens)  # the token it samples
        self.stats.num_mixed_steps += 1
        self.stats.num_inserted_rows += len(joining)
        # Read while the next program runs (async scheduling), or everything now.
        while len(batch.inflight) > (1 if self.config.async_scheduling else 0):
            more, n = self._read_window()
            finished += more
            num_read += n
        self._record(out, num_read, time.perf_counter() - start_time, self.runner.num_traces - traces_before)
        return [RequestOutput.of(r) for r in finished]

    def _joining_rows(self, out: SchedulerOutput, rows: np.ndarray, num_seqs: int
                      ) -> tuple[np.ndarray, DecodeState, list[tuple[int, Request]]]:
        """The batch rows that the requests whose prompt ends in ``out`` take in the mixed
        step (`ModelRunner.run_mixed`'s ``join_index`` and ``join_rows``, and the
        ``(row, request)`` pairs). When they do not all fit (rows, block-table width,
        stop ids, the batch's static greedy / logprobs choice) none joins, and the batch
        is rebuilt before the next step instead."""
        batch = self._batch
        assert batch is not None
        join_index = np.full(num_seqs, batch.num_rows, np.int32)  # padding entries are dropped
        join_rows = DecodeState.empty(num_seqs, batch.width, batch.num_stop_ids)
        items = [(item.request, seq) for item, seq in zip(out.scheduled, rows) if item.samples]
        if not items:
            return join_index, join_rows, []
        free = batch.free_rows()
        if len(items) > len(free) or not all(self._fits_batch(request) for request, _ in items):
            batch.missing_rows = True
            return join_index, join_rows, []
        joining = []
        for (request, seq), row in zip(items, free):
            self._fill_row(join_rows, seq, request, sampled_later=True)
            join_index[seq] = row
            joining.append((row, request))
        return join_index, join_rows, joining

    def _fits_batch(self, request: Request) -> bool:
        """Whether ``request`` can decode in a row of the current batch as it is."""
        batch = self._batch
        assert batch is not None
        return (len(request.block_table) <= batch.width
                and self.scheduler.last_input_position(request) // self.config.block_size + 1 <= batch.width
                and len(self.scheduler.stop_token_ids(request)) <= batch.num_stop_ids
                and (request.sampling_params.greedy or not batch.greedy)
                and self._num_logprobs([request]) == batch.num_logprobs)

    def _can_prefill_beside_batch(self) -> bool:
        """Whether the next step may prefill while the persistent batch keeps its windows
        in flight: prefill-only steps (no ``decode_during_prefill``), nobody swapped out,
        a free row for a new request, and every decoding request already in the batch."""
        batch, sched = self._batch, self.scheduler
        if batch is None or self.config.decode_during_prefill or sched.swapped:
            return False
        if batch.needs_rebuild(self.shapes) or not batch.free_rows():
            return False
        members = {r.request_id for r in batch.requests}
        return all(r.in_prefill or r.request_id in members for r in sched.running)

    def _join_batch(self, requests: list[Request]) -> None:
        """Puts requests that start decoding into free rows of the persistent batch, on the
        device after the windows in flight; when they do not all fit (rows, block-table
        width, stop ids, the batch's static greedy / logprobs choice) the batch is rebuilt
        before its next window instead."""
        batch = self._batch
        assert batch is not None
        if not requests:
            return
        free = batch.free_rows()
        fits = len(requests) <= len(free) and all(self._fits_batch(r) for r in requests)
        if not fits:
            batch.missing_rows = True
            return
        values = DecodeState.empty(batch.num_rows, batch.width, batch.num_stop_ids)
        row_index = np.full(batch.num_rows, batch.num_rows, np.int32)  # padding entries are dropped
        for j, (row, request) in enumerate(zip(free, requests)):
            self._fill_row(values, j, request)
            row_index[j] = row
            self._take_row(row, request, next_position=request.num_tokens - 1)
        self.runner.insert_decode_rows(row_index, values)
        self.stats.num_inserted_rows += len(requests)

    def _take_row(self, row: int, request: Request, *, next_position: int) -> None:
        """Gives ``row`` of the batch's host view to ``request``, whose next input sits at
        ``next_position`` (free rows list the padding rows last, in order)."""
        batch = self._batch
        assert batch is not None
        if row == len(batch.requests):
            batch.requests.append(request)
        else:
            batch.requests[row] = request
        batch.next_position[row] = next_position
        batch.table_len[row] = len(request.block_table)

    def _fill_row(self, rows: DecodeState, i: int, request: Request, *, sampled_later: bool = False) -> None:
        """Host row ``i`` of a `DecodeState` from a decoding request; ``sampled_later``:
        as the request will be after the token a dispatched step samples for it (whose
        value the device fills in)."""
        params = request.sampling_params
        stops = self.scheduler.stop_token_ids(request)
        num_pending = 1 if sampled_later else 0
        rows.tokens[i] = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
        rows.positions[i] = request.num_tokens - 1 + num_pending
        rows.active[i] = True
        rows.block_tables[i, :len(request.block_table)] = request.block_table
        rows.temperature[i], rows.top_p[i], rows.top_k[i] = params.temperature, params.top_p, params.top_k
        rows.seed[i], rows.num_generated[i] = request.seed, len(request.output_token_ids) + num_pending
        rows.max_tokens[i] = params.max_tokens
        rows.stop_ids[i, :len(stops)] = stops

    def _start_batch(self, requests: list[Request], *, mixing: bool) -> None:
        """Uploads ``requests`` (decoding ones) as the rows of a new persistent batch.

        A batch for mixed steps (``mixing``) has the prompt sections' block-table width
        and rows for every request that may run while prompts are admitted; a batch of
        decode windows is as small as its rows allow, and wide enough for every row's
        last position, so it never needs rebuilding (and recompiling) to grow a row.
        """
        cfg, sched = self.config, self.scheduler
        if mixing:
            num_rows = self.shapes.rows_for(min(cfg.max_num_seqs, len(sched.running) + len(sched.waiting)),
                                            mixing=True)
            width = self.shapes.block_table_width
        else:
            num_rows = self.shapes.rows_for(len(requests), mixing=False)
            longest = max(sched.final_length(r) for r in requests)
            width = self.shapes.window_width(
                max([-(-longest // cfg.block_size)] + [len(r.block_table) for r in requests]))
        num_stop_ids = stop_id_columns(max((len(sched.stop_token_ids(r)) for r in requests), default=1))
        rows = DecodeState.empty(num_rows, width, num_stop_ids)
        for i, request in enumerate(requests):
            self._fill_row(rows, i, request)
        self.runner.start_decode(rows)
        self.stats.num_decode_batches += 1
        self._batch = _DecodeBatch(
            requests=list(requests), num_rows=num_rows, width=width, num_stop_ids=num_stop_ids,
            next_position=rows.positions.astype(np.int64), table_len=np.array(
                [len(r.block_table) for r in requests] + [0] * (num_rows - len(requests)), np.int64),
            greedy=all(r.sampling_params.greedy for r in requests), num_logprobs=self._num_logprobs(requests))

    def _reserve_rows(self, num_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None:
        """Reserves the blocks the batch's live rows write in the next ``num_steps`` steps;
        returns the batch update ``(keep, block_rows, block_values)`` and the live rows, or
        None (nothing reserved) when a row outgrew the table or the blocks do not suffice."""
        batch = self._batch
        assert batch is not None
        bs = self.config.block_size
        live = [i for i, r in enumerate(batch.requests) if not r.is_finished
                and batch.next_position[i] + 2 <= self.scheduler.final_length(r)]
        need = [min(int(batch.next_position[i]) + num_steps - 1,
                    self.scheduler.last_input_position(batch.requests[i])) // bs + 1 for i in live]
        if need and max(need) > batch.width:
            batch.wants_wider_table = True
            return None
        missing = sum(max(0, n - len(batch.requests[i].block_table)) for i, n in zip(live, need))
        if not self.scheduler.device_blocks.can_allocate(missing):
            return None
        changed = []
        for i in live:
            request = batch.requests[i]
            reserved = self.scheduler.reserve_decode_blocks(request, int(batch.next_position[i]) + num_steps - 1)
            assert reserved is not None, "blocks were counted before reserving"
            if len(request.block_table) > batch.table_len[i]:
                changed.append(i)
        # One shape (R updates, padding rows index R and are dropped), so one program.
        update_rows = np.full(batch.num_rows, batch.num_rows, np.int32)
        update_values = np.zeros((len(update_rows), batch.width), np.int32)
        for j, i in enumerate(changed):
            table = batch.requests[i].block_table
            update_rows[j] = i
            update_values[j, :len(table)] = table
            batch.table_len[i] = len(table)
        keep = np.zeros(batch.num_rows, bool)
        keep[live] = True
        return keep, update_rows, update_values, live

    def _dispatch_window(self) -> bool:
        """Reserves the next window's blocks and dispatches it; False if it cannot run now."""
        batch = self._batch
        assert batch is not None
        k = self.config.num_scheduler_steps
        update = self._reserve_rows(k)
        if update is None or not update[3]:
            return False
        keep, update_rows, update_values, live = update
        out = self.runner.run_decode_window(keep, update_rows, update_values, num_steps=k, greedy=batch.greedy,
                                            max_model_len=self.config.max_model_len,
                                            num_logprobs=batch.num_logprobs)
        batch.inflight.append(_InFlight(out, list(batch.requests)))  # the rows' requests when dispatched
        batch.next_position[live] += k
        return True

    def _read_window(self) -> tuple[list[Request], int]:
        """Waits for the oldest window (or mixed step) in flight and records its tokens:
        a mixed step's prompt tokens first, then its rows'."""
        batch = self._batch
        assert batch is not None and batch.inflight
        entry = batch.inflight.popleft()
        finished, num_tokens = [], 0
        if entry.prompt is not None:
            finished, num_tokens = self._read_prompt_tokens(entry.prompt)
        requests = entry.requests
        tokens, logprobs = _to_host(entry.result)  # [K, R]; waits for that window only
        now = time.perf_counter()
        counts = (tokens != NO_TOKEN).sum(axis=0)
        for i in np.nonzero(counts[:len(requests)])[0]:
            request = requests[i]
            n = int(counts[i])
            if logprobs is not None:
                _append_logprobs(request, tokens[:n, i], logprobs, np.s_[:n, i])
            if self.scheduler.record_decoded(request, tokens[:n, i].tolist(), now) is not None:
                finished.append(request)
            num_tokens += n
        return finished, num_tokens

    def _read_prompt_tokens(self, step: "_PromptTokens") -> tuple[list[Request], int]:
        """Records the tokens a mixed step sampled for the prompts that ended in it."""
        tokens, logprobs = _to_host(step.result)  # waits for the step
        sampled = {item.request.request_id: int(tokens[row])
                   for item, row in zip(step.out.scheduled, step.rows) if item.samples}
        if logprobs is not None:
            for item, row in zip(step.out.scheduled, step.rows):
                if item.samples and not item.request.is_finished:
                    _append_logprobs(item.request, tokens[row:row + 1], logprobs, np.s_[row:row + 1])
        return self.scheduler.record_sampled(step.out, sampled), len(sampled)

    def _drain(self) -> tuple[list[Request], int]:
        """Reads every window in flight and retires the persistent batch (the host then
        knows every request's tokens exactly, as a scheduled step needs)."""
        finished, num_tokens = [], 0
        while self._batch is not None and self._batch.inflight:
            more, n = self._read_window()
            finished += more
            num_tokens += n
        if self._batch is not None:
            self._batch = None
            self.runner.drop_decode_state()
        return finished, num_tokens

    # --------------------------------------------------- scheduled steps
    def _prepare_inputs(self, out: SchedulerOutput) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray,
                                                               tuple[np.ndarray, ...]]:
        """Host inputs of a scheduled step: metadata, token ids, positions, metadata row
        of each scheduled request, sampling arrays (NumPy, padded to the metadata's buckets)."""
        sequences = [
            ScheduledSequence(is_prompt=item.is_prefill, seq_len=item.seq_len, context_len=item.start,
                              query_len=item.num_new_tokens, block_table=item.request.block_table)
            for item in out.scheduled
        ]
        if out.num_prefills == len(out.scheduled):
            metadata = self._prompt_section(sequences)
        else:
            metadata = self.builder.build_host(sequences)
        if self.config.coarse_length_bounds and metadata.num_prefills and metadata.num_decode_tokens:
            capacity = int(metadata.block_tables.shape[1]) * self.config.block_size
            metadata = dataclasses.replace(
                metadata, max_query_len=max(metadata.max_query_len, metadata.num_prefill_tokens),
                max_prefill_seq_len=max(metadata.max_prefill_seq_len, capacity))
        token_ids = pack_per_token(metadata, sequences,
                                   [_token_slice(item.request, item.start, item.seq_len) for item in out.scheduled])
        positions = input_positions(metadata, sequences)
        rows = sequence_rows(metadata, sequences)
        return metadata, token_ids, positions, rows, self._sampling_arrays(out, rows, metadata.num_seqs)

    def _prompt_section(self, sequences: list[ScheduledSequence]) -> Any:
        """Host metadata of prompt chunks in one of the engine's prompt shapes
        (`ProgramShapes.prompt_shape`), with the static length bounds its shape can hold
        (so the shape alone selects the program)."""
        num_tokens, num_seqs = self.shapes.prompt_shape(sum(s.query_len for s in sequences), len(sequences))
        width = self.shapes.block_table_width
        builder = dataclasses.replace(self.builder, batch_buckets=(num_seqs,), token_buckets=(num_tokens,),
                                      block_table_width_buckets=(width,))
        metadata = builder.build_host(sequences)
        return dataclasses.replace(metadata, max_query_len=num_tokens,
                                   max_prefill_seq_len=width * self.config.block_size)

    def _sampling_arrays(self, out: SchedulerOutput, rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, ...]:
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

    def _num_logprobs(self, requests: Sequence[Request]) -> int | None:
        """Static ``num_logprobs`` of a program sampling for ``requests``: None when none
        asks for logprobs (the programs without them), else a bucket of the largest ask."""
        asks = [r.sampling_params.logprobs for r in requests if r.sampling_params.logprobs is not None]
        return logprobs_bucket(max(asks), self.vocab_size) if asks else None

    # ---------------------------------------------------------------- stats
    def _scheduler_counts(self) -> dict[str, int]:
        s = self.scheduler
        return dict(num_preemptions=s.num_preemptions, num_swapped_out_blocks=s.num_swapped_out_blocks,
                    num_recomputed_requests=s.num_recomputed_requests,
                    num_prefix_cache_hit_tokens=s.num_prefix_cache_hit_tokens)

    def _record(self, out: SchedulerOutput | None, num_sampled: int, elapsed: float, compiled: int) -> None:
        """Updates the stats after a step (``out`` None: a decode window)."""
        s = self.stats
        self._num_traces += compiled
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_compiled_programs = self._num_traces
        for name, value in self._scheduler_counts().items():
            setattr(s, name, value - self._stats_base[name])
        # Not only the runner's programs: the step's block moves may have compiled.
        if compiled or _compile_events != self._compile_events_before:
            s.compile_steps += 1
            s.compile_time_s += elapsed
        elif out is not None and out.num_prefills:
            s.num_prefill_tokens += sum(i.num_new_tokens for i in out.scheduled if i.is_prefill)
            s.prefill_time_s += elapsed
        else:
            s.num_decode_tokens += num_sampled
            s.decode_time_s += elapsed

    def warmup(self, *, use_tqdm: bool = True) -> "WarmupReport":
        """Compiles every program the configuration reaches, so that no later `step` or
        `generate` compiles (a server must not stall a request for a compilation).

        The programs and their shapes are `ProgramShapes`': decode windows and row
        inserts of every batch size, greedy and sampled, the mixed prompt + decode steps
        of every prompt shape (the prompt-only steps with ``decode_during_prefill``
        False) and, with prefix caching, the copy-on-write block copies. Each runs once
        on padding (no cache slot is written). Not covered, and compiled on first use:
        requests asking for ``logprobs`` (a program per logprobs width), more stop ids
        than `shapes.MIN_STOP_ID_COLUMNS`, preemption by swapping (the swap programs)
        and the scheduled steps that follow it. With ``EngineConfig.compilation_cache`` a
        second start loads the programs from the program store instead, untraced.

        Raises RuntimeError while requests are in the engine.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() runs before any request: this engine has unfinished requests.")
        tasks = self._warmup_tasks()
        start, compiles_before, hits_before = time.perf_counter(), _backend_compiles, _cache_hits
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(tasks), desc="compiling", unit="program", file=sys.stderr)
        seconds = []
        try:
            for task in tasks:
                task_start = time.perf_counter()
                task()
                seconds.append(time.perf_counter() - task_start)
                if bar is not None:
                    bar.update(1)
            jax.block_until_ready(self.runner.kv_caches)
        finally:
            if bar is not None:
                bar.close()
            self.runner.drop_decode_state()
            self._batch = None
        report = WarmupReport(num_programs=len(tasks), num_compiled=_backend_compiles - compiles_before,
                              num_cache_hits=_cache_hits - hits_before, seconds=time.perf_counter() - start,
                              slowest_program_s=max(seconds, default=0.0))
        logger.info("LLMEngine.warmup: %s", report)
        self._num_traces = self.runner.num_traces
        self.stats.num_compiled_programs = self._num_traces
        return report

    def _warmup_tasks(self) -> list[Any]:
        """One callable per program (shape) that `warmup` runs."""
        shapes, cfg, runner = self.shapes, self.config, self.runner
        num_stop_ids = shapes.num_stop_id_columns
        tasks: list[Any] = []

        def no_row_update(num_rows: int, width: int) -> tuple[np.ndarray, ...]:
            # (keep, block_rows, block_values): every row stopped, no block-table row changed.
            return (np.zeros(num_rows, bool), np.full(num_rows, num_rows, np.int32),
                    np.zeros((num_rows, width), np.int32))

        def window(num_rows: int, width: int, greedy: bool) -> None:
            runner.start_decode(DecodeState.empty(num_rows, width, num_stop_ids))
            runner.insert_decode_rows(np.full(num_rows, num_rows, np.int32),
                                      DecodeState.empty(num_rows, width, num_stop_ids))
            runner.run_decode_window(*no_row_update(num_rows, width), num_steps=cfg.num_scheduler_steps,
                                     greedy=greedy, max_model_len=cfg.max_model_len)

        def mixed(num_rows: int, prompt_shape: tuple[int, int], greedy: bool) -> None:
            width = shapes.block_table_width
            runner.start_decode(DecodeState.empty(num_rows, width, num_stop_ids))
            inputs = self._padding_prompt_inputs(*prompt_shape)
            num_seqs = prompt_shape[1]
            no_join = (np.full(num_seqs, num_rows, np.int32), DecodeState.empty(num_seqs, width, num_stop_ids))
            runner.run_mixed(*no_row_update(num_rows, width), *inputs, *no_join, greedy=greedy,
                             max_model_len=cfg.max_model_len)

        def prompts(prompt_shape: tuple[int, int], greedy: bool) -> None:
            runner.run_step(*self._padding_prompt_inputs(*prompt_shape), greedy=greedy)

        def copies(num_pairs: int) -> None:
            mapping = np.full((num_pairs, 2), cache_ops.PAD_BLOCK_ID, np.int32)
            runner.kv_caches = _copy_blocks_donated(runner.kv_caches, mapping)

        for greedy in (True, False):
            for width in shapes.window_widths:
                for num_rows in shapes.decode_rows:
                    tasks.append(functools.partial(window, num_rows, width, greedy))
            for prompt_shape in shapes.prompt_shapes:
                if cfg.decode_during_prefill:
                    for num_rows in shapes.mixed_rows:
                        tasks.append(functools.partial(mixed, num_rows, prompt_shape, greedy))
                else:
                    tasks.append(functools.partial(prompts, prompt_shape, greedy))
        if cfg.enable_prefix_caching:
            num_pairs = 1
            while num_pairs <= next_power_of_2(shapes.max_prompts_per_step):
                tasks.append(functools.partial(copies, num_pairs))
                num_pairs *= 2
        return tasks

    def _padding_prompt_inputs(self, num_tokens: int, num_seqs: int) -> tuple[Any, ...]:
        """``(token_ids, positions, metadata, sampling)`` of a prompt section of that shape
        holding padding sequences only (they read no key and write no slot), with the
        leaves and static fields `_prompt_section` gives real steps."""
        width, bs = self.shapes.block_table_width, self.config.block_size
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

    def reset_stats(self) -> None:
        """Zeroes every counter (keeps the compiled-program count), e.g. after a warm-up run."""
        self.stats = EngineStats(num_compiled_programs=self._num_traces)
        self._stats_base = self._scheduler_counts()

    # ------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        stop_checker: StopChecker | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt until all finish; outputs come back in prompt order.

        Args:
          prompts: token-id sequences.
          sampling_params: one `SamplingParams` for all, or one per prompt. A prompt
            whose params set ``n`` > 1 runs as ``n`` requests (sample ``j`` seeded
            ``seed + j`` when ``seed`` is set) gathered into one output.
          use_tqdm: show a progress bar (sequences done, tokens so far, tokens/s over
            the steps that compiled nothing, and the time spent in steps that compiled).
          stop_checker: for stops the host decides (`LLM` passes its stop strings'
            check): after every step, called as ``stop_checker(i, j, completion)`` for
            each sequence ``j`` of prompt ``i`` that has new tokens (also one that has
            just finished); returning ``(num_tokens, stop_reason)`` ends it there
            (`stop_request`). Prompts with ``SamplingParams.stop`` need one.

        Returns one `RequestOutput` per prompt: the same vLLM-shaped class as `LLM`
        returns (``outputs[j].token_ids``, ``finish_reason``, ``stop_reason``, ...), with
        ``prompt`` and ``text`` None (the engine has no tokenizer), so code moves
        between the two unchanged; the timings and counts are the engine's own.

        Every prompt is validated before any runs: a bad one raises ValueError naming
        its index (``prompts[i]: ...``), and requests already in the engine are untouched.
        When anything raises later (a step, ``stop_checker``, an interrupt), this call's
        unfinished requests are aborted and removed, their blocks freed, before the
        error propagates.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}.")
        params_list = params_per_prompt(sampling_params, len(prompts))
        samples: list[list[str]] = []  # per prompt, its sequences' request ids
        sample_of: dict[str, tuple[int, int]] = {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            samples.append([])
            try:
                if params.stop and stop_checker is None:
                    raise ValueError(f"sampling_params.stop={list(params.stop)!r}: stop strings need text and "
                                     f"the engine works on token ids; use LLM (with a tokenizer) or stop_token_ids.")
                one = dataclasses.replace(params, n=1, stop=())  # the stops are stop_checker's
                for j in range(params.n):
                    seed = one.seed if one.seed is None else (one.seed + j) % 2**32
                    samples[i].append(self.add_request(prompt, dataclasses.replace(one, seed=seed)))
                    sample_of[samples[i][-1]] = (i, j)
            except (ValueError, TypeError) as e:
                for rid in sample_of:
                    self.abort_request(rid)
                    self.scheduler.pop_finished(rid)
                raise type(e)(f"prompts[{i}]: {e}") from e
        pending = set(sample_of)
        num_seen = dict.fromkeys(pending, 0)  # output tokens stop_checker has seen
        progress = _Progress(len(pending), use_tqdm)
        outputs: dict[str, RequestOutput] = {}
        try:
            while pending:
                tokens_before = self.stats.num_generated_tokens
                compiles_before = self.stats.compile_steps
                start_time = time.perf_counter()
                self.step()
                elapsed_s = time.perf_counter() - start_time
                if stop_checker is not None:
                    self._check_host_stops(pending, num_seen, sample_of, stop_checker)
                done = [rid for rid in pending if self.scheduler.requests[rid].is_finished]
                for rid in done:
                    pending.discard(rid)
                    outputs[rid] = self.pop_output(rid)
                progress.update(len(done), self.stats.num_generated_tokens - tokens_before, elapsed_s,
                                compiled=self.stats.compile_steps > compiles_before)
        except BaseException:
            # Whatever raised (a stop_checker, an interrupt, a failed step), no later call
            # may inherit this call's requests: they leave the engine with their blocks.
            for rid in pending:
                if rid in self.scheduler.requests:
                    self.scheduler.abort(rid)
                    self.scheduler.pop_finished(rid)
            raise
        finally:
            progress.close()
        return [RequestOutput.merge([outputs[rid] for rid in ids]) for ids in samples]

    def _check_host_stops(self, pending: set[str], num_seen: dict[str, int], sample_of: dict[str, tuple[int, int]],
                          stop_checker: StopChecker) -> None:
        """Asks ``stop_checker`` about every pending sequence with new tokens (`generate`)."""
        for rid in pending:
            request = self.scheduler.requests[rid]
            if len(request.output_token_ids) == num_seen[rid]:
                continue
            num_seen[rid] = len(request.output_token_ids)
            i, j = sample_of[rid]
            stop = stop_checker(i, j, CompletionOutput.of(request, j))
            if stop is not None:
                self.stop_request(rid, *stop)


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What `LLMEngine.warmup` did: programs (shapes) run, XLA compilations they took
    (``num_compiled``, JAX's count, which includes the ``num_cache_hits`` executables
    loaded from the persistent compilation cache instead), seconds in all and for the
    slowest program."""

    num_programs: int
    num_compiled: int
    num_cache_hits: int
    seconds: float
    slowest_program_s: float

    def __str__(self) -> str:
        return (f"{self.num_programs} programs ready in {self.seconds:.1f} s (slowest {self.slowest_program_s:.1f} s; "
                f"{self.num_compiled - self.num_cache_hits} XLA compilations, {self.num_cache_hits} programs "
                f"loaded from the compilation cache)")


def _program_store_dir(config: EngineConfig) -> str | None:
    """Where the engine keeps its compiled programs (`program_store`): beside JAX's
    persistent compilation cache, in its directory, and off when that cache is off
    (`_use_compilation_cache` leaves it off in an untrusted directory). The runner checks
    the directory itself again (`program_store.make_private_directory`)."""
    from jax_paged_attn.engine import program_store

    if not config.compilation_cache or not jax.config.jax_enable_compilation_cache:
        return None
    directory = jax.config.jax_compilation_cache_dir
    if not directory or program_store.untrusted_directory_reason(directory):
        return None
    return os.path.join(directory, "jax_paged_attn_programs")


_CACHE_DIR_SET_BY_ENGINE: list[str] = []
"""The directory an engine pointed JAX's process-wide persistent cache at, if any."""


def _use_compilation_cache(config: EngineConfig) -> str:
    """Points JAX's persistent compilation cache at ``config``'s directory unless the
    process chose one; returns the line saying what holds.

    The cache and the program store load native code from the directory, so a directory
    others can write (`program_store.untrusted_directory_reason`) is not used: the
    engine runs without both and says so. JAX's cache is one per process: an engine
    whose ``compilation_cache_dir`` differs from the directory in use raises."""
    from jax_paged_attn.engine import program_store

    current = jax.config.jax_compilation_cache_dir
    if not config.compilation_cache:
        return f"compilation cache: off (EngineConfig.compilation_cache=False){'' if not current else f'; JAX caches in {current}'}"
    if not jax.config.jax_enable_compilation_cache:
        return "compilation cache: off (the process set jax_enable_compilation_cache=False)"
    requested = None if config.compilation_cache_dir is None else os.path.expanduser(config.compilation_cache_dir)
    if current and requested and os.path.realpath(requested) != os.path.realpath(current):
        raise ValueError(
            f"EngineConfig.compilation_cache_dir={config.compilation_cache_dir!r}, but JAX's persistent compilation "
            f"cache (one per process) already uses {current!r}; pass that directory or None.")
    if current:
        reason = program_store.untrusted_directory_reason(current)
        owner = "an engine" if current in _CACHE_DIR_SET_BY_ENGINE else "the process"
        if reason:
            return (f"compilation cache: {current} (set by {owner}); program store off: the directory is not safe "
                    f"({reason})")
        return f"compilation cache: {current} (set by {owner})"
    directory = requested
    if directory is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "jax_paged_attn", "xla")
    reason = program_store.make_private_directory(directory)
    if reason:
        # JAX's cache would load executables from there as the store would: both off.
        return (f"compilation cache: off, program store off ({reason}; a directory others can write would choose "
                f"the code this process runs: make it yours with mode 700, or set "
                f"EngineConfig.compilation_cache_dir)")
    jax.config.update("jax_compilation_cache_dir", directory)
    _CACHE_DIR_SET_BY_ENGINE.append(directory)
    # Every program, not only those over JAX's default second of compile time: a warm
    # start should trace and load, never compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return (f"compilation cache: {directory} (JAX's persistent cache, every program kept; "
            f"EngineConfig.compilation_cache_dir moves it)")


@dataclasses.dataclass(frozen=True)
class _PromptTokens:
    """The prompt part of a mixed step in flight (dispatched and committed, not read)."""

    out: SchedulerOutput
    result: Any  # the prompt sequences' sampled tokens (and logprobs), on the device
    rows: np.ndarray  # each scheduled item's sequence index in ``result``


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A decode window or mixed step dispatched and not yet read."""

    result: Any  # the rows' tokens i32[K, R] (and logprobs), on the device
    requests: list[Request]  # row i's request when it was dispatched
    prompt: _PromptTokens | None = None  # a mixed step's prompt part


@dataclasses.dataclass
class _DecodeBatch:
    """Host view of the persistent decode batch (see `ModelRunner.run_decode_window`)."""

    requests: list[Request]  # row i's request (rows past the list are padding)
    num_rows: int
    width: int  # block-table columns of a row
    num_stop_ids: int  # stop-id columns of a row
    next_position: np.ndarray  # i64[R]: each row's input position at the next window's start
    table_len: np.ndarray  # i64[R]: block ids the device holds for each row
    greedy: bool
    num_logprobs: int | None = None  # the window programs' static num_logprobs
    # `_InFlight` windows and mixed steps, oldest first
    inflight: collections.deque = dataclasses.field(default_factory=collections.deque)
    wants_wider_table: bool = False
    missing_rows: bool = False  # a decoding request could not join (`LLMEngine._join_batch`)

    def free_rows(self) -> list[int]:
        """Rows a new request may take: those whose request finished as far as the host
        knows (a row the device stopped is inactive; an aborted one is overwritten after
        the windows in flight, which may still write into the freed blocks, before any
        later program reuses them), then the padding rows in order."""
        done = [i for i, r in enumerate(self.requests) if r.is_finished]
        return done + list(range(len(self.requests), self.num_rows))

    def needs_rebuild(self, shapes: ProgramShapes) -> bool:
        """A request outgrew its block-table row, a decoding request is outside the batch,
        or most rows stopped (a smaller batch bucket runs faster)."""
        if self.wants_wider_table or self.missing_rows:
            return True
        live = sum(not r.is_finished for r in self.requests)
        return live > 0 and shapes.rows_for(live, mixing=False) < self.num_rows


_copy_blocks_donated = jax.jit(cache_ops.copy_kv_cache_blocks, donate_argnums=(0,))
"""Copy-on-write over every layer's cache, in place (the caches are donated)."""


def _implementation_report(model: Any) -> str:
    """Which code the model's attention runs, in words (`jax_paged_attn.dispatch`)."""
    from jax_paged_attn import dispatch

    layers = getattr(getattr(model, "model", None), "layers", None)
    attn = getattr(getattr(layers[0], "self_attn", None), "attn", None) if layers else None
    from jax_paged_attn import tuning

    impl = dispatch.normalize_implementation(getattr(attn, "implementation", None))
    backend = jax.default_backend()
    if impl == dispatch.AUTO:
        if backend == "gpu":
            head_size = getattr(getattr(model, "config", None), "head_dim", None)
            prefill = ""
            if head_size is not None and tuning.auto_prefers_mosaic_prefill(head_size):
                prefill = (f", prefill of long query runs (at least {dispatch.MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE} "
                           f"rows per sequence) through the Mosaic GPU kernel (measured faster than the Triton one "
                           f"at head size {head_size} on this GPU)")
            return ("auto: Pallas Triton kernels for attention and the cache write on CUDA"
                    f"{prefill} (the pure-JAX reference for calls no kernel supports); {tuning.describe_tables()}")
        return f"auto: the pure-JAX reference (no Pallas kernel for the {backend} backend)"
    if impl == dispatch.MOSAIC_GPU:
        return ("mosaic_gpu (chosen by the model's implementation argument): the Mosaic GPU prefill and decode "
                "kernels with their default configs (not tuned yet), the Triton cache-write kernel")
    if impl == dispatch.TRITON and backend == "gpu":
        return f"{impl} (chosen by the model's implementation argument); {tuning.describe_tables()}"
    return f"{impl} (chosen by the model's implementation argument)"


def _matmul_report(model: Any) -> str:
    """Which code the model's projections run, in words (`jax_paged_attn.matmul.linear`)."""
    from jax_paged_attn import matmul

    impl = getattr(model, "matmul_implementation", None)
    if impl in (None, "auto"):
        return f"auto: {matmul.AUTO_CHOICE}"
    return f"{impl} (chosen by the model's matmul_implementation argument)"


KV_CACHE_BLOCK_QUANTUM = 256
"""A KV cache sized from memory holds a multiple of this many blocks (when that many fit):
the count is in the shape of every program that takes the cache, so it must not move
with a process's allocation history, or a second start would miss every such program in
the persistent compilation cache."""


def _device_memory_stats(device: Any) -> dict[str, int] | None:
    """The device's allocator statistics (``bytes_limit``, ``bytes_in_use``, ...), or None
    where the backend reports none (CPU)."""
    return device.memory_stats() if hasattr(device, "memory_stats") else None


def _kv_cache_blocks_for_memory(model: Any, config: EngineConfig, max_model_len: int) -> tuple[int, str]:
    """KV cache blocks that fit beside what the device holds now (the weights) and the
    largest step's activations in ``gpu_memory_utilization`` of the device's memory,
    rounded down to a multiple of `KV_CACHE_BLOCK_QUANTUM`; and the line saying so.

    Every term is a function of the model, the configuration and the arrays alive now:
    the activations are XLA's buffer assignment for the largest step's program, not the
    allocator's peak, which also counts whatever the process compiled or freed before
    (XLA's autotuner allocates while it compiles, so a cold start's peak is higher than
    a warm start's)."""
    device = jax.devices()[0]
    stats = _device_memory_stats(device)
    if not stats or "bytes_limit" not in stats:
        n = DEFAULT_NUM_BLOCKS_WITHOUT_MEMORY_STATS
        return n, (f"KV cache sized to {n} blocks: the {device.platform} device reports no memory statistics "
                   f"(pass EngineConfig.num_blocks to choose)")
    in_use = int(stats.get("bytes_in_use", 0))
    activations = _largest_step_activation_bytes(model, config, max_model_len)
    one = model.allocate_kv_caches(1, config.block_size)
    bytes_per_block = sum(int(c.nbytes) for c in one)
    del one
    allowed = int(stats["bytes_limit"] * config.gpu_memory_utilization)
    n = (allowed - in_use - activations) // bytes_per_block
    if n < 1:
        raise ValueError(
            f"no room for a KV cache: the weights (and other arrays alive) take {in_use / (1 << 30):.2f} GiB and the "
            f"largest step's activations {activations / (1 << 30):.2f} GiB of the "
            f"{config.gpu_memory_utilization:.0%} ({allowed / (1 << 30):.2f} GiB) allowed by gpu_memory_utilization; "
            f"raise it or lower max_num_batched_tokens.")
    if n >= KV_CACHE_BLOCK_QUANTUM:
        n -= n % KV_CACHE_BLOCK_QUANTUM
    return n, (f"KV cache sized by gpu_memory_utilization={config.gpu_memory_utilization}: arrays alive "
               f"(weights) {in_use / (1 << 30):.2f} GiB + the largest step's activations "
               f"{activations / (1 << 30):.2f} GiB (XLA's buffer assignment), {n} blocks fit (a multiple of "
               f"{KV_CACHE_BLOCK_QUANTUM}: the same count, and the same programs, at every start)")


def _largest_step_activation_bytes(model: Any, config: EngineConfig, max_model_len: int) -> int:
    """Device bytes a forward over ``max_num_batched_tokens`` prompt tokens with no cache
    (vLLM's profiling run) needs beside the weights: its other inputs, its outputs and
    its temporaries, as XLA's buffer assignment of the compiled program states them."""
    from flax import nnx

    from jax_paged_attn.builder import FlashAttentionMetadataBuilder as Builder

    num_tokens = config.max_num_batched_tokens
    seqs = max(1, min(config.max_num_seqs, num_tokens))
    lens = [num_tokens // seqs + (1 if i < num_tokens % seqs else 0) for i in range(seqs)]
    lens = [min(n, max_model_len) for n in lens if n > 0]
    builder = Builder(block_size=config.block_size, num_blocks=1, pad=False)
    metadata = builder.build([ScheduledSequence(is_prompt=True, seq_len=n, context_len=0, query_len=n,
                                                block_table=None) for n in lens])
    total = metadata.num_tokens
    graphdef, state = nnx.split(model)
    empty = [jax.numpy.zeros((0,), model.dtype) for _ in range(model.config.num_hidden_layers)]

    def forward(state: Any, ids: Array, positions: Array, md: Any) -> Array:
        rows = jax.numpy.maximum(md.query_start_loc[1:] - 1, 0)
        logits, _ = nnx.merge(graphdef, state)(ids, positions, empty, md, logits_indices=rows)
        return logits

    ids = np.zeros(total, np.int32)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    compiled = jax.jit(forward).trace(state, ids, positions, metadata).lower().compile()
    memory = compiled.memory_analysis()
    if memory is None:
        raise RuntimeError(f"the {jax.default_backend()} backend states no memory figures for a compiled program, so "
                           f"the KV cache cannot be sized from memory: pass EngineConfig.num_blocks.")
    inputs = sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves((ids, positions, metadata)))
    return int(memory.temp_size_in_bytes) + int(memory.output_size_in_bytes) + inputs


def _to_host(result: Any) -> tuple[np.ndarray, Any]:
    """``(tokens, TokenLogprobs | None)`` in NumPy from `ModelRunner.run_step` /
    `ModelRunner.run_decode_window`'s result (waits for it)."""
    if isinstance(result, tuple):
        tokens, logprobs = result
        return np.asarray(tokens), jax.tree_util.tree_map(np.asarray, logprobs)
    return np.asarray(result), None


def _append_logprobs(request: Request, tokens: np.ndarray, logprobs: Any, index: Any) -> None:
    """Appends the logprobs of ``tokens`` (about to be recorded for ``request``) when it
    asked for them; ``index`` selects those tokens' entries in ``logprobs`` (NumPy
    `TokenLogprobs`). A request that finished (aborted) records nothing, as its tokens."""
    k = request.sampling_params.logprobs
    if k is None or request.is_finished:
        return
    mine = jax.tree_util.tree_map(lambda x: x[index], logprobs)
    request.output_logprobs.extend(logprob_dicts(tokens, mine, k))
    request.cumulative_logprob += float(mine.sampled_logprob.astype(np.float64).sum())


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of ``prompt + output`` without building the whole list."""
    prompt, output, n = request.prompt_token_ids, request.output_token_ids, len(request.prompt_token_ids)
    if start >= n:
        return output[start - n:end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[:end - n]
