#!/usr/bin/env python3
"""Where the time of a Mosaic GPU prefill call goes, beside the stock Mosaic GPU kernel.

    python benchmarks/prefill_parts.py [--config FIELD=VALUE ...] [--reps N] [--head-sizes D ...]
                                       [--timeline DIR] [--no-stock] [--versus FIELD=VALUE ...]
                                       [--case B,S,HQ,HK,D ...] [--suite varlen|prefix ...] [--no-causal]

For each dense causal shape of `bench_attention.py`'s prefill suite (bf16, packed
sequences of equal length; ``--case`` for others, ``--no-causal`` without the mask), and
each case of its varlen (16 mixed packed lengths) and prefix (new tokens over a paged
cache) suites with ``--suite``, times back-to-back calls (`timing.Timer`) of:

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
(`parts_common.profiled_timeline`). ``--versus`` times the kernel with other fields in alternating
rounds beside the config's, in the same process (`timing.compare_kernels`; repeat ``--versus``
for several variants in the same rounds). Needs a Hopper GPU, exits with 2 otherwise,
except with ``--interpret``: a CPU
dry run (one small shape, the Mosaic GPU interpreter, the stock kernel left out;
`tests/test_benchmarks_smoke.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import sys

_HERE = pathlib.Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernel_resources import parse_overrides  # noqa: E402
from parts_common import parse_case_fields, profiled_timeline, refuse_without_gpu  # noqa: E402
from suites import FULL_CASES, TINY_CASES, AttentionCase, build_attention_inputs  # noqa: E402
from timing import Timer, compare_kernels, one_call_ms, short_error  # noqa: E402

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
    """The `suites.AttentionCase`s to run: ``--case`` shapes, else bench_attention's
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
        timeline, clock, source = profiled_timeline(lambda: profiled(q, k, v, plan, table), trace_dir,
                                                    tiling.compute_warpgroups, tiling.warp_specialized, args.clock_mhz)
        print(f"  SM clock {clock:.0f} MHz ({source})", flush=True)
        print(timeline, flush=True)


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``"B,S,HQ,HK,D"`` -> (batch, sequence length, query heads, KV heads, head size)."""
    return parse_case_fields(text, "B,S,HQ,HK,D", (5,))


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


if __name__ == "__main__":
    sys.exit(main())
