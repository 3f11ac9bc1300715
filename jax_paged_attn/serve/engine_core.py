"""Where the server's engine runs: `ThreadCore` (a thread of the server's process) or
`ProcessCore` (an engine process of its own, vLLM V1's engine core); both drive one
`EngineLoop` and hand its events to the front end (`AsyncEngine`) through ``deliver``.

Why a process: the engine's host work for the next step (scheduling, the step's inputs,
reading the last step's tokens, their text) is on the device's critical path whenever a
step is short (a mixed prompt + decode step, a short decode window), and in one process
it shares one GIL with the HTTP server's work for every chunk it streams (JSON, the ASGI
stack, a socket write per chunk and client). In its own process the engine loop runs
beside the server on another core. The price: the model loads in the engine process
(the server's process holds only the tokenizer) and each step's events cross a pipe.

The pipe carries JSON (`jax_paged_attn.serve.engine_process`'s `encode` / `decode`, the
module that spawns the process before the server imports JAX), never pickles: the
server's process sends ``["start", {model, options}]`` once, then ``["add", stream_id,
prompts, sampling params]``, ``["abort", stream_id]`` and ``["stop"]``; the engine
process sends ``["ready", {...}]`` (or ``["error", text]``) once, then one list of
`EngineLoop` events per step.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from jax_paged_attn.engine import Logprob, SamplingParams
from jax_paged_attn.serve.engine_loop import EngineLoop, Event, SequenceDelta
from jax_paged_attn.serve.engine_process import EngineProcess, decode, encode

if TYPE_CHECKING:
    from jax_paged_attn.engine import LLM

logger = logging.getLogger(__name__)

Deliver = Callable[[list[Event]], None]


class ThreadCore:
    """The engine loop in a thread of this process, over ``llm``'s engine."""

    def __init__(self, llm: "LLM") -> None:
        if llm.tokenizer is None:
            raise ValueError("the server needs a tokenizer: the checkpoint directory has no tokenizer.json.")
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len: int = self.engine.config.max_model_len
        self.max_num_seqs: int = self.engine.config.max_num_seqs
        self.vocab_size: int = self.engine.vocab_size
        self._cond = threading.Condition()
        self._ops: list[Callable[[EngineLoop], None]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: EngineLoop | None = None

    def start(self, deliver: Deliver) -> None:
        self._loop = EngineLoop(self.engine, self.tokenizer, deliver)
        deliver([self._loop.load_event()])
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    def add(self, stream_id: str, prompt_token_ids: list[list[int]], params: SamplingParams) -> None:
        self._submit(lambda loop: loop.add(stream_id, prompt_token_ids, params))

    def abort(self, stream_id: str) -> None:
        self._submit(lambda loop: loop.abort(stream_id))

    def stop(self) -> None:
        """Aborts what runs (its streams told "shutdown") and ends the thread (blocks)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _submit(self, op: Callable[[EngineLoop], None]) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify()

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            with self._cond:
                while not self._ops and not loop.has_sequences and not self._stopping:
                    self._cond.wait()
                ops, self._ops = self._ops, []
                stopping = self._stopping
            try:
                for op in ops:
                    op(loop)
                if stopping:
                    loop.abort_all("shutdown")
                    return
                loop.step()
            except Exception:  # a bug of this front end: fail what runs rather than hang every client
                logger.exception("serve: the engine loop failed; aborting every request")
                loop.abort_all("engine")


class ProcessCore:
    """The engine loop in an engine process of its own (module docstring), which loads
    ``model_dir`` with `LLM` (``llm_options``: its keyword arguments, JSON values) and
    warms it up (unless ``warmup`` is False). The server's process loads only the
    tokenizer.

    ``process``: an `jax_paged_attn.serve.engine_process.EngineProcess` spawned earlier
    (the server spawns it before importing JAX), else one is spawned here; either way it
    is told to start now, and `wait_ready` waits until it is ready (RuntimeError, with
    the engine process's error, when it fails to start), so the server's own start-up
    (its imports, the chat template) runs meanwhile."""

    def __init__(self, model_dir: str, llm_options: dict[str, Any], *, warmup: bool = True,
                 log_level: str = "INFO", process: EngineProcess | None = None) -> None:
        spawned = process if process is not None else EngineProcess()
        self._conn, self.process = spawned.conn, spawned.process
        self.model_dir = model_dir
        spawned.start(model_dir, llm_options, warmup, log_level)

    def wait_ready(self) -> None:
        """Waits for the engine process to load and warm up, and loads the tokenizer
        meanwhile; RuntimeError, with the engine process's error, when it fails to start."""
        from jax_paged_attn.engine.llm import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_dir)
        try:
            kind, info = decode(self._conn.recv_bytes())
        except EOFError:
            self.process.join(timeout=10)
            raise RuntimeError(f"the engine process exited with {self.process.exitcode} before it was ready "
                               f"(its log says why)") from None
        if kind != "ready":
            self.process.join(timeout=10)
            raise RuntimeError(f"the engine process failed to start: {info}")
        self.max_model_len: int = info["max_model_len"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.vocab_size: int = info["vocab_size"]
        self.warmup_report: str | None = info["warmup"]
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None

    def start(self, deliver: Deliver) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(deliver,), name="llm-engine-receiver",
                                          daemon=True)
        self._receiver.start()

    def add(self, stream_id: str, prompt_token_ids: list[list[int]], params: SamplingParams) -> None:
        self._send(["add", stream_id, prompt_token_ids, params_to_json(params)])

    def abort(self, stream_id: str) -> None:
        self._send(["abort", stream_id])

    def stop(self) -> None:
        """Asks the engine process to abort what runs and exit; waits for it (blocks)."""
        try:
            self._send(["stop"])
        except OSError:
            pass  # gone already
        if self._receiver is not None:
            self._receiver.join()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()

    def _send(self, message: list[Any]) -> None:
        with self._send_lock:
            self._conn.send_bytes(encode(message))

    def _receive(self, deliver: Deliver) -> None:
        while True:
            try:
                events = decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                deliver([("exited", self.process.exitcode)])
                return
            deliver([_event_from_json(e) for e in events])
            if events and events[-1][0] == "stopped":
                return


# ------------------------------------------------------------------ the engine process
def run_engine_process(conn: Any, model_dir: str, llm_options: dict[str, Any], warmup: bool,
                       log_level: str) -> None:
    """The engine process's work once told to start (`jax_paged_attn.serve.engine_process`):
    loads the model, warms it up, says "ready", then applies the server's messages between
    steps and sends each step's events."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    from jax_paged_attn.engine import LLM

    try:
        llm = LLM(model=model_dir, warmup=False, **llm_options)
        report = llm.engine.warmup(use_tqdm=False) if warmup else None
    except Exception as e:  # noqa: BLE001 - said to the server, which exits with it
        logger.exception("serve: the engine process failed to start")
        conn.send_bytes(encode(["error", f"{type(e).__name__}: {e}"]))
        return
    engine = llm.engine
    conn.send_bytes(encode(["ready", dict(max_model_len=engine.config.max_model_len,
                                          max_num_seqs=engine.config.max_num_seqs, vocab_size=engine.vocab_size,
                                          warmup=None if report is None else str(report))]))

    def emit(events: list[Event]) -> None:
        conn.send_bytes(encode([_event_to_json(e) for e in events]))

    loop = EngineLoop(engine, llm.tokenizer, emit)
    emit([loop.load_event()])
    while True:
        try:
            while conn.poll(0 if loop.has_sequences else None):
                message = decode(conn.recv_bytes())
                if message[0] == "add":
                    loop.add(message[1], message[2], params_from_json(message[3]))
                elif message[0] == "abort":
                    loop.abort(message[1])
                elif message[0] == "stop":
                    loop.abort_all("shutdown")
                    conn.send_bytes(encode([["stopped"]]))
                    return
            loop.step()
        except (EOFError, OSError):
            return  # the server's process is gone
        except Exception:  # a bug of this front end: fail what runs rather than hang every client
            logger.exception("serve: the engine loop failed; aborting every request")
            loop.abort_all("engine")


# ------------------------------------------------------------------ the pipe's JSON
def params_to_json(params: SamplingParams) -> dict[str, Any]:
    fields = dataclasses.asdict(params)
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = [[int(k), float(v)] for k, v in fields["logit_bias"].items()]
    return fields


def params_from_json(fields: dict[str, Any]) -> SamplingParams:
    fields = dict(fields)
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"]}
    for name in ("stop_token_ids", "stop"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])
    return SamplingParams(**fields)


def _delta_to_json(d: SequenceDelta) -> list[Any]:
    logprobs = None if d.logprobs is None else [
        [[token, lp.logprob, lp.rank, lp.decoded_token] for token, lp in entry.items()] for entry in d.logprobs]
    return [d.index, d.text, d.token_ids, logprobs, d.finish_reason, d.stop_reason, d.num_tokens]


def _delta_from_json(v: list[Any]) -> SequenceDelta:
    logprobs = None if v[3] is None else [
        {token: Logprob(logprob, rank, text) for token, logprob, rank, text in entry} for entry in v[3]]
    return SequenceDelta(index=v[0], text=v[1], token_ids=v[2], logprobs=logprobs, finish_reason=v[4],
                         stop_reason=v[5], num_tokens=v[6])


def _event_to_json(event: Event) -> list[Any]:
    if event[0] == "deltas":
        return ["deltas", {sid: [_delta_to_json(d) for d in ds] for sid, ds in event[1].items()}]
    return list(event)


def _event_from_json(value: list[Any]) -> Event:
    if value[0] == "deltas":
        return ("deltas", {sid: [_delta_from_json(d) for d in ds] for sid, ds in value[1].items()})
    if value[0] == "added" and value[2] is not None:
        return ("added", value[1], tuple(value[2]))
    return tuple(value)
