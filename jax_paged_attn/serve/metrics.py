"""The server's Prometheus metrics: owns the counters, histograms and the text format of
``GET /metrics``.

Written by hand (the exposition format is a few lines; no prometheus_client
dependency), with vLLM's metric names so its dashboards read them:

* gauges ``vllm:num_requests_running`` / ``_waiting`` / ``_swapped`` (engine sequences)
  and ``vllm:kv_cache_usage_perc`` (fraction of the device KV blocks held, 0..1; cached
  prefix blocks nobody holds count as free);
* counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason}``;
* histograms ``vllm:time_to_first_token_seconds``,
  ``vllm:time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``;
* ours: the counter ``jax_paged_attn:xla_compilations_total``, programs the engine's
  process handed to XLA since the engine loop started (after the warm-up;
  `jax_paged_attn.engine.stats.backend_compiles`, JAX's own events, as the engine loop
  reports them): 0 while every request runs on the programs the warm-up compiled or
  loaded; anything else is a request that waited for a compiler.

Every metric carries the label ``model_name``. Updated from the engine core's thread,
read from the server's: one lock.
"""
from __future__ import annotations

import bisect
import collections
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class ServerMetrics:
    """The metrics of one served model (see the module docstring)."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self._lock = threading.Lock()
        self.gauges = {"running": 0, "waiting": 0, "swapped": 0, "kv_cache_usage": 0.0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.tpot = _Histogram(TPOT_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.compiles = 0

    def set_load(self, running: int, waiting: int, swapped: int, kv_cache_usage: float, compiles: int) -> None:
        """The engine's queues (sequences on their way to it counted as waiting), the
        share of its KV-cache blocks held (`LLMEngine.load`) and its compilations since
        the engine loop started."""
        with self._lock:
            self.gauges.update(running=running, waiting=waiting, swapped=swapped, kv_cache_usage=kv_cache_usage)
            self.compiles = compiles

    def add_tokens(self, *, prompt: int = 0, generation: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generation

    def finish(self, reason: str, ttft_s: float | None, latency_s: float, num_output_tokens: int) -> None:
        """Records a finished sequence: its reason and, when it produced a token, its
        time to first token, time per output token after the first, and latency."""
        with self._lock:
            self.finished[reason] += 1
            self.latency.observe(latency_s)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
                if num_output_tokens > 1:
                    self.tpot.observe((latency_s - ttft_s) / (num_output_tokens - 1))

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for suffix, extra, value in samples:
                labels = self.labels + (f",{extra}" if extra else "")
                lines.append(f"{name}{suffix}{{{labels}}} {_number(value)}")

        def histogram(name: str, help_text: str, h: _Histogram) -> None:
            cumulative, samples = 0, []
            for bound, count in zip(h.buckets, h.counts):
                cumulative += count
                samples.append(("_bucket", f'le="{_number(float(bound))}"', cumulative))
            total = cumulative + h.counts[-1]
            samples += [("_bucket", 'le="+Inf"', total), ("_count", "", total), ("_sum", "", h.sum)]
            metric(name, "histogram", help_text, samples)

        with self._lock:
            g = dict(self.gauges)
            metric("vllm:num_requests_running", "gauge", "Sequences in the engine's running batch.",
                   [("", "", g["running"])])
            metric("vllm:num_requests_waiting", "gauge", "Sequences waiting for admission (engine queue and "
                   "requests not yet handed to it).", [("", "", g["waiting"])])
            metric("vllm:num_requests_swapped", "gauge", "Sequences preempted to host memory.",
                   [("", "", g["swapped"])])
            metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of the device KV-cache blocks held (0..1).",
                   [("", "", float(g["kv_cache_usage"]))])
            metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of admitted sequences.",
                   [("", "", self.prompt_tokens)])
            metric("vllm:generation_tokens_total", "counter", "Generated tokens.", [("", "", self.generation_tokens)])
            metric("vllm:request_success_total", "counter", "Finished sequences by finish reason.",
                   [("", f'finished_reason="{_escape(r)}"', c) for r, c in sorted(self.finished.items())])
            histogram("vllm:time_to_first_token_seconds", "Time to first token (from admission).", self.ttft)
            histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.", self.tpot)
            histogram("vllm:e2e_request_latency_seconds", "Latency from admission to the last token.", self.latency)
        metric("jax_paged_attn:xla_compilations_total", "counter", "XLA compilations since the server started "
               "serving (0: every request ran on the warm-up's programs).",
               [("", "", self.compiles)])
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
