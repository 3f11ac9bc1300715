"""The engine process's start: spawned before the server's process imports JAX.

`spawn` starts a fresh interpreter (multiprocessing's "spawn": no JAX state and no
threads inherited) whose first work is importing the engine (JAX, Flax, the models:
about two seconds) while the server's process checks its flags, imports the HTTP stack and
reads the tokenizer; it then waits on its pipe for the model and options to load
(`EngineProcess.start`, one JSON message) or for the pipe's end (`EngineProcess.cancel`:
the flags were refused, or ``--help``). This module imports only the standard library,
so spawning costs the server's process nothing it would not pay anyway; the engine loop
itself is `jax_paged_attn.serve.engine_core.run_engine_process`.
"""
from __future__ import annotations

import json
import multiprocessing
import signal
from typing import Any


def encode(value: Any) -> bytes:
    """A pipe message: JSON, never a pickle (`jax_paged_attn.serve.engine_core`)."""
    return json.dumps(value, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    return json.loads(data)


class EngineProcess:
    """An engine process spawned early (module docstring), and the server's end of its pipe."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=engine_process_main, args=(child,), name="llm-engine-core",
                                       daemon=True)
        self.process.start()
        child.close()
        self.started = False

    def start(self, model_dir: str, llm_options: dict[str, Any], warmup: bool, log_level: str) -> None:
        """Tells the process what to load (``llm_options``: `LLM`'s keyword arguments, JSON
        values) and whether to warm up; it answers "ready" or "error" on the pipe."""
        self.conn.send_bytes(encode(["start", dict(model_dir=model_dir, llm_options=llm_options,
                                                    warmup=warmup, log_level=log_level)]))
        self.started = True

    def cancel(self) -> None:
        """Ends a process that was never started. It holds nothing yet (it has only imported
        modules; JAX initializes no device on import), so it is killed, not waited for."""
        self.conn.close()
        self.process.kill()
        self.process.join()


def engine_process_main(conn: Any) -> None:
    """The engine process: imports the engine, waits for "start", then runs the engine
    loop (`jax_paged_attn.serve.engine_core.run_engine_process`) until told to stop."""
    # The server's process decides when this one stops ("stop", or the pipe's end): a
    # Ctrl-C or a SIGTERM sent to the process group must not end it before the server's
    # graceful shutdown has finished the running requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from jax_paged_attn.serve import engine_core  # the engine's imports, while the server's process starts

    try:
        kind, start = decode(conn.recv_bytes())
    except (EOFError, OSError):
        return  # cancelled
    if kind != "start":
        return
    engine_core.run_engine_process(conn, **start)
