"""The engine's counters: `EngineStats`, the step-by-step `StatsRecorder` that keeps
them, the process's compilation counts (`jax.monitoring` listeners) that tell a
compiling step from a serving one, and `generate`'s `ProgressBar`.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import jax

from jax_paged_attn.engine.request import SchedulerOutput
from jax_paged_attn.engine.scheduler import Scheduler

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"  # JAX's tracing, lowering and XLA compilation events
_compile_events = 0
_compile_events_lock = threading.Lock()


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation or cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_backend_compiles = 0
_cache_hits = 0


def _on_jax_event(event: str, duration_s: float, **kwargs: Any) -> None:
    global _compile_events, _backend_compiles
    if event.startswith(_COMPILE_EVENT_PREFIX):
        with _compile_events_lock:
            _compile_events += 1
            _backend_compiles += event == _BACKEND_COMPILE_EVENT


def _on_jax_count(event: str, **kwargs: Any) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        with _compile_events_lock:
            _cache_hits += 1


jax.monitoring.register_event_listener(_on_jax_count)
# Counts every compilation in the process, not only the runner's programs: a step that
# first swaps or copies blocks (or allocates the host swap space) compiles those
# programs too, and its time must not count as serving time.
jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine was built (or `LLMEngine.reset_stats`).

    Throughput attribution: a step that contains any prefill chunk counts as a prefill
    step (its time and prefill tokens); a step with only decodes counts as a decode
    step (its time and one token per request). Steps in which anything compiled (a
    model program, or a swap / copy-on-write program, the host swap space's allocation:
    any JAX compilation in the process, seen through `jax.monitoring`) are kept apart
    (``compile_steps``, ``compile_time_s``, their tokens in ``num_generated_tokens``
    only) so compilation does not distort the rates. ``num_compiled_programs`` counts
    the model programs (step and decode window) only. ``num_decode_batches``: persistent
    batches uploaded (each after reading every window in flight);
    ``num_inserted_rows``: requests put into a running batch's free rows instead;
    ``num_mixed_steps``: steps that ran prompt chunks and a decode step of the batch's
    rows in one program (``decode_during_prefill``).
    """

    num_steps: int = 0
    num_prefill_tokens: int = 0
    prefill_time_s: float = 0.0
    num_decode_tokens: int = 0
    decode_time_s: float = 0.0
    num_generated_tokens: int = 0
    num_compiled_programs: int = 0
    compile_steps: int = 0
    compile_time_s: float = 0.0
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_recomputed_requests: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_copied_blocks: int = 0
    num_decode_batches: int = 0
    num_inserted_rows: int = 0
    num_mixed_steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prefill_tokens / self.prefill_time_s if self.prefill_time_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_time_s if self.decode_time_s else 0.0

    def summary(self) -> str:
        def rate(tokens: int, per_s: float) -> str:
            return f"{tokens} tokens, {per_s:,.1f} tok/s" if tokens else "n/a (only in compiling steps)"

        return (
            f"prefill: {rate(self.num_prefill_tokens, self.prefill_tokens_per_s)} | "
            f"decode: {rate(self.num_decode_tokens, self.decode_tokens_per_s)} | "
            f"{self.num_steps} steps, {self.num_compiled_programs} programs compiled "
            f"({self.compile_time_s:.1f} s in {self.compile_steps} compiling steps), "
            f"{self.num_preemptions} preemptions, {self.num_prefix_cache_hit_tokens} prefix-cached tokens"
        )


class ProgressBar:
    """A tqdm bar over requests, updated every step with the tokens so far and tokens/s
    over the steps that compiled nothing (a compilation stall is shown as such, not
    averaged into the rate)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.tokens = 0
        self.serving_tokens = 0  # generated in steps that compiled nothing ...
        self.serving_time_s = 0.0  # ... and those steps' time
        self.compile_time_s = 0.0
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="req", file=sys.stderr)

    def update(self, finished: int, tokens: int, elapsed_s: float, *, compiled: bool) -> None:
        self.tokens += tokens
        if compiled:
            self.compile_time_s += elapsed_s
        else:
            self.serving_tokens += tokens
            self.serving_time_s += elapsed_s
        if self.bar is None:
            return
        rate = self.serving_tokens / self.serving_time_s if self.serving_time_s else 0.0
        text = f"{self.tokens} tokens, {rate:,.0f} tok/s"
        if self.compile_time_s:
            text += f", compiling {self.compile_time_s:.1f} s" + (" (now)" if compiled else "")
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(finished)
        if not finished:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()



def compile_events() -> int:
    """JAX compilation events (tracing, lowering, XLA compilation) in the process so far."""
    return _compile_events


def backend_compiles() -> int:
    """XLA compilations in the process so far, cache loads included (`WarmupReport`)."""
    return _backend_compiles


def cache_hits() -> int:
    """Executables loaded from JAX's persistent compilation cache in the process so far."""
    return _cache_hits


class StatsRecorder:
    """Keeps an engine's `EngineStats` step by step: the step's time, tokens and
    compilations, and the scheduler's counters since the last reset."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.num_traces = 0  # model programs compiled for the engine (`LLMEngine.num_compiled_programs`)
        self.compile_events_before = _compile_events
        self.stats = EngineStats()
        self._base = self._scheduler_counts()

    def start_step(self) -> None:
        """Marks a step's start: a compilation from here on makes it a compiling step."""
        self.compile_events_before = _compile_events  # see `record`

    def reset(self) -> None:
        """Zeroes every counter (keeps the compiled-program count)."""
        self.stats = EngineStats(num_compiled_programs=self.num_traces)
        self._base = self._scheduler_counts()

    def _scheduler_counts(self) -> dict[str, int]:
        s = self.scheduler
        return dict(num_preemptions=s.num_preemptions, num_swapped_out_blocks=s.num_swapped_out_blocks,
                    num_recomputed_requests=s.num_recomputed_requests,
                    num_prefix_cache_hit_tokens=s.num_prefix_cache_hit_tokens)

    def record(self, out: SchedulerOutput | None, num_sampled: int, elapsed: float, compiled: int) -> None:
        """Updates the stats after a step (``out`` None: a decode window)."""
        s = self.stats
        self.num_traces += compiled
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_compiled_programs = self.num_traces
        for name, value in self._scheduler_counts().items():
            setattr(s, name, value - self._base[name])
        # Not only the runner's programs: the step's block moves may have compiled.
        if compiled or _compile_events != self.compile_events_before:
            s.compile_steps += 1
            s.compile_time_s += elapsed
        elif out is not None and out.num_prefills:
            s.num_prefill_tokens += sum(i.num_new_tokens for i in out.scheduled if i.is_prefill)
            s.prefill_time_s += elapsed
        else:
            s.num_decode_tokens += num_sampled
            s.decode_time_s += elapsed
