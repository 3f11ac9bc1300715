#!/usr/bin/env python3
"""Where a decode step's time goes: the engine's decode window and the dense loop's
step, kernel by kernel, from a JAX profiler trace.

    python benchmarks/profile_engine.py [--model 1b|8b|70b] [--tp N] [--batches 1,32,256]
                                        [--context 192] [--num-steps 16] [--table-keys 256] [--out DIR]
                                        [--variant NAME:OPTION=VALUE[,OPTION=VALUE...]]
                                        [--decode-config FIELD=VALUE,...] [--top N]

For each batch size it builds the 1.1B Llama of `bench_engine.py` (random weights,
bfloat16; ``--model 8b`` / ``70b``: `bench_tp.py`'s Llama 3 shapes; ``--tp N``: split
over the first N GPUs by heads, each creating its own shards, the dense step skipped),
a persistent decode batch of that many rows at position ``--context`` whose
block tables cover ``--table-keys`` keys (as the engine sizes them for requests ending
there; 256 in `bench_engine.py`; runs before 2026-12-02 03:40 UTC used 2,112), and
compiles `ModelRunner`'s decode window (rows padded as the engine pads them)
(``--num-steps`` steps per call). It prints:

* ms per step (wall, 20 windows back to back) and the GPU's busy time per step (the
  union of kernel intervals), so launch gaps show as the difference;
* kernels per step and the largest kernels: count and microseconds per step;
* the same for the dense XLA loop's step (`bench_engine.make_dense_decode_step`).

With several GPUs the kernels listed are GPU 0's (each GPU runs the same program on its
shards); the "collective (NCCL)" family is the all-reduces after each layer's
``o_proj`` and ``down_proj``, so its time per step over ``2 * layers`` is one
all-reduce's cost, to set beside NCCL's latency and try XLA's collective options
against with ``--variant``.

``--variant`` compiles the window again with XLA options (``jax.jit``'s
``compiler_options``) and reports its ms per step beside the default, e.g.
``--variant nocb:xla_gpu_enable_command_buffer=``. ``--out`` keeps the traces
(``perfetto_trace.json.gz``) and the optimized HLO of each program.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

_REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (_REPO, _REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_engine import LLAMA_1B, make_dense_decode_step, parse_options, use_decode_config  # noqa: E402
from bench_tp import MODELS  # noqa: E402
from jax_paged_attn import matmul, parallel  # noqa: E402
from jax_paged_attn.engine.model_runner import DecodeState, ModelRunner, decode_batch_rows  # noqa: E402
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM  # noqa: E402


PROFILED_MODELS = {name: config for name, (config, _, _) in MODELS.items()}
"""`bench_tp.py`'s Llama 3 shapes, by name."""


def device_kernel_events(trace_path: pathlib.Path, first_device_only: bool = True) -> list[dict[str, Any]]:
    """Complete events ("X") of the trace's GPU streams (kernels and copies): the first
    GPU's (by process name) unless ``first_device_only`` is False."""
    with gzip.open(trace_path, "rt") as fp:
        trace = json.load(fp)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process_names, thread_names = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            process_names[event["pid"]] = event.get("args", {}).get("name", "")
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            thread_names[(event["pid"], event["tid"])] = event.get("args", {}).get("name", "")
    device_pids = {pid for pid, name in process_names.items() if re.search(r"GPU|gpu", name)}
    if first_device_only and len(device_pids) > 1:
        device_pids = {min(device_pids, key=lambda pid: process_names[pid])}
    out = []
    for event in events:
        if event.get("ph") != "X" or event.get("pid") not in device_pids:
            continue
        thread = thread_names.get((event["pid"], event.get("tid")), "")
        if thread.startswith("Stream") or "stream" in thread.lower():
            out.append(event)
    if not out:
        print(f"no GPU stream events in {trace_path}; processes {sorted(set(process_names.values()))[:20]}, "
              f"threads {sorted(set(thread_names.values()))[:40]}")
    return out


