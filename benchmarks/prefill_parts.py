#!/usr/bin/env python3
"""Where the time of a Mosaic GPU prefill call goes, beside the stock Mosaic GPU kernel.

    python benchmarks/prefill_parts.py [--config FIELD=VALUE ...] [--reps N] [--head-sizes D ...]
                                       [--timeline DIR] [--no-stock] [--versus FIELD=VALUE ...]
                                       [--case B,S,HQ,HK,D ...] [--suite varlen|prefix ...] [--no-causal]

For each dense causal shape of `bench_attention.py`'s prefill suite (bf16, packed
sequences of equal length; ``--case`` for others, ``--no-causal`` without the mask), and
each case of its varlen (16 mixed packed lengths) and prefix (new tokens over a paged
cache) suites with ``--suite``, times back-to-back calls (`bench_attention.Timer`) of:

* ``full``: `jax_paged_attn.prefill.varlen_attention` with ``lowering="mosaic_gpu"``,
  what a user's call runs;
* ``plan``: `jax_paged_attn.prefill.plan_mosaic_varlen` alone, the work list computed under jit
  before every kernel call;
* ``kernel``: `jax_paged_attn.prefill.run_mosaic_varlen` (the kernel) with the
  plan computed beforehand; ``kernel_once``: the same, one call at a time, each waited
  for (`one_call_ms`);
* ``stock_bkv64`` / ``stock_bkv128``: JAX's stock ``attention_mgpu`` kernel (fp16, the
  query pre-scaled, 64-row query blocks, 64- / 128-key blocks, a 2-deep ring), which has
  no plan, no varlen and no masking of non-finite values (``--no-stock`` leaves it out;
  dense shapes only).

Each shape runs the package's config for its head size
(`jax_paged_attn.tuning.mosaic_prefill_config`); ``--config`` overrides its fields with Python
literals (`kernel_resources.parse_overrides`; e.g. ``--config "nonfinite_check='probe'"``).
The kernel's output is checked against the whole
call's. ``--timeline DIR`` also runs the kernel once with the Mosaic GPU profiler
(`jax_paged_attn.prefill.run_mosaic_varlen`'s ``profile_dir``; its Chrome trace files stay
in DIR for chrome://tracing or Perfetto) and prints where a work item's time goes per
warpgroup role and named region, and the gap between work items on an SM
(`summarize_timeline`). ``--versus`` times the kernel with other fields in alternating
rounds beside the config's, in the same process (`compare_kernels`; repeat ``--versus``
for several variants in the same rounds). Needs a Hopper GPU, exits with 2 otherwise,
except with ``--interpret``: a CPU
dry run (one small shape, the Mosaic GPU interpreter, the stock kernel left out;
`tests/test_benchmarks_smoke.py`).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_attention import (FULL_CASES, TINY_CASES, AttentionCase, Timer, build_attention_inputs,  # noqa: E402
                             short_error)
from kernel_resources import parse_overrides  # noqa: E402

INTERPRET_SHAPES = ((2, 80, 2, 1, 64),)


def config_for(head_size: int, overrides: dict, interpret: bool):
    """The package's config for the head size (`tuning.mosaic_prefill_config`), fields
    overridden from the command line."""
    from jax_paged_attn import tuning

    base = tuning.mosaic_prefill_config(head_size, "bfloat16", interpret=interpret)
    return dataclasses.replace(base, **overrides)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="MosaicPrefillConfig fields (default: the package default)")
    parser.add_argument("--reps", type=int, default=10, help="timed samples per measurement (median)")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run in the Mosaic GPU interpreter")
    parser.add_argument("--head-sizes", type=int, nargs="*", metavar="D",
                        help="only the shapes of these head sizes (default: every shape)")
    parser.add_argument("--no-stock", action="store_true", help="leave the stock attention_mgpu kernel out")
    parser.add_argument("--case", action="append", default=[], metavar="B,S,HQ,HK,D",
                        help="a shape instead of the suite's (repeatable; --head-sizes still filters)")
    parser.add_argument("--suite", action="append", default=[], choices=("varlen", "prefix"),
                        help="also (without --case: only) bench_attention.py's cases of this suite: mixed "
                             "packed lengths, or new tokens over a paged cache (repeatable)")
    parser.add_argument("--no-causal", dest="causal", action="store_false",
                        help="every query sees every key of its sequence: no masked blocks where S is a "
                             "multiple of the block sizes, so times over several S separate a work item's "
                             "fixed cost from its per-block cost")
    parser.add_argument("--timeline", metavar="DIR",
                        help="also profile one kernel call per shape into DIR and print its timeline summary")
    parser.add_argument("--versus", nargs="+", action="append", default=[], metavar="FIELD=VALUE",
                        help="also time the kernel with these fields changed, alternating with the config's "
                             "kernel round by round in this process (`compare_kernels`); repeat the option "
                             "for several variants, all in the same rounds")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of --versus (default 7)")
    parser.add_argument("--clock-mhz", type=float,
                        help="SM clock for the profiler's cycle counts (default: fitted to the trace's block "
                             "starts, `fit_clock_mhz`; else nvidia-smi's clocks.max.sm)")
    args = parser.parse_args()
    if refuse_without_gpu("prefill_parts.py", args):
        return 2
    overrides = parse_overrides(args.config)
    interpret = args.interpret
    timer = Timer.dry_run() if interpret else Timer(reps=args.reps)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, config overrides {overrides or 'none'}")
    for case in selected_cases(args):
        if args.head_sizes and case.head_dim not in args.head_sizes:
            continue
        measure_case(case, args, overrides, timer)
    return 0


def selected_cases(args: argparse.Namespace) -> list:
    """The `bench_attention.AttentionCase`s to run: ``--case`` shapes, else bench_attention's
    dense prefill cases (`INTERPRET_SHAPES` with ``--interpret``), then those of each
    ``--suite`` (bench_attention's varlen / prefix cases; their tiny cases with
    ``--interpret``)."""
    cases = [AttentionCase.dense_prefill(*parse_shape(text)) for text in args.case]
    if not cases and not args.suite:
        cases = ([AttentionCase.dense_prefill(*shape) for shape in INTERPRET_SHAPES] if args.interpret
                 else list(FULL_CASES["prefill"]))
    for suite in args.suite:
        cases += (TINY_CASES if args.interpret else FULL_CASES)[suite]
    return cases


def measure_case(case, args: argparse.Namespace, overrides: dict, timer: Timer) -> None:
    """Times one case's whole call, plan and kernel (and the stock kernel on dense
    shapes), then ``--versus`` and ``--timeline``; prints the figures."""
    from jax_paged_attn import prefill
    from jax_paged_attn.spec import AttentionSpec

    interpret = args.interpret
    head_size = case.head_dim
    config = config_for(head_size, overrides, interpret)
    x = build_attention_inputs(case)
    q, k, v, table = x.q, x.k, x.v, x.block_table
    cu_q, cu_k = x.cu_seqlens_q, x.cu_seqlens_k
    max_q, max_k = x.max_q, x.max_k
    spec = AttentionSpec.create(head_size, causal=args.causal)
    full = jax.jit(functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, lowering="mosaic_gpu", config=config,
                                     interpret=interpret))
    plan_call = functools.partial(prefill.plan_mosaic_varlen, q, k, v, spec=spec, max_seqlen_q=max_q,
                                  max_seqlen_k=max_k, config=config)
    tiling, _ = plan_call(cu_q, cu_k, table, None)
    plan_fn = jax.jit(lambda cu_q, cu_k, table: plan_call(cu_q, cu_k, table, None)[1])
    plan = plan_fn(cu_q, cu_k, table)

    def kernel_fn(q, k, v, plan, table, profile_dir=None, tiling=tiling):
        return prefill.run_mosaic_varlen(q, k, v, plan, table, None, 1.0, 1.0, spec=spec, tiling=tiling,
                                         interpret=interpret, profile_dir=profile_dir)

    kernel = jax.jit(kernel_fn)
    times = {}
    times["full"], _, whole = timer.jax(lambda: full(q, k, v, cu_q, cu_k, table, None, None, 1.0, 1.0))
    times["plan"], _, _ = timer.jax(lambda: plan_fn(cu_q, cu_k, table))
    times["kernel"], _, part = timer.jax(lambda: kernel(q, k, v, plan, table))
    times["kernel_once"] = one_call_ms(lambda: kernel(q, k, v, plan, table), 1 if interpret else 5)
    if not jnp.array_equal(part, whole):
        raise AssertionError("the kernel alone and the whole call disagree")
    if interpret or args.no_stock or not case.dense:  # (JAX's stock kernel: dense, no interpret path here)
        block_kvs = ()
    else:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as stock

        block_kvs = (64, 128)
    if block_kvs:
        dense = lambda x: x.reshape(case.batch, max_q, *x.shape[1:])
        q16 = dense((q.astype(jnp.float32) * head_size ** -0.5).astype(jnp.float16))
        k16, v16 = dense(k.astype(jnp.float16)), dense(v.astype(jnp.float16))
    for block_kv in block_kvs:
        tuning = stock.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=args.causal)
        fn = jax.jit(functools.partial(stock.attention, config=tuning))
        try:
            times[f"stock_bkv{block_kv}"], _, _ = timer.jax(lambda: fn(q16, k16, v16))
        except Exception as e:  # noqa: BLE001 - e.g. shared memory at D 256: say so, go on
            print(f"  stock_bkv{block_kv}: {short_error(e, 160)}")
    # (without the mask every query sees its sequence's keys)
    flop = case.work if args.causal else 4.0 * case.q_heads * head_size * float(np.dot(x.q_lens, x.k_lens))
    shape = case.label + ("" if args.causal else " non-causal")
    print(f"{shape}, {config}\n  ({tiling.compute_warpgroups} compute "
          f"warpgroups, block_k {tiling.block_k}, work rows {tiling.work_rows}): " + "  ".join(
        f"{name} {ms:.3f} ms" + (f" ({flop / ms / 1e9:.0f} TFLOP/s)" if name != "plan" else "")
        for name, ms in times.items()), flush=True)
    if args.versus:
        variants = [parse_overrides(fields) for fields in args.versus]
        calls = [lambda: kernel(q, k, v, plan, table)]
        for versus in variants:
            other_tiling, other_plan = functools.partial(plan_call, config=dataclasses.replace(
                config, **versus))(cu_q, cu_k, table, None)
            other = jax.jit(functools.partial(kernel_fn, tiling=other_tiling))
            check_variant(other(q, k, v, other_plan, table), part, versus)
            calls.append(functools.partial(other, q, k, v, other_plan, table))
        rounds = 1 if interpret else args.rounds
        medians = compare_kernels(calls, timer, rounds)
        print(f"  {rounds} alternating rounds, medians: config's kernel {medians[0]:.3f} ms", flush=True)
        for versus, other_ms in zip(variants, medians[1:]):
            print(f"  versus {versus}: {other_ms:.3f} ms ({flop / other_ms / 1e9:.0f} TFLOP/s), "
                  f"config's / this x{medians[0] / other_ms:.3f}", flush=True)
    if args.timeline:
        trace_dir = pathlib.Path(args.timeline) / re.sub(r"[^\w.-]+", "_", shape)
        trace_dir.mkdir(parents=True, exist_ok=True)
        profiled = jax.jit(functools.partial(kernel_fn, profile_dir=str(trace_dir)))
        trace = profile_once(lambda: profiled(q, k, v, plan, table), trace_dir)
        warpgroups = tiling.compute_warpgroups + tiling.warp_specialized
        fitted = None if args.clock_mhz else fit_clock_mhz(trace, warpgroups)
        clock = args.clock_mhz or (fitted[0] if fitted else sm_clock_mhz())
        source = "given" if args.clock_mhz else "fitted to the block starts" if fitted else "nvidia-smi maximum"
        print(f"  SM clock {clock:.0f} MHz ({source})", flush=True)
        print(format_timeline(summarize_timeline(
            trace, clock, tiling.compute_warpgroups, has_producer=tiling.warp_specialized)), flush=True)


def refuse_without_gpu(script: str, args: argparse.Namespace) -> bool:
    """True (with the reason on stderr) where ``script`` cannot run as asked: no GPU and
    no ``--interpret``, or ``--timeline`` in the interpreter."""
    if jax.default_backend() != "gpu" and not args.interpret:
        print(f"{script} needs a GPU (the Mosaic GPU kernels run on Hopper)", file=sys.stderr)
        return True
    if args.timeline and args.interpret:
        print("--timeline needs a GPU: the Mosaic GPU profiler has no interpreter", file=sys.stderr)
        return True
    return False


def parse_case_fields(text: str, usage: str, counts: tuple[int, ...]) -> tuple[int, ...]:
    """``--case``'s comma-separated positive integers, as many as one of ``counts``
    (``usage`` names them in the error, e.g. ``"B,S,HQ,HK,D"``)."""
    try:
        fields = tuple(int(part) for part in text.split(","))
    except ValueError:
        fields = ()
    if len(fields) not in counts or min(fields) < 1:
        raise SystemExit(f"--case takes {usage} (positive integers), got {text!r}")
    return fields


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``"B,S,HQ,HK,D"`` -> (batch, sequence length, query heads, KV heads, head size)."""
    return parse_case_fields(text, "B,S,HQ,HK,D", (5,))


