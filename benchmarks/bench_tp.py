#!/usr/bin/env python3
"""Decode throughput of `LLMEngine` with tensor parallelism: the same model on 1 and on
several GPUs, beside the floor of reading the weights once per step.

    python benchmarks/bench_tp.py [--model 8b,70b] [--tp 1,2] [--batches 1,32,256]
                                  [--prompt-len 128] [--new-tokens 128]
                                  [--num-scheduler-steps 16] [--engine-option FIELD=VALUE ...]
                                  [--warm-up requests|engine] [--json PATH] [--quick]

Models (random bfloat16 weights, seed 0), each with its own default tensor-parallel
sizes and batches:

* ``8b``: Llama 3 8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128,
  intermediate 14336, vocabulary 128256), tp 1 and 2, batches 1 / 32 / 256;
* ``70b``: Llama 3 70B's shape (hidden 8192, 80 layers, 64 query / 8 KV heads of 128,
  intermediate 28672, vocabulary 128256), tp 2 (its 141 GB do not fit one H200),
  batches 1 / 32.

``--tp`` and ``--batches`` replace the defaults of every model. tp = 1 is the model
without a mesh (what a one-GPU user runs; the projections follow
``--matmul-implementation``, whose auto may take the weight-streaming kernel there); a
larger tp builds the model with ``mesh=`` over the first tp devices, each device
creating only its own shards of the random weights (`jax_paged_attn.parallel.
init_sharded`), and its projections use XLA's dot (the kernel is not partitioned over
devices). A tp larger than the devices, or whose weights would not fit a device, is
skipped and said so; the exit code is 1 when no row was measured.

Each row is timed as `bench_engine.py` times the engine (`bench_engine.bench_engine`):
B prompts of ``--prompt-len`` random tokens, greedy decoding of N = ``--new-tokens``
tokens (EOS ignored), calls of N and of 1 new tokens alternating twice after a warm-up;
**decode tok/s** = ``B * (N - 1) / (best t(N) - best t(1))`` by wall clock, and
**ms/step** the wall time of one decode step that makes. **tp=T / tp=1** is a row's
decode tok/s over the same model and batch's at tp = 1. The **weight-read floor** of a
step is the bytes of the weights a decode step reads (all parameters but the input
embedding table, of which a step gathers B rows) over ``tp x`` the GPU's copy rate
(`timing.device_copy_rate`, measured at the start; each device reads its own shards); **of floor** is our
decode tok/s over the floor's. The warm-up defaults to untimed runs of the timed
requests (``--warm-up requests``): `LLMEngine.warmup()` would compile every program of
the configuration, many more than the timed requests reach, each over 32 or 80 layers.

``--quick``: a tiny float32 model (the engine tests' shape) at tp 1 and 2 on whatever
backend JAX has; with fewer devices than the largest tp it reruns itself on that many
forced CPU devices (a CPU smoke run of every part of the script).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

# Run as a script from anywhere: make the working tree's jax_paged_attn and the
# benchmarks' shared modules importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (_REPO, _REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_engine import bench_engine  # noqa: E402
from engine_common import add_decode_run_arguments, parse_engine_options  # noqa: E402
from jax_paged_attn import matmul, parallel  # noqa: E402
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from timing import device_copy_rate  # noqa: E402

LLAMA_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
    max_position_embeddings=8192,
)
LLAMA_70B = LlamaConfig(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
    max_position_embeddings=8192,
)
MODELS: dict[str, tuple[LlamaConfig, tuple[int, ...], tuple[int, ...]]] = {
    "8b": (LLAMA_8B, (1, 2), (1, 32, 256)),
    "70b": (LLAMA_70B, (2,), (1, 32)),
}
"""Model name -> (config, default tensor-parallel sizes, default batches)."""

QUICK_MODEL = "tiny"
QUICK_DEFAULTS = dict(tp=(1, 2), batches=(2,), prompt_len=4, new_tokens=3)


def weight_bytes(config: LlamaConfig, dtype: Any) -> tuple[int, int]:
    """(bytes of every parameter, bytes a decode step reads: all but the input embedding
    table when it is not tied to the LM head) of a model of ``config`` in ``dtype``."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
    total = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(nnx.state(abstract)))
    embedding = config.vocab_size * config.hidden_size * jnp.dtype(dtype).itemsize
    return total, total - (0 if config.tie_word_embeddings else embedding)


