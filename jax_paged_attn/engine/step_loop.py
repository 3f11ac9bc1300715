"""The step loop: which kind of step runs next, and running it.

`StepLoop.step` is the body of `LLMEngine.step`. Three kinds of step:

* **scheduled step** (the first prompts, swaps, recomputation after a preemption)::

      scheduler.schedule()                 host: who runs, how many tokens, block moves
      swap_blocks / copy_blocks            device: swap-outs, copy-on-write, swap-ins
      FlashAttentionMetadataBuilder        host: packed, bucketed batch description
      runner.run_step                      device: forward + sampling (caches donated)
      scheduler.update(sampled tokens)     host: append tokens, finish requests

* **decode window** (every running request is decoding and nothing can be admitted):
  the running requests become the rows of a persistent batch that stays on the device
  (`jax_paged_attn.engine.decode_batch`), and ``num_scheduler_steps`` decode steps run
  in one program (sampling, stop checks and the next step's metadata on the device;
  ``latency_scheduler_steps`` steps while no request waits, so tokens stream sooner).
  The host reserves each window's blocks ahead (lookahead slots, capped at each
  request's last position) and dispatches window ``n + 1`` *before* it reads window
  ``n``'s tokens (copied to the host asynchronously), so the host's bookkeeping
  overlaps the device's work and the device never waits for the host. Rows that stop
  mid-window write nothing more; their blocks are freed when the host reads the window.

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

The loop owns the current `DecodeBatch` (None between batches) and calls the other
rooms: the scheduler, the block moves, the step inputs, the runner, the outputs and
the stats, in that order.
"""
from __future__ import annotations

import time

import numpy as np

from jax_paged_attn.engine.block_moves import BlockMoves
from jax_paged_attn.engine.config import EngineConfig
from jax_paged_attn.engine.decode_batch import DecodeBatch, InFlight, PromptTokens
from jax_paged_attn.engine.model_runner import ModelRunner
from jax_paged_attn.engine.outputs import RequestOutput, append_logprobs, to_host
from jax_paged_attn.engine.request import Request, SchedulerOutput
from jax_paged_attn.engine.scheduler import Scheduler
from jax_paged_attn.engine.shapes import ProgramShapes
from jax_paged_attn.engine.stats import StatsRecorder
from jax_paged_attn.engine.step_inputs import StepInputs, program_greedy, program_num_logprobs, uses_penalties


