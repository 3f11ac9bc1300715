#!/usr/bin/env python3
"""Registers, spills and shared memory of the attention kernels as XLA compiles them.

    python benchmarks/kernel_resources.py [--kernel prefill|decode] [--implementation triton|mosaic_gpu]
                                          [--config FIELD=VALUE ...] [--out DIR] [--sass]

Compiles one call of the kernel (prefill: B8 S2048 Hq32 Hk8 D128 bf16 causal, packed;
decode: B64 ctx4096 Hq32 Hk8 D128 bf16, page 16) on the GPU with XLA's dump on, then runs
``ptxas -v`` for the GPU's architecture over each PTX file of the dump and prints, for
each kernel entry, its registers per thread, spill stores / loads and shared memory.
The Triton kernels are compiled by XLA's own Triton, so this is what the GPU runs, which
a compile with another Triton release need not match. ``--config`` overrides fields of
the kernel's config (the tuned one for Triton, the default for Mosaic GPU; e.g.
``--config masked_block_k=16``) to compare variants.

The Mosaic GPU kernels compile to a binary without a PTX file in XLA's dump: for them
the call is compiled in a child process with Mosaic GPU's own ``MOSAIC_GPU_DUMP_PTXAS``
on (its ptxas report: registers, spills, and ptxas's "Potential Performance Loss" notes:
C7513 or C7512, wgmma instructions serialized, which undoes any overlap of two wgmmas;
C7507, a ``setmaxnreg`` register split ignored) and, with ``--sass``,
``MOSAIC_GPU_DUMP_SASS`` (the kernel's machine code: the count of its local-memory
spill instructions, ``STL`` / ``LDL``; for each innermost loop that issues wgmma (the
per-block loops), its instructions a pass, wgmma, spill and MUFU instructions; the whole
output kept in ``--out``).

Needs a CUDA GPU and ``ptxas`` on the PATH (the Triton tier); exits with 2 otherwise.
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
_PERFORMANCE_NOTE = re.compile(r"\((C7\d{3})\) Potential Performance Loss: (.*?)\.?\s*$")
_NOTE_FUNCTION = re.compile(r" (?:in|for) the function '([^']+)'")
_SPILL_INSTRUCTION = re.compile(r"\b(STL|LDL)(\.\w+)*\b")


@dataclasses.dataclass
class EntryResources:
    """What ptxas reports for one kernel entry."""

    name: str
    arch: str
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    shared_bytes: int | None = None
    # ptxas's "Potential Performance Loss" notes, "C7512 wgmma.mma_async instructions are
    # serialized due to insufficient register resources" and the like.
    performance_notes: tuple[str, ...] = ()

    @property
    def serialized_wgmma(self) -> bool:  # (C7512 / C7513: wgmma instructions issued one after the other)
        return any("serialized" in note for note in self.performance_notes)


def parse_ptxas_verbose(text: str) -> list[EntryResources]:
    """The per-entry figures of ``ptxas -v`` output, in the order ptxas prints them. A
    performance note comes before its function's entry line and goes to the function it
    names, or (C7507 names none) to the next entry."""
    entries: list[EntryResources] = []
    notes: dict[str | None, list[str]] = collections.defaultdict(list)
    for line in text.splitlines():
        if note := _PERFORMANCE_NOTE.search(line):
            function = _NOTE_FUNCTION.search(note.group(2))
            notes[function.group(1) if function else None].append(
                f"{note.group(1)} {_NOTE_FUNCTION.sub('', note.group(2))}")
            continue
        entry = _ENTRY.search(line)
        if entry:
            name = entry.group(1)
            entries.append(EntryResources(name, entry.group(2),
                                          performance_notes=tuple(notes.pop(None, []) + notes.pop(name, []))))
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


def count_spill_instructions(sass: str) -> dict[str, int]:
    """Local-memory stores and loads (``STL`` / ``LDL``, register spills and their reloads)
    in SASS text, and how many of them lie between its first and last wgmma instruction
    (``HGMMA``; where the attention loops are) as ``STL_among_wgmma`` / ``LDL_among_wgmma``."""
    lines = sass.splitlines()
    wgmma_lines = [i for i, line in enumerate(lines) if "HGMMA" in line]
    first, last = (wgmma_lines[0], wgmma_lines[-1]) if wgmma_lines else (0, -1)
    counts: collections.Counter = collections.Counter()
    for i, line in enumerate(lines):
        for match in _SPILL_INSTRUCTION.finditer(line):
            counts[match.group(1)] += 1
            if first < i < last:
                counts[match.group(1) + "_among_wgmma"] += 1
    return {key: counts[key] for key in ("STL", "LDL", "STL_among_wgmma", "LDL_among_wgmma")}


_SASS_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")


@dataclasses.dataclass
class SassLoop:
    """A loop of SASS (a branch back to a label at or before it) and what it holds."""

    start: int  # address of its first instruction
    end: int  # address of the branch back
    instructions: int
    counts: dict[str, int]  # HGMMA (wgmma), STL / LDL (spills), MUFU (exp2, rcp)


def innermost_wgmma_loops(sass: str) -> list[SassLoop]:
    """The innermost loops of SASS text that issue wgmma instructions (the attention
    kernels' per-block loops, one per code path: each compute warpgroup's unmasked run,
    the masked blocks), in address order: a loop is a conditional branch back to a label
    at or before it, innermost when no other such loop lies inside it."""
    instructions: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if label := _SASS_LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif instruction := _SASS_INSTRUCTION.match(line):
            instructions.append((int(instruction.group(1), 16), instruction.group(2)))
    spans = set()
    for i, (_, text) in enumerate(instructions):
        branch = _SASS_BRANCH.search(text)
        # (A loop closes with a conditional branch back; an unconditional one is the way
        # back from code placed out of line, e.g. a barrier wait's retry at the end.)
        if branch and text.startswith("@") and labels.get(branch.group(1), i + 1) <= i:
            spans.add((labels[branch.group(1)], i))

    def opcode(text: str) -> str:  # "@!P1 LDL.LU R5, [R1]" -> "LDL"
        return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]

    with_wgmma = sorted((lo, hi) for lo, hi in spans
                        if any(opcode(text) == "HGMMA" for _, text in instructions[lo:hi + 1]))
    innermost = [(lo, hi) for lo, hi in with_wgmma
                 if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in with_wgmma)]
    loops = []
    for lo, hi in innermost:
        ops = collections.Counter(opcode(text) for _, text in instructions[lo:hi + 1])
        loops.append(SassLoop(instructions[lo][0], instructions[hi][0], hi - lo + 1,
                              {key: ops[key] for key in ("HGMMA", "STL", "LDL", "MUFU")}))
    return loops


def describe(entry: EntryResources) -> str:
    return (f"{entry.name} [{entry.arch}] registers {entry.registers}, spills {entry.spill_store_bytes} B stored / "
            f"{entry.spill_load_bytes} B loaded, shared {entry.shared_bytes} B"
            + "".join(f"; ptxas: {note}" for note in entry.performance_notes))


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
    parser.add_argument("--sass", action="store_true",
                        help="Mosaic GPU: also dump the kernel's SASS and count its spill instructions")
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.config)
    if args.compile_only:
        print(f"CONFIG {_compile_once(args.kernel, args.implementation, overrides)}")
        return 0
    if args.implementation == "mosaic_gpu":
        return _mosaic_gpu_resources(args)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        print("kernel_resources.py: no ptxas on the PATH (install the CUDA toolkit)", file=sys.stderr)
        return 2
    dump = args.out or pathlib.Path(tempfile.mkdtemp(prefix="kernel_resources_"))
    dump.mkdir(parents=True, exist_ok=True)
    # XLA reads its flags when the backend starts: set them before JAX's first use.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    device = _gpu_device()
    if device is None:
        return 2
    import jax
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
            print(f"{path.name}: {describe(entry)}")
    return 0


def _gpu_device():
    """JAX's default device if it is a GPU; else None, having said so."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"kernel_resources.py: no GPU here (JAX's default device is {device.platform})", file=sys.stderr)
        return None
    return device


