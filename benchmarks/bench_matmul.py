#!/usr/bin/env python3
"""The decode step's matrix products: the weight-streaming matmul beside XLA's dot.

    python benchmarks/bench_matmul.py [--rows 2,32,128] [--budget-s 240] [--out DIR] [--quick]

Products: those of one decode step of `bench_engine.py`'s ~1B Llama (hidden 2048,
intermediate 8192, 32 query / 8 KV heads of 64, vocab 32000), bfloat16: the fused
q/k/v projection, o, the fused gate/up projection, down (16 of each per step) and the
LM head (1 per step).

Each product is timed as a chain over separate weight arrays (a layer's worth each,
together several times the 50 MB L2), so every call reads its weights from HBM as in a
decode step; the time per call is the chain's device time divided by its length
(`timing.Timer`). Per rows: GB/s of weights read for XLA and for the kernel's
best config of a sweep (`--quick`: the default config only), the ratio, and the sum
over one step (16 layers + head) against the weight-read floor at the GPU's measured copy
rate (`timing.device_copy_rate`). Outputs are
compared with XLA's (max |diff| / max |ref|).

These chains measure each product alone; on an H200 they put XLA's small GEMMs at
0.7 TB/s where, inside the engine's compiled decode step, the same GEMMs ran at 1.7-2.0
TB/s, level with the kernel. What decides a choice is `profile_engine.py` (per-kernel
times inside the step) with ``--matmul-implementation``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Any, Callable

_HERE = pathlib.Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_paged_attn import matmul  # noqa: E402
from jax_paged_attn.tuning import MatmulConfig  # noqa: E402
from timing import Timer, device_copy_rate, short_error  # noqa: E402

CHAIN_BYTES = 400e6
"""Weight bytes per timed chain: several times the L2, so no call reads its weights from it."""

# (name, K, N, calls per decode step)
PRODUCTS = (
    ("qkv_proj", 2048, 3072, 16),
    ("o_proj", 2048, 2048, 16),
    ("gate_up_proj", 2048, 16384, 16),
    ("down_proj", 8192, 2048, 16),
    ("lm_head", 2048, 32000, 1),
)


def sweep_configs(quick: bool) -> list[MatmulConfig]:
    if quick:
        return [MatmulConfig()]
    grid = [
        dict(),
        dict(target_programs=512),
        dict(target_programs=132),
        dict(block_k=256, num_stages=3),
        dict(block_k=64, num_stages=6),
        dict(block_n=128),
        dict(block_n=128, block_k=64),
        dict(block_n=32),
        dict(block_n=32, block_k=256),
        dict(num_stages=6),
        dict(num_stages=3),
        dict(eviction_policy=""),
        dict(block_n=128, num_stages=3, target_programs=512),
        dict(num_warps=8),
    ]
    return [MatmulConfig(**g) for g in grid]


def describe(config: MatmulConfig) -> str:
    default = MatmulConfig()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(default, f.name)}
    return ",".join(f"{k}={v}" for k, v in changed.items()) or "default"


def chain(product: Callable[[Any, Any], Any], num: int) -> Callable[..., Any]:
    @jax.jit
    def run(x, *weights):
        return [product(x, w) for w in weights[:num]]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2,32,128")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="default config only, small chains")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke run)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    timer = Timer(warmup=2, reps=7, sample_ms=4.0)
    end = time.monotonic() + args.budget_s
    dtype = jnp.bfloat16
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, bfloat16", flush=True)
    records = []
    configs = sweep_configs(args.quick or args.interpret)
    for name, depth, cols, per_step in PRODUCTS:
        nbytes = depth * cols * 2
        if args.interpret:
            depth, cols = min(depth, 256), min(cols, 256)
            nbytes = depth * cols * 2
        num = 2 if (args.quick or args.interpret) else max(2, math.ceil(CHAIN_BYTES / nbytes))
        key = jax.random.key(0)
        weights = [jax.random.normal(jax.random.fold_in(key, i), (depth, cols), dtype) * depth ** -0.5
                   for i in range(num)]
        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + rows), (rows, depth), dtype)
            rec: dict[str, Any] = dict(product=name, rows=rows, K=depth, N=cols, per_step=per_step, chain=num)
            try:
                xla_chain = chain(matmul.xla_matmul, num)
                ms, _, ref = timer.jax(lambda: xla_chain(x, *weights))
                rec["xla_ms"] = ms / num
            except Exception as e:  # noqa: BLE001
                rec["xla_error"] = short_error(e)
                ref = None
            trials = []
            for config in configs:
                if time.monotonic() > end:
                    trials.append(dict(config=describe(config), skipped="time budget"))
                    continue
                reason = matmul.streaming_unsupported_reason(x, weights[0], config)
                if reason:
                    trials.append(dict(config=describe(config), skipped=reason))
                    continue
                fn = chain(lambda a, b, c=config: matmul.weight_streaming_matmul(a, b, config=c,
                                                                                 interpret=args.interpret), num)
                try:
                    ms, _, out = timer.jax(lambda: fn(x, *weights))
                except Exception as e:  # noqa: BLE001 - one config failing must not stop the sweep
                    trials.append(dict(config=describe(config), error=short_error(e, 300)))
                    continue
                err = None
                if ref is not None:
                    diff = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
                               for o, r in zip(out, ref))
                    err = diff / max(float(jnp.max(jnp.abs(ref[0].astype(jnp.float32)))), 1e-30)
                trials.append(dict(config=describe(config), ms=ms / num, rel_err=err))
            rec["trials"] = trials
            timed = [t for t in trials if "ms" in t]
            if timed:
                best = min(timed, key=lambda t: t["ms"])
                rec.update(ours_ms=best["ms"], ours_config=best["config"], ours_rel_err=best["rel_err"],
                           default_ms=next((t["ms"] for t in timed if t["config"] == "default"), None))
            records.append(rec)
            gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9 if ms else float("nan")  # noqa: E731
            line = f"{name:13s} rows {rows:4d}  xla {rec.get('xla_ms', float('nan')) * 1e3:8.1f} us " \
                   f"({gbps(rec.get('xla_ms')):6.0f} GB/s)"
            if "ours_ms" in rec:
                line += (f"  ours {rec['ours_ms'] * 1e3:8.1f} us ({gbps(rec['ours_ms']):6.0f} GB/s) "
                         f"x{rec.get('xla_ms', float('nan')) / rec['ours_ms']:.2f} [{rec['ours_config']}] "
                         f"err {rec['ours_rel_err']:.1e}")
            else:
                line += "  ours: " + "; ".join(t.get("error") or t.get("skipped") for t in trials)[:300]
            print(line, flush=True)
    print("\n| rows | XLA ms/step | ours ms/step (best per product) | ours default ms/step | floor ms/step | ours / XLA |")
    print("| --- | --- | --- | --- | --- | --- |")
    floor_ms = sum(d * n * 2 * s for _, d, n, s in PRODUCTS) / device_copy_rate() * 1e3
    for rows in rows_list:
        recs = [r for r in records if r["rows"] == rows]
        xla = sum(r.get("xla_ms", float("nan")) * r["per_step"] for r in recs)
        ours = sum(r.get("ours_ms", float("nan")) * r["per_step"] for r in recs)
        default = sum((r.get("default_ms") or float("nan")) * r["per_step"] for r in recs)
        print(f"| {rows} | {xla:.3f} | {ours:.3f} | {default:.3f} | {floor_ms:.3f} | {xla / ours:.2f} |")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "matmul.json").write_text(json.dumps(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                                                          records=records), indent=1))


if __name__ == "__main__":
    main()
