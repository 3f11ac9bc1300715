"""`EngineLoop`: the engine's side of the server: owns one `LLMEngine`'s requests as the
server's streams see them, their text, and what each step sends back.

One caller drives it (`jax_paged_attn.serve.engine_core`: a thread of the server's
process, or an engine process of its own): `add` and `abort` between steps, then `step`,
which runs `LLMEngine.step` and reads every sequence's new tokens. Their text is decoded
here (`SequenceText`: incremental decoding, stop strings, which end a sequence through
`LLMEngine.stop_request` at once); a step's output leaves as one list of events
(`emit`): the new deltas of every stream, the sequences that finished (for the metrics),
the token counts and the engine's load, so a caller in another process sends one message
a step.

Running requests' new tokens come from `LLMEngine.peek_new_output` (`step` returns
finished requests only): after each step only what each sequence produced since the last
is copied, and a waiting one costs a lookup, so the work a step grows with the tokens
produced, not with the tokens held. The front end uses the engine's public API alone.

Events (tuples, the first item their kind):

* ``("added", stream_id, error)``: the stream's sequences are in the engine (``error``
  None) or were refused: ``(exception type name, message)``, the engine's ValueError or
  TypeError naming the argument;
* ``("deltas", {stream_id: [SequenceDelta, ...]})``: what each stream's sequences
  produced in the step;
* ``("failed", stream_id, reason)``: the stream's sequences are gone: "engine" (a step
  raised; its requests were aborted) or "shutdown";
* ``("tokens", prompt, generated)``, ``("finished", reason, ttft_s, latency_s,
  num_tokens)`` and ``("load", running, waiting, swapped, kv_cache_usage, compiles)``
  (XLA compilations in the engine's process since this loop was made): the metrics.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable

from jax_paged_attn.engine import Logprob, SamplingParams
from jax_paged_attn.engine.stats import backend_compiles
from jax_paged_attn.serve.detokenizer import SequenceText

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from jax_paged_attn.engine import LLMEngine

logger = logging.getLogger(__name__)

Event = tuple
"""One of the module docstring's events."""


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
    """State of one engine request (one sequence of a stream)."""

    stream_id: str
    index: int
    text: SequenceText
    token_ids: list[int] = dataclasses.field(default_factory=list)  # output ids read so far
    num_tokens_sent: int = 0


class EngineLoop:
    """The engine side of the server (see the module docstring).

    Args:
      engine: the `LLMEngine`; only this object calls it.
      tokenizer: the checkpoint's tokenizer (the text of every sequence).
      emit: called with each step's (or `add`'s, `abort`'s) list of events.
    """

    def __init__(self, engine: "LLMEngine", tokenizer: "Tokenizer", emit: Callable[[list[Event]], None]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.emit = emit
        self._sequences: dict[str, _Sequence] = {}  # engine request id -> its state
        self._streams: dict[str, list[str]] = {}  # stream id -> its engine request ids
        self._compiles_at_start = backend_compiles()  # made after the warm-up

    @property
    def has_sequences(self) -> bool:
        return bool(self._sequences)

    def load_event(self) -> Event:
        load = self.engine.load()
        return ("load", load.num_running, load.num_waiting, load.num_swapped, load.kv_cache_usage,
                backend_compiles() - self._compiles_at_start)

    def add(self, stream_id: str, prompt_token_ids: list[list[int]], params: SamplingParams) -> None:
        """Adds a stream's sequences (each prompt sampled ``params.n`` times); emits
        "added" (with the engine's error, and nothing left in the engine, when it refuses)."""
        # The engine takes one sequence per request and no stop strings (the text is
        # checked here); sample j of a seeded request draws with seed + j, as
        # `LLMEngine.generate` does.
        one = dataclasses.replace(params, n=1, stop=())
        rids = self._streams[stream_id] = []
        try:
            for i, prompt in enumerate(prompt_token_ids):
                for j in range(params.n):
                    seed = None if one.seed is None else (one.seed + j) % 2**32
                    rid = f"{stream_id}-{i}-{j}"
                    self.engine.add_request(prompt, dataclasses.replace(one, seed=seed), request_id=rid)
                    rids.append(rid)
                    text = SequenceText(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                        params.skip_special_tokens, params.min_tokens)
                    self._sequences[rid] = _Sequence(stream_id, i * params.n + j, text)
        except (ValueError, TypeError) as e:
            self._drop_stream(stream_id, count=False)
            self.emit([("added", stream_id, (type(e).__name__, str(e))), self.load_event()])
            return
        self.emit([("added", stream_id, None), ("tokens", params.n * sum(map(len, prompt_token_ids)), 0),
                   self.load_event()])

    def abort(self, stream_id: str) -> None:
        """Removes a stream's unfinished sequences (their blocks freed now)."""
        events = self._drop_stream(stream_id)
        self.emit([*events, self.load_event()])

    def abort_all(self, reason: str) -> None:
        """Removes every stream, each told ("failed", id, ``reason``)."""
        events = []
        for stream_id in list(self._streams):
            events += [*self._drop_stream(stream_id), ("failed", stream_id, reason)]
        self.emit([*events, self.load_event()])

    def step(self) -> None:
        """One engine step (when it has work), then every stream's new deltas."""
        events: list[Event] = []
        if self.engine.has_unfinished_requests():
            try:
                self.engine.step()
            except Exception:
                logger.exception("serve: LLMEngine.step failed; its requests are aborted")
                failed = {seq.stream_id for rid, seq in self._sequences.items()
                          if self.engine.peek_output(rid).outputs[0].finish_reason == "abort"}
                for stream_id in failed:
                    events += [*self._drop_stream(stream_id), ("failed", stream_id, "engine")]
        collected, deltas = self._collect()
        # The metrics before the deltas, so /metrics never lags what a client has read.
        events += [*collected, self.load_event()]
        if deltas:
            events.append(("deltas", deltas))
        self.emit(events)

    def _drop_stream(self, stream_id: str, count: bool = True) -> list[Event]:
        """Aborts and forgets a stream's engine requests; their "finished" events (as
        "abort") unless ``count`` is False (a refused add)."""
        events = []
        for rid in self._streams.pop(stream_id, ()):
            if self._sequences.pop(rid, None) is None:
                continue  # finished already
            self.engine.abort_request(rid)
            final = self.engine.pop_output(rid)
            if count:
                events.append(("finished", "abort", final.time_to_first_token_s, final.latency_s,
                               len(final.outputs[0].token_ids)))
        return events

    def _collect(self) -> tuple[list[Event], dict[str, list[SequenceDelta]]]:
        """Every sequence's new tokens and text as deltas; ends sequences whose text
        reached a stop string; pops finished ones."""
        deltas: dict[str, list[SequenceDelta]] = {}
        events: list[Event] = []
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
            seq.num_tokens_sent = len(seq.token_ids)
            num_generated += len(out.token_ids)
            if out.finished:
                del self._sequences[rid]
                rids = self._streams.get(seq.stream_id)
                if rids is not None and all(r not in self._sequences for r in rids):
                    del self._streams[seq.stream_id]
                final = self.engine.pop_output(rid)
                events.append(("finished", out.finish_reason, final.time_to_first_token_s, final.latency_s,
                               len(seq.token_ids)))
            elif not text and not out.token_ids:
                continue
            deltas.setdefault(seq.stream_id, []).append(SequenceDelta(
                index=seq.index, text=text, token_ids=out.token_ids, logprobs=out.logprobs,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason, num_tokens=len(seq.token_ids)))
        if num_generated:
            events.append(("tokens", 0, num_generated))
        return events, deltas
