"""The persistent decode batch's host side: its rows, the requests joining them, and
the windows and mixed steps in flight.

The decoding requests are the rows of a batch that stays on the device
(`ModelRunner.start_decode`); `DecodeBatch` is the host's view of it: which request
holds each row, where each row's next input sits, the block ids the device holds for
it, and the programs dispatched and not yet read (`InFlight`, oldest first). It
reserves each window's blocks ahead (lookahead slots, capped at each request's last
position), dispatches windows, reads their tokens into the requests, and puts requests
that start decoding into free rows (`join`, or `joining_rows` inside a mixed step).
The step loop (`jax_paged_attn.engine.step_loop`) decides when a batch starts, runs,
takes prompts beside it and retires.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from jax_paged_attn.engine.config import EngineConfig
from jax_paged_attn.engine.model_runner import NO_TOKEN, DecodeState, ModelRunner
from jax_paged_attn.engine.outputs import append_logprobs, to_host
from jax_paged_attn.engine.penalties import fill_penalties
from jax_paged_attn.engine.request import Request, SchedulerOutput
from jax_paged_attn.engine.scheduler import Scheduler
from jax_paged_attn.engine.shapes import ProgramShapes, stop_id_columns
from jax_paged_attn.engine.step_inputs import program_greedy, program_num_logprobs, uses_penalties


@dataclasses.dataclass(frozen=True)
class PromptTokens:
    """The prompt part of a mixed step in flight (dispatched and committed, not read)."""

    out: SchedulerOutput
    result: Any  # the prompt sequences' sampled tokens (and logprobs), on the device
    rows: np.ndarray  # each scheduled item's sequence index in ``result``


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A decode window or mixed step dispatched and not yet read."""

    result: Any  # the rows' tokens i32[K, R] (and logprobs), on the device
    requests: list[Request]  # row i's request when it was dispatched
    prompt: PromptTokens | None = None  # a mixed step's prompt part