def _mosaic_gpu_resources(args: argparse.Namespace) -> int:
    """Compiles the call in a child process with Mosaic GPU's dumps on (they are written by
    its C++ compiler to the process's output, past Python's streams) and reads them."""
    device = _gpu_device()
    if device is None:
        return 2
    import jax
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(_REPO), os.environ.get("PYTHONPATH")])))
    if args.sass:
        env["MOSAIC_GPU_DUMP_SASS"] = "1"
    command = [sys.executable, __file__, "--compile-only", "--kernel", args.kernel, "--implementation",
               "mosaic_gpu", "--config", *args.config]
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mosaic_gpu_compile.txt").write_text(result.stdout)
    if result.returncode != 0:
        print(f"kernel_resources.py: the compile failed:\n{result.stdout[-2000:]}", file=sys.stderr)
        return 1
    config = next((line[len("CONFIG "):] for line in result.stdout.splitlines() if line.startswith("CONFIG ")), "?")
    print(f"{device.device_kind} | jax {jax.__version__} | {args.kernel} mosaic_gpu | {config}")
    entries = parse_ptxas_verbose(result.stdout)
    if not entries:
        print("no ptxas report in the child's output (MOSAIC_GPU_DUMP_PTXAS unknown to this jax?)", file=sys.stderr)
        return 1
    for entry in entries:
        print(describe(entry))
    if args.sass:
        counts = count_spill_instructions(result.stdout)
        print(f"SASS: {counts['STL']} STL (spill stores), {counts['LDL']} LDL (spill loads); between the first "
              f"and last wgmma: {counts['STL_among_wgmma']} STL, {counts['LDL_among_wgmma']} LDL"
              + (f"; the whole output in {args.out / 'mosaic_gpu_compile.txt'}" if args.out else ""))
        for loop in innermost_wgmma_loops(result.stdout):
            print(f"  loop {loop.start:#07x}-{loop.end:#07x}: {loop.instructions} instructions a pass, "
                  f"{loop.counts['HGMMA']} wgmma, {loop.counts['STL']} STL / {loop.counts['LDL']} LDL, "
                  f"{loop.counts['MUFU']} MUFU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