def device_memory_bytes() -> int | None:
    """The first device's allocator limit (None where the backend does not say: CPU)."""
    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    return None if not stats else stats.get("bytes_limit")


def build_model(config: LlamaConfig, dtype: Any, tp: int, *, implementation: str | None,
                matmul_implementation: str | None) -> LlamaForCausalLM:
    """The random-weight model (seed 0): without a mesh at tp = 1, else created sharded
    over the first ``tp`` devices."""
    mesh = parallel.tensor_parallel_mesh(tp) if tp > 1 else None
    # The weight-streaming kernel is not partitioned over devices: with a mesh, auto (XLA's dot).
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, mesh=mesh,
                            implementation=implementation,
                            matmul_implementation=None if mesh is not None else matmul_implementation)


def table_columns(tps: Sequence[int]) -> list[str]:
    """The table's header for a run of tensor-parallel sizes ``tps``: one ratio column
    ``tp=T / tp=1`` per size T > 1."""
    ratio_columns = [f"tp={tp} / tp=1" for tp in sorted(set(tps)) if tp > 1]
    return ["model", "tp", "batch", "generate ms (first / best)", "decode tok/s (wall clock)",
            "ms/step (wall clock)", *ratio_columns, "weight-read floor ms/step", "floor tok/s", "of floor",
            "compiles after start"]