def compare_kernels(calls, timer, rounds: int) -> list[float]:
    """Median ms of each call, timed in alternating rounds (first, second, ..., first, ...)
    in one process: the H200 varies by up to ~15 % between processes, so a comparison of
    configs read across processes can flip."""
    times = [[] for _ in calls]
    for _ in range(rounds):
        for call, kept in zip(calls, times):
            kept.append(timer.jax(call)[0])
    return [statistics.median(kept) for kept in times]


VARIANT_TOLERANCE = 2e-2
"""Largest |difference| allowed between a variant's output and the config's (bf16, unit
normal inputs): other block sizes sum the softmax in another order, so the bits may
differ; a wrong kernel differs by far more."""


def check_variant(output, expected, versus: dict) -> None:
    """Raises AssertionError where a variant's output is not the config's (within
    `VARIANT_TOLERANCE`; NaN where the config's has NaN)."""
    diff = jnp.abs(output.astype(jnp.float32) - expected.astype(jnp.float32))
    same_nan = jnp.array_equal(jnp.isnan(output), jnp.isnan(expected))
    worst = float(jnp.nanmax(diff))
    if not (bool(same_nan) and worst <= VARIANT_TOLERANCE):
        raise AssertionError(f"the kernel with {versus} and the config's disagree: max |diff| {worst:.3g}")


