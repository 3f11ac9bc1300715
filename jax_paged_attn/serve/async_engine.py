"""`AsyncEngine`: the asynchronous front end over one `LLMEngine`: owns the engine
thread, admission, per-request streams of new tokens and text, aborts and shutdown.

One thread owns the engine and is the only one to call it. It loops: apply the
operations queued since the last step (add a request, abort one; queued under one
condition variable, so an add or an abort never races a step), run `LLMEngine.step`,
then read every sequence's new tokens, turn them into text (`SequenceText`: incremental
decoding, stop strings, which it ends with `LLMEngine.stop_request`) and hand each
request its deltas on the asyncio loop (``call_soon_threadsafe`` into the request's
queue). It sleeps when there is nothing to do.

Admission: a request of ``k`` sequences (prompts × ``n``) is refused with a 503 and
``Retry-After`` when the sequences in the engine (running or waiting, or queued for it)
would exceed ``max_num_seqs + max_waiting_requests``: the queue is bounded, the server's
memory too. A request whose client goes away is aborted (`RequestStream.abort`): its
engine requests leave the engine with their KV blocks at the next step boundary.

Engine failure: when a step raises, the engine aborts the requests it had running (its
``on_step_failure``); their streams get `EngineError` (the server answers 500 with a
generic message, the cause stays in the log) and their sequences are removed. Requests
that only waited go on.

Running requests' new tokens come from `LLMEngine.peek_new_output` (`step` returns
finished requests only): after each step the thread copies only what each sequence
produced since the last, and skips the waiting ones at the cost of a lookup, so its work
a step grows with the tokens produced, not with the tokens held. The queue lengths and
block use of the metrics come from `LLMEngine.load`: the front end uses the engine's
public API alone.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import uuid
from typing import TYPE_CHECKING, Callable

from jax_paged_attn.engine import CompletionOutput, Logprob, SamplingParams
from jax_paged_attn.serve.detokenizer import SequenceText
from jax_paged_attn.serve.metrics import ServerMetrics
from jax_paged_attn.serve.protocol import ApiError

if TYPE_CHECKING:
    from jax_paged_attn.engine import LLM, LLMEngine

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 for a full queue: about a few decode windows."""


class EngineError(RuntimeError):
    """The engine failed while running this request (the cause is in the server log)."""


class RequestAborted(Exception):
    """The request was aborted (its client went away, or the server shut down)."""


@dataclasses.dataclass(frozen=True)
class SequenceDelta:
    """What one sequence produced since its last delta.

    Attributes:
      index: the sequence's choice index: ``prompt_index * n + sample_index``.
      text: new text (held-back text arrives later; see `SequenceText`).
      token_ids: new token ids (a stop string's completing token included).
      logprobs: one ``{token_id: Logprob}`` per new token, or None when not asked for.
      finish_reason: None while it runs; "stop", "length" or "abort" on its last delta.
      stop_reason: the stop string or stop token id that ended it ("stop" only).
      num_tokens: the sequence's output tokens so far.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_tokens: int


@dataclasses.dataclass
class _Sequence:
    """Engine-thread state of one engine request (one sequence of a `RequestStream`)."""

    stream: "RequestStream"
    index: int
    text: SequenceText
    token_ids: list[int] = dataclasses.field(default_factory=list)  # output ids read so far
    num_tokens_sent: int = 0


class RequestStream:
    """The deltas of one server request, as an async iterator of ``list[SequenceDelta]``
    (one list per engine step that produced anything); it ends after every sequence's
    last delta. Raises `EngineError` or `RequestAborted` instead of a delta when the
    request failed or was aborted.

    Attributes: ``request_id``, ``prompt_token_ids`` (one list per prompt),
    ``num_sequences`` (prompts × n).
    """

    def __init__(self, front: "AsyncEngine", request_id: str, prompt_token_ids: list[list[int]], n: int) -> None:
        self.front = front
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_sequences = len(prompt_token_ids) * n
        self.engine_request_ids: list[str] = []  # set by the engine thread
        self._queue: asyncio.Queue[list[SequenceDelta] | BaseException] = asyncio.Queue()
        self._num_unfinished = self.num_sequences
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> list[SequenceDelta]:
        if self.closed and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._close()
            raise item
        self._num_unfinished -= sum(d.finish_reason is not None for d in item)
        if self._num_unfinished == 0:
            self._close()
        return item

    def deliver(self, item: list[SequenceDelta] | BaseException) -> None:
        """Called on the event loop (from the engine thread through ``call_soon_threadsafe``)."""
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Aborts the request's unfinished sequences (freeing their KV blocks at the
        engine's next step boundary); a no-op once the stream has ended. The iterator
        then raises `RequestAborted`."""
        if self.closed:
            return
        self._close()
        self._queue.put_nowait(RequestAborted(self.request_id))
        self.front._submit(lambda: self.front._drop_stream(self))

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.front._num_sequences -= self.num_sequences