@dataclasses.dataclass
class DecodeBatch:
    """Host view of the persistent decode batch (see `ModelRunner.run_decode_window`),
    with the scheduler whose blocks its rows take and the runner that holds it."""

    scheduler: Scheduler = dataclasses.field(repr=False)
    runner: ModelRunner = dataclasses.field(repr=False)
    config: EngineConfig = dataclasses.field(repr=False)  # the engine's, resolved at start
    vocab_size: int
    requests: list[Request]  # row i's request (rows past the list are padding)
    num_rows: int
    width: int  # block-table columns of a row
    num_stop_ids: int  # stop-id columns of a row
    next_position: np.ndarray  # i64[R]: each row's input position at the next window's start
    table_len: np.ndarray  # i64[R]: block ids the device holds for each row
    last_input: np.ndarray  # i64[R]: each row's last input position (`Scheduler.last_input_position`; -1: none)
    greedy: bool
    num_logprobs: int | None = None  # the window programs' static num_logprobs
    penalized: bool = False  # the rows carry `Penalties` (the programs that apply them)
    # `InFlight` windows and mixed steps, oldest first
    inflight: collections.deque = dataclasses.field(default_factory=collections.deque)
    wants_wider_table: bool = False
    missing_rows: bool = False  # a decoding request could not join (`join`, `joining_rows`)
    steps_since_prompts: int = 0  # steps dispatched since the batch started or last took a prompt

    @classmethod
    def start(cls, requests: list[Request], *, mixing: bool, scheduler: Scheduler, runner: ModelRunner,
              config: EngineConfig, shapes: ProgramShapes, vocab_size: int, penalized: bool = False
              ) -> "DecodeBatch":
        """Uploads ``requests`` (decoding ones) as the rows of a new persistent batch;
        ``penalized``: its rows carry `Penalties` (also when a request of ``requests``
        needs them).

        A batch for mixed steps (``mixing``) has the prompt sections' block-table width
        and rows for every request that may run while prompts are admitted; a batch of
        decode windows is as small as its rows allow, and wide enough for every row's
        last position, so it never needs rebuilding (and recompiling) to grow a row.
        """
        cfg, sched = config, scheduler
        if mixing:
            num_rows = shapes.rows_for(min(cfg.max_num_seqs, len(sched.running) + len(sched.waiting)), mixing=True)
            width = shapes.block_table_width
        else:
            num_rows = shapes.rows_for(len(requests), mixing=False)
            longest = max(sched.final_length(r) for r in requests)
            width = shapes.window_width(
                max([-(-longest // cfg.block_size)] + [len(r.block_table) for r in requests]))
        num_stop_ids = stop_id_columns(max((len(sched.stop_token_ids(r)) for r in requests), default=1))
        penalized = penalized or uses_penalties(requests)
        rows = DecodeState.empty(num_rows, width, num_stop_ids, vocab_size if penalized else None)
        for i, request in enumerate(requests):
            fill_row(sched, rows, i, request)
        runner.start_decode(rows)
        return cls(
            scheduler=scheduler, runner=runner, config=config, vocab_size=vocab_size,
            requests=list(requests), num_rows=num_rows, width=width, num_stop_ids=num_stop_ids,
            next_position=rows.positions.astype(np.int64), table_len=np.array(
                [len(r.block_table) for r in requests] + [0] * (num_rows - len(requests)), np.int64),
            last_input=np.array([sched.last_input_position(r) for r in requests] + [-1] * (num_rows - len(requests)),
                                np.int64),
            greedy=program_greedy(requests, penalized),
            num_logprobs=program_num_logprobs(requests, vocab_size), penalized=penalized)

    def free_rows(self) -> list[int]:
        """Rows a new request may take: those whose request finished as far as the host
        knows (a row the device stopped is inactive; an aborted one is overwritten after
        the windows in flight, which may still write into the freed blocks, before any
        later program reuses them), then the padding rows in order."""
        done = [i for i, r in enumerate(self.requests) if r.is_finished]
        return done + list(range(len(self.requests), self.num_rows))

    def needs_rebuild(self, shapes: ProgramShapes) -> bool:
        """A request outgrew its block-table row, a decoding request is outside the batch,
        most rows stopped and no prompt joined for `shrink_after_steps` steps (a smaller
        batch bucket runs faster), or the batch applies penalties that no live row uses
        any more (the program without them runs faster)."""
        if self.wants_wider_table or self.missing_rows:
            return True
        live = [r for r in self.requests if not r.is_finished]
        if live and self.penalized and not uses_penalties(live):
            return True
        return (bool(live) and shapes.rows_for(len(live), mixing=False) < self.num_rows
                and self.steps_since_prompts >= self.shrink_after_steps())

    def shrink_after_steps(self) -> int:
        """Steps without a prompt joining before the batch may shrink to a smaller bucket:
        two full windows. A shrink drains the batch (the device idles while the host reads
        every window in flight and uploads the rows again), and the next prompt's mixed
        step needs the largest bucket back (a second drain): while requests keep arriving,
        as a server's do, the batch keeps its rows; once they pause, it shrinks."""
        return 2 * self.config.num_scheduler_steps

    # ------------------------------------------------------------- joining
    def joining_rows(self, out: SchedulerOutput, rows: np.ndarray, num_seqs: int
                     ) -> tuple[np.ndarray, DecodeState, list[tuple[int, Request]]]:
        """The batch rows that the requests whose prompt ends in ``out`` take in the mixed
        step (`ModelRunner.run_mixed`'s ``join_index`` and ``join_rows``, and the
        ``(row, request)`` pairs). When they do not all fit (rows, block-table width,
        stop ids, the batch's static greedy / logprobs / penalties choice) none joins,
        and the batch is rebuilt before the next step instead."""
        join_index = np.full(num_seqs, self.num_rows, np.int32)  # padding entries are dropped
        join_rows = DecodeState.empty(num_seqs, self.width, self.num_stop_ids)
        items = [(item.request, seq) for item, seq in zip(out.scheduled, rows) if item.samples]
        if not items:
            return join_index, join_rows, []
        free = self.free_rows()
        if len(items) > len(free) or not all(self.fits(request) for request, _ in items):
            self.missing_rows = True
            return join_index, join_rows, []
        joining = []
        for (request, seq), row in zip(items, free):
            fill_row(self.scheduler, join_rows, seq, request, sampled_later=True)
            join_index[seq] = row
            joining.append((row, request))
        return join_index, join_rows, joining

    def fits(self, request: Request) -> bool:
        """Whether ``request`` can decode in a row of this batch as it is."""
        return (len(request.block_table) <= self.width
                and self.scheduler.last_input_position(request) // self.config.block_size + 1 <= self.width
                and len(self.scheduler.stop_token_ids(request)) <= self.num_stop_ids
                and (request.sampling_params.greedy or not self.greedy)
                and program_num_logprobs([request], self.vocab_size) == self.num_logprobs
                and (self.penalized or not request.sampling_params.processes_logits))

    def join(self, requests: list[Request]) -> int:
        """Puts requests that start decoding into free rows of the persistent batch, on the
        device after the windows in flight; when they do not all fit (rows, block-table
        width, stop ids, the batch's static greedy / logprobs / penalties choice) the
        batch is rebuilt before its next window instead. Returns how many rows were
        inserted."""
        if not requests:
            return 0
        free = self.free_rows()
        fits = len(requests) <= len(free) and all(self.fits(r) for r in requests)
        if not fits:
            self.missing_rows = True
            return 0
        values = DecodeState.empty(self.num_rows, self.width, self.num_stop_ids,
                                   self.vocab_size if self.penalized else None)
        row_index = np.full(self.num_rows, self.num_rows, np.int32)  # padding entries are dropped
        for j, (row, request) in enumerate(zip(free, requests)):
            fill_row(self.scheduler, values, j, request)
            row_index[j] = row
            self.take_row(row, request, next_position=request.num_tokens - 1)
        self.runner.insert_decode_rows(row_index, values)
        self.steps_since_prompts = 0
        return len(requests)

    def take_row(self, row: int, request: Request, *, next_position: int) -> None:
        """Gives ``row`` of the host view to ``request``, whose next input sits at
        ``next_position`` (free rows list the padding rows last, in order)."""
        if row == len(self.requests):
            self.requests.append(request)
        else:
            self.requests[row] = request
        self.next_position[row] = next_position
        self.table_len[row] = len(request.block_table)
        self.last_input[row] = self.scheduler.last_input_position(request)

    # ------------------------------------------------------------- windows
    def reserve_rows(self, num_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Reserves the blocks the batch's live rows write in the next ``num_steps`` steps;
        returns the batch update ``(keep, block_rows, block_values)`` and the live rows, or
        None (nothing reserved) when a row outgrew the table or the blocks do not suffice.

        Array arithmetic over the rows: only the rows that cross into a block they do not
        hold (one in ``block_size / num_steps`` a window) cost the host a request's work."""
        bs = self.config.block_size
        n = len(self.requests)
        finished = np.fromiter((r.is_finished for r in self.requests), bool, n)
        positions, last_input = self.next_position[:n], self.last_input[:n]
        # a row feeds a token while its next position is at most its last input position
        live = np.flatnonzero(~finished & (positions <= last_input))
        need = np.minimum(positions[live] + num_steps - 1, last_input[live]) // bs + 1
        if len(live) and int(need.max()) > self.width:
            self.wants_wider_table = True
            return None
        short = need > self.table_len[live]  # rows whose device table lacks a block they write
        growing, growing_need = live[short], need[short]
        missing = sum(max(0, int(k) - len(self.requests[i].block_table)) for i, k in zip(growing, growing_need))
        if not self.scheduler.device_blocks.can_allocate(missing):
            return None
        changed = []
        for i in growing:
            request = self.requests[i]
            reserved = self.scheduler.reserve_decode_blocks(request, int(self.next_position[i]) + num_steps - 1)
            assert reserved is not None, "blocks were counted before reserving"
            if len(request.block_table) > self.table_len[i]:
                changed.append(i)
        # One shape (R updates, padding rows index R and are dropped), so one program.
        update_rows = np.full(self.num_rows, self.num_rows, np.int32)
        update_values = np.zeros((len(update_rows), self.width), np.int32)
        for j, i in enumerate(changed):
            table = self.requests[i].block_table
            update_rows[j] = i
            update_values[j, :len(table)] = table
            self.table_len[i] = len(table)
        keep = np.zeros(self.num_rows, bool)
        keep[live] = True
        return keep, update_rows, update_values, live

    def window_steps(self) -> int:
        """The next window's length: ``latency_scheduler_steps`` while no request waits
        and at most ``latency_max_rows`` run (tokens stream as they are sampled),
        ``num_scheduler_steps`` otherwise."""
        cfg, sched = self.config, self.scheduler
        if cfg.latency_scheduler_steps is None or sched.waiting or sched.swapped:
            return cfg.num_scheduler_steps
        if cfg.latency_max_rows is not None and len(sched.running) > cfg.latency_max_rows:
            return cfg.num_scheduler_steps
        return cfg.latency_scheduler_steps

    def dispatch_window(self) -> bool:
        """Reserves the next window's blocks and dispatches it; False if it cannot run now."""
        k = self.window_steps()
        update = self.reserve_rows(k)
        if update is None or not len(update[3]):
            return False
        keep, update_rows, update_values, live = update
        out = self.runner.run_decode_window(keep, update_rows, update_values, num_steps=k, greedy=self.greedy,
                                            max_model_len=self.config.max_model_len,
                                            num_logprobs=self.num_logprobs)
        self.inflight.append(InFlight(out, list(self.requests)))  # the rows' requests when dispatched
        self.next_position[live] += k
        self.steps_since_prompts += k
        return True

    def read_window(self) -> tuple[list[Request], int]:
        """Waits for the oldest window (or mixed step) in flight and records its tokens:
        a mixed step's prompt tokens first, then its rows'."""
        assert self.inflight
        entry = self.inflight.popleft()
        finished, num_tokens = [], 0
        if entry.prompt is not None:
            finished, num_tokens = self.read_prompt_tokens(entry.prompt)
        requests = entry.requests
        tokens, logprobs = to_host(entry.result)  # [K, R]; waits for that window only
        now = time.perf_counter()
        counts = (tokens != NO_TOKEN).sum(axis=0)
        for i in np.nonzero(counts[:len(requests)])[0]:
            request = requests[i]
            n = int(counts[i])
            if logprobs is not None:
                append_logprobs(request, tokens[:n, i], logprobs, np.s_[:n, i])
            if self.scheduler.record_decoded(request, tokens[:n, i].tolist(), now) is not None:
                finished.append(request)
            num_tokens += n
        return finished, num_tokens

    def read_prompt_tokens(self, step: PromptTokens) -> tuple[list[Request], int]:
        """Records the tokens a mixed step sampled for the prompts that ended in it."""
        tokens, logprobs = to_host(step.result)  # waits for the step
        sampled = {item.request.request_id: int(tokens[row])
                   for item, row in zip(step.out.scheduled, step.rows) if item.samples}
        if logprobs is not None:
            for item, row in zip(step.out.scheduled, step.rows):
                if item.samples and not item.request.is_finished:
                    append_logprobs(item.request, tokens[row:row + 1], logprobs, np.s_[row:row + 1])
        return self.scheduler.record_sampled(step.out, sampled), len(sampled)

    def read_all(self) -> tuple[list[Request], int]:
        """Reads every window in flight (the host then knows every row's tokens exactly)."""
        finished, num_tokens = [], 0
        while self.inflight:
            more, n = self.read_window()
            finished += more
            num_tokens += n
        return finished, num_tokens


def fill_row(scheduler: Scheduler, rows: DecodeState, i: int, request: Request, *, sampled_later: bool = False
             ) -> None:
    """Host row ``i`` of a `DecodeState` from a decoding request; ``sampled_later``:
    as the request will be after the token a dispatched step samples for it (whose
    value the device fills in; the device also fills its `Penalties`, from the prompt's)."""
    params = request.sampling_params
    stops = scheduler.stop_token_ids(request)
    num_pending = 1 if sampled_later else 0
    rows.tokens[i] = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
    rows.positions[i] = request.num_tokens - 1 + num_pending
    rows.active[i] = True
    rows.block_tables[i, :len(request.block_table)] = request.block_table
    rows.temperature[i], rows.top_p[i], rows.top_k[i] = params.temperature, params.top_p, params.top_k
    rows.seed[i], rows.num_generated[i] = request.seed, len(request.output_token_ids) + num_pending
    rows.max_tokens[i] = params.max_tokens
    rows.stop_ids[i, :len(stops)] = stops
    if rows.penalties is not None:
        fill_penalties(rows.penalties, i, request, stops)