def one_call_ms(call, reps: int) -> float:
    """Median wall time of ``reps`` calls made one at a time, each waited for (host
    dispatch and the wait included: tens of µs). Beside the back-to-back timing it
    would tell a cost that only consecutive calls pay (none found: the persistent
    form's 2x over its profiled span came from reading the span at the maximum clock)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def sm_clock_mhz() -> float:
    """The GPU's maximum SM clock (nvidia-smi), to turn the profiler's cycles into time."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])


CLOCK_WRAP = 2 ** 32
"""The profiler's cycle counts are 32-bit: an event whose cycles, less the profiler's
overhead correction, fell below its trace's first event's came back as about 2^32
cycles after it (a 2^32-cycle region seen on the H100, 2026-12-02)."""


def profile_once(call, trace_dir: pathlib.Path) -> dict:
    """Runs ``call`` (a kernel compiled to write its Mosaic GPU profiler trace into
    ``trace_dir``) once and returns that trace, cycles unwrapped (`_unwrap_cycles`).

    One call: the profiler does not overwrite a kernel's trace file ("profile already
    exists"), so a second call's trace is never written; the trace is the first run after
    compiling."""
    jax.block_until_ready(call())
    jax.effects_barrier()  # (the trace is written by a host callback)
    return _unwrap_cycles(json.loads(max(trace_dir.glob("*trace.json"), key=lambda f: f.stat().st_mtime).read_text()))