def busy_us(events: Sequence[dict[str, Any]]) -> float:
    """Microseconds in which at least one event runs (the union of their intervals)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    total, end = 0.0, -1.0
    for start, stop in spans:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def idle_gaps_us(events: Sequence[dict[str, Any]], bounds_us: Sequence[float] = (10, 100, 1000)
                 ) -> list[tuple[str, int, float]]:
    """The device's idle time between its busy intervals, by gap length: ``(range, gaps,
    microseconds)`` for gaps below each of ``bounds_us`` and above the last. Short gaps
    are launch overhead between kernels; long ones, the device waiting for the host."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    edges = [0.0, *bounds_us, float("inf")]
    counts, totals = [0] * (len(edges) - 1), [0.0] * (len(edges) - 1)
    end = None
    for start, stop in spans:
        if end is not None and start > end:
            gap = start - end
            k = next(i for i in range(len(edges) - 1) if gap < edges[i + 1])
            counts[k] += 1
            totals[k] += gap
        end = stop if end is None else max(end, stop)
    labels = [f"< {bounds_us[0]:g} us"] + [f"{a:g}-{b:g} us" for a, b in zip(bounds_us, bounds_us[1:])] + \
        [f">= {bounds_us[-1]:g} us"]
    return list(zip(labels, counts, totals))


