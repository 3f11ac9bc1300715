"""`LLMEngine`: continuous-batching generation over the paged KV cache.

One engine step is::

    scheduler.schedule()                    host: who runs, how many tokens, block moves
    swap_blocks / copy_blocks               device: swap-outs, copy-on-write, swap-ins
    FlashAttentionMetadataBuilder.build     host: packed, bucketed batch description
    step_fn(params, kv_caches, ...)         device: model forward + sampling, one jit,
                                            KV caches donated (updated in place)
    scheduler.update(sampled tokens)        host: append tokens, finish requests

Host work per step is kept small for large decode batches: a decode-only step that
runs the same requests as the previous one skips the builder and moves the previous
metadata one token on (vectorized numpy), and with ``num_scheduler_steps > 1`` a
decode-only batch runs several model steps per scheduling step (vLLM's multi-step
scheduling), each step's sampled tokens feeding the next on the device.

Compilation: the jitted step is traced once per distinct *static* shape of its inputs.
The builder pads every count (sequences, tokens, block-table width) to a bucket, so a
long run compiles a bounded number of programs (`EngineStats.num_compiled_programs`);
a decode-only run of fixed batch compiles one program per block-table width bucket
(powers of two by default: about ``log2(max_model_len / block_size)``).

Memory: the KV caches are passed to the step with ``donate_argnums``, so XLA writes the
new tokens' K/V into the same buffers (no copy of the cache per step); the arrays the
engine held before a step are deleted by it. Host swap space
(`jax_paged_attn.cache.allocate_host_kv_cache`) is allocated on the first preemption.

Example::

    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16))
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=8))
    print(outputs[0].output_token_ids, engine.stats.summary())
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged_attn import cache as cache_ops
from jax_paged_attn.builder import (
    FlashAttentionMetadataBuilder,
    ScheduledSequence,
    input_positions,
    pack_per_token,
    sequence_rows,
)
from jax_paged_attn.engine.sampling import SamplingParams, sample_tokens
from jax_paged_attn.engine.scheduler import Request, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from jax_paged_attn.metadata import FlashAttentionMetadata, advance_step

Array = jax.Array


DEFAULT_SWAP_SPACE_BYTES = 4 << 30
"""Host swap space used when `EngineConfig.num_host_blocks` is None (vLLM's default, 4 GiB)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and policies of an `LLMEngine`.

    Attributes:
      num_blocks: blocks of the device KV cache (per layer).
      block_size: token slots per block (a multiple of 16).
      num_host_blocks: blocks of host swap space for preemption (allocated, in pinned
        host memory where the backend has it, at the first swap-out); None = as many as
        fit in `DEFAULT_SWAP_SPACE_BYTES` (vLLM's 4 GiB), at most ``num_blocks``. 0
        disables swapping (preempted requests are recomputed instead).
      max_num_seqs: requests holding cache blocks at once (batch size bound).
      max_num_batched_tokens: token budget of one step; prompts longer than it are
        prefilled in chunks across steps.
      max_model_len: longest context (prompt + output); None = the model's
        ``max_position_embeddings``.
      enable_prefix_caching: share full prompt blocks between requests (turned off for
        sliding-window models, whose caches skip tokens outside the window).
      eos_token_id: ends a request (unless its params set ``ignore_eos``); None: never.
      seed: engine seed; requests without their own seed get one derived from it and
        their arrival number.
      batch_buckets, token_buckets, block_table_width_buckets: padding buckets of the
        metadata builder (None = powers of two).
      coarse_length_bounds: set each prefill step's static length bounds to what its
        buckets can hold (``max_query_len`` = the prefill token rows,
        ``max_prefill_seq_len`` = the block-table capacity) instead of the builder's
        next power of two: only the count and width buckets then select a program
        (fewer compilations), at the price of more padded attention work in prefills.
      num_scheduler_steps: model steps per scheduling step for decode-only batches
        (vLLM's multi-step scheduling): the engine reserves blocks for the extra tokens,
        runs the steps back to back on the device (each step's sampled tokens feed the
        next without a host round trip) and reads all tokens at once. Tokens sampled
        after a request finished are dropped, so outputs equal ``num_scheduler_steps=1``;
        the price is up to ``num_scheduler_steps - 1`` wasted steps per finishing
        request and new requests waiting up to that many steps. Used only when no
        request waits for admission.
      compiler_options: XLA compiler options for the jitted step (``jax.jit``'s
        ``compiler_options``), e.g. ``{"xla_backend_optimization_level": 0}`` to compile
        faster on a CPU; None for the defaults.
    """

    num_blocks: int = 256
    block_size: int = 16
    num_host_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    eos_token_id: int | None = None
    seed: int = 0
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    block_table_width_buckets: tuple[int, ...] | None = None
    coarse_length_bounds: bool = False
    num_scheduler_steps: int = 1
    compiler_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            _check_int(getattr(self, name), name, 1)
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}.")
        if self.num_host_blocks is not None:
            _check_int(self.num_host_blocks, "num_host_blocks", 0)
        if self.max_model_len is not None:
            _check_int(self.max_model_len, "max_model_len", 2)
        if self.eos_token_id is not None:
            _check_int(self.eos_token_id, "eos_token_id", 0)
        _check_int(self.seed, "seed", 0)


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request.

    Attributes:
      request_id, prompt_token_ids, output_token_ids: the request and its generation.
      finish_reason: "length", "stop", "max_model_len" or "aborted".
      num_cached_tokens: prompt tokens served from the prefix cache.
      num_preemptions: times it was swapped out (or dropped for recomputation).
      time_to_first_token_s, latency_s: from ``add_request``.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    num_preemptions: int
    time_to_first_token_s: float | None
    latency_s: float

    @staticmethod
    def of(request: Request) -> "RequestOutput":
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason.value if request.finish_reason else "",
            num_cached_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
            time_to_first_token_s=(None if request.first_token_time is None
                                   else request.first_token_time - request.arrival_time),
            latency_s=(request.finish_time or time.perf_counter()) - request.arrival_time,
        )


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine was built (or `LLMEngine.reset_stats`).

    Throughput attribution: a step that contains any prefill chunk counts as a prefill
    step (its time and prefill tokens); a step with only decodes counts as a decode
    step (its time and one token per request). Steps that compiled a new program are
    kept apart (``compile_time_s``) so compilation does not distort the rates.
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
    """tqdm when it is installed, else a one-line stderr counter (no hard dependency)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.tokens = total, 0, 0
        self.enabled = enabled
        self.start = self.last_print = time.perf_counter()
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, finished: int, tokens: int) -> None:
        self.done += finished
        self.tokens += tokens
        if not self.enabled:
            return
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(finished)
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
            return
        now = time.perf_counter()
        if finished and (now - self.last_print > 0.5 or self.done == self.total):
            self.last_print = now
            sys.stderr.write(f"\rgenerate: {self.done}/{self.total} requests, {rate:,.1f} tok/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class LLMEngine:
    """Generates tokens for many requests at once over a paged KV cache.

    Args:
      model: a `jax_paged_attn.models.LlamaForCausalLM` (or any NNX module with its
        contract: ``config`` with ``vocab_size``, ``num_hidden_layers``,
        ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``;
        ``allocate_kv_caches(num_blocks, block_size)``; ``__call__(input_ids, positions,
        kv_caches, metadata, logits_indices=...) -> (logits, kv_caches)``).
      config: `EngineConfig`; keyword ``overrides`` replace its fields.

    Public methods: `add_request`, `abort_request`, `step`, `has_unfinished_requests`,
    `generate`; `stats` holds the counters, `kv_caches` the current caches.
    """

    def __init__(self, model: nnx.Module, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        model_config = model.config
        max_model_len = config.max_model_len or int(model_config.max_position_embeddings)
        sliding_window = getattr(model_config, "sliding_window", None)
        prefix_caching = config.enable_prefix_caching and sliding_window is None
        self.kv_caches: list[Array] = list(model.allocate_kv_caches(config.num_blocks, config.block_size))
        num_host_blocks = config.num_host_blocks
        if num_host_blocks is None:
            bytes_per_block = sum(int(c.nbytes) for c in self.kv_caches) // config.num_blocks
            num_host_blocks = min(config.num_blocks, max(1, DEFAULT_SWAP_SPACE_BYTES // max(bytes_per_block, 1)))
        self.config = dataclasses.replace(config, max_model_len=max_model_len, num_host_blocks=num_host_blocks,
                                          enable_prefix_caching=prefix_caching)
        self.model_config = model_config
        self.vocab_size = int(model_config.vocab_size)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=max_model_len, enable_prefix_caching=prefix_caching),
            num_device_blocks=config.num_blocks, num_host_blocks=num_host_blocks, block_size=config.block_size,
            eos_token_id=config.eos_token_id, vocab_size=self.vocab_size,
        )
        self.builder = FlashAttentionMetadataBuilder(
            block_size=config.block_size, num_blocks=config.num_blocks, sliding_window=sliding_window,
            chunked_prefill=True, pad=True, batch_buckets=config.batch_buckets,
            token_buckets=config.token_buckets, block_table_width_buckets=config.block_table_width_buckets,
        )
        self._model = model
        self._host_caches: list[Array] | None = None
        self._decode_batch: _DecodeBatch | None = None
        graphdef, self._state = nnx.split(model)
        options = tuple(sorted((config.compiler_options or {}).items()))
        self._step = _compiled_step(graphdef, options)
        self._num_traces = 0
        self.stats = EngineStats()
        self._request_counter = 0

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
        for the model's max context, token ids out of range, duplicate id, a request
        the cache could never hold).
        """
        params = SamplingParams() if sampling_params is None else sampling_params
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
        """Stops a request and frees its blocks (KeyError for an unknown id)."""
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return self.scheduler.has_unfinished()

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
        """Programs compiled for this engine's steps (one per distinct bucket of inputs).

        Engines over models with the same structure share one jitted step (and its
        compiled programs); a program another engine compiled first is not counted.
        """
        return self._num_traces

    def _host_swap_space(self) -> list[Array]:
        if self._host_caches is None:
            cfg, mc = self.config, self.model_config
            self._host_caches = [
                cache_ops.allocate_host_kv_cache(
                    cfg.num_host_blocks, cfg.block_size, mc.num_key_value_heads, mc.head_dim,
                    kv_cache_dtype=getattr(self._model, "kv_cache_dtype", "auto"),
                    model_dtype=getattr(self._model, "dtype", cache.dtype),
                    sharding=None,
                )
                for cache in self.kv_caches
            ]
        return self._host_caches

    def _run_block_ops(self, out: SchedulerOutput) -> None:
        """Swap-outs, copy-on-write copies, swap-ins, in the order `SchedulerOutput` requires."""
        if out.swap_out:
            mapping = np.asarray(out.swap_out, np.int32)
            host = self._host_swap_space()
            self._host_caches = [cache_ops.swap_blocks(dev, h, mapping) for dev, h in zip(self.kv_caches, host)]
        if out.copies:
            n = len(out.copies)
            mapping = np.full((1 << (n - 1).bit_length(), 2), cache_ops.PAD_BLOCK_ID, np.int32)  # few programs
            mapping[:n] = out.copies
            self.kv_caches = _copy_blocks_donated(self.kv_caches, mapping)
            self.stats.num_copied_blocks += n
        if out.swap_in:
            mapping = np.asarray(out.swap_in, np.int32)
            host = self._host_swap_space()
            self.kv_caches = [cache_ops.swap_blocks(h, dev, mapping) for h, dev in zip(host, self.kv_caches)]

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step and its model step(s); returns the requests that finished.

        A decode-only batch runs ``num_scheduler_steps`` model steps back to back when
        nothing waits for admission and the cache has room for the lookahead slots (see
        `EngineConfig.num_scheduler_steps`); otherwise one. Finished requests stay
        retrievable with `pop_output` (`generate` pops its own).
        """
        start_time = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request (this is a bug).")
            return []
        self._run_block_ops(out)
        num_model_steps = 1
        lookahead = self.config.num_scheduler_steps - 1
        if (lookahead and out.num_prefills == 0 and not (out.swap_out or out.swap_in or out.copies)
                and not self.scheduler.waiting and not self.scheduler.swapped
                and self.builder.sliding_window is None
                and self.scheduler.reserve_lookahead(out, lookahead)):
            num_model_steps += lookahead

        metadata, token_ids, positions, rows, sampling = self._prepare_inputs(out)
        traces_before = self._step.num_traces
        tokens, self.kv_caches = self._step.fn(self._state, self.kv_caches, token_ids, positions, metadata, *sampling)
        window = [tokens]
        for _ in range(num_model_steps - 1):
            # The decode rows are the token rows, so the sampled tokens feed the next step
            # on the device, without a round trip through the host.
            metadata, positions, sampling = self._advance_decode_metadata()
            tokens, self.kv_caches = self._step.fn(self._state, self.kv_caches, tokens, positions, metadata,
                                                   *sampling)
            window.append(tokens)
        all_tokens = np.asarray(jnp.stack(window)) if len(window) > 1 else np.asarray(tokens)[None]  # waits
        compiled = self._step.num_traces - traces_before
        self._num_traces += compiled

        finished, num_sampled, first = [], 0, out
        row_of = {item.request.request_id: int(row) for item, row in zip(out.scheduled, rows)}
        for k in range(num_model_steps):
            if k:  # the requests still running take their next token
                live = [item.request for item in out.scheduled if not item.request.is_finished]
                out = dataclasses.replace(out, scheduled=[ScheduledRequest.of(r, 1) for r in live],
                                          swap_out=[], swap_in=[], copies=[], preempted=[])
            sampled = {item.request.request_id: int(all_tokens[k, row_of[item.request.request_id]])
                       for item in out.scheduled if item.samples}
            finished += self.scheduler.update(out, sampled)
            num_sampled += len(sampled)
        self._record(first, num_sampled, time.perf_counter() - start_time, compiled > 0)
        return [RequestOutput.of(r) for r in finished]

    def _prepare_inputs(self, out: SchedulerOutput) -> tuple[FlashAttentionMetadata, np.ndarray, np.ndarray,
                                                               np.ndarray, tuple[np.ndarray, ...]]:
        """Host inputs of a step: metadata, token ids, positions, metadata row of each
        scheduled request, sampling arrays (all numpy, padded to the metadata's buckets)."""
        fast = self._advance_decode_batch(out)
        if fast is not None:
            return fast
        sequences = [
            ScheduledSequence(is_prompt=item.is_prefill, seq_len=item.seq_len, context_len=item.start,
                              query_len=item.num_new_tokens, block_table=item.request.block_table)
            for item in out.scheduled
        ]
        metadata = self.builder.build_host(sequences)
        if self.config.coarse_length_bounds and metadata.num_prefills:
            capacity = int(metadata.block_tables.shape[1]) * self.config.block_size
            metadata = dataclasses.replace(
                metadata, max_query_len=max(metadata.max_query_len, metadata.num_prefill_tokens),
                max_prefill_seq_len=max(metadata.max_prefill_seq_len, capacity))
        token_ids = pack_per_token(metadata, sequences,
                                   [_token_slice(item.request, item.start, item.seq_len) for item in out.scheduled])
        positions = input_positions(metadata, sequences)
        rows = sequence_rows(metadata, sequences)
        sampling = self._sampling_arrays(out, rows, metadata.num_seqs)
        self._decode_batch = None
        if out.num_prefills == 0 and self.builder.sliding_window is None:
            self._decode_batch = _DecodeBatch(
                requests=[item.request for item in out.scheduled], metadata=metadata,
                num_blocks=[len(item.request.block_table) for item in out.scheduled], sampling=sampling)
        return metadata, token_ids, positions, rows, sampling

    def _advance_decode_batch(self, out: SchedulerOutput) -> tuple[Any, ...] | None:
        """Decode fast path: the previous step's decode metadata moved one token on.

        When a decode-only step runs exactly the requests of the previous decode-only
        step, in the same order, with no block moved, the builder's output is the old
        one with every real sequence one token longer (`metadata.advance_step`, on the
        host): this skips the per-sequence Python of the builder (the dominant host cost
        of large decode batches). New blocks of a request are written into its
        block-table row; a request that outgrows the row falls back to the builder.
        Returns None when the fast path does not apply.
        """
        prev = self._decode_batch
        if (prev is None or out.num_prefills or out.swap_out or out.swap_in or out.copies
                or len(out.scheduled) != len(prev.requests)
                or any(item.request is not r for item, r in zip(out.scheduled, prev.requests))):
            return None
        width = int(prev.metadata.block_tables.shape[1])
        if any(len(r.block_table) > width for r in prev.requests):
            return None
        block_tables = prev.metadata.block_tables
        for row, request in enumerate(prev.requests):
            have = prev.num_blocks[row]
            if len(request.block_table) != have:
                if block_tables is prev.metadata.block_tables:
                    block_tables = block_tables.copy()
                block_tables[row, have:len(request.block_table)] = request.block_table[have:]
                prev.num_blocks[row] = len(request.block_table)
        prev.metadata = dataclasses.replace(prev.metadata, block_tables=block_tables)
        metadata, positions, sampling = self._advance_decode_metadata()
        n = len(prev.requests)
        token_ids = np.zeros(metadata.num_tokens, np.int32)
        token_ids[:n] = [r.output_token_ids[-1] for r in prev.requests]
        return metadata, token_ids, positions, np.arange(n, dtype=np.int32), sampling

    def _advance_decode_metadata(self) -> tuple[FlashAttentionMetadata, np.ndarray, tuple[np.ndarray, ...]]:
        """Moves the stored decode batch one token on (`advance_step` on the host
        metadata, so NumPy); returns its new metadata, token positions and sampling
        arrays (the sampling counter + 1). The input tokens are the caller's: the last
        sampled ones, on the host or still on the device in multi-step decoding."""
        prev = self._decode_batch
        assert prev is not None
        n = len(prev.requests)
        metadata, _, positions = advance_step(prev.metadata, np.zeros(n, np.int32),
                                              block_size=self.config.block_size, num_queries=n)
        temperature, top_p, top_k, seed, counter = prev.sampling
        counter = counter.copy()
        counter[:n] += 1
        prev.metadata, prev.sampling = metadata, (temperature, top_p, top_k, seed, counter)
        return metadata, positions, prev.sampling

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

    def _record(self, first: SchedulerOutput, num_sampled: int, elapsed: float, compiled: bool) -> None:
        """Updates the stats after a scheduling step whose first model step ran ``first``."""
        s = self.stats
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_compiled_programs = self._num_traces
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_swapped_out_blocks = self.scheduler.num_swapped_out_blocks
        s.num_recomputed_requests = self.scheduler.num_recomputed_requests
        s.num_prefix_cache_hit_tokens = self.scheduler.num_prefix_cache_hit_tokens
        if compiled:
            s.compile_steps += 1
            s.compile_time_s += elapsed
        elif first.num_prefills:
            s.num_prefill_tokens += sum(i.num_new_tokens for i in first.scheduled if i.is_prefill)
            s.prefill_time_s += elapsed
        else:
            s.num_decode_tokens += num_sampled
            s.decode_time_s += elapsed

    def reset_stats(self) -> None:
        """Zeroes the counters (keeps the compiled-program count), e.g. after a warm-up run."""
        self.stats = EngineStats(num_compiled_programs=self._num_traces)

    # ------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt until all finish; outputs come back in prompt order.

        Args:
          prompts: token-id sequences.
          sampling_params: one `SamplingParams` for all, or one per prompt.
          use_tqdm: show progress (tqdm if installed, else a stderr line).

        Every prompt is validated before any runs: a bad one raises ValueError naming
        its index (``prompts[i]: ...``), and requests already in the engine are untouched.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}.")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts; "
                    f"pass one SamplingParams or one per prompt."
                )
        ids = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                ids.append(self.add_request(prompt, params))
            except (ValueError, TypeError) as e:
                for rid in ids:
                    self.abort_request(rid)
                    self.scheduler.pop_finished(rid)
                raise type(e)(f"prompts[{i}]: {e}") from e
        pending = set(ids)
        progress = _Progress(len(ids), use_tqdm)
        outputs: dict[str, RequestOutput] = {}
        try:
            while pending:
                tokens_before = self.stats.num_generated_tokens
                finished = self.step()
                mine = [f for f in finished if f.request_id in pending]
                for f in mine:
                    pending.discard(f.request_id)
                    outputs[f.request_id] = self.pop_output(f.request_id)
                progress.update(len(mine), self.stats.num_generated_tokens - tokens_before)
        finally:
            progress.close()
        return [outputs[rid] for rid in ids]


@dataclasses.dataclass
class _DecodeBatch:
    """The last decode-only step's host inputs, for `LLMEngine._advance_decode_batch`."""

    requests: list[Request]  # in metadata row order
    metadata: FlashAttentionMetadata  # numpy leaves
    num_blocks: list[int]  # block-table entries written in each row
    sampling: tuple[np.ndarray, ...]


_copy_blocks_donated = jax.jit(cache_ops.copy_kv_cache_blocks, donate_argnums=(0,))
"""Copy-on-write over every layer's cache, in place (the caches are donated)."""


class _CompiledStep:
    """The jitted model step + sampling of one model structure, and how often it was traced."""

    def __init__(self, graphdef: Any, compiler_options: tuple[tuple[str, Any], ...]) -> None:
        self.num_traces = 0

        def step_fn(
            state: Any,
            kv_caches: list[Array],  # per layer [2, num_blocks, block_size, Hk, D], donated
            input_ids: Array,  # i32[T]
            positions: Array,  # i32[T]
            metadata: FlashAttentionMetadata,
            temperature: Array,  # f32[B]
            top_p: Array,  # f32[B]
            top_k: Array,  # i32[B]
            seed: Array,  # u32[B]
            counter: Array,  # i32[B]
        ) -> tuple[Array, list[Array]]:
            self.num_traces += 1  # runs only while tracing: one per compiled program
            model = nnx.merge(graphdef, state)
            # Last token row of every sequence (padding sequences own >= 1 row or
            # point at a real row; their tokens are ignored).
            last_rows = jnp.maximum(metadata.query_start_loc[1:] - 1, 0).astype(jnp.int32)  # [B]
            logits, new_caches = model(input_ids, positions, kv_caches, metadata, logits_indices=last_rows)
            tokens = sample_tokens(logits, temperature, top_p, top_k, seed, counter)
            return tokens, list(new_caches)

        self.fn = jax.jit(step_fn, donate_argnums=(1,), compiler_options=dict(compiler_options) or None)


@functools.lru_cache(maxsize=16)
def _compiled_step(graphdef: Any, compiler_options: tuple[tuple[str, Any], ...]) -> _CompiledStep:
    """One jitted step per model structure (NNX graph definition) and compiler options,
    shared by engines (so they share compiled programs)."""
    return _CompiledStep(graphdef, compiler_options)


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of ``prompt + output`` without building the whole list."""
    prompt, output, n = request.prompt_token_ids, request.output_token_ids, len(request.prompt_token_ids)
    if start >= n:
        return output[start - n:end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[:end - n]


def dense_greedy_generate(model: nnx.Module, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Reference generation with no cache: greedy argmax over ``model.forward_dense``.

    Every step re-runs the whole (right-padded) batch from position 0, so it shares no
    code with the paged path (no cache, no metadata, no scheduler): the oracle the
    engine is tested against. One compiled program for the whole loop.
    """
    lengths = [len(p) for p in prompts]
    width = max(lengths) + max_tokens
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_tokens(state: Any, tokens: Array, last: Array) -> Array:
        logits = nnx.merge(graphdef, state).forward_dense(tokens)  # [B, S, V]
        return jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1)

    outputs: list[list[int]] = [[] for _ in prompts]
    cur = np.asarray(lengths)
    for _ in range(max_tokens):
        nxt = np.asarray(next_tokens(state, tokens, cur - 1))
        tokens[np.arange(len(prompts)), cur] = nxt
        for i, t in enumerate(nxt.tolist()):
            outputs[i].append(int(t))
        cur = cur + 1
    return outputs