def _unwrap_cycles(trace: dict) -> dict:
    """``trace`` with every event's time unwrapped (`CLOCK_WRAP`): an event read more
    than 2^31 cycles after its trace's first event (a second, at these clocks) is
    2^32 cycles earlier."""
    first, events = {}, []
    for event in trace["traceEvents"]:
        start = first.setdefault(event["tid"], event["ts"])
        if (event["ts"] - start) * 1e3 > CLOCK_WRAP // 2:
            event = dict(event, ts=event["ts"] - CLOCK_WRAP / 1e3)
        events.append(event)
    return dict(trace, traceEvents=events)


def _warpgroup_spans(trace: dict) -> dict:
    """{tid: (sm, start, cycles)} of a profiler trace, one per warpgroup trace: its first
    event's time (µs, global timer) and the clock cycles from it to its last event
    (later events add cycles / 1000 to the first one's time)."""
    first, last, sm_of = {}, {}, {}
    for event in trace["traceEvents"]:
        tid = event["tid"]
        first.setdefault(tid, event["ts"])
        last[tid] = max(last.get(tid, event["ts"]), event["ts"])
        sm_of[tid] = event["pid"]
    return {tid: (sm_of[tid], start, (last[tid] - start) * 1e3) for tid, start in first.items()}


def _block_starts_and_cycles(trace: dict, warpgroups: int) -> dict:
    """{block: (sm, start, cycles)}: the start of a block's earliest warpgroup and the
    most cycles one of its warpgroups ran (`_warpgroup_spans`; they start together)."""
    blocks = {}
    for tid, (sm, start, cycles) in _warpgroup_spans(trace).items():
        block = (tid - 1) // warpgroups
        _, block_start, block_cycles = blocks.get(block, (sm, start, 0.0))
        blocks[block] = (sm, min(block_start, start), max(block_cycles, cycles))
    return blocks


