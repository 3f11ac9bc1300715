"""What the engine benchmarks (`bench_engine.py`, `bench_serving.py`) share: the count of
XLA compilations, ``--engine-option`` parsing into an `EngineConfig`, and the warm-up.

Compilations are counted from JAX's own monitoring events: every program JAX hands to
XLA records ``/jax/core/compile/backend_compile_duration`` (also when the persistent
compilation cache serves the executable: that is counted apart, from
``/jax/compilation_cache/cache_hits``). The listeners are registered once per process,
when this module is first imported, and count every compilation in the process: the
engine's programs, and any eager op or helper program a step would run for the first
time.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import threading
import time
from typing import Any, Mapping, Sequence

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PERSISTENT_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_totals = {"compiles": 0, "compile_s": 0.0, "cache_hits": 0}


def _on_duration(event: str, duration_s: float, **kwargs: Any) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _totals["compiles"] += 1
            _totals["compile_s"] += duration_s


def _on_event(event: str, **kwargs: Any) -> None:
    if event == PERSISTENT_CACHE_HIT_EVENT:
        with _lock:
            _totals["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


class CompileCounter:
    """XLA compilations in the process since this counter was made (or `restart`ed).

    ``count``: programs handed to XLA (compiled, or loaded from the persistent cache);
    ``seconds``: the time JAX spent on them; ``cache_hits``: those the persistent
    compilation cache served.
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        with _lock:
            self._base = dict(_totals)

    def _since(self, key: str) -> Any:
        with _lock:
            return _totals[key] - self._base[key]

    @property
    def count(self) -> int:
        return self._since("compiles")

    @property
    def seconds(self) -> float:
        return self._since("compile_s")

    @property
    def cache_hits(self) -> int:
        return self._since("cache_hits")


# --------------------------------------------------------------------------- options


def parse_value(text: str) -> Any:
    """One option value: ``true`` / ``false`` (any case) as bools, a Python literal (int,
    float, None, tuple such as ``16,64,256``) as itself, anything else as the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_options(text: str) -> dict[str, Any]:
    """``"NAME=VALUE,..."`` -> a dict of `parse_value`'d values (no value may hold a comma)."""
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        options[key] = parse_value(value)
    return options


def add_decode_run_arguments(parser: argparse.ArgumentParser, *, quick_prompt_len: int,
                             quick_new_tokens: int) -> None:
    """The options of a decode-throughput run that `bench_engine.py` and `bench_tp.py`
    share: prompt length, new tokens, block size, prompt tokens a step, steps a decode
    window and ``--engine-option`` (parsed by `parse_engine_options`)."""
    parser.add_argument("--prompt-len", type=int, default=None, help=f"default 128 (--quick: {quick_prompt_len})")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help=f"N, at least 2; default 128 (--quick: {quick_new_tokens})")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-scheduler-steps", type=int, default=16, help="decode steps per decode window")
    parser.add_argument("--engine-option", action="append", default=[], metavar="FIELD=VALUE",
                        help="set an EngineConfig field (repeatable; overrides the options above)")


def parse_engine_options(items: Sequence[str] | None) -> dict[str, Any]:
    """Repeated ``--engine-option FIELD=VALUE`` -> ``{FIELD: value}`` (`parse_value`; a
    value may hold commas: ``batch_buckets=16,64,256``). Unknown `EngineConfig` fields
    raise ValueError naming them."""
    from jax_paged_attn.engine import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    options: dict[str, Any] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--engine-option {item!r}: expected FIELD=VALUE.")
        if name not in fields:
            raise ValueError(f"--engine-option {item!r}: EngineConfig has no field {name!r} "
                             f"(fields: {', '.join(sorted(fields))}).")
        options[name] = parse_value(value)
    return options


def engine_config(defaults: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    """An `EngineConfig` from the benchmark's ``defaults`` overridden by the user's
    ``options`` (`parse_engine_options`). A default naming a field this `EngineConfig`
    does not have is left out, and said on stdout."""
    from jax_paged_attn.engine import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    dropped = sorted(set(defaults) - fields)
    if dropped:
        print(f"EngineConfig has no field {', '.join(dropped)}: the benchmark's "
              f"{', '.join(f'{k}={defaults[k]!r}' for k in dropped)} not applied")
    merged = {k: v for k, v in defaults.items() if k in fields}
    merged.update(options)
    return EngineConfig(**merged)


# --------------------------------------------------------------------------- warm-up


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """How an engine was warmed up: ``how`` (``engine.warmup()`` or the fallback run),
    its wall time and the compilations it made (`CompileCounter`)."""

    how: str
    seconds: float
    compiles: int
    compile_s: float

    def describe(self) -> str:
        return (f"warm-up by {self.how}: {self.seconds:.1f} s, {self.compiles} XLA compilations "
                f"({self.compile_s:.1f} s)")


def warm_up(engine: Any, fallback: Any, fallback_name: str, *, whole_engine: bool = True) -> WarmUp:
    """``engine.warmup()`` where the engine has it and ``whole_engine`` (it compiles
    every program its configuration can reach), else ``fallback()`` (an untimed run of
    the benchmark's own requests: only the programs they reach), timed and counted."""
    counter = CompileCounter()
    start = time.perf_counter()
    if whole_engine and hasattr(engine, "warmup"):
        engine.warmup()
        how = "engine.warmup()"
    else:
        fallback()
        why = "only the programs the benchmark's requests reach" if not whole_engine else \
            "this LLMEngine has no warmup()"
        how = f"{fallback_name} ({why})"
    return WarmUp(how, time.perf_counter() - start, counter.count, counter.seconds)
