"""`EngineConfig`: the sizes and policies an `LLMEngine` is built with, and their checks.

An `EngineConfig` is checked when it is built (a bad field raises ValueError naming it);
`LLMEngine` then fills in what it resolves at start (``num_blocks`` from device memory,
``max_model_len`` from the model, ...) with `dataclasses.replace`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from jax_paged_attn.engine.sampling import as_bool

DEFAULT_SWAP_SPACE_GIB = 4.0
"""Host swap space when `EngineConfig.num_host_blocks` is None (vLLM's default, 4 GiB)."""

DEFAULT_NUM_BLOCKS_WITHOUT_MEMORY_STATS = 256
"""KV cache blocks when ``num_blocks`` is None and the device reports no memory statistics (CPU)."""

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
      latency_scheduler_steps: decode steps per window while no request waits for a row
        or blocks (the engine is not saturated): a window's tokens reach the host, and a
        server's streams, together, so shorter windows while there is room give each
        token as it is sampled (and admit a new request sooner), and
        ``num_scheduler_steps`` windows while requests queue keep the host's work per
        token low when throughput is what counts. None: ``num_scheduler_steps`` always.
        Each length is its own set of window programs (`LLMEngine.warmup` compiles both).
      latency_max_rows: short windows only while at most this many requests run (None:
        any number). The host's work per window grows with its rows (each row's tokens
        read, recorded and, in a server, decoded to text and sent), and a short window
        of many rows of a small model takes the host longer than the device's steps:
        the device then waits for the host, and a full batch draining (the tail of a
        burst) loses throughput. Above the cap the windows run ``num_scheduler_steps``.
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
      warmup_penalties: `LLMEngine.warmup` also compiles the programs of penalized batches
        (presence / frequency / repetition penalties, ``logit_bias``, ``min_tokens``,
        ``min_p``: a third variant of each program, `jax_paged_attn.engine.penalties`),
        so a server's first such request does not wait for compilations. False halves
        the start's compile work beside the greedy and sampled variants for a workload
        that never asks for them; a penalized request then compiles its programs on
        first use (the start report says so).
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
    latency_scheduler_steps: int | None = None
    latency_max_rows: int | None = None
    decode_during_prefill: bool = True
    async_scheduling: bool = True
    compiler_options: Mapping[str, Any] | None = None
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    warmup_penalties: bool = True
    on_step_failure: str = "abort"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            _check_int(getattr(self, name), name, 1)
        for name in ("enable_prefix_caching", "coarse_length_bounds", "decode_during_prefill", "async_scheduling",
                     "compilation_cache", "warmup_penalties"):
            as_bool(getattr(self, name), name)
        if self.num_blocks is not None:
            _check_int(self.num_blocks, "num_blocks", 1)
        if self.latency_scheduler_steps is not None:
            _check_int(self.latency_scheduler_steps, "latency_scheduler_steps", 1)
            if self.latency_scheduler_steps > self.num_scheduler_steps:
                raise ValueError(f"latency_scheduler_steps must be at most num_scheduler_steps "
                                 f"({self.num_scheduler_steps}), got {self.latency_scheduler_steps}.")
        if self.latency_max_rows is not None:
            _check_int(self.latency_max_rows, "latency_max_rows", 1)
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


def window_step_counts(config: EngineConfig) -> tuple[int, ...]:
    """The decode-window lengths ``config`` runs (each its own programs), ascending."""
    return tuple(sorted({config.num_scheduler_steps, config.latency_scheduler_steps or config.num_scheduler_steps}))


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
