#!/usr/bin/env python3
"""Registers, spills and shared memory of the attention kernels as XLA compiles them.

    python benchmarks/kernel_resources.py [--kernel prefill|decode] [--implementation triton|mosaic_gpu]
                                          [--config FIELD=VALUE ...] [--out DIR]

Compiles one call of the kernel (prefill: B8 S2048 Hq32 Hk8 D128 bf16 causal, packed;
decode: B64 ctx4096 Hq32 Hk8 D128 bf16, page 16) on the GPU with XLA's dump on, then runs
``ptxas -v`` for the GPU's architecture over each PTX file of the dump and prints, for
each kernel entry, its registers per thread, spill stores / loads and shared memory.
The Triton kernels are compiled by XLA's own Triton, so this is what the GPU runs, which
a compile with another Triton release need not match. ``--config`` overrides fields of
the kernel's config (the tuned one for Triton, the default for Mosaic GPU; e.g.
``--config masked_block_k=16``) to compare variants.

Needs a CUDA GPU and ``ptxas`` on the PATH; exits with 2 otherwise. The Mosaic GPU
kernels compile to a binary without a PTX dump, so for them the tool reports what the
dump holds (the surrounding XLA kernels).
"""
from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

_REPO = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SHARED = re.compile(r"(\d+) bytes smem")


@dataclasses.dataclass
class EntryResources:
    """What ptxas reports for one kernel entry."""

    name: str
    arch: str
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    shared_bytes: int | None = None


def parse_ptxas_verbose(text: str) -> list[EntryResources]:
    """The per-entry figures of ``ptxas -v`` output, in the order ptxas prints them."""
    entries: list[EntryResources] = []
    for line in text.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            entries.append(EntryResources(entry.group(1), entry.group(2)))
            continue
        if not entries:
            continue
        current = entries[-1]
        if (spills := _SPILLS.search(line)) and current.spill_store_bytes is None:
            current.spill_store_bytes, current.spill_load_bytes = int(spills.group(1)), int(spills.group(2))
        if (registers := _REGISTERS.search(line)) and current.registers is None:
            current.registers = int(registers.group(1))
            if shared := _SHARED.search(line):
                current.shared_bytes = int(shared.group(1))
    return entries


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``["masked_block_k=16", "num_stages=2"]`` -> ``{"masked_block_k": 16, "num_stages": 2}``
    (values are Python literals)."""
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"--config takes FIELD=VALUE, got {item!r}")
        try:
            overrides[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--config {item!r}: the value must be a Python literal") from None
    return overrides


def _compile_once(kernel: str, implementation: str, overrides: dict[str, object]) -> str:
    """Compiles and runs the kernel's call once; returns a description of the config."""
    import jax
    import jax.numpy as jnp

    from jax_paged_attn import decode, prefill, tuning
    from jax_paged_attn.spec import AttentionSpec

    key = jax.random.key(0)
    spec = AttentionSpec.create(128, causal=True)
    if kernel == "prefill":
        batch, seq, q_heads, kv_heads, head = 8, 2048, 32, 8, 128
        default = (tuning.prefill_config(head, "bfloat16", False) if implementation == "triton"
                   else tuning.mosaic_prefill_config(head, "bfloat16", False))
        config = dataclasses.replace(default, **overrides)
        q = jax.random.normal(key, (batch * seq, q_heads, head), jnp.bfloat16)
        kv = jax.random.normal(key, (batch * seq, kv_heads, head), jnp.bfloat16)
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * seq
        fn = jax.jit(lambda q, k, v, cu: prefill.varlen_attention(
            q, k, v, cu, cu, None, None, None, 1.0, 1.0, spec=spec, max_seqlen_q=seq, max_seqlen_k=seq,
            lowering=implementation, config=config))
        fn(q, kv, kv, cu).block_until_ready()
        return repr(config)
    batch, context, q_heads, kv_heads, head, page = 64, 4096, 32, 8, 128, 16
    default = (tuning.decode_config(head, page, q_heads // kv_heads) if implementation == "triton"
               else tuning.mosaic_decode_config(head, page, q_heads // kv_heads))
    config = dataclasses.replace(default, **overrides)
    blocks = batch * context // page
    q = jax.random.normal(key, (batch, 1, q_heads, head), jnp.bfloat16)
    cache = jax.random.normal(key, (blocks, page, kv_heads, head), jnp.bfloat16)
    table = jax.random.permutation(key, blocks).astype(jnp.int32).reshape(batch, -1)
    lengths = jnp.full((batch,), context, jnp.int32)
    fn = jax.jit(lambda q, k, v, n, t: decode.paged_decode_attention(
        q, k, v, n, t, None, 1.0, 1.0, spec=spec, lowering=implementation, config=config))
    fn(q, cache, cache, lengths, table).block_until_ready()
    return repr(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--kernel", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--implementation", choices=("triton", "mosaic_gpu"), default="triton")
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="keep the dump here")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.config)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        print("kernel_resources.py: no ptxas on the PATH (install the CUDA toolkit)", file=sys.stderr)
        return 2
    dump = args.out or pathlib.Path(tempfile.mkdtemp(prefix="kernel_resources_"))
    dump.mkdir(parents=True, exist_ok=True)
    # XLA reads its flags when the backend starts: set them before JAX's first use.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"kernel_resources.py: no GPU here (JAX's default device is {device.platform})", file=sys.stderr)
        return 2
    arch = "sm_" + str(getattr(device, "compute_capability", "9.0")).replace(".", "")
    arch += "a" if arch in ("sm_90", "sm_100") else ""
    config = _compile_once(args.kernel, args.implementation, overrides)
    print(f"{device.device_kind} | jax {jax.__version__} | {args.kernel} {args.implementation} | {config}")
    ptx_files = sorted(dump.rglob("*.ptx"))
    if not ptx_files:
        # (jax 0.11.2 on the H200 left none in the top folder: say what the dump holds.)
        kinds = collections.Counter(p.suffix or p.name for p in dump.rglob("*") if p.is_file())
        print(f"no PTX in the dump ({dump}); it holds {dict(kinds.most_common(12))}", file=sys.stderr)
        return 1
    for path in ptx_files:
        result = subprocess.run([ptxas, f"-arch={arch}", "-v", str(path), "-o", os.devnull],
                                capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{path.name}: ptxas failed: {result.stderr.strip()[-500:]}")
            continue
        for entry in parse_ptxas_verbose(result.stderr):
            print(f"{path.name}: {entry.name} [{entry.arch}] registers {entry.registers}, spills "
                  f"{entry.spill_store_bytes} B stored / {entry.spill_load_bytes} B loaded, "
                  f"shared {entry.shared_bytes} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