def _rerun_on_forced_cpu_devices(argv: Sequence[str], num_devices: int) -> list[dict[str, Any]]:
    """``--quick`` with fewer devices than its largest tp: this script again in a process
    with ``num_devices`` forced CPU devices (a flag XLA reads only when it starts); its
    output is printed here and its rows returned."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = os.path.join(tmp, "rows.json")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
        # The last --json wins: the caller's file is written here, from the rows.
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json", rows_path], env=env,
                              text=True, capture_output=True)
        print(done.stdout, end="")
        if done.returncode:
            raise RuntimeError(f"bench_tp.py on {num_devices} forced CPU devices failed (exit {done.returncode}):\n"
                               f"{done.stderr[-4000:]}")
        with open(rows_path) as f:
            return json.load(f)["rows"]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="8b,70b", help=f"comma-separated models: {', '.join(MODELS)}")
    parser.add_argument("--tp", default=None, help="comma-separated tensor-parallel sizes for every model "
                                                   "(default: 8b 1,2; 70b 2)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes for every model "
                                                        "(default: 8b 1,32,256; 70b 1,32)")
    add_decode_run_arguments(parser, quick_prompt_len=4, quick_new_tokens=3)
    parser.add_argument("--implementation", default=None,
                        help="paged attention implementation: auto (default), xla, triton")
    parser.add_argument("--matmul-implementation", default=None, choices=matmul.IMPLEMENTATION_CHOICES,
                        help="the projections at tp = 1 (default auto); with a mesh always XLA's dot")
    parser.add_argument("--warm-up", default="requests", choices=("requests", "engine"),
                        help="requests: untimed generate calls of the timed requests compile the programs they "
                             "reach; engine: LLMEngine.warmup() compiles every program of the configuration")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows to PATH")
    parser.add_argument("--quick", action="store_true",
                        help="tiny float32 model at tp 1,2: a CPU smoke run (forced CPU devices when needed)")
    args = parser.parse_args(argv)
    engine_options = parse_engine_options(args.engine_option)

    if args.quick:
        models = {QUICK_MODEL: (LlamaConfig.tiny(num_hidden_layers=1), QUICK_DEFAULTS["tp"],
                                QUICK_DEFAULTS["batches"])}
        dtype = jnp.float32
        compiler_options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    else:
        unknown = [m for m in args.model.split(",") if m not in MODELS]
        if unknown:
            parser.error(f"--model {args.model}: unknown {unknown}; known: {', '.join(MODELS)}")
        models = {m: MODELS[m] for m in args.model.split(",")}
        dtype, compiler_options = jnp.bfloat16, None
    tp_override = tuple(int(t) for t in args.tp.split(",")) if args.tp else None
    batch_override = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
    plan = {name: (config, tp_override or tps, batch_override or batches) for name, (config, tps, batches)
            in models.items()}
    all_tps = sorted({tp for _, tps, _ in plan.values() for tp in tps})
    prompt_len = args.prompt_len or (QUICK_DEFAULTS["prompt_len"] if args.quick else 128)
    new_tokens = args.new_tokens or (QUICK_DEFAULTS["new_tokens"] if args.quick else 128)
    if new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (decode is timed as t(N) - t(1)), got {new_tokens}")

    num_devices = len(jax.devices())
    if args.quick and num_devices < max(all_tps) and jax.default_backend() == "cpu" and \
            "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        rows = _rerun_on_forced_cpu_devices(argv, max(all_tps))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
        return rows

    start = time.perf_counter()
    memory = device_memory_bytes()
    copy_rate = device_copy_rate()
    columns = table_columns(all_tps)
    print(f"# LLMEngine decode with tensor parallelism: {jnp.dtype(dtype).name} random weights, prompt "
          f"{prompt_len}, {new_tokens} new tokens, block size {args.block_size}, {args.num_scheduler_steps}-step "
          f"decode windows, {num_devices} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}; projections at tp = 1: matmul_implementation="
          f"{args.matmul_implementation or 'auto'}, with a mesh: xla; warm-up: {args.warm_up}"
          + (f"; engine options {engine_options}" if engine_options else ""))
    print(f"# decode tok/s = B * (N - 1) / (best t(N) - best t(1)) by wall clock; floor = bytes a step reads "
          f"(weights but the input embedding) / (tp x {copy_rate / 1e12:.2f} TB/s, the measured copy rate)")
    skipped: list[str] = []
    warm_ups: list[str] = []
    rows: list[dict[str, Any]] = []
    header_printed = False
    rng = np.random.default_rng(0)
    for name, (config, tps, batches) in plan.items():
        total_bytes, read_bytes = weight_bytes(config, dtype)
        for tp in sorted(tps):
            if tp > num_devices:
                skipped.append(f"{name} tp={tp}: needs {tp} devices, this host has {num_devices}")
                continue
            if memory is not None and total_bytes / tp > 0.9 * memory:
                skipped.append(f"{name} tp={tp}: {total_bytes / tp / 1e9:.0f} GB of weights per device do not fit "
                               f"its {memory / 1e9:.0f} GB")
                continue
            model = build_model(config, dtype, tp, implementation=args.implementation,
                                matmul_implementation=args.matmul_implementation)
            floor_s = read_bytes / (tp * copy_rate)
            for batch in batches:
                prompts = rng.integers(0, config.vocab_size, size=(batch, prompt_len))
                result = bench_engine(model, prompts, new_tokens, block_size=args.block_size,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      num_scheduler_steps=args.num_scheduler_steps, compiler_options=compiler_options,
                                      engine_options=engine_options, whole_engine_warm_up=args.warm_up == "engine")
                tok_s = result["decode_tok_s"]
                base = next((r for r in rows if r["model"] == name and r["tp"] == 1 and r["batch"] == batch), None)
                row = dict(model=name, tp=tp, batch=batch, generate_first_ms=result["first_ms"],
                           generate_ms=result["best_ms"], decode_tok_s=tok_s, ms_per_step=1e3 * batch / tok_s,
                           speedup_vs_tp1=None if base is None or tp == 1 else tok_s / base["decode_tok_s"],
                           floor_ms_per_step=1e3 * floor_s, floor_tok_s=batch / floor_s,
                           fraction_of_floor=tok_s * floor_s / batch,
                           compiles_after_start=result["compiles_after_start"])
                rows.append(row)
                warm_ups.append(f"{name} tp={tp} batch {batch}: {result['warm_up'].describe()}")
                ratios = ["" if t != tp else ("n/a" if row["speedup_vs_tp1"] is None else
                                              f"{row['speedup_vs_tp1']:.2f}") for t in all_tps if t > 1]
                cells = [name, tp, batch, f"{row['generate_first_ms']:,.1f} / {row['generate_ms']:,.1f}",
                         f"{tok_s:,.0f}", f"{row['ms_per_step']:.2f}", *ratios, f"{row['floor_ms_per_step']:.2f}",
                         f"{row['floor_tok_s']:,.0f}", f"{row['fraction_of_floor']:.2f}",
                         row["compiles_after_start"]]
                if not header_printed:
                    print()
                    print("| " + " | ".join(columns) + " |")
                    print("| " + " | ".join("---" for _ in columns) + " |")
                    header_printed = True
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            del model
            gc.collect()
    print()
    for line in warm_ups:
        print(line)
    for line in skipped:
        print(f"skipped {line}")
    print(f"total time {time.perf_counter() - start:.1f} s (weight init and compilation included)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    return rows


if __name__ == "__main__":
    if not main():
        print("no row measured")
        sys.exit(1)
