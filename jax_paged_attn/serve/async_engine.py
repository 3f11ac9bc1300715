"""`AsyncEngine`: the asynchronous front end of the server: owns admission, the
per-request streams of deltas (new tokens and text), aborts and shutdown, over an engine
core (`jax_paged_attn.serve.engine_core`: the engine loop in a thread of this process, or
in an engine process of its own) whose events it turns into stream items and metrics.

The event loop's side: `generate` admits a request and returns its `RequestStream` once
the core has added its sequences (or raises the engine's ValueError / TypeError naming
the argument); a stream yields one list of `SequenceDelta` per engine step that produced
anything, and ends after every sequence's last delta. The core's side arrives on the
core's thread (`_on_events`): metrics are applied there (`ServerMetrics` has its own
lock), stream items are handed to the event loop (``call_soon_threadsafe``).

Admission: a request of ``k`` sequences (prompts × ``n``) is refused with a 503 and
``Retry-After`` when the sequences in the engine (running or waiting, or on their way to
it) would exceed ``max_num_seqs + max_waiting_requests``: the queue is bounded, the
server's memory too. A request whose client goes away is aborted (`RequestStream.abort`):
its sequences leave the engine with their KV blocks at the next step boundary.

Engine failure: when a step raises, the engine aborts the requests it had running; their
streams get `EngineError` (the server answers 500 with a generic message, the cause stays
in the log). Requests that only waited go on. An engine process that exits fails every
stream the same way, and the server stops accepting requests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any

from jax_paged_attn.engine import SamplingParams
from jax_paged_attn.serve.engine_core import ThreadCore
from jax_paged_attn.serve.engine_loop import Event, SequenceDelta
from jax_paged_attn.serve.metrics import ServerMetrics
from jax_paged_attn.serve.protocol import ApiError

if TYPE_CHECKING:
    from jax_paged_attn.engine import LLM
    from jax_paged_attn.serve.engine_core import ProcessCore

__all__ = ["AsyncEngine", "EngineError", "RequestAborted", "RequestStream", "SequenceDelta"]

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 for a full queue: about a few decode windows."""


class EngineError(RuntimeError):
    """The engine failed while running this request (the cause is in the server log)."""


class RequestAborted(Exception):
    """The request was aborted (its client went away, or the server shut down)."""


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
        """Called on the event loop (from the core's thread through ``call_soon_threadsafe``)."""
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Aborts the request's unfinished sequences (freeing their KV blocks at the
        engine's next step boundary); a no-op once the stream has ended. The iterator
        then raises `RequestAborted`."""
        if self.closed:
            return
        self._close()
        self._queue.put_nowait(RequestAborted(self.request_id))
        self.front.core.abort(self.request_id)

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.front._num_sequences -= self.num_sequences
            self.front._streams.pop(self.request_id, None)


class AsyncEngine:
    """Serves an engine to many asyncio tasks (see the module docstring).

    Args:
      llm: an `LLM` with a tokenizer, served by a `ThreadCore` (None with ``core``).
      model_name: the served model name (the metrics' label).
      max_waiting_requests: sequences allowed to wait beyond ``max_num_seqs``.
      core: the engine core (a `ProcessCore`); default a `ThreadCore` over ``llm``.
    """

    def __init__(self, llm: "LLM | None" = None, *, model_name: str, max_waiting_requests: int,
                 core: "ThreadCore | ProcessCore | None" = None) -> None:
        if core is None:
            if llm is None:
                raise ValueError("AsyncEngine needs an llm or a core.")
            core = ThreadCore(llm)
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.vocab_size
        self.capacity = core.max_num_seqs + max_waiting_requests
        self.metrics = ServerMetrics(model_name)
        self.accepting = True
        self._num_sequences = 0  # admitted and not finished (event-loop side)
        self._streams: dict[str, RequestStream] = {}  # event-loop side
        self._added: dict[str, tuple[RequestStream, concurrent.futures.Future[None]]] = {}
        self._lock = threading.Lock()
        self._num_on_the_way = 0  # sequences submitted, not yet added by the core (under _lock)
        self._load = (0, 0, 0, 0.0, 0)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Starts the core; call on the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self.core.start(self._on_events)

    async def stop(self) -> None:
        """Aborts what still runs (their streams get `RequestAborted`) and stops the core."""
        self.accepting = False
        await asyncio.to_thread(self.core.stop)

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
        self._streams[stream.request_id] = stream
        with self._lock:
            self._added[stream.request_id] = (stream, added)
            self._num_on_the_way += stream.num_sequences
        self.core.add(stream.request_id, prompt_token_ids, params)
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException:
            stream._close()
            raise
        return stream

    # ------------------------------------------------------------ the core's thread
    def _on_events(self, events: list[Event]) -> None:
        """Applies a step's events (module docstring): metrics here, stream items on the loop."""
        for event in events:
            kind = event[0]
            if kind == "deltas":
                for stream_id, deltas in event[1].items():
                    self._post(stream_id, deltas)
            elif kind == "tokens":
                self.metrics.add_tokens(prompt=event[1], generation=event[2])
            elif kind == "finished":
                self.metrics.finish(*event[1:])
            elif kind == "load":
                self._load = event[1:]
                self._update_load()
            elif kind == "added":
                self._on_added(event[1], event[2])
            elif kind == "failed":
                error = EngineError("the engine failed while running this request") if event[2] == "engine" \
                    else RequestAborted("the server shut down")
                self._post(event[1], error)
            elif kind == "exited":
                self._on_core_exit(event[1])

    def _on_added(self, stream_id: str, error: tuple[str, str] | None) -> None:
        with self._lock:
            stream, future = self._added.pop(stream_id)
            self._num_on_the_way -= stream.num_sequences
        if not future.set_running_or_notify_cancel():
            return  # the client went away meanwhile: its abort follows
        if error is None:
            future.set_result(None)
        else:
            future.set_exception((TypeError if error[0] == "TypeError" else ValueError)(error[1]))
        self._update_load()

    def _on_core_exit(self, exitcode: Any) -> None:
        logger.error("serve: the engine process exited (code %s); failing every request", exitcode)
        self.accepting = False
        with self._lock:
            pending, self._added = list(self._added.values()), {}
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineError("the engine process exited"))
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fail_all_streams)

    def _fail_all_streams(self) -> None:
        for stream in list(self._streams.values()):
            stream.deliver(EngineError("the engine process exited"))

    def _post(self, stream_id: str, item: list[SequenceDelta] | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, stream_id, item)

    def _deliver(self, stream_id: str, item: list[SequenceDelta] | BaseException) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.closed:
            stream.deliver(item)

    def _update_load(self) -> None:
        with self._lock:
            on_the_way = self._num_on_the_way
        running, waiting, swapped, usage, compiles = self._load
        self.metrics.set_load(running, waiting + on_the_way, swapped, usage, compiles)
