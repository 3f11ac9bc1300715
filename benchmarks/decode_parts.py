#!/usr/bin/env python3
"""Mosaic GPU paged decode configs compared in one process, and where a program's time goes.

    python benchmarks/decode_parts.py [--config FIELD=VALUE ...] [--versus FIELD=VALUE ...] ...
                                      [--rounds N] [--reps N] [--timeline DIR] [--page-size N]
                                      [--triton] [--torch] [--shapes I ...] [--case B,CTX,HQ,HK[,D] ...]
                                      [--interpret]

For each decode shape of `bench_attention.py`'s decode suite (bf16, page 16, every
sequence ``context`` keys long, a random page permutation), times
`jax_paged_attn.decode.run_mosaic_decode` (the Mosaic GPU kernel and its split merge)
with the package's `MosaicDecodeConfig` overridden by ``--config``, and prints GB/s of
K+V read. Each ``--versus`` (repeatable; a group of FIELD=VALUE overrides applied on top
of ``--config``) adds a config; all are timed in the same alternating rounds in this
process (`timing.compare_kernels`: the H200 varies by up to ~15 % between
processes); ``--triton`` adds the Triton decode kernel the same way. Every output is
checked against the first config's. ``--page-size`` changes the cache's page size;
``--case B,CTX,HQ,HK[,D]`` runs other shapes (e.g. the same bytes with one KV head, whose
16-row pages are 4 KiB contiguous per head, not 16 rows strided by the other heads);
``--torch`` adds torch's cuDNN SDPA on contiguous K/V. ``--timeline DIR``
also runs each config once with the Mosaic GPU profiler and prints where a program's
time goes per warpgroup role and named region (`parts_common.profiled_timeline`):
the waits for each tile's K and V, its scores and values, the producer's refill, the
merge and the epilogue. Needs a Hopper GPU, exits with 2 otherwise, except with
``--interpret``: a CPU dry run (one small shape, the Mosaic GPU interpreter;
`tests/test_benchmarks_smoke.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernel_resources import parse_overrides  # noqa: E402
from parts_common import parse_case_fields, profiled_timeline, refuse_without_gpu  # noqa: E402
from peers import _torch_sdpa  # noqa: E402
from suites import DECODE_CASES, DecodeCase, build_decode_inputs  # noqa: E402
from timing import Context, Deadline, Timer, compare_kernels  # noqa: E402

INTERPRET_CASES = (DecodeCase(2, 100, 8, 2, 64),)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="MosaicDecodeConfig fields over the package's (tuning.MOSAIC_DECODE_MEASURED)")
    parser.add_argument("--versus", nargs="*", action="append", default=[], metavar="FIELD=VALUE",
                        help="another config (fields over --config), timed in alternating rounds; repeatable")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--timeline", metavar="DIR", help="also profile one call per config and shape into DIR")
    parser.add_argument("--shapes", type=int, nargs="*", metavar="I",
                        help="indices into the decode suite's shapes (default: all)")
    parser.add_argument("--page-size", type=int, help="cache page size (default: the suite's, 16)")
    parser.add_argument("--triton", action="store_true",
                        help="also time the Triton decode kernel, in alternating rounds with the first config")
    parser.add_argument("--case", action="append", default=[], metavar="B,CTX,HQ,HK[,D]",
                        help="a decode shape instead of the suite's (repeatable; head size 128 if not given), "
                             "e.g. the same bytes with one KV head, whose pages are contiguous per head")
    parser.add_argument("--torch", action="store_true",
                        help="also time torch's cuDNN SDPA on contiguous K/V (bench_attention's peer), after the "
                             "rounds, on the same shapes")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run in the Mosaic GPU interpreter")
    args = parser.parse_args()
    if refuse_without_gpu("decode_parts.py", args):
        return 2
    from jax_paged_attn import decode, plans, tuning
    from jax_paged_attn.kv_view import as_plane
    from jax_paged_attn.spec import AttentionSpec

    base = dataclasses.replace(tuning.MOSAIC_DECODE_MEASURED, **parse_overrides(args.config))
    configs = [base] + [dataclasses.replace(base, **parse_overrides(v)) for v in args.versus]
    timer = Timer.dry_run() if args.interpret else Timer(reps=args.reps)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    cases = [parse_case(text) for text in args.case] or (INTERPRET_CASES if args.interpret else DECODE_CASES)
    for index, case in enumerate(cases):
        if args.shapes and index not in args.shapes:
            continue
        if args.page_size:
            case = dataclasses.replace(case, page_size=args.page_size)
        x = build_decode_inputs(case)
        spec = AttentionSpec.create(case.head_dim, causal=True)
        kv_bytes = 2 * case.batch * case.context * case.kv_heads * case.head_dim * jnp.dtype(case.dtype).itemsize

        def call_for(config, profile_dir=None):
            def run(q, k_cache, v_cache, seqlens, block_table):
                # (The planes are made under jit: made outside, each call would copy the cache.)
                return decode.run_mosaic_decode(q, as_plane(k_cache), as_plane(v_cache), seqlens, block_table, None,
                                                1.0, 1.0, spec=spec, config=config, interpret=args.interpret,
                                                profile_dir=profile_dir)

            fn = jax.jit(run)
            return lambda: fn(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)

        calls = [call_for(c) for c in configs]
        if args.triton:
            triton_fn = jax.jit(functools.partial(decode.paged_decode_attention, spec=spec, lowering="triton",
                                                  interpret=args.interpret))
            calls.append(lambda: triton_fn(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, None, 1.0, 1.0))
        first = calls[0]()
        for config, call in zip(configs[1:] + ["the Triton kernel"] * args.triton, calls[1:]):
            if not jnp.allclose(call().astype(jnp.float32), first.astype(jnp.float32), atol=2e-2, rtol=2e-2):
                raise AssertionError(f"{config} and {configs[0]} disagree")
        print(f"{case.label}:", flush=True)
        rounds = 1 if args.interpret else args.rounds
        ms = compare_kernels(calls, timer, rounds)
        for i, config in enumerate(configs):
            tiling = plans.plan_mosaic_decode_tiling(x.q.shape, x.k_cache.shape, x.block_table.shape[1],
                                                     x.q.dtype, config)
            t = ms[i]
            against = "" if i == 0 else f" (first config in the same rounds: {ms[0]:.4f} ms)"
            print(f"  {config}\n    {tiling}\n    {t:.4f} ms, {kv_bytes / t / 1e6:.0f} GB/s{against}", flush=True)
            if args.timeline:
                trace_dir = pathlib.Path(args.timeline) / f"{index}-{i}"
                trace_dir.mkdir(parents=True, exist_ok=True)
                workers = max(tiling.compute_warpgroups, 1)
                timeline, _, _ = profiled_timeline(call_for(config, str(trace_dir)), trace_dir, workers,
                                                   tiling.warp_specialized)
                print(timeline, flush=True)
        if args.torch:
            torch_ms = time_torch_sdpa(x, case, timer)
            print(f"  torch cuDNN SDPA, contiguous K/V\n    {torch_ms:.4f} ms, {kv_bytes / torch_ms / 1e6:.0f} GB/s",
                  flush=True)
        if args.triton:
            first_ms, triton_ms = ms[0], ms[-1]
            print(f"  the Triton kernel (the package's DecodeConfig)\n    {triton_ms:.4f} ms, "
                  f"{kv_bytes / triton_ms / 1e6:.0f} GB/s (first config in the same rounds: {first_ms:.4f} ms)",
                  flush=True)
    return 0


def parse_case(text: str) -> DecodeCase:
    """``"B,CTX,HQ,HK[,D]"`` -> a `DecodeCase` (head size 128 if not given)."""
    fields = parse_case_fields(text, "B,CTX,HQ,HK[,D]", (4, 5))
    return DecodeCase(*fields[:4], fields[4] if len(fields) == 5 else 128)


def time_torch_sdpa(x, case: DecodeCase, timer: Timer) -> float:
    """ms of `bench_attention.py`'s ``torch_sdpa_cudnn`` peer (`peers._torch_sdpa`: torch's cuDNN
    SDPA over this shape's K/V made contiguous) on these inputs."""
    context = Context(timer, Deadline(math.inf))
    return _torch_sdpa("CUDNN_ATTENTION")(context, case, x).ms


if __name__ == "__main__":
    sys.exit(main())
