"""Continuous-batching scheduler with chunked prefill, prefix sharing and swap preemption.

Everything here runs on the host between two model steps. `Scheduler.schedule` decides
which requests run in the next step and with how many tokens each; the engine runs the
step and hands the sampled tokens back with `Scheduler.update`.

Policy (vLLM's chunked-prefill scheduler, first come first served):

1. **Running** requests, oldest first, each get ``min(pending tokens, token budget)``
   tokens: 1 for a decode, a chunk of the prompt for a prefill. When the KV cache has
   no block left for one, the *youngest* running request not yet scheduled is
   preempted (the request itself if it is the youngest): its blocks are swapped out
   to host memory (`swap_blocks`), or, when the host pool is full too, dropped and
   recomputed later from its tokens. No request ever loses a token either way.
2. **Swapped** requests, oldest first, come back (swap in) when no preemption happened
   this step and their blocks fit.
3. **Waiting** requests are admitted, oldest first, only when no older request is
   swapped out, the token budget has room and their first chunk fits. Full prompt
   blocks already in the cache (same prefix, `BlockAllocator.lookup`) are shared
   instead of recomputed.

A request never jumps ahead of an older one in the same queue (a request that does
not fit stops admission), so long requests are not starved by short ones.

The batch is laid out as vLLM's FlashAttention backend expects it: prefill chunks
first, then decodes (one token each).

Token accounting per request: ``num_computed_tokens`` tokens have their K/V in the
cache; the next step feeds tokens ``[num_computed_tokens, num_computed_tokens +
num_new_tokens)`` of ``prompt + output``; a token is sampled when the chunk reaches
the last known token.

The request and the step plan it schedules (`Request`, `ScheduledRequest`,
`SchedulerOutput`, ...) are `jax_paged_attn.engine.request`'s.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Sequence

import numpy as np

from jax_paged_attn.engine.block_allocator import BlockAllocator, hash_block_tokens, root_digest
from jax_paged_attn.engine.request import (FinishReason, Request, RequestStatus, ScheduledRequest, SchedulerOutput,
                                           validate_prompt)
from jax_paged_attn.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step.

    Attributes:
      max_num_seqs: requests holding device blocks at once (the batch size bound).
      max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
      max_model_len: longest context (prompt + output) a request may reach.
      enable_prefix_caching: share full prompt blocks between requests.
      decode_during_prefill: a step that prefills prompt chunks also decodes the running
        requests (vLLM's chunked-prefill scheduling). False: while some prompt can be
        prefilled, steps hold prefill chunks only, and running requests decode in the
        steps after (vLLM's default scheduling; an engine then decodes them in
        multi-step windows between admissions).
      max_num_prefill_seqs: most prompt chunks (prefills) in one step; None: no limit
        beyond the others. An engine whose prompt sections have a fixed number of
        sequence rows sets it.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    decode_during_prefill: bool = True
    max_num_prefill_seqs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_prefill_seqs"):
            value = getattr(self, name)
            if value is None and name == "max_num_prefill_seqs":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")


class Scheduler:
    """Decides, step by step, which requests run; owns the device and host block pools.

    Args:
      config: step limits (`SchedulerConfig`).
      num_device_blocks, num_host_blocks: sizes of the device KV cache and of the host
        swap space, in blocks.
      block_size: token slots per block.
      eos_token_id: token (or tokens) that finish a request unless its params say
        ``ignore_eos``; None: none.
      vocab_size: if given, prompt token ids must lie in ``[0, vocab_size)``.
    """

    def __init__(self, config: SchedulerConfig, *, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, eos_token_id: int | Sequence[int] | None = None,
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._next_arrival = 0
        self.block_size = block_size
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_token_id is None else (int(eos_token_id),) if isinstance(eos_token_id, (int, np.integer))
            else tuple(int(t) for t in eos_token_id))
        self._new_block_pools(num_device_blocks, num_host_blocks)
        # Each queue is kept sorted by arrival (FCFS).
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_recomputed_requests = 0
        self.num_prefix_cache_hit_tokens = 0

    # ------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams, *, seed: int) -> Request:
        """Validates and queues a request; a bad one raises here and changes nothing.

        Raises:
          ValueError: duplicate ``request_id``; empty prompt; a token id outside
            ``[0, vocab_size)``; a prompt that leaves no room for one generated token
            within ``max_model_len``; a request whose longest possible context needs
            more blocks than the whole device cache (it could never run).
          TypeError: a prompt that is not a sequence of ints; params that are not
            `SamplingParams`.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}.")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}.")
        prompt = validate_prompt(prompt_token_ids, self.vocab_size)
        max_len = self.config.max_model_len
        if len(prompt) >= max_len:
            raise ValueError(
                f"prompt of request {request_id!r} has {len(prompt)} tokens; the model's max context "
                f"(max_model_len) is {max_len}, which leaves no room to generate a token."
            )
        longest = min(len(prompt) + sampling_params.max_tokens, max_len)
        blocks = -(-longest // self.block_size)
        if blocks > self.device_blocks.num_blocks:
            raise ValueError(
                f"request {request_id!r} may reach {longest} tokens (prompt {len(prompt)} + max_tokens "
                f"{sampling_params.max_tokens}), needing {blocks} blocks of {self.block_size}, but the "
                f"KV cache has only num_blocks={self.device_blocks.num_blocks}."
            )
        request = Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling_params,
                          arrival_index=self._next_arrival, seed=int(seed))
        self._next_arrival += 1
        self.requests[request_id] = request
        _insort(self.waiting, request)
        return request

    def abort(self, request_id: str) -> None:
        """Finishes a request now and releases its blocks. Unknown ids raise KeyError."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}.")
        if not request.is_finished:
            self._finish(request, FinishReason.ABORTED)

    @property
    def next_arrival_index(self) -> int:
        """Arrival number the next added request gets (FCFS order)."""
        return self._next_arrival

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def pop_finished(self, request_id: str) -> Request:
        """Forgets a request (after it finished); returns it."""
        return self.requests.pop(request_id)

    # ------------------------------------------------------------- schedule
    def can_admit(self) -> bool:
        """Whether the next `schedule` could start the oldest waiting request: nobody
        waits in swap, a sequence slot is free and the device pool holds the blocks of
        its first chunk, or with ``decode_during_prefill`` False of its whole prompt
        (prefix-cache hits not counted)."""
        if self.swapped or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        return self._blocks_to_admit(self.waiting[0], self.config.max_num_batched_tokens)

    def _blocks_to_admit(self, request: Request, num_new: int) -> bool:
        """Whether the pool can give a waiting request the blocks it needs to start with
        ``num_new`` tokens. Without ``decode_during_prefill`` the whole prompt must fit
        (as in vLLM's block manager): a prompt admitted chunk by chunk into a nearly
        full cache would preempt the requests decoding in windows."""
        pending = request.num_tokens - request.num_computed_tokens
        num_new = pending if not self.config.decode_during_prefill else min(num_new, pending)
        return self.device_blocks.can_allocate(self._num_blocks_needed(request, num_new, len(request.block_table)))

    def schedule(self) -> SchedulerOutput:
        """The next step: which requests run, with how many new tokens, and the block
        operations (swap-out, copy-on-write, swap-in) that must run before it."""
        out = SchedulerOutput([], [], [], [], [], 0, 0)
        if not self.config.decode_during_prefill:
            out = self._schedule(out, prefill_only=True)
            if out.scheduled:
                return out
            # Nothing to prefill. A preemption it made (a prompt chunk that found no
            # blocks) stays in `out`: its swap-outs must run before anything else.
        return self._schedule(out, prefill_only=False)

    def schedule_prefills(self) -> SchedulerOutput:
        """A step of prompt chunks only (those of running requests still in prefill, then
        admissions), or an empty one; requests that decode are neither scheduled nor
        preempted. Only without ``decode_during_prefill``: an engine runs such a step
        while its decode windows are in flight (the decoding requests' host state then
        lags the device's, so nothing may be decided from it)."""
        assert not self.config.decode_during_prefill, "prefill-only steps need decode_during_prefill=False"
        return self._schedule(SchedulerOutput([], [], [], [], [], 0, 0), prefill_only=True)

    def _schedule(self, out: SchedulerOutput, *, prefill_only: bool) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        prefill_slots = self.config.max_num_prefill_seqs
        if prefill_slots is None:
            prefill_slots = self.config.max_num_seqs + 1
        scheduled: list[ScheduledRequest] = []

        # 1. Running requests, oldest first; preempt the youngest when blocks run out.
        queue = [r for r in self.running if r.in_prefill] if prefill_only else list(self.running)
        while queue:
            request = queue.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or (request.in_prefill and prefill_slots <= 0):
                continue  # budget spent: it keeps its blocks and runs next step
            while not self._prepare_blocks(request, num_new, out.copies):
                victim = queue.pop() if queue else request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest.of(request, num_new))
                budget -= num_new
                prefill_slots -= scheduled[-1].is_prefill

        # 2. Swapped requests come back, oldest first, unless this step had to preempt.
        while not prefill_only and not out.preempted and self.swapped and budget > 0:
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            extra = self._num_blocks_needed(request, num_new, len(request.host_block_table))
            if (len(self.running) >= self.config.max_num_seqs
                    or not self.device_blocks.can_allocate(len(request.host_block_table) + extra)):
                break
            self.swapped.pop(0)
            self._swap_in(request, out)
            ok = self._prepare_blocks(request, num_new, out.copies)
            assert ok, "blocks were checked before swapping in"
            scheduled.append(ScheduledRequest.of(request, num_new))
            budget -= num_new
            prefill_slots -= scheduled[-1].is_prefill

        # 3. Waiting requests, oldest first, only when nobody older waits in swap.
        while not out.preempted and not self.swapped and self.waiting and budget > 0 and prefill_slots > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hits = self._lookup_prefix(request) if request.num_computed_tokens == 0 else []
            start = request.num_computed_tokens
            if hits:
                # Always feed at least one token, to get logits for the next one.
                start = min(len(hits) * self.block_size, request.num_tokens - 1)
            num_new = min(request.num_tokens - start, budget)
            # (With decode_during_prefill the chunk's own allocation below is the check.)
            if not self.config.decode_during_prefill and not hits and not self._blocks_to_admit(request, num_new):
                break
            table_before = request.block_table
            request.block_table = table_before + hits
            computed_before = request.num_computed_tokens
            request.num_computed_tokens = start
            copies_before = len(out.copies)
            if not self._prepare_blocks(request, num_new, out.copies):
                del out.copies[copies_before:]
                self.device_blocks.free_many(hits)
                request.block_table = table_before
                request.num_computed_tokens = computed_before
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            if hits:
                if not request.num_preemptions:  # vLLM's count: the first admission's hit, of prompt tokens only
                    request.num_cached_prompt_tokens = start
                request.num_registered_blocks = len(hits)
                self.num_prefix_cache_hit_tokens += start
            _insort(self.running, request)
            scheduled.append(ScheduledRequest.of(request, num_new))
            budget -= num_new
            prefill_slots -= 1

        prefills = [s for s in scheduled if s.is_prefill]
        decodes = [s for s in scheduled if not s.is_prefill]
        out.scheduled = prefills + decodes
        out.num_prefills = len(prefills)
        out.num_batched_tokens = sum(s.num_new_tokens for s in scheduled)
        return out

    def reserve_lookahead(self, out: SchedulerOutput, num_lookahead: int) -> bool:
        """Gives every scheduled decode the blocks for ``num_lookahead`` more tokens.

        Multi-step decoding (vLLM's lookahead slots): the engine then runs
        ``1 + num_lookahead`` model steps before the next `schedule`, and every token
        those steps write needs its slot. All or nothing: returns False, reserving
        nothing, when ``out`` holds a prefill or the free blocks do not suffice (no
        preemption is done for lookahead).
        """
        if out.num_prefills or num_lookahead <= 0:
            return num_lookahead == 0 and not out.num_prefills
        wanted = []
        for item in out.scheduled:
            request = item.request
            num_required = -(-(item.seq_len + num_lookahead) // self.block_size)
            wanted.append(max(0, num_required - len(request.block_table)))
        if not self.device_blocks.can_allocate(sum(wanted)):
            return False
        for item, count in zip(out.scheduled, wanted):
            item.request.block_table.extend(self.device_blocks.allocate_many(count))
        return True

    # --------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Records a finished step: computed tokens, new full blocks, sampled tokens
        (`commit` then `record_sampled`).

        Args:
          out: the step's `SchedulerOutput`.
          sampled: request_id -> new token, for every scheduled request that samples.

        Returns the requests that finished in this step.
        """
        self.commit(out)
        return self.record_sampled(out, sampled)

    def commit(self, out: SchedulerOutput) -> None:
        """Counts a dispatched step's tokens as computed and offers its full blocks to the
        prefix cache, before its sampled tokens are known.

        An engine that schedules step n + 1 while step n runs commits step n at its
        dispatch, so the next schedule starts each prompt where step n left it; the
        device runs the steps in order, so a block step n fills is written before a
        later step reads it (a prefix hit included).
        """
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # aborted since it was scheduled
                continue
            request.num_computed_tokens += item.num_new_tokens
            self._register_full_blocks(request)

    def record_sampled(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Appends the tokens a committed step sampled; returns the requests that finished
        (requests aborted while the step ran are skipped)."""
        finished = []
        now = time.perf_counter()
        for item in out.scheduled:
            request = item.request
            if request.is_finished or not item.samples:
                continue
            token = sampled[request.request_id]
            request.output_token_ids.append(int(token))
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._finish_reason(request, int(token))
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    # ------------------------------------------------ persistent decode batch
    def stop_token_ids(self, request: Request) -> tuple[int, ...]:
        """Tokens that end ``request`` (its stop ids, and EOS unless it ignores EOS)."""
        params = request.sampling_params
        return params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)

    def final_length(self, request: Request) -> int:
        """Tokens ``request`` holds when it ends by length (``max_tokens`` or ``max_model_len``)."""
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.max_model_len)

    def last_input_position(self, request: Request) -> int:
        """The position of the last token ``request`` feeds the model (the token before its
        last one, at `final_length`): the last cache slot it may write."""
        return self.final_length(request) - 2

    def reserve_decode_blocks(self, request: Request, last_position: int) -> int | None:
        """Appends the blocks ``request`` needs to write positions up to ``last_position``
        (capped at its last possible input position); returns how many, or None (nothing
        reserved) when the free blocks do not suffice. No preemption is done."""
        last_position = min(last_position, self.last_input_position(request))
        wanted = last_position // self.block_size + 1 - len(request.block_table)
        if wanted <= 0:
            return 0
        if not self.device_blocks.can_allocate(wanted):
            return None
        request.block_table.extend(self.device_blocks.allocate_many(wanted))
        return wanted

    def record_decoded(self, request: Request, tokens: Sequence[int], now: float) -> FinishReason | None:
        """Records tokens a decode window sampled for ``request`` (each fed the next), in
        one update; finishes it when the last one ends it. Returns the finish reason."""
        if not tokens or request.is_finished:
            return None
        request.output_token_ids.extend(tokens)
        request.num_computed_tokens = request.num_tokens - 1
        if request.first_token_time is None:
            request.first_token_time = now
        self._register_full_blocks(request)
        reason = self._finish_reason(request, int(tokens[-1]))
        if reason is not None:
            self._finish(request, reason)
        return reason

    # -------------------------------------------------------------- helpers
    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        self.device_blocks.free_many(request.block_table)
        self.host_blocks.free_many(request.host_block_table)
        request.block_table = []
        request.host_block_table = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter()

    def _num_blocks_needed(self, request: Request, num_new: int, num_held: int) -> int:
        """New blocks (allocations + copy-on-write copies) to write ``num_new`` more tokens."""
        start = request.num_computed_tokens
        end = start + num_new
        num_required = -(-end // self.block_size)
        needed = max(0, num_required - num_held)
        if request.status != RequestStatus.SWAPPED:
            for index in range(start // self.block_size, min(num_required, num_held)):
                block = request.block_table[index]
                if self.device_blocks.is_shared(block) or self.device_blocks.is_cached(block):
                    needed += 1
        return needed

    def _prepare_blocks(self, request: Request, num_new: int, copies: list[tuple[int, int]]) -> bool:
        """Makes the blocks that the next ``num_new`` tokens go to exist and be private.

        Returns False, changing nothing, when the device pool cannot provide them.
        """
        needed = self._num_blocks_needed(request, num_new, len(request.block_table))
        if not self.device_blocks.can_allocate(needed):
            return False
        start = request.num_computed_tokens
        num_required = -(-(start + num_new) // self.block_size)
        table = request.block_table
        for index in range(start // self.block_size, min(num_required, len(table))):
            table[index], copy = self.device_blocks.cow(table[index])
            if copy is not None:
                copies.append(copy)
                # The private copy is not (yet) in the prefix cache.
                request.num_registered_blocks = min(request.num_registered_blocks, index)
        table.extend(self.device_blocks.allocate_many(max(0, num_required - len(table))))
        return True

    def _lookup_prefix(self, request: Request) -> list[int]:
        """Shares the longest run of cached full blocks at the start of the request's tokens."""
        if not self.config.enable_prefix_caching:
            return []
        self._extend_hashes(request, request.num_tokens)
        hits = []
        for index, block_hash in enumerate(request.block_hashes):
            block = self.device_blocks.lookup(block_hash, self._block_tokens(request, index),
                                              parent_block=hits[-1] if hits else None,
                                              cache_salt=request.sampling_params.cache_salt)
            if block is None:
                break
            hits.append(block)
        return hits

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        return [request.token_at(p) for p in range(index * self.block_size, (index + 1) * self.block_size)]

    def _extend_hashes(self, request: Request, num_known_tokens: int) -> None:
        while (len(request.block_hashes) + 1) * self.block_size <= num_known_tokens:
            index = len(request.block_hashes)
            parent = request.block_hashes[-1] if request.block_hashes else root_digest(
                request.sampling_params.cache_salt)
            request.block_hashes.append(hash_block_tokens(parent, self._block_tokens(request, index)))

    def _register_full_blocks(self, request: Request) -> None:
        """Offers blocks that became full and computed to the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        self._extend_hashes(request, num_full * self.block_size)
        for index in range(request.num_registered_blocks, num_full):
            self.device_blocks.register(request.block_table[index], request.block_hashes[index],
                                        self._block_tokens(request, index),
                                        parent_block=request.block_table[index - 1] if index else None,
                                        cache_salt=request.sampling_params.cache_salt)
        request.num_registered_blocks = num_full

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Moves a running request out of the device cache (swap, else recompute later)."""
        self.running.remove(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(request.request_id)
        num_blocks = len(request.block_table)
        if self.host_blocks.can_allocate(num_blocks):
            host = self.host_blocks.allocate_many(num_blocks)
            out.swap_out.extend(zip(request.block_table, host))
            request.host_block_table = host
            request.status = RequestStatus.SWAPPED
            self.num_swapped_out_blocks += num_blocks
            _insort(self.swapped, request)
        else:
            # No host room: drop the K/V, keep every token; its next prefill recomputes them.
            request.num_recomputed_tokens = request.num_tokens
            request.num_computed_tokens = 0
            request.num_registered_blocks = 0
            request.status = RequestStatus.WAITING
            self.num_recomputed_requests += 1
            _insort(self.waiting, request)
        self.device_blocks.free_many(request.block_table)
        request.block_table = []

    def _swap_in(self, request: Request, out: SchedulerOutput) -> None:
        device = self.device_blocks.allocate_many(len(request.host_block_table))
        out.swap_in.extend(zip(request.host_block_table, device))
        self.host_blocks.free_many(request.host_block_table)
        request.host_block_table = []
        request.block_table = device
        # The fresh blocks are offered to the prefix cache only after this step ran: their
        # content arrives with the swap-in, after this step's copy-on-write copies.
        request.num_registered_blocks = 0
        request.status = RequestStatus.RUNNING
        _insort(self.running, request)

    def reset_after_failure(self, *, recompute: bool) -> list[Request]:
        """Forgets every block after a step failed (the device caches' contents are lost
        or unknown: a failed program may have half-written blocks, some of them already
        offered to the prefix cache at dispatch). The unfinished requests that held
        blocks or had computed tokens are aborted, or with ``recompute`` queued again to
        recompute their tokens so far (as after a preemption); returns them."""
        affected = [r for r in self.requests.values()
                    if not r.is_finished and (r.block_table or r.host_block_table or r.num_computed_tokens)]
        for request in affected:
            request.block_table, request.host_block_table = [], []
            request.num_computed_tokens = request.num_registered_blocks = 0
            if not recompute:
                self._finish(request, FinishReason.ABORTED)
            elif request.status != RequestStatus.WAITING:
                for queue in (self.running, self.swapped):
                    if request in queue:
                        queue.remove(request)
                request.status = RequestStatus.WAITING
                _insort(self.waiting, request)
        self._new_block_pools(self.device_blocks.num_blocks, self.host_blocks.num_blocks)
        return affected

    def _new_block_pools(self, num_device_blocks: int, num_host_blocks: int) -> None:
        """Empty device and host block pools (the device's with the prefix cache, if on)."""
        self.device_blocks = BlockAllocator(num_device_blocks, self.block_size, name="device",
                                            enable_prefix_caching=self.config.enable_prefix_caching)
        self.host_blocks = BlockAllocator(num_host_blocks, self.block_size, name="host", enable_prefix_caching=False)




def _insort(queue: list[Request], request: Request) -> None:
    keys = [r.arrival_index for r in queue]
    queue.insert(bisect.bisect(keys, request.arrival_index), request)

