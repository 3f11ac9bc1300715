#!/usr/bin/env python3
"""Serving benchmark of `LLMEngine`, after vLLM's ``benchmark_serving``: a mixed-length
workload submitted at once and arriving at Poisson rates, and the engine's start-up time
with a cold and a warm persistent compilation cache.

    python benchmarks/bench_serving.py [--num-requests 1000] [--rates 8,16,32,64,inf]
                                       [--max-num-seqs 256] [--max-num-batched-tokens 8192]
                                       [--num-scheduler-steps 16] [--block-size 16]
                                       [--engine-option FIELD=VALUE ...] [--no-parts]
                                       [--implementation auto] [--decode-config ...] [--profile DIR]
                                       [--quick]
    python benchmarks/bench_serving.py --startup [--quick] [--engine-option FIELD=VALUE ...]

Model: `bench_engine.py`'s (the random-weight 1.1B Llama in bfloat16; ``--quick``: the
tiny float32 config with a small workload, a CPU smoke run).

**Workload** (``--seed`` 0): ``--num-requests`` requests with prompts of uniformly drawn
lengths in ``--prompt-lens`` (32-2,048) and outputs of ``--output-lens`` (16-512) tokens,
random token ids, greedy, EOS ignored: the workload `bench_engine.py --serving` ran
until 2026-12-03 (same generator, same seed, same requests).

**Arrivals**: per ``--rates`` entry, the whole workload once, request i arriving at
``t_i``: ``inf`` submits every request at 0; a number r (requests/s) draws Poisson
arrivals (exponential gaps of mean 1/r, first request at 0; the gaps come from one seed,
so every rate replays the same pattern scaled); ``Fx`` is F times the request
throughput of the ``inf`` run (its saturation rate), e.g. ``0.5x`` for the targets' half
saturation. The ``inf`` run goes first. One loop in one thread drives the engine: it
submits every request whose arrival time has passed (`LLMEngine.add_request`), calls
`LLMEngine.step` while anything is unfinished, and spins without sleeping when idle
until the next arrival.

**Per rate**: duration (first arrival to last finish), request throughput, output tok/s,
``total tok/s`` (prompt + output tokens / duration), time to first token (TTFT) and time
per output token (TPOT = (latency - TTFT) / (output tokens - 1) per request, as vLLM)
at p50 / p90 / p99, both from the request's arrival time (a request that arrives
during a step is submitted when the step returns: that wait counts); and
``compiles after start``: XLA compilations during the timed run (JAX's monitoring
events, `engine_common.py`; should be 0).

**Sum of parts** (unless ``--no-parts``): the same engine, before the rate runs, times
two runs of the workload's first ``--max-num-seqs`` prompts submitted at once: with 1
output token (pure prefill: prefill tok/s = their prompt tokens / its wall time) and with
M = the workload's mean output length (pure decode at the saturating batch, by
`bench_engine.py`'s wall-clock difference: B * (M - 1) / (t(M) - t(1))). The estimate
``prompt tokens / prefill tok/s + (output tokens - requests) / decode tok/s`` is printed
beside each run's duration: what the workload would take if prefill and decode each ran
at its own pace, one after the other.

**Warm-up**: before the timed runs, `LLMEngine.warmup()` where the engine has it (it
compiles every program the configuration can reach), else an untimed run of the first
``max_num_seqs + 16`` requests with outputs cut to 48 tokens (enough to fill every batch
bucket and to make later prompts join a running batch).

**Start-up** (``--startup``): starts the engine (`LLMEngine` construction, which sizes
the KV cache, and the warm-up above) twice, each in its own process, with JAX's
persistent compilation cache in one fresh temporary directory: cold (empty cache), then
warm; prints both times and warm / cold, the programs each start traced and loaded from
the engine's program store (kept in the cache directory), its XLA compilations and those
JAX's cache served, and the KV cache block count (a different count would be other
programs). Where `EngineConfig` has
``compilation_cache_dir`` the directory goes there (the engine's own settings apply),
else this script sets ``jax_compilation_cache_dir`` and caches every program
(``jax_persistent_cache_min_compile_time_secs=0``,
``jax_persistent_cache_min_entry_size_bytes=-1``) and says so.

``--engine-option FIELD=VALUE`` (repeatable) sets any `EngineConfig` field over the
benchmark's (``--max-num-seqs`` etc., and: no prefix caching, coarse length bounds,
batch buckets 16 / 64 / max_num_seqs, token buckets 256 / max_num_batched_tokens, one
block-table width for ``--max-model-len``, 4,096).

**Profile** (``--profile DIR``): after the timed runs, the workload submitted at once runs
again under JAX's profiler (trace kept in DIR); prints the GPU's busy time beside the
run's wall clock, and microseconds over the run by kernel family and by kernel
(`profile_engine.py`'s summary).

Prints markdown tables.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

# Run as a script from anywhere: make the working tree's jax_paged_attn and the other
# benchmarks importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (_REPO, _REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_engine import MODELS, build_model, use_decode_config, wall_clock_decode  # noqa: E402
from engine_common import CompileCounter, engine_config, parse_engine_options, warm_up  # noqa: E402
from jax_paged_attn import matmul  # noqa: E402
from jax_paged_attn.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams  # noqa: E402

STARTUP_RESULT_PREFIX = "startup result: "


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests: ``prompts`` (token-id lists) and their ``params`` (greedy, EOS ignored)."""

    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def make_workload(num_requests: int, vocab_size: int, prompt_lens: tuple[int, int] = (32, 2048),
                  output_lens: tuple[int, int] = (16, 512), seed: int = 0) -> Workload:
    """``num_requests`` requests with uniformly drawn prompt and output lengths (both
    bounds included) and random token ids (the draws `bench_engine.py --serving` made)."""
    rng = np.random.default_rng(seed)
    prompt_sizes = rng.integers(prompt_lens[0], prompt_lens[1] + 1, size=num_requests)
    output_sizes = rng.integers(output_lens[0], output_lens[1] + 1, size=num_requests)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in prompt_sizes]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for n in output_sizes]
    return Workload(prompts, params)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """f64[num_requests] arrival times in s, ascending: all 0 for ``rate`` inf, else the
    first at 0 and exponential gaps of mean ``1 / rate`` (the same draws for every rate)."""
    if rate == float("inf"):
        return np.zeros(num_requests)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}.")
    gaps = np.random.default_rng(seed + 1).standard_exponential(num_requests) / rate
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def parse_rates(text: str) -> list[str]:
    """``--rates``: entries ``inf``, a positive number (requests/s) or ``Fx`` (F times the
    ``inf`` run's request throughput); returned in run order, ``inf`` first (added when
    an ``Fx`` entry needs it)."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise ValueError("--rates: no rate given.")
    for entry in entries:
        try:
            value = float(entry[:-1] if entry.endswith("x") else entry)
        except ValueError:
            raise ValueError(f"--rates entry {entry!r}: expected inf, a number of requests/s, or Fx.") from None
        if not value > 0:
            raise ValueError(f"--rates entry {entry!r}: must be > 0.")
    finite = [e for e in entries if e != "inf"]
    needs_inf = "inf" in entries or any(e.endswith("x") for e in entries)
    return (["inf"] if needs_inf else []) + list(dict.fromkeys(finite))


def rate_value(entry: str, saturation: float | None) -> float:
    """Requests/s of a `parse_rates` entry: ``inf``, the number, or F times ``saturation``
    (the ``inf`` run's request throughput, measured before any ``Fx`` entry runs)."""
    return float(entry[:-1]) * saturation if entry.endswith("x") else float(entry)


def percentiles(values: Sequence[float]) -> list[float]:
    """p50, p90, p99 (NaN for no values)."""
    return np.percentile(values, [50, 90, 99]).tolist() if len(values) else [float("nan")] * 3


def run_arrivals(engine: LLMEngine, workload: Workload, arrivals_s: np.ndarray, label: str,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Drives ``engine`` through ``workload`` arriving at ``arrivals_s`` (see the module
    docstring) and measures it. TTFT and latency count from the arrival time: the
    engine's figures (from `add_request`) plus how late the loop submitted the request.
    ``clock``: the engine's clock (`time.perf_counter`)."""
    num_requests = len(workload.prompts)
    late_s = np.zeros(num_requests)
    outputs: dict[int, RequestOutput] = {}
    engine.reset_stats()
    counter = CompileCounter()
    start = clock()
    submitted = 0
    while submitted < num_requests or engine.has_unfinished_requests():
        now = clock() - start
        while submitted < num_requests and arrivals_s[submitted] <= now:
            late_s[submitted] = clock() - start - arrivals_s[submitted]
            engine.add_request(workload.prompts[submitted], workload.params[submitted],
                               request_id=f"{label}-{submitted}")
            submitted += 1
        if engine.has_unfinished_requests():
            for finished in engine.step():
                index = int(finished.request_id.rsplit("-", 1)[1])
                outputs[index] = engine.pop_output(finished.request_id)
        elif submitted < num_requests:
            while clock() - start < arrivals_s[submitted]:
                pass  # idle until the next arrival: a spin, as a sleep could overshoot it
    duration = clock() - start
    compiles = counter.count
    assert len(outputs) == num_requests, (len(outputs), num_requests)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    ttft = [1e3 * (outputs[i].time_to_first_token_s + late_s[i]) for i in range(num_requests)]
    tpot = [1e3 * (o.latency_s - o.time_to_first_token_s) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs.values() if len(o.outputs[0].token_ids) > 1]
    stats = engine.stats
    return dict(requests=num_requests, duration_s=duration, last_arrival_s=float(arrivals_s[-1]),
                request_rate=num_requests / duration, output_tok_s=generated / duration,
                total_tok_s=(generated + workload.prompt_tokens) / duration, generated_tokens=generated,
                ttft_ms=percentiles(ttft), tpot_ms=percentiles(tpot), compiles_after_start=compiles,
                compile_s_after_start=counter.seconds, max_late_ms=1e3 * float(late_s.max()),
                decode_batches=getattr(stats, "num_decode_batches", None),
                joined_rows=getattr(stats, "num_inserted_rows", None),
                preemptions=getattr(stats, "num_preemptions", None), steps=getattr(stats, "num_steps", None),
                mixed_steps=getattr(stats, "num_mixed_steps", None),
                decode_step_s=getattr(stats, "decode_time_s", None), prompt_step_s=getattr(stats, "prefill_time_s", None))


def measure_parts(engine: LLMEngine, workload: Workload, batch: int) -> dict[str, Any]:
    """Pure-prefill and pure-decode rates of ``engine`` on the workload's first ``batch``
    prompts submitted at once (module docstring: sum of parts)."""
    prompts = workload.prompts[:batch]
    mean_output = max(2, round(workload.output_tokens / len(workload.params)))

    def run(num_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == num_tokens for o in outputs)

    counter = CompileCounter()
    timed = wall_clock_decode(run, len(prompts), mean_output, repeats=1)
    prefill_tok_s = sum(len(p) for p in prompts) / (1e-3 * timed["one_token_ms"])
    return dict(batch=len(prompts), decode_tokens=mean_output, prefill_tok_s=prefill_tok_s,
                decode_tok_s=timed["decode_tok_s"], compiles=counter.count)


def sum_of_parts_s(workload: Workload, parts: dict[str, Any]) -> float:
    """The workload's prompt tokens at the pure-prefill rate plus its decode-step tokens
    (every output token after each request's first) at the pure-decode rate."""
    num_requests = len(workload.prompts)
    return (workload.prompt_tokens / parts["prefill_tok_s"]
            + (workload.output_tokens - num_requests) / parts["decode_tok_s"])


def serving_engine_defaults(args: argparse.Namespace, compiler_options: dict[str, Any] | None) -> dict[str, Any]:
    """The benchmark's `EngineConfig` fields: the sizes above and the engine's own
    program shapes (`jax_paged_attn.engine.shapes`); no prefix caching (the workload's
    random prompts share no block; earlier figures were measured without it)."""
    seqs, tokens, block, max_len = args.max_num_seqs, args.max_num_batched_tokens, args.block_size, args.max_model_len
    return dict(block_size=block, max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=max_len,
                num_scheduler_steps=args.num_scheduler_steps, compiler_options=compiler_options, seed=args.seed,
                enable_prefix_caching=False)


def warm_up_serving(engine: LLMEngine, workload: Workload, max_num_seqs: int):
    """`engine_common.warm_up`, the fallback being the module docstring's untimed run."""
    warm = min(len(workload.prompts), max_num_seqs + 16)
    short = [dataclasses.replace(p, max_tokens=min(p.max_tokens, 48)) for p in workload.params[:warm]]
    return warm_up(engine, lambda: engine.generate(workload.prompts[:warm], short, use_tqdm=False),
                   f"an untimed run of {warm} of the requests, outputs cut to 48 tokens")


SERVING_COLUMNS = (
    "request rate (req/s)", "requests", "duration s", "last arrival s", "request throughput (req/s)",
    "output tok/s", "total tok/s", "TTFT ms p50 / p90 / p99", "TPOT ms p50 / p90 / p99", "sum of parts s",
    "duration / sum of parts", "compiles after start",
)


def _serving_cells(rate: str, row: dict[str, Any], parts_s: float | None) -> list[str]:
    def three(values: list[float], digits: int) -> str:
        return " / ".join(f"{v:,.{digits}f}" for v in values)

    return [rate, str(row["requests"]), f"{row['duration_s']:.2f}", f"{row['last_arrival_s']:.2f}",
            f"{row['request_rate']:.2f}", f"{row['output_tok_s']:,.0f}", f"{row['total_tok_s']:,.0f}",
            three(row["ttft_ms"], 0), three(row["tpot_ms"], 2),
            "n/a" if parts_s is None else f"{parts_s:.2f}",
            "n/a" if parts_s is None else f"{row['duration_s'] / parts_s:.2f}", str(row["compiles_after_start"])]


def run_serving(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    """The rate sweep and the sum of parts; prints the table, returns the rows."""
    model, compiler_options = build_model(args.quick, args.implementation, args.matmul_implementation, args.model)
    workload = make_workload(args.num_requests, model.config.vocab_size, args.prompt_lens, args.output_lens,
                             args.seed)
    rates = parse_rates(args.rates)
    config = engine_config(serving_engine_defaults(args, compiler_options), engine_options)
    print(f"# LLMEngine serving: {len(workload.prompts)} requests, prompts {args.prompt_lens[0]}-"
          f"{args.prompt_lens[1]} ({workload.prompt_tokens:,} tokens), outputs {args.output_lens[0]}-"
          f"{args.output_lens[1]} ({workload.output_tokens:,} tokens), seed {args.seed}; "
          f"{jnp.dtype(model.dtype).name}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"jax {jax.__version__}")
    print(f"# engine: {config}")
    start = time.perf_counter()
    engine = LLMEngine(model, config)
    print(f"# {engine.start_report.replace(chr(10), '; ')}")
    print(f"# engine constructed in {time.perf_counter() - start:.1f} s; "
          f"{warm_up_serving(engine, workload, config.max_num_seqs).describe()}", flush=True)
    estimate = None
    parts = None
    if not args.no_parts:
        parts = measure_parts(engine, workload, min(config.max_num_seqs, len(workload.prompts)))
        estimate = sum_of_parts_s(workload, parts)
        print(f"# sum of parts: pure prefill {parts['prefill_tok_s']:,.0f} tok/s, pure decode "
              f"{parts['decode_tok_s']:,.0f} tok/s at batch {parts['batch']} (the workload's first "
              f"{parts['batch']} prompts at once, {parts['decode_tokens']} output tokens against 1, wall clock; "
              f"{parts['compiles']} compilations): {workload.prompt_tokens:,} prompt tokens + "
              f"{workload.output_tokens - len(workload.prompts):,} decode tokens take {estimate:.2f} s", flush=True)
    print()
    print("| " + " | ".join(SERVING_COLUMNS) + " |")
    print("| " + " | ".join("---" for _ in SERVING_COLUMNS) + " |", flush=True)
    rows: list[dict[str, Any]] = []
    saturation = None
    for entry in rates:
        rate = rate_value(entry, saturation)
        shown = f"{rate:.2f} ({entry})" if entry.endswith("x") else entry
        row = run_arrivals(engine, workload, poisson_arrivals(len(workload.prompts), rate, args.seed), entry)
        if entry == "inf":
            saturation = row["request_rate"]
        row.update(rate=rate, rate_entry=entry)
        rows.append(row)
        print("| " + " | ".join(_serving_cells(shown, row, estimate)) + " |", flush=True)
    result: dict[str, Any] = dict(rows=rows, parts=parts, sum_of_parts_s=estimate)
    print()
    for row in rows:
        print(f"rate {row['rate_entry']}: {row['decode_batches']} decode batches built, {row['joined_rows']} requests "
              f"joined a running batch, {row['preemptions']} preemptions; requests submitted up to "
              f"{row['max_late_ms']:,.0f} ms after their arrival (a step was running)")
        if row.get("steps") is not None:  # where the host's time went, step by step
            print(f"rate {row['rate_entry']}: {row['steps']:,} engine steps ({row['mixed_steps']:,} with prompts "
                  f"beside the batch), {row['decode_step_s']:.2f} s in decode-only steps, "
                  f"{row['prompt_step_s']:.2f} s in steps with prompts")
    if args.profile:
        result["profile"] = profile_run(engine, workload, pathlib.Path(args.profile))
    del engine
    gc.collect()
    return result


def profile_run(engine: LLMEngine, workload: Workload, trace_dir: pathlib.Path) -> dict[str, Any]:
    """The workload submitted at once, run again under JAX's profiler (after the timed
    runs, so their figures carry no tracing cost): where the GPU's time goes, by kernel
    family and kernel, in seconds over the whole run, beside the GPU's busy time and the
    run's wall clock (the difference: the GPU idle between kernels)."""
    from profile_engine import busy_us, device_kernel_events, idle_gaps_us, summarize

    trace_dir.mkdir(parents=True, exist_ok=True)
    # Device activity only: with the host's events too, a run of ~10 s outgrew what the
    # trace's JSON export keeps, and it kept well under half the kernels.
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 0
    options.python_tracer_level = 0
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options):
        row = run_arrivals(engine, workload, np.zeros(len(workload.prompts)), "profile")
    traces = sorted(trace_dir.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = device_kernel_events(traces[-1]) if traces else []
    busy_s = busy_us(events) / 1e6
    print(f"\n# profiled run (all at once, under the profiler): {row['duration_s']:.2f} s wall, GPU busy "
          f"{busy_s:.2f} s ({len(events):,} kernels and copies; trace in {trace_dir}); "
          f"microseconds over the whole run:")
    print(summarize(events, 1, top=24, per="run"))
    gaps = idle_gaps_us(events)
    print("\n| idle gap between busy intervals | gaps | seconds |\n| --- | --- | --- |")
    for label, count, total in gaps:
        print(f"| {label} | {count:,} | {total / 1e6:.3f} |")
    sys.stdout.flush()
    return dict(duration_s=row["duration_s"], busy_s=busy_s, events=len(events),
                idle_gaps=[dict(range=label, gaps=count, seconds=total / 1e6) for label, count, total in gaps])


# --------------------------------------------------------------------------- start-up


def startup_child(args: argparse.Namespace, engine_options: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    """One engine start with the persistent compilation cache in ``cache_dir``; prints
    and returns the times (`STARTUP_RESULT_PREFIX` + JSON)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "compilation_cache_dir" in fields:
        engine_options = dict(engine_options, compilation_cache_dir=cache_dir)
        how = "EngineConfig.compilation_cache_dir (the engine's cache settings)"
    else:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        how = ("jax_compilation_cache_dir set by this script, every program cached (this EngineConfig has no "
               "compilation_cache_dir)")
    model, compiler_options = build_model(args.quick, args.implementation, args.matmul_implementation, args.model)
    workload = make_workload(args.num_requests, model.config.vocab_size, args.prompt_lens, args.output_lens,
                             args.seed)
    config = engine_config(serving_engine_defaults(args, compiler_options), engine_options)
    counter = CompileCounter()
    start = time.perf_counter()
    engine = LLMEngine(model, config)
    constructed = time.perf_counter()
    warm = warm_up_serving(engine, workload, config.max_num_seqs)
    result = dict(construct_s=constructed - start, warm_up_s=warm.seconds, start_s=time.perf_counter() - start,
                  compiles=counter.count, cache_hits=counter.cache_hits, compile_s=counter.seconds,
                  kv_cache_blocks=engine.config.num_blocks, cache=how, warm_up=warm.how,
                  traced=engine.runner.num_traces, **_program_store_counts(engine),
                  min_compile_time_s=getattr(jax.config, "jax_persistent_cache_min_compile_time_secs", None),
                  min_entry_size_bytes=getattr(jax.config, "jax_persistent_cache_min_entry_size_bytes", None))
    print(STARTUP_RESULT_PREFIX + json.dumps(result), flush=True)
    return result


def _program_store_counts(engine: Any) -> dict[str, int | None]:
    """Programs the engine's program store loaded, wrote, and could not serialize (None:
    no store)."""
    store = getattr(engine.runner, "program_store", None)
    return dict(programs_loaded=getattr(store, "num_loaded", None), programs_stored=getattr(store, "num_stored", None),
                programs_unserializable=getattr(store, "num_unserializable", None))


def measure_startup(forwarded: list[str]) -> dict[str, Any]:
    """Cold and warm engine starts (`startup_child` in a subprocess each, one fresh cache
    directory); prints the table, returns both results and warm / cold."""
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="jax-compilation-cache-") as cache_dir:
        for label in ("cold", "warm"):
            cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *forwarded, "--startup-child", cache_dir]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = done.stdout.splitlines()
            found = [line for line in lines if line.startswith(STARTUP_RESULT_PREFIX)]
            if done.returncode or not found:
                sys.stdout.write(done.stdout)
                sys.stderr.write(done.stderr[-4000:])
                raise RuntimeError(f"the {label} start-up process failed (exit {done.returncode})")
            for line in lines:
                if not line.startswith(STARTUP_RESULT_PREFIX):
                    print(f"[{label}] {line}")
            runs[label] = json.loads(found[-1][len(STARTUP_RESULT_PREFIX):])
    cold, warm = runs["cold"], runs["warm"]
    ratio = warm["start_s"] / cold["start_s"]
    print(f"# engine start-up, persistent compilation cache: {cold['cache']} (min compile time "
          f"{cold['min_compile_time_s']} s, min entry size {cold['min_entry_size_bytes']} bytes); "
          f"warm-up by {cold['warm_up']}")
    print()
    # The block count is in every cache program's shape: two starts that size the cache
    # differently share no such program through the cache.
    print("| cache | construction s | warm-up s | start s | programs traced | programs loaded (program store) | "
          "XLA compilations | served by JAX's cache | compile s (incl. cache reads) | KV cache blocks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, run in runs.items():
        print(f"| {label} | {run['construct_s']:.2f} | {run['warm_up_s']:.2f} | {run['start_s']:.2f} | "
              f"{run.get('traced', 'n/a')} | {run.get('programs_loaded', 'n/a')} | {run['compiles']} | "
              f"{run['cache_hits']} | {run['compile_s']:.2f} | {run['kv_cache_blocks']} |")
    print()
    print(f"warm / cold start: {ratio:.2f}")
    return dict(cold=cold, warm=warm, warm_over_cold=ratio)


# --------------------------------------------------------------------------- main


def length_range(text: str) -> tuple[int, int]:
    """``LOW,HIGH`` (or ``N``) of a ``--prompt-lens`` / ``--output-lens`` option."""
    low, _, high = text.partition(",")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=None, help="default 1000 (--quick: 24)")
    parser.add_argument("--rates", default=None,
                        help="requests/s per run: inf, numbers, Fx = F times the inf run's request throughput "
                             "(default 8,16,32,64,inf; --quick: inf,50)")
    parser.add_argument("--prompt-lens", type=length_range, default=None, metavar="LOW,HIGH",
                        help="prompt lengths drawn from LOW..HIGH (default 32,2048; --quick: 4,40)")
    parser.add_argument("--output-lens", type=length_range, default=None, metavar="LOW,HIGH",
                        help="output lengths drawn from LOW..HIGH (default 16,512; --quick: 4,30)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's and the arrivals' seed")
    parser.add_argument("--model", default="llama-1b", choices=tuple(MODELS),
                        help="the model's shapes, random bf16 weights (--quick: a tiny config of its family)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (--quick: 8)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192 (--quick: 256; 2048 until 2026-12-04: 110k against 128k total tok/s on the H200)")
    parser.add_argument("--num-scheduler-steps", type=int, default=None, help="default 16 (--quick: 4)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's longest context, its one block-table width (default 4096; --quick: 128)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="FIELD=VALUE",
                        help="set an EngineConfig field (repeatable; overrides the options above)")
    parser.add_argument("--no-parts", action="store_true", help="skip the pure-prefill and pure-decode runs")
    parser.add_argument("--startup", action="store_true",
                        help="only time the engine's start, cold and warm persistent compilation cache")
    parser.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--implementation", default=None,
                        help="paged attention implementation of the model: auto (default), xla, triton")
    parser.add_argument("--matmul-implementation", default=None, choices=matmul.IMPLEMENTATION_CHOICES)
    parser.add_argument("--decode-config", default=None, metavar="FIELD=VALUE,...",
                        help="replace the Triton decode kernel's tile config for this run (bench_engine.py's)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after the timed runs, run the workload at once again under JAX's profiler (trace in "
                             "DIR) and print where the GPU's time goes")
    parser.add_argument("--quick", action="store_true", help="tiny float32 model, small workload: a CPU smoke run")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(num_requests=(24, 1000), rates=("inf,50", "8,16,32,64,inf"), prompt_lens=((4, 40), (32, 2048)),
                    output_lens=((4, 30), (16, 512)), max_num_seqs=(8, 256), max_num_batched_tokens=(256, 8192),
                    num_scheduler_steps=(4, 16), max_model_len=(128, 4096))
    for name, (quick_value, full_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick_value if quick else full_value)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    engine_options = parse_engine_options(args.engine_option)
    use_decode_config(args.decode_config)
    if args.startup_child:
        return startup_child(args, engine_options, args.startup_child)
    if args.startup:
        return measure_startup([a for a in argv if a != "--startup"])
    return run_serving(args, engine_options)


if __name__ == "__main__":
    main()