class StepLoop:
    """Chooses and runs an engine's steps over its scheduler, block moves, inputs and
    runner; records each in its stats."""

    def __init__(self, config: EngineConfig, shapes: ProgramShapes, scheduler: Scheduler, runner: ModelRunner,
                 inputs: StepInputs, block_moves: BlockMoves, recorder: StatsRecorder, vocab_size: int) -> None:
        self.config = config
        self.shapes = shapes
        self.scheduler = scheduler
        self.runner = runner
        self.inputs = inputs
        self.block_moves = block_moves
        self.recorder = recorder
        self.vocab_size = vocab_size
        self.batch: DecodeBatch | None = None

    def step(self) -> list[RequestOutput]:
        """One decode window, or one scheduled or mixed step; returns the requests that finished."""
        start_time = time.perf_counter()
        traces_before = self.runner.num_traces
        self.recorder.start_step()
        if self.decode_window_ready():
            window = self.decode_window_step()
            if window is not None:
                finished, num_tokens = window
                self.recorder.record(None, num_tokens, time.perf_counter() - start_time,
                                     self.runner.num_traces - traces_before)
                return [RequestOutput.of(r) for r in finished]
        finished: list[Request] = []
        num_drained = 0
        if self.can_mix():
            result = self.mixed_step(start_time, traces_before)
            if isinstance(result, list):
                return result
            finished, num_drained = result  # no mixed step could run: a scheduled one follows
        elif self.can_prefill_beside_batch():
            out = self.scheduler.schedule_prefills()
            if not out.is_empty:
                return self.run_scheduled(out, [], 0, start_time, traces_before, beside_batch=True)
            self.block_moves.run(out)  # a prompt chunk found no blocks: its preemption's swap-outs
        more, n = self.drain()
        finished += more
        num_drained += n
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request (this is a bug).")
            if num_drained:
                self.recorder.record(None, num_drained, time.perf_counter() - start_time, 0)
            return [RequestOutput.of(r) for r in finished]
        return self.run_scheduled(out, finished, num_drained, start_time, traces_before, beside_batch=False)

    def run_scheduled(self, out: SchedulerOutput, finished: list[Request], num_drained: int, start_time: float,
                      traces_before: int, *, beside_batch: bool) -> list[RequestOutput]:
        """Runs a scheduled step (block moves, forward, sampling) and records it; with
        ``beside_batch`` (a prefill-only step while the decode windows stay in flight) the
        requests that finished their prompt join the persistent batch's free rows."""
        self.block_moves.run(out)
        metadata, token_ids, positions, rows, sampling = self.inputs.prepare(out)
        sampling_requests = [item.request for item in out.scheduled if item.samples]
        num_logprobs = program_num_logprobs(sampling_requests, self.vocab_size)
        penalties = None
        if uses_penalties(sampling_requests):
            penalties = self.inputs.penalties(out, rows, metadata.num_seqs, self.scheduler.stop_token_ids)
        greedy = program_greedy([item.request for item in out.scheduled], penalties is not None)
        result = self.runner.run_step(token_ids, positions, metadata, sampling, penalties, greedy=greedy,
                                      num_logprobs=num_logprobs)
        if beside_batch and self.batch is not None and len(self.batch.inflight) < 2:
            # The batch's rows decode one more window behind the prefill while the host
            # waits for the prompt's token, so the device does not idle until they join.
            self.batch.dispatch_window()
        tokens, logprobs = to_host(result)  # waits
        sampled = {item.request.request_id: int(tokens[row]) for item, row in zip(out.scheduled, rows) if item.samples}
        if logprobs is not None:
            for item, row in zip(out.scheduled, rows):
                if item.samples:
                    append_logprobs(item.request, tokens[row:row + 1], logprobs, np.s_[row:row + 1])
        finished += self.scheduler.update(out, sampled)
        if beside_batch:
            assert self.batch is not None
            self.recorder.stats.num_inserted_rows += self.batch.join(
                [item.request for item in out.scheduled if item.samples and not item.request.is_finished])
        compiled = self.runner.num_traces - traces_before
        self.recorder.record(out, len(sampled) + num_drained, time.perf_counter() - start_time, compiled)
        return [RequestOutput.of(r) for r in finished]

    # ------------------------------------------------------ decode windows
    def decode_window_ready(self) -> bool:
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

    def decode_window_step(self) -> tuple[list[Request], int] | None:
        """Dispatches the next window(s) and reads the oldest in flight; None (after
        draining) when no window can run: a request needs blocks the free list lacks."""
        finished, num_tokens = [], 0
        if self.batch is None or self.batch.needs_rebuild(self.shapes):
            finished, num_tokens = self.drain()
            if not self.decode_window_ready():
                return finished, num_tokens
            self.start_batch(list(self.scheduler.running), mixing=False)
        batch = self.batch
        assert batch is not None
        # Keep one window queued behind the one running, so the device never waits for us.
        while len(batch.inflight) < 2 and batch.dispatch_window():
            pass
        if not batch.inflight:
            more, n = self.drain()
            return None if not (finished or more) else (finished + more, num_tokens + n)
        more_finished, more_tokens = batch.read_window()
        return finished + more_finished, num_tokens + more_tokens

    # --------------------------------------------------------- mixed steps
    def can_mix(self) -> bool:
        """Whether the next step can be a mixed step: ``decode_during_prefill``, nobody
        swapped out (swap-ins are scheduled steps), and a prompt chunk to run."""
        sched = self.scheduler
        if not self.config.decode_during_prefill or sched.swapped:
            return False
        return any(r.in_prefill for r in sched.running) or sched.can_admit()

    def batch_takes_prompts(self) -> bool:
        """Whether the persistent batch can run beside prompt sections as it is: their
        block-table width and a row count the mixed programs were built for, `Penalties`
        if a prompt to come needs them, and every decoding request among its rows."""
        batch = self.batch
        if batch is None or batch.wants_wider_table or batch.missing_rows:
            return False
        live = [r for r in batch.requests if not r.is_finished]
        if batch.penalized != uses_penalties(live + self.pending_prompts()):
            return False  # a prompt needs penalties, or nobody uses them any more (a faster program)
        if batch.width != self.shapes.block_table_width or batch.num_rows not in self.shapes.mixed_rows:
            return False
        members = {r.request_id for r in batch.requests}
        return all(r.in_prefill or r.request_id in members for r in self.scheduler.running)

    def mixed_step(self, start_time: float, traces_before: int) -> list[RequestOutput] | tuple[list[Request], int]:
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
        if not self.batch_takes_prompts():
            finished, num_read = self.drain()
            self.start_batch([r for r in sched.running if not r.in_prefill], mixing=True,
                             penalized=uses_penalties(self.pending_prompts()))
        batch = self.batch
        assert batch is not None
        update = batch.reserve_rows(1)
        if update is None:
            return finished, num_read
        out = sched.schedule_prefills()
        self.block_moves.run(out)
        if out.is_empty:
            return finished, num_read
        keep, block_rows, block_values, live = update
        metadata, token_ids, positions, rows, sampling = self.inputs.prepare(out)
        prompts = [item.request for item in out.scheduled if item.samples]
        greedy = batch.greedy and all(item.request.sampling_params.greedy for item in out.scheduled)
        asks = [k for k in (batch.num_logprobs, program_num_logprobs(prompts, self.vocab_size)) if k is not None]
        num_logprobs = max(asks) if asks else None
        join_index, join_rows, joining = batch.joining_rows(out, rows, metadata.num_seqs)
        prompt_penalties = None
        if batch.penalized:  # the prompts sample with the rows' program, which applies penalties
            prompt_penalties = self.inputs.penalties(out, rows, metadata.num_seqs, sched.stop_token_ids)
        prompt_result, rows_result = self.runner.run_mixed(
            keep, block_rows, block_values, token_ids, positions, metadata, sampling, join_index, join_rows,
            prompt_penalties, greedy=greedy, max_model_len=self.config.max_model_len, num_logprobs=num_logprobs)
        sched.commit(out)  # the next schedule starts each prompt where this step leaves it
        batch.inflight.append(InFlight(rows_result, list(batch.requests), PromptTokens(out, prompt_result, rows)))
        batch.next_position[live] += 1
        batch.steps_since_prompts = 0
        for row, request in joining:
            batch.take_row(row, request, next_position=request.num_tokens)  # the token it samples
        stats = self.recorder.stats
        stats.num_mixed_steps += 1
        stats.num_inserted_rows += len(joining)
        # Read while the next program runs (async scheduling), or everything now.
        while len(batch.inflight) > (1 if self.config.async_scheduling else 0):
            more, n = batch.read_window()
            finished += more
            num_read += n
        self.recorder.record(out, num_read, time.perf_counter() - start_time, self.runner.num_traces - traces_before)
        return [RequestOutput.of(r) for r in finished]

    def can_prefill_beside_batch(self) -> bool:
        """Whether the next step may prefill while the persistent batch keeps its windows
        in flight: prefill-only steps (no ``decode_during_prefill``), nobody swapped out,
        a free row for a new request, and every decoding request already in the batch."""
        batch, sched = self.batch, self.scheduler
        if batch is None or self.config.decode_during_prefill or sched.swapped:
            return False
        if batch.needs_rebuild(self.shapes) or not batch.free_rows():
            return False
        members = {r.request_id for r in batch.requests}
        return all(r.in_prefill or r.request_id in members for r in sched.running)

    # ------------------------------------------------------ batch lifetime
    def start_batch(self, requests: list[Request], *, mixing: bool, penalized: bool = False) -> None:
        """Uploads ``requests`` (decoding ones) as the rows of a new persistent batch
        (`DecodeBatch.start`); ``penalized``: with `Penalties` even if none of them needs any."""
        self.batch = DecodeBatch.start(requests, mixing=mixing, scheduler=self.scheduler, runner=self.runner,
                                       config=self.config, shapes=self.shapes, vocab_size=self.vocab_size,
                                       penalized=penalized)
        self.recorder.stats.num_decode_batches += 1

    def pending_prompts(self) -> list[Request]:
        """The requests whose prompt runs (or waits to run): the next mixed steps' prompts."""
        sched = self.scheduler
        return [r for r in sched.running if r.in_prefill] + list(sched.waiting)

    def drain(self) -> tuple[list[Request], int]:
        """Reads every window in flight and retires the persistent batch (the host then
        knows every request's tokens exactly, as a scheduled step needs)."""
        finished, num_tokens = [], 0
        if self.batch is not None:
            finished, num_tokens = self.batch.read_all()
            self.batch = None
            self.runner.drop_decode_state()
        return finished, num_tokens
