"""`LLMEngine`: continuous-batching generation over the paged KV cache.

The engine is the host-side loop; `jax_paged_attn.engine.model_runner.ModelRunner` owns
the device side (parameters, KV caches, the persistent decode batch, the jitted
programs). The engine lives in rooms, one job each (vLLM V1 splits its engine core,
scheduler, input batch and output processing alike), listed in the order a step
visits them:

==================  ===================================================================
``engine.py``       `LLMEngine`: construction (wiring the rooms), the request API,
                    `step` and its failure recovery, `generate`, `warmup`
``step_loop.py``    `StepLoop`: which kind of step runs next (scheduled, mixed, decode
                    window), and running it; owns the current `DecodeBatch`
``scheduler.py``    `Scheduler`: who runs next, with how many tokens; the block pools
``request.py``      `Request` and the scheduler's plan of a step (`SchedulerOutput`)
``block_moves.py``  `BlockMoves`: a step's swap-outs, copy-on-write copies, swap-ins;
                    the host swap space
``step_inputs.py``  `StepInputs`: a step's packed, bucketed host inputs
``decode_batch.py`` `DecodeBatch`: the persistent decode batch's rows, joins and windows
                    in flight
``outputs.py``      `RequestOutput` / `CompletionOutput`; sampled tokens to the host
``stats.py``        `EngineStats` and the `StatsRecorder` that keeps them; the progress bar
``config.py``       `EngineConfig`: sizes and policies, and their checks (before the
                    first step, as the next two)
``startup.py``      KV-cache sizing from device memory, the compilation cache, the start
                    report
``warmup.py``       the warm-up's programs, `WarmupReport`
==================  ===================================================================

Beneath the rooms: ``block_allocator.py`` (the scheduler's block pools and prefix
cache), ``model_runner.py`` (the device side), ``sampling.py`` (`SamplingParams`, the
samplers), ``penalties.py`` (the penalties, ``logit_bias`` and ``min_tokens`` on the
device, and the per-row token counts they read), ``shapes.py`` (the programs' static
shapes), ``program_store.py`` (compiled programs kept on disk) and
``trusted_directory.py`` (whether a directory may hold them); above them,
``llm.py`` (`LLM`: text in, text out).

A walk through `LLMEngine.step`, top to bottom, one module each:

1. ``engine.py``: `LLMEngine.step` calls the step loop; if that raises, it recovers
   (`EngineConfig.on_step_failure`) and raises again.
2. ``step_loop.py``: `StepLoop.step` picks the kind of step: a decode window when every
   running request decodes and none can be admitted, else a mixed step
   (``decode_during_prefill``), else a scheduled step (after reading the windows in
   flight and retiring the batch).
3. ``scheduler.py``: `Scheduler.schedule` (or `schedule_prefills`, the prompt chunks
   beside the batch) plans the step as ``request.py``'s `SchedulerOutput`.
4. ``block_moves.py``: `BlockMoves.run` swaps and copies the blocks the plan orders.
5. ``step_inputs.py``: `StepInputs.prepare` packs its metadata, token ids, positions
   and sampling arrays.
6. ``decode_batch.py``: the persistent batch reserves its rows' next blocks, gives free
   rows to the requests that start decoding, and, with ``model_runner.py``'s programs,
   dispatches the step or the next window and reads the oldest one in flight.
7. ``outputs.py``: the sampled tokens come to the host (with their logprobs), and the
   requests that finished go back as `RequestOutput`.
8. ``stats.py``: `StatsRecorder.record` counts the step, as serving or as compiling.

A decode window skips 3 to 5 (its rows' blocks are the batch's own reservation); a
scheduled step without a batch skips 6. A mixed step visits 6 twice: the batch reserves its
rows' next blocks before 3 plans the prompts beside them.

Example::

    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16))
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=8))
    print(outputs[0].outputs[0].token_ids, engine.stats.summary())
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Sequence

import jax
import numpy as np

from jax_paged_attn.builder import FlashAttentionMetadataBuilder
from jax_paged_attn.engine import startup, stats as stats_lib
from jax_paged_attn.engine.block_moves import BlockMoves
from jax_paged_attn.engine.config import EngineConfig
from jax_paged_attn.engine.model_runner import CausalLM, ModelRunner, check_model
from jax_paged_attn.engine.outputs import CompletionOutput, EngineLoad, RequestOutput, StopChecker
from jax_paged_attn.engine.request import FinishReason
from jax_paged_attn.engine.sampling import SamplingParams, params_per_prompt
from jax_paged_attn.engine.scheduler import Scheduler, SchedulerConfig
from jax_paged_attn.engine.shapes import ProgramShapes
from jax_paged_attn.engine.stats import EngineStats, ProgressBar, StatsRecorder
from jax_paged_attn.engine.step_inputs import StepInputs
from jax_paged_attn.engine.step_loop import StepLoop
from jax_paged_attn.engine.warmup import WarmupReport, warmup_tasks

Array = jax.Array

logger = logging.getLogger(__name__)


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
        # Dynamic NTK rope serves past max_position_embeddings (`LlamaConfig.max_sequence_length`).
        max_position = int(getattr(model_config, "max_sequence_length", model_config.max_position_embeddings))
        if config.max_model_len is not None and config.max_model_len > max_position:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's longest sequence "
                f"(max_position_embeddings, scaled by dynamic rope) {max_position}.")
        max_model_len = config.max_model_len or max_position
        self.vocab_size = int(model_config.vocab_size)
        eos = config.eos_token_id
        if eos is None:
            eos = getattr(model_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (tuple, list)) else (int(eos),)
        for token in eos_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"eos_token_id {token} is outside the vocabulary [0, {self.vocab_size}).")
        # Blocks wholly outside the window may be freed only when every layer has it
        # (`LlamaConfig.kv_cache_window`); with a full-attention layer the cache keeps them all.
        sliding_window = getattr(model_config, "kv_cache_window", model_config.sliding_window)
        # A cached block is reusable only when keys do not depend on the sequence's length.
        prefix_caching = (config.enable_prefix_caching and sliding_window is None
                          and not getattr(model_config, "rope_depends_on_length", False))
        report = [startup.use_compilation_cache(config)]
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks, line = startup.kv_cache_blocks_for_memory(model, config, max_model_len,
                                                                  startup.program_store_dir(config))
            report.append(line)
        # The warm-up's programs are this configuration's: the store reads those first at the next start.
        self._manifest_lines = [f"engine {config!r}", f"num_blocks {num_blocks}", f"max_model_len {max_model_len}"]
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                                  compiler_options=config.compiler_options,
                                  program_store_dir=startup.program_store_dir(config),
                                  manifest_lines=self._manifest_lines)
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
        self._recorder = StatsRecorder(self.scheduler)
        self._inputs = StepInputs(self.builder, self.shapes, block_size=config.block_size,
                                  coarse_length_bounds=config.coarse_length_bounds)
        self._loop = StepLoop(self.config, self.shapes, self.scheduler, self.runner, self._inputs,
                              BlockMoves(model, self.runner, self.config, self._recorder), self._recorder,
                              self.vocab_size)
        self._request_counter = 0
        report.append(startup.kv_cache_report(num_blocks, config.block_size, bytes_per_block, num_host_blocks))
        report.append(f"attention: {startup.implementation_report(model)}")
        report.append(f"projections: {startup.matmul_report(model)}")
        report.append("sampling: penalties, logit_bias, min_tokens and min_p run in a third variant of each "
                      "program (beside greedy and sampled), which batches without them never run; "
                      + ("warmup compiles it" if config.warmup_penalties else
                         "warmup leaves it out (EngineConfig.warmup_penalties=False): a penalized request "
                         "compiles its programs on first use"))
        report.append(f"model: {startup.model_report(model)}")
        self.start_report = "\n".join(report)
        """What the engine chose at start (cache size, implementations); also logged."""
        logger.info("LLMEngine: %s", self.start_report.replace("\n", "; "))

    @property
    def kv_caches(self) -> list[Array]:
        """The current device caches, one per layer (replaced by every step: donated)."""
        return self.runner.kv_caches

    @property
    def stats(self) -> EngineStats:
        """The counters (`EngineStats`) since the engine was built or `reset_stats`."""
        return self._recorder.stats

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
        for the model's max context, token ids out of range, stop ids or ``logit_bias``
        ids outside the vocabulary, duplicate id, a request the cache could never hold,
        ``n`` > 1 or stop strings: see below).

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
        bad = [t for t in params.logit_bias or () if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"sampling_params.logit_bias token ids {bad} lie outside the vocabulary "
                             f"[0, {self.vocab_size}).")
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
        return self.scheduler.has_unfinished() or bool(self._loop.batch and self._loop.batch.inflight)

    def peek_output(self, request_id: str) -> RequestOutput:
        """The output of a request so far, finished or not, leaving it in the engine (a
        server streams a running request's tokens from it). KeyError for an unknown id."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}.")
        return RequestOutput.of(request)

    def peek_new_output(self, request_id: str, num_seen: int) -> CompletionOutput | None:
        """What a request's sequence generated after its first ``num_seen`` tokens, with its
        finish state: a `CompletionOutput` whose ``token_ids`` (and ``logprobs``) hold the
        new tokens only; None while the request runs (or waits) with nothing new.

        For a server streaming many requests: read after every step, it copies only what
        is new (`peek_output` copies the prompt and every token each time). KeyError for
        an unknown id; ValueError for ``num_seen`` outside ``[0, tokens generated]``."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}.")
        generated = len(request.output_token_ids)
        if not 0 <= num_seen <= generated:
            raise ValueError(f"num_seen must be in [0, {generated}] (the tokens request {request_id!r} has "
                             f"generated), got {num_seen!r}.")
        if num_seen == generated and not request.is_finished:
            return None
        return CompletionOutput.of(request, start=num_seen)

    def load(self) -> EngineLoad:
        """The engine's queues and the share of its device KV blocks held now."""
        scheduler = self.scheduler
        blocks = scheduler.device_blocks
        return EngineLoad(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                          num_swapped=len(scheduler.swapped),
                          kv_cache_usage=blocks.num_used_blocks / max(blocks.num_blocks, 1))

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
        return self._recorder.num_traces

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
            return self._loop.step()
        except BaseException as error:
            self._recover_from_failed_step(error)
            raise

    def _recover_from_failed_step(self, error: BaseException) -> None:
        """Puts the engine back in a usable state after ``error`` interrupted a step."""
        self._loop.batch = None
        self.runner.drop_decode_state()
        rebuilt = self.runner.rebuild_kv_caches_if_consumed()
        self._loop.block_moves.host_caches = None  # swapped-out blocks are dropped with their requests' state
        recompute = self.config.on_step_failure == "recompute"
        affected = self.scheduler.reset_after_failure(recompute=recompute)
        logger.warning(
            "LLMEngine.step failed (%s: %s): %s; %d request(s) that held KV blocks %s "
            "(EngineConfig.on_step_failure=%r); the prefix cache was emptied.",
            type(error).__name__, error,
            "the KV caches it had consumed were allocated anew" if rebuilt else "the KV caches were kept",
            len(affected), "queued for recomputation" if recompute else "aborted", self.config.on_step_failure)

    def warmup(self, *, use_tqdm: bool = True) -> "WarmupReport":
        """Compiles every program the configuration reaches, so that no later `step` or
        `generate` compiles (a server must not stall a request for a compilation).

        The programs and their shapes are `ProgramShapes`': decode windows and row
        inserts of every batch size, the mixed prompt + decode steps of every prompt
        shape (the prompt-only steps with ``decode_during_prefill`` False), each greedy,
        sampled, and sampled with penalties (`jax_paged_attn.engine.penalties`: one
        extra variant per shape, which a batch without penalties never runs; left out
        with ``EngineConfig.warmup_penalties`` False), and, with
        prefix caching, the copy-on-write block copies. Each runs once on padding (no
        cache slot is written). Not covered, and compiled on first use:
        requests asking for ``logprobs`` (a program per logprobs width), more stop ids
        than `shapes.MIN_STOP_ID_COLUMNS`, preemption by swapping (the swap programs)
        and the scheduled steps that follow it. With ``EngineConfig.compilation_cache`` a
        second start loads the programs from the program store instead, untraced.

        Raises RuntimeError while requests are in the engine.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() runs before any request: this engine has unfinished requests.")
        tasks = warmup_tasks(self.shapes, self.config, self.runner, self._inputs, self.vocab_size)
        start, compiles_before, hits_before = time.perf_counter(), stats_lib.backend_compiles(), stats_lib.cache_hits()
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
            self._loop.batch = None
        if self.runner.program_store is not None:
            self.runner.program_store.write_manifest(self._manifest_lines)
        report = WarmupReport(num_programs=len(tasks), num_compiled=stats_lib.backend_compiles() - compiles_before,
                              num_cache_hits=stats_lib.cache_hits() - hits_before, seconds=time.perf_counter() - start,
                              slowest_program_s=max(seconds, default=0.0))
        logger.info("LLMEngine.warmup: %s", report)
        self._recorder.num_traces = self.runner.num_traces
        self.stats.num_compiled_programs = self._recorder.num_traces
        return report

    def reset_stats(self) -> None:
        """Zeroes every counter (keeps the compiled-program count), e.g. after a warm-up run."""
        self._recorder.reset()

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
        progress = ProgressBar(len(pending), use_tqdm)
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