def fit_clock_mhz(trace: dict, warpgroups: int) -> tuple[float, float] | None:
    """(SM clock in MHz, mean gap between blocks on an SM in µs), fitted to the trace:
    on each SM, the time from a block's start to the next one's (global timer) is the
    block's cycles / clock plus the gap; a least-squares line over every such pair.
    (Under load the SM clock runs below its maximum: read at the maximum, the blocks
    look shorter and the gaps longer than they are.) None when the blocks' lengths do
    not vary enough to fit."""
    per_sm = collections.defaultdict(list)
    for sm, start, cycles in _block_starts_and_cycles(trace, warpgroups).values():
        per_sm[sm].append((start, cycles))
    pairs = []
    for blocks in per_sm.values():
        blocks.sort()
        pairs += [(a[1], b[0] - a[0]) for a, b in zip(blocks, blocks[1:])]
    if len(pairs) < 3:
        return None
    n = len(pairs)
    mean_x, mean_y = sum(x for x, _ in pairs) / n, sum(y for _, y in pairs) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in pairs)
    if var_x <= (0.05 * mean_x) ** 2 * n:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / var_x  # µs per cycle
    if slope <= 0:
        return None
    return 1.0 / slope, mean_y - slope * mean_x


def summarize_timeline(trace: dict, clock_mhz: float, compute_warpgroups: int, has_producer: bool = True) -> dict:
    """Where the work items' time goes in a Mosaic GPU profiler trace of the kernel.

    ``trace``: the profiler's Chrome trace (``traceEvents`` of begin / end events, ``tid``
    numbering the warpgroups block by block, ``pid`` the SM; a block's first event sits
    at its start on the global timer, in µs, later ones add clock cycles / 1000).
    A block's warpgroups: ``compute_warpgroups``, then the producer (``has_producer``).

    Returns: ``clock_mhz``; ``blocks``; ``sms``; ``span_us`` (first block's start to last
    block's end); ``block_us`` (mean start-to-last-event of a block); ``busy`` (the SMs'
    share of the span spent inside blocks); ``gap_us`` (mean time between a block's end
    and the next block's start on the same SM); ``regions``: {role: {region: mean µs
    per block}}, role ``"compute"`` (summed over the compute warpgroups, divided by
    their number) or ``"producer"``.
    """
    warpgroups = compute_warpgroups + has_producer
    by_trace = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        by_trace[event["tid"]].append(event)
    block_spans = collections.defaultdict(lambda: [float("inf"), float("-inf"), 0])  # start, end, sm
    for tid, (sm, start, cycles) in _warpgroup_spans(trace).items():
        span = block_spans[(tid - 1) // warpgroups]
        span[0], span[1], span[2] = min(span[0], start), max(span[1], start + cycles / clock_mhz), sm
    totals = {"compute": collections.Counter(), "producer": collections.Counter()}
    for tid, events in by_trace.items():
        role = "producer" if (tid - 1) % warpgroups == compute_warpgroups else "compute"
        # Durations only: cycles / 1000 between two events of one trace, at the clock.
        open_at = {}
        for event in events:
            if event["ph"] == "B":
                open_at[event["name"]] = event["ts"]
            else:
                totals[role][event["name"]] += (event["ts"] - open_at.pop(event["name"])) * 1e3 / clock_mhz
    per_sm = collections.defaultdict(list)
    for start, end, sm in block_spans.values():
        per_sm[sm].append((start, end))
    gaps = [b[0] - a[1] for spans in per_sm.values() for a, b in zip(sorted(spans), sorted(spans)[1:])]
    num_blocks = len(block_spans)
    first = min(s[0] for s in block_spans.values())
    last = max(s[1] for s in block_spans.values())
    inside = sum(s[1] - s[0] for s in block_spans.values())
    return {
        "clock_mhz": clock_mhz,
        "blocks": num_blocks,
        "sms": len(per_sm),
        "span_us": last - first,
        "block_us": inside / num_blocks,
        "busy": inside / (len(per_sm) * (last - first)) if last > first else 0.0,
        "gap_us": sum(gaps) / len(gaps) if gaps else 0.0,
        "regions": {
            "compute": {k: v / (num_blocks * compute_warpgroups) for k, v in totals["compute"].items()},
            "producer": {k: v / num_blocks for k, v in totals["producer"].items()},
        },
    }


def format_timeline(summary: dict) -> str:
    """`summarize_timeline`'s figures as three lines."""
    head = (f"  timeline ({summary['blocks']} blocks on {summary['sms']} SMs, {summary['clock_mhz']:.0f} MHz): "
            f"span {summary['span_us']:.1f} µs, a block {summary['block_us']:.2f} µs, SMs busy "
            f"{100 * summary['busy']:.0f} %, gap between blocks on an SM {summary['gap_us']:.2f} µs")
    lines = [head]
    for role, regions in summary["regions"].items():
        if regions:
            lines.append(f"  {role} (µs a block): " + ", ".join(f"{k} {v:.2f}" for k, v in regions.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