class AsyncEngine:
    """Serves an `LLM`'s engine to many asyncio tasks (see the module docstring).

    Args:
      llm: an `LLM` with a tokenizer.
      model_name: the served model name (the metrics' label).
      max_waiting_requests: sequences allowed to wait beyond ``max_num_seqs``.
    """

    def __init__(self, llm: "LLM", *, model_name: str, max_waiting_requests: int) -> None:
        if llm.tokenizer is None:
            raise ValueError("the server needs a tokenizer: the checkpoint directory has no tokenizer.json.")
        self.engine: LLMEngine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len: int = self.engine.config.max_model_len
        self.capacity = self.engine.config.max_num_seqs + max_waiting_requests
        self.metrics = ServerMetrics(model_name)
        self.accepting = True
        self._num_sequences = 0  # in the engine or queued for it (event-loop side)
        self._cond = threading.Condition()
        self._ops: list[Callable[[], None]] = []
        self._num_queued_sequences = 0  # of adds not yet applied (under _cond)
        self._stopping = False
        self._sequences: dict[str, _Sequence] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._update_load()

    # ------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Starts the engine thread; call on the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Aborts what still runs (their streams get `RequestAborted`) and ends the thread."""
        self.accepting = False
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def num_sequences(self) -> int:
        """Sequences the server has admitted and not yet finished."""
        return self._num_sequences

    async def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RequestStream:
        """Admits a request (each prompt sampled ``params.n`` times) and returns its stream.

        Raises `ApiError` 503 when the server is shutting down or its queue is full, and
        the engine's ValueError / TypeError (naming the argument) for a request it
        refuses; nothing is left in the engine then.
        """
        if not self.accepting:
            raise ApiError(503, "the server is shutting down and takes no new requests.", type="service_unavailable")
        stream = RequestStream(self, f"req-{uuid.uuid4().hex}", prompt_token_ids, params.n)
        if self._num_sequences + stream.num_sequences > self.capacity:
            raise ApiError(503, f"the server is at capacity ({self._num_sequences} sequences admitted, at most "
                           f"{self.capacity}: max_num_seqs + --max-waiting-requests); retry later.",
                           type="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._num_sequences += stream.num_sequences
        self._submit(lambda: self._add(stream, params, added), num_sequences=stream.num_sequences)
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException:
            stream._close()
            raise
        return stream

    def _submit(self, op: Callable[[], None], num_sequences: int = 0) -> None:
        with self._cond:
            self._ops.append(op)
            self._num_queued_sequences += num_sequences
            self._cond.notify()

    def _post(self, stream: RequestStream, item: list[SequenceDelta] | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(stream.deliver, item)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ops and not self._sequences and not self._stopping:
                    self._cond.wait()
                ops, self._ops = self._ops, []
                stopping = self._stopping
            for op in ops:
                op()
            if ops:
                self._update_load()  # an abort frees its blocks now: /metrics says so before the next step
            if stopping:
                self._drop_all(RequestAborted("the server shut down"))
                return
            try:
                if self.engine.has_unfinished_requests():
                    self._step()
                self._collect()
            except Exception:  # a bug of this front end: fail what runs rather than hang every client
                logger.exception("serve: the engine loop failed; aborting every request")
                self._drop_all(EngineError("the engine loop failed"))
            self._update_load()

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception:
            logger.exception("serve: LLMEngine.step failed; its requests are aborted")
            failed = {seq.stream for rid, seq in self._sequences.items()
                      if self.engine.peek_output(rid).outputs[0].finish_reason == "abort"}
            for stream in failed:
                self._drop_stream(stream)
                self._post(stream, EngineError("the engine failed while running this request"))

    def _add(self, stream: RequestStream, params: SamplingParams, added: concurrent.futures.Future[None]) -> None:
        with self._cond:
            self._num_queued_sequences -= stream.num_sequences
        if not added.set_running_or_notify_cancel():
            return
        # The engine takes one sequence per request and no stop strings (this thread
        # checks them on the text); sample j of a seeded request draws with seed + j, as
        # `LLMEngine.generate` does.
        one = dataclasses.replace(params, n=1, stop=())
        try:
            for i, prompt in enumerate(stream.prompt_token_ids):
                for j in range(params.n):
                    seed = None if one.seed is None else (one.seed + j) % 2**32
                    rid = f"{stream.request_id}-{i}-{j}"
                    self.engine.add_request(prompt, dataclasses.replace(one, seed=seed), request_id=rid)
                    stream.engine_request_ids.append(rid)
                    text = SequenceText(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                        params.skip_special_tokens, params.min_tokens)
                    self._sequences[rid] = _Sequence(stream, i * params.n + j, text)
        except Exception as e:
            self._drop_stream(stream)
            added.set_exception(e)
            return
        self.metrics.add_tokens(prompt=params.n * sum(len(p) for p in stream.prompt_token_ids))
        added.set_result(None)

    def _drop(self, rid: str) -> None:
        """Removes an engine request (aborting it first if it runs) and forgets it; the
        metrics count it as finished by "abort"."""
        self._sequences.pop(rid, None)
        self.engine.abort_request(rid)
        final = self.engine.pop_output(rid)
        self.metrics.finish("abort", final.time_to_first_token_s, final.latency_s, len(final.outputs[0].token_ids))

    def _drop_stream(self, stream: RequestStream) -> None:
        for rid in stream.engine_request_ids:
            if rid in self._sequences:
                self._drop(rid)

    def _drop_all(self, error: BaseException) -> None:
        streams = {seq.stream for seq in self._sequences.values()}
        for stream in streams:
            self._drop_stream(stream)
            self._post(stream, error)

    def _collect(self) -> None:
        """Hands every sequence's new tokens and text to its stream; ends sequences whose
        text reached a stop string; pops finished ones."""
        deltas: dict[RequestStream, list[SequenceDelta]] = {}
        num_generated = 0
        for rid, seq in list(self._sequences.items()):
            start = seq.num_tokens_sent
            out = self.engine.peek_new_output(rid, start)
            if out is None:
                continue
            seq.token_ids += out.token_ids
            if seq.text.stop and out.finish_reason != "abort":
                stop = seq.text.find_stop(seq.token_ids)
                if stop is not None:
                    self.engine.stop_request(rid, *stop)
                    del seq.token_ids[stop[0]:]
                    out = self.engine.peek_new_output(rid, start)
            text = seq.text.update(seq.token_ids, out.finish_reason, out.stop_reason)
            new_ids = out.token_ids
            seq.num_tokens_sent = len(seq.token_ids)
            num_generated += len(new_ids)
            if out.finished:
                del self._sequences[rid]
                final = self.engine.pop_output(rid)
                self.metrics.finish(out.finish_reason, final.time_to_first_token_s, final.latency_s,
                                    len(seq.token_ids))
            elif not text and not new_ids:
                continue
            deltas.setdefault(seq.stream, []).append(SequenceDelta(
                index=seq.index, text=text, token_ids=new_ids, logprobs=out.logprobs,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason, num_tokens=len(seq.token_ids)))
        self.metrics.add_tokens(generation=num_generated)
        self._update_load()  # before the clients hear of these tokens, so /metrics never lags them
        for stream, items in deltas.items():
            self._post(stream, items)

    def _update_load(self) -> None:
        with self._cond:
            queued = self._num_queued_sequences
        self.metrics.set_load(self.engine.load(), queued=queued)

