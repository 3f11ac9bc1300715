#!/usr/bin/env python3
"""Where the time of a Mosaic GPU prefill call goes, beside the stock Mosaic GPU kernel.

    python benchmarks/prefill_parts.py [--config FIELD=VALUE ...] [--reps N]

For each dense causal shape of `bench_attention.py`'s prefill suite (bf16, packed
sequences of equal length), times back-to-back calls (`bench_attention.Timer`) of:

* ``full``: `jax_paged_attn.prefill.varlen_attention` with ``lowering="mosaic_gpu"``,
  what a user's call runs;
* ``plan``: `jax_paged_attn.plans.plan_tiles` alone, the work list computed under jit
  before every kernel call;
* ``kernel``: `jax_paged_attn.kernels.mosaic_prefill.varlen_attention_call` with the
  plan computed beforehand;
* ``stock_bkv64`` / ``stock_bkv128``: JAX's stock ``attention_mgpu`` kernel (fp16, the
  query pre-scaled, 64-row query blocks, 64- / 128-key blocks, a 2-deep ring), which has
  no plan, no varlen and no masking of non-finite values.

``--config`` overrides fields of `jax_paged_attn.tuning.MosaicPrefillConfig` with Python
literals (`kernel_resources.parse_overrides`; e.g. ``--config "nonfinite_check='probe'"``).
The kernel's output is checked against the whole
call's. Needs a Hopper GPU, exits with 2 otherwise, except with ``--interpret``: a CPU
dry run (one small shape, the Mosaic GPU interpreter, the stock kernel left out;
`tests/test_benchmarks_smoke.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_attention import Timer, short_error  # noqa: E402
from kernel_resources import parse_overrides  # noqa: E402

SHAPES = ((8, 2048, 32, 8, 128), (1, 16384, 32, 8, 128), (16, 1024, 32, 8, 64), (4, 4096, 16, 16, 256))
"""(batch, sequence length, query heads, KV heads, head size): the prefill suite's shapes."""
INTERPRET_SHAPES = ((2, 80, 2, 1, 64),)


def parse_config(pairs: list[str], interpret: bool):
    from jax_paged_attn import tuning

    # The interpreter runs the single-warpgroup form several times faster (tuning's default there).
    base = tuning.MOSAIC_PREFILL_CONFIG_SINGLE_WARPGROUP if interpret else tuning.MOSAIC_PREFILL_CONFIG
    return dataclasses.replace(base, **parse_overrides(pairs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="MosaicPrefillConfig fields (default: the package default)")
    parser.add_argument("--reps", type=int, default=10, help="timed samples per measurement (median)")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run in the Mosaic GPU interpreter")
    parser.add_argument("--head-sizes", type=int, nargs="*", metavar="D",
                        help="only the shapes of these head sizes (default: every shape)")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and not args.interpret:
        print("prefill_parts.py needs a GPU (the Mosaic GPU kernels run on Hopper)", file=sys.stderr)
        return 2
    from jax_paged_attn import plans, prefill
    from jax_paged_attn.kernels import mosaic_prefill
    from jax_paged_attn.spec import AttentionSpec

    config = parse_config(args.config, args.interpret)
    interpret = args.interpret
    timer = Timer(warmup=1, reps=1) if interpret else Timer(reps=args.reps)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {config}")
    for batch, seq, q_heads, kv_heads, head_size in INTERPRET_SHAPES if interpret else SHAPES:
        if args.head_sizes and head_size not in args.head_sizes:
            continue
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (batch * seq, q_heads, head_size), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch * seq, kv_heads, head_size), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch * seq, kv_heads, head_size), jnp.bfloat16)
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * seq
        spec = AttentionSpec.create(head_size, causal=True)
        full = jax.jit(functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=seq,
                                         max_seqlen_k=seq, lowering="mosaic_gpu", config=config,
                                         interpret=interpret))
        tiling = plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, max_seqlen_q=seq, max_seqlen_k=seq,
                                                  block_size=None, config=config)
        plan_fn = jax.jit(lambda cu: plans.plan_tiles(
            cu, cu, None, num_q_tokens=batch * seq, num_packed_keys=batch * seq, key_capacity=None,
            spec=spec, max_seqlen_q=seq, max_seqlen_k=seq, positions_per_tile=tiling.block_q,
            block_k=tiling.block_k, longest_first=tiling.longest_first, align_rows=plans.MOSAIC_TMA_ROW_ALIGN))
        plan = plan_fn(cu)
        if interpret:  # (the jax 0.10 interpreter cannot read past an array's end: a tile of zero rows)
            pad = lambda x: jnp.pad(x, ((0, 128),) + ((0, 0),) * (x.ndim - 1))
        else:
            pad = lambda x: x
        rows = slice(0, batch * seq) if tiling.direct_output else slice(None)  # (else one slab per tile)
        kernel = jax.jit(lambda q, k, v, plan: mosaic_prefill.varlen_attention_call(
            pad(q), (pad(k)[None, None], 0), (pad(v)[None, None], 0), plan, None, None, None, spec=spec,
            tiling=tiling, interpret=interpret)[rows])
        times = {}
        times["full"], _, whole = timer.jax(lambda: full(q, k, v, cu, cu, None, None, None, 1.0, 1.0))
        times["plan"], _, _ = timer.jax(lambda: plan_fn(cu))
        times["kernel"], _, part = timer.jax(lambda: kernel(q, k, v, plan))
        if tiling.direct_output and not jnp.array_equal(part, whole):
            raise AssertionError("the kernel alone and the whole call disagree")
        if interpret:  # (JAX's stock kernel has no interpret path here)
            block_kvs = ()
        else:
            from jax.experimental.pallas.ops.gpu import attention_mgpu as stock

            block_kvs = (64, 128)
        dense = lambda x: x.reshape(batch, seq, *x.shape[1:])
        q16 = dense((q.astype(jnp.float32) * head_size ** -0.5).astype(jnp.float16))
        k16, v16 = dense(k.astype(jnp.float16)), dense(v.astype(jnp.float16))
        for block_kv in block_kvs:
            tuning = stock.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=True)
            fn = jax.jit(functools.partial(stock.attention, config=tuning))
            try:
                times[f"stock_bkv{block_kv}"], _, _ = timer.jax(lambda: fn(q16, k16, v16))
            except Exception as e:  # noqa: BLE001 - e.g. shared memory at D 256: say so, go on
                print(f"  stock_bkv{block_kv}: {short_error(e, 160)}")
        flop = 4 * batch * q_heads * head_size * seq * seq / 2
        print(f"B{batch} S{seq} Hq{q_heads} Hk{kv_heads} D{head_size} ({tiling.compute_warpgroups} compute "
              f"warpgroups, block_k {tiling.block_k}, work rows {tiling.work_rows}): " + "  ".join(
            f"{name} {ms:.3f} ms" + (f" ({flop / ms / 1e9:.0f} TFLOP/s)" if name != "plan" else "")
            for name, ms in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