def kernel_family(name: str) -> str:
    """A coarse class of a kernel's name, for the per-step summary."""
    lowered = name.lower()
    if any(s in lowered for s in ("nccl", "all_reduce", "allreduce", "all-reduce", "all_gather", "allgather")):
        return "collective (NCCL)"
    if any(s in lowered for s in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "matmul (cuBLAS)"
    if "triton" in lowered and "fusion" in lowered or lowered.startswith(("gemm_fusion", "triton_gemm")):
        return "matmul (XLA Triton)"
    if any(s in lowered for s in ("paged", "decode", "attention", "flash", "prefill", "cache")):
        return "attention / cache (Pallas)"
    if "memcpy" in lowered or "memset" in lowered:
        return "copy / memset"
    if "fusion" in lowered or "reduce" in lowered or "scatter" in lowered or "gather" in lowered:
        return "XLA fusion"
    return "other"


def summarize(events: Sequence[dict[str, Any]], num_steps: int, top: int = 14, per: str = "step") -> str:
    """Kernel families and the largest kernels: counts and microseconds per ``num_steps``
    (``per`` names that unit in the headers)."""
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        per_name[e["name"]].append(float(e.get("dur", 0)))
    families: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, durs in per_name.items():
        fam = families[kernel_family(name)]
        fam[0] += len(durs)
        fam[1] += sum(durs)
    lines = [f"| kernel family | kernels / {per} | us / {per} |", "| --- | --- | --- |"]
    for fam, (count, total) in sorted(families.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {fam} | {count / num_steps:.1f} | {total / num_steps:.1f} |")
    lines += ["", f"| kernel | per {per} | us / {per} | us each |", "| --- | --- | --- | --- |"]
    for name, durs in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| `{name[:90]}` | {len(durs) / num_steps:.1f} | {sum(durs) / num_steps:.1f} | "
                     f"{np.mean(durs):.1f} |")
    return "\n".join(lines)


def profile(run: Callable[[], Any], num_steps_per_call: int, calls: int, trace_dir: pathlib.Path,
            top: int = 14) -> tuple[float, float, str]:
    """(wall ms/step, GPU-busy ms/step, kernel summary) of ``run`` (one call = that many steps)."""
    jax.block_until_ready(run())
    start = time.perf_counter()
    for _ in range(calls):
        result = run()
    jax.block_until_ready(result)
    wall_ms = 1e3 * (time.perf_counter() - start) / (calls * num_steps_per_call)
    trace_dir.mkdir(parents=True, exist_ok=True)
    traced_calls = 2
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(traced_calls):
            result = run()
        jax.block_until_ready(result)
    traces = sorted(trace_dir.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return wall_ms, float("nan"), "(no trace written)"
    events = device_kernel_events(traces[-1])
    steps = traced_calls * num_steps_per_call
    return wall_ms, busy_us(events) / 1e3 / steps, summarize(events, steps, top)


def window_runner(model: LlamaForCausalLM, batch: int, context: int, num_steps: int, block_size: int,
                  compiler_options: dict[str, Any] | None,
                  table_keys: int = 256) -> tuple[ModelRunner, Callable[[], Any]]:
    # Block-table columns as the engine sizes them: every row's last position (here
    # ``table_keys``, at least the window's end), so the decode kernel is planned as in
    # `bench_engine.py` (whose requests end at 128 + 128 = 256 tokens).
    width = -(-max(table_keys, context + num_steps) // block_size)
    runner = ModelRunner(model, num_blocks=batch * width + 1, block_size=block_size,
                         compiler_options=compiler_options)
    num_rows = decode_batch_rows(batch)  # as the engine pads its persistent batch
    rows = DecodeState.empty(num_rows, width, 1)
    rows.tokens[:] = 1
    rows.positions[:] = context
    rows.active[:batch] = True
    rows.block_tables[:batch] = np.arange(batch * width, dtype=np.int32).reshape(batch, width) + 1
    rows.max_tokens[:] = 1 << 30
    keep = np.ones(num_rows, bool)
    block_rows = np.full(num_rows, num_rows, np.int32)
    block_values = np.zeros((num_rows, width), np.int32)
    max_len = width * block_size + 1

    def run() -> Any:
        runner.start_decode(rows)  # rewound: every call decodes at the same context length
        return runner.run_decode_window(keep, block_rows, block_values, num_steps=num_steps, greedy=True,
                                        max_model_len=max_len)

    return runner, run


def dense_runner(model: LlamaForCausalLM, batch: int, context: int) -> Callable[[], Any]:
    cfg = model.config
    graphdef, state = nnx.split(model)
    step = make_dense_decode_step(graphdef, None)
    shape = (batch, context + 64, cfg.num_key_value_heads, cfg.head_dim)
    caches = {"k": [jnp.zeros(shape, model.dtype) for _ in range(cfg.num_hidden_layers)],
              "v": [jnp.zeros(shape, model.dtype) for _ in range(cfg.num_hidden_layers)]}
    tokens = jnp.ones((batch,), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)

    def run() -> Any:
        out, _, caches["k"], caches["v"] = step(state, caches["k"], caches["v"], tokens, lengths)
        return out

    return run


def decode_plan_line(config: LlamaConfig, num_rows: int, width: int, block_size: int, dtype: Any,
                     tp: int = 1, kv_head_replicas: int = 1) -> str:
    """The Triton decode kernel's plan for the window's attention calls (what the splits
    and tile sizes are planned from: the rows, the block table's width and, split over
    ``tp`` devices, each device's heads)."""
    from jax_paged_attn import decode

    tiling = decode.triton_tiling(
        (num_rows, 1, config.num_attention_heads // tp, config.head_dim),
        (1, block_size, config.num_key_value_heads * kv_head_replicas // tp, config.head_dim), width, dtype, dtype)
    return (f"decode plan: {num_rows} rows, block tables of {width} blocks ({width * block_size} keys): "
            f"{tiling.tile_keys} keys per step, {tiling.num_splits} split(s), {tiling.num_warps} warps, "
            f"{tiling.num_stages} stages")


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``"NAME:OPTION=VALUE,..."`` -> (name, options) (`bench_engine.parse_options`)."""
    name, _, options = text.partition(":")
    return name, parse_options(options)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="1b", choices=("1b", *PROFILED_MODELS),
                        help="1b: bench_engine.py's 1.1B Llama; 8b / 70b: bench_tp.py's Llama 3 shapes")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: the first N devices, split by heads")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--context", type=int, default=192, help="position of every row's token")
    parser.add_argument("--num-steps", type=int, default=16, help="decode steps per window")
    parser.add_argument("--table-keys", type=int, default=256,
                        help="keys the rows' block tables cover (the engine: each request's final length; "
                             "bench_engine.py: 256); the decode kernel's splits are planned from it")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20, help="timed windows (dense: timed steps / num_steps)")
    parser.add_argument("--variant", action="append", default=[], help="NAME:XLA_OPTION=VALUE,...")
    parser.add_argument("--matmul-implementation", default=None, choices=matmul.IMPLEMENTATION_CHOICES,
                        help="the model's projections (jax_paged_attn.matmul.linear; default auto)")
    parser.add_argument("--decode-config", default=None, metavar="FIELD=VALUE,...",
                        help="replace the Triton decode kernel's tile config (tuning.DecodeConfig fields) for "
                             "this run, e.g. pages_per_step=1,num_warps=4,num_stages=3")
    parser.add_argument("--top", type=int, default=14, help="kernels listed per program (by time per step)")
    parser.add_argument("--no-dense", action="store_true")
    parser.add_argument("--out", default=None, help="keep traces and optimized HLO here")
    parser.add_argument("--quick", action="store_true", help="tiny float32 model (a CPU smoke run)")
    args = parser.parse_args(argv)
    use_decode_config(args.decode_config)

    if args.quick:
        config, dtype = LlamaConfig.tiny(), jnp.float32
    else:
        config, dtype = (LLAMA_1B if args.model == "1b" else PROFILED_MODELS[args.model]), jnp.bfloat16
    out = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="profile_engine_"))
    out.mkdir(parents=True, exist_ok=True)
    mesh = None
    if args.tp > 1:
        mesh = parallel.tensor_parallel_mesh(args.tp)  # ValueError: more than the devices
        if not args.no_dense:
            print(f"(the dense XLA step is not profiled at tp = {args.tp}: it runs on one device)")
            args.no_dense = True
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, mesh=mesh,
                             matmul_implementation=args.matmul_implementation)
    variants = [("default", {})] + [parse_variant(v) for v in args.variant]
    print(f"# decode step profile: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{jnp.dtype(dtype).name}, tp {args.tp}, context {args.context}, {args.num_steps}-step windows, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, options in variants:
            runner, run = window_runner(model, batch, args.context, args.num_steps, args.block_size, options or None,
                                        args.table_keys)
            label = f"b{batch}_{name}"
            try:
                wall, busy, table = profile(run, args.num_steps, args.calls, out / f"trace_{label}", args.top)
            except Exception as error:  # an option this XLA does not know: report it, go on
                print(f"## batch {batch}, engine window, {name} {options}: failed: {error!r}\n")
                continue
            print(f"## batch {batch}, engine window, {name} {options or ''}: {wall:.3f} ms/step wall, "
                  f"{busy:.3f} ms/step GPU busy\n")
            if name == "default":
                num_rows, width = runner._decode_state.block_tables.shape
                print(decode_plan_line(config, num_rows, width, args.block_size, dtype, args.tp,
                                       model.kv_head_replicas) + "\n")
                print(table + "\n")
                compiled = runner.window_program.lower(
                    runner.params, runner.kv_caches, runner._decode_state, np.ones(num_rows, bool),
                    np.full(num_rows, num_rows, np.int32), np.zeros((num_rows, width), np.int32),
                    num_steps=args.num_steps, greedy=True, block_size=args.block_size,
                    max_model_len=width * args.block_size + 1).compile()
                (out / f"window_{label}.hlo.txt").write_text(compiled.as_text())
            del runner, run
        if not args.no_dense:
            run = dense_runner(model, batch, args.context)
            wall, busy, table = profile(run, 1, args.calls * args.num_steps, out / f"trace_b{batch}_dense", args.top)
            print(f"## batch {batch}, dense XLA step: {wall:.3f} ms/step wall, {busy:.3f} ms/step GPU busy\n")
            print(table + "\n", flush=True)
    print(f"traces and HLO under {out}")


if __name__ == "__main__":
    main()
