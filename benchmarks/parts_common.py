"""What the parts scripts (`prefill_parts.py`, `decode_parts.py`) share: their refusal
without a GPU, their ``--case`` parsing, and the reading of a Mosaic GPU profiler trace.

Owns: `refuse_without_gpu`, `parse_case_fields`; and the timeline of a kernel's work
items (``--timeline``): one profiled call (`profile_once`, its 32-bit cycle counts
unwrapped, `CLOCK_WRAP`), the SM clock fitted to the trace's block starts
(`fit_clock_mhz`, else nvidia-smi's maximum, `sm_clock_mhz`), and where a block's time
goes per warpgroup role and named region (`summarize_timeline`, `format_timeline`), all
four in one call (`profiled_timeline`).
Their alternating rounds are `timing.py`'s (`compare_kernels`).
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
import sys

import jax


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


def profiled_timeline(call, trace_dir: pathlib.Path, compute_warpgroups: int, has_producer: bool,
                      clock_mhz: float | None = None) -> tuple[str, float, str]:
    """Runs ``call`` once under the Mosaic GPU profiler (`profile_once`) and returns
    (`format_timeline`'s lines, the SM clock they were read at, where that clock came
    from): ``clock_mhz`` where given, else fitted to the trace's block starts
    (`fit_clock_mhz`), else nvidia-smi's maximum (`sm_clock_mhz`)."""
    trace = profile_once(call, trace_dir)
    fitted = None if clock_mhz else fit_clock_mhz(trace, compute_warpgroups + has_producer)
    clock = clock_mhz or (fitted[0] if fitted else sm_clock_mhz())
    source = "given" if clock_mhz else "fitted to the block starts" if fitted else "nvidia-smi maximum"
    summary = summarize_timeline(trace, clock, compute_warpgroups, has_producer=has_producer)
    return format_timeline(summary), clock, source
