"""Measures the kernels' tile configs on this GPU for a model's shapes and writes a user
table, which later processes load (`jax_paged_attn.tuning.user_table`):

    python3 -m jax_paged_attn.tune --model-config path/to/config.json
    python3 -m jax_paged_attn.tune --head-sizes 64,128 --num-q-heads 32 --num-kv-heads 8 \\
        [--block-size 16] [--dtype bfloat16] [--quick]

For every head size it times the candidate configs (`candidates`) of the Triton decode
kernel (DECODE_TABLE) and the varlen kernel over packed keys and over a paged cache
(PREFILL_TABLE) on a few shapes (`tune_cases`), keeps per table key the config with the
best geometric mean of (the shape's best time / the config's time) (`choose`), and writes
them to ``<tuning dir>/<gpu model>.json`` (`jax_paged_attn.tuning.user_table_path`;
``--tuning-dir`` or ``$JAX_PAGED_ATTN_TUNING_DIR`` moves it), keeping the entries of
other keys a previous run of the same GPU and JAX version wrote. A table written with
another JAX version is not used (re-tune). The shipped tables stay the defaults for every
key the user table does not hold.

``--ignore-shipped`` sweeps as if the package had no table for this GPU (the grid starts
from the defaults); ``--compare`` writes nothing and times, shape by shape, the user
table's config against the shipped one (or the defaults), in alternating rounds.

Without a GPU it refuses (exit code 2): there is nothing to measure. ``--interpret`` is a
CPU dry run of the whole path (toy shapes, Pallas interpret mode, one timed call each:
the times mean nothing; the table is written for the CPU's device kind, which no GPU
reads).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import decode, prefill, tuning
from jax_paged_attn.spec import AttentionSpec
from jax_paged_attn.tuning import DecodeConfig, PrefillConfig

Config = PrefillConfig | DecodeConfig


# --------------------------------------------------------------------------- candidates
# Decode: (pages_per_step, num_warps, num_stages, target_programs), all with prefetched
# page ids, which give the K/V loads num_stages - 1 buffers, so num_stages - 2 tiles stay
# in flight during a step's math; the grid trades tile size x depth (bytes in flight per
# program) against programs per SM (shared memory ~ (num_stages - 1) * 2 * tile_keys *
# 256 B at D 128 bf16).
DECODE_GRID = (
    (1, 4, 7, 1024),
    (2, 4, 3, 1024), (2, 4, 4, 1024), (2, 4, 5, 1024), (2, 4, 6, 1024),
    (2, 1, 4, 1024), (2, 2, 4, 1024), (2, 2, 5, 1024), (2, 8, 4, 1024),
    (4, 4, 3, 1024), (4, 4, 4, 1024), (4, 8, 3, 1024), (4, 8, 4, 1024), (4, 2, 3, 1024),
    (2, 4, 4, 2048), (2, 4, 4, 4096), (4, 4, 3, 2048), (2, 4, 4, 512),
    # Longer tiles for head size 64 (half the bytes per key of D 128).
    (8, 4, 3, 1024), (8, 4, 4, 1024), (8, 8, 3, 1024), (4, 4, 5, 1024),
)
DECODE_GRID_QUICK = ((2, 4, 4, 1024), (4, 4, 3, 1024), (2, 4, 5, 1024))

# Prefill: (block_q, block_k, num_warps, num_stages, other fields). Register / shared-memory
# notes from compiling for sm_90 (ptxas): at D 128, 128 x 128 / 8 warps / 2 stages (the
# stock mha tiling) needs 160 KiB and spills ~nothing, 3 stages 224 KiB (fits); at D 64 the
# 4-warp 128 x 128 tile spills, 8 warps do not; at D 256 only 64-row tiles over 8 warps
# compile without spills, 128-row ones spill a little. Configs that do not fit a head size
# fail fast (shared memory) and are left out. Measured 2026-11-29 (H200): at D 128,
# 32-key blocks beat 64 and 128 (+15-25 %): the QK^T tile of a 128 x 32 block leaves the
# registers for the PV accumulator.
PREFILL_GRID = (  # D 64 / 128
    (128, 128, 8, 2, {}), (128, 128, 8, 3, {}), (128, 64, 8, 3, {}), (128, 64, 8, 2, {}),
    (128, 32, 8, 3, {}), (128, 32, 8, 4, {}), (64, 32, 4, 3, {}), (64, 32, 4, 4, {}),
    (128, 32, 4, 3, {}), (128, 32, 8, 3, dict(pack_gqa=False)),
    (128, 128, 8, 2, dict(pack_gqa=False)), (128, 128, 8, 2, dict(single_kv_loop=True)),
    (128, 64, 8, 3, dict(single_kv_loop=True)), (128, 128, 8, 2, dict(longest_first=False)),
    (128, 128, 4, 2, {}), (128, 64, 4, 3, {}), (64, 128, 4, 2, {}), (64, 64, 4, 3, {}),
    # Width of the masked (diagonal / window-edge) steps, which also keep non-finite
    # values from the rows that cannot see them: narrower than block_k, or full.
    (128, 32, 8, 3, dict(masked_block_k=16)), (128, 64, 8, 3, dict(masked_block_k=16)),
    (128, 64, 8, 3, dict(masked_block_k=64)), (128, 128, 8, 2, dict(masked_block_k=128)),
)
PREFILL_GRID_D256 = (  # D 256 (and small tiles for the others)
    (64, 64, 8, 2, {}), (64, 32, 8, 2, {}), (64, 32, 8, 3, {}), (128, 64, 8, 2, {}),
    (128, 32, 8, 2, {}), (64, 64, 4, 2, {}), (64, 64, 8, 2, dict(pack_gqa=False)),
    (64, 64, 8, 2, dict(single_kv_loop=True)),
    (128, 64, 8, 2, dict(masked_block_k=16)), (128, 64, 8, 2, dict(masked_block_k=64)),
)
PAGED_PREFILL_GRID = (  # over a paged cache: page ids prefetched (default) or read in the step
    (128, 128, 8, 2, {}), (128, 128, 8, 3, {}), (128, 64, 8, 3, {}), (128, 64, 8, 4, {}),
    (128, 32, 8, 2, {}), (128, 32, 8, 3, {}), (64, 32, 4, 3, {}),
    (128, 64, 8, 3, dict(prefetch_page_ids=False)),
    (128, 64, 8, 3, dict(prefetch_page_ids=False, num_stages_paged=5)),
    (128, 128, 8, 2, dict(prefetch_page_ids=False, num_stages_paged=4)),
    (128, 128, 8, 2, dict(single_kv_loop=True)), (128, 64, 8, 3, dict(pack_gqa=False)),
    (64, 64, 4, 3, {}), (128, 128, 4, 2, {}),
    (128, 32, 8, 2, dict(masked_block_k=16)), (128, 32, 8, 3, dict(masked_block_k=16)),
)


def decode_grid(quick: bool = False) -> list[DecodeConfig]:
    """The decode configs a sweep tries (after the current table's choice)."""
    base = DecodeConfig(prefetch_page_ids=True)
    grid = [dataclasses.replace(base, pages_per_step=p, num_warps=w, num_stages=st, target_programs=t)
            for p, w, st, t in (DECODE_GRID_QUICK if quick else DECODE_GRID)]
    if not quick:
        # The same depth with ids read in the step: isolates the prefetch's effect.
        grid.append(DecodeConfig(pages_per_step=2, num_warps=4, num_stages=4))
    return grid


def prefill_grid(kind: str, quick: bool = False) -> list[PrefillConfig]:
    """The varlen kernel's configs a sweep tries: ``kind`` "dense" (packed keys, every
    head size), "varlen" (packed, D 128 only) or "paged" (keys over a paged cache)."""
    if kind == "paged":
        choices = PAGED_PREFILL_GRID[:4] if quick else PAGED_PREFILL_GRID
    elif kind == "varlen":
        choices = PREFILL_GRID[:4] if quick else PREFILL_GRID
    elif kind == "dense":
        choices = PREFILL_GRID[:3] + PREFILL_GRID_D256[:2] if quick else PREFILL_GRID + PREFILL_GRID_D256
    else:
        raise ValueError(f"kind must be 'dense', 'varlen' or 'paged', got {kind!r}")
    return [PrefillConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st, **knobs)
            for bq, bk, w, st, knobs in choices]


# --------------------------------------------------------------------------- timing
def calls_per_sample(single_ms: float, sample_ms: float, min_calls: int, max_calls: int) -> int:
    """Calls in one timed sample: enough that it lasts ``sample_ms`` (within the bounds)."""
    return int(min(max_calls, max(min_calls, math.ceil(sample_ms / max(single_ms, 1e-3)))))


def time_jax(call: Callable[[], Any], warmup: int = 3, reps: int = 10, sample_ms: float = 25.0,
             min_calls: int = 2, max_calls: int = 256) -> tuple[float, float, Any]:
    """(median ms per call, first-call seconds, last output) of the zero-argument ``call``.

    ``warmup`` untimed calls (the first compiles), then ``reps`` samples of back-to-back
    calls (`calls_per_sample`) with one `jax.block_until_ready` at the end: dispatch is
    asynchronous, so the host's per-call dispatch overlaps the previous call's GPU work
    instead of being counted, as in the jitted loops that run these ops, and a sample's
    fixed cost (its first launch, the final wait) is spread over enough calls to vanish
    (2 ms samples read 3,164 GB/s on the H200's B64 ctx4096 decode, 40 ms ones 4,028).
    """
    start = time.perf_counter()
    out = jax.block_until_ready(call())
    compile_s = time.perf_counter() - start
    single_ms = compile_s * 1e3  # the last warm-up call's time sizes the samples
    for _ in range(warmup - 1):
        start = time.perf_counter()
        out = jax.block_until_ready(call())
        single_ms = (time.perf_counter() - start) * 1e3
    calls = calls_per_sample(single_ms, sample_ms, min_calls, max_calls)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        out = jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times), compile_s, out


def decode_call(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, seqlens: jax.Array, block_table: jax.Array,
                config: DecodeConfig, interpret: bool = False) -> Callable[[], jax.Array]:
    """A zero-argument call of the Triton decode kernel with ``config`` (causal, unit scales)."""
    spec = AttentionSpec.create(q.shape[-1], causal=True)
    scale = jnp.ones((), jnp.float32)
    fn = jax.jit(functools.partial(decode.paged_decode_attention, spec=spec, lowering="triton",
                                   interpret=interpret, config=config))
    return lambda: fn(q, k_cache, v_cache, seqlens, block_table, None, scale, scale)


def prefill_call(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array,
                 block_table: jax.Array | None, max_seqlen_q: int, max_seqlen_k: int, config: PrefillConfig,
                 interpret: bool = False) -> Callable[[], jax.Array]:
    """A zero-argument call of the Triton varlen kernel with ``config`` (causal, unit scales)."""
    spec = AttentionSpec.create(q.shape[-1], causal=True)
    scale = jnp.ones((), jnp.float32)
    fn = jax.jit(functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=max_seqlen_q,
                                   max_seqlen_k=max_seqlen_k, lowering="triton", interpret=interpret,
                                   config=config))
    return lambda: fn(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, None, None, scale, scale)


# --------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """The attention shapes of a model: head sizes, query and KV heads, cache block
    size, dtype of the queries."""

    head_sizes: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    block_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not self.head_sizes or any(type(d) is not int or d < 1 for d in self.head_sizes):
            raise ValueError(f"head_sizes must be positive ints, got {self.head_sizes!r}")
        for name in ("num_q_heads", "num_kv_heads", "block_size"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {self.dtype!r}")

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike, block_size: int = 16) -> "ModelShapes":
        """From a Hugging Face ``config.json`` (or the folder holding it): ``head_dim`` (else
        ``hidden_size // num_attention_heads``), ``num_attention_heads``,
        ``num_key_value_heads`` (else the query heads) and ``torch_dtype`` / ``dtype``
        (float32 models tune at bfloat16, what they serve in)."""
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--model-config: no file {path}")
        try:
            hf = json.loads(path.read_text())
            heads = int(hf["num_attention_heads"])
            head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--model-config {path}: not a model config with num_attention_heads and head_dim "
                             f"or hidden_size ({type(e).__name__}: {e})") from e
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
        return cls((head_dim,), heads, int(hf.get("num_key_value_heads") or heads), block_size,
                   dtype if dtype in ("bfloat16", "float16") else "bfloat16")


@dataclasses.dataclass(frozen=True)
class TuneCase:
    """One shape the sweep times: decode (one query per sequence over ``context`` cached
    keys) or a causal prefill of ``q_len`` new tokens per sequence over ``context`` keys,
    packed or (``paged``) read from a paged cache."""

    table: str
    head_size: int
    num_q_heads: int
    num_kv_heads: int
    batch: int
    q_len: int
    context: int
    block_size: int
    dtype: str
    paged: bool = True

    @property
    def label(self) -> str:
        heads = f"Hq{self.num_q_heads} Hk{self.num_kv_heads} D{self.head_size}"
        if self.table == "DECODE_TABLE":
            return f"decode B{self.batch} ctx{self.context} {heads} page{self.block_size}"
        if not self.paged:
            return f"prefill B{self.batch} S{self.q_len} {heads}"
        return f"prefix B{self.batch} q{self.q_len} on ctx{self.context} {heads} page{self.block_size}"

    @property
    def key(self) -> tuple:
        """Its table key, rounded as `jax_paged_attn.tuning` rounds it."""
        if self.table == "DECODE_TABLE":
            return (tuning.next_power_of_2(self.head_size), self.block_size,
                    tuning.next_power_of_2(self.num_q_heads // self.num_kv_heads))
        return (tuning.next_power_of_2(self.head_size), self.dtype, self.paged)

    def current(self, device: tuning.TuningDevice, tables: tuple[str, ...] = tuning.TABLE_SOURCES) -> Config:
        """The config the package gives this shape on ``device`` from ``tables``."""
        if self.table == "DECODE_TABLE":
            return tuning.decode_config(self.head_size, self.block_size, self.num_q_heads // self.num_kv_heads,
                                        device, tables=tables)
        return tuning.prefill_config(self.head_size, self.dtype, self.paged, device, tables=tables)

    def grid(self, quick: bool) -> list[Config]:
        return decode_grid(quick) if self.table == "DECODE_TABLE" else prefill_grid(
            "paged" if self.paged else "dense", quick)


def tune_cases(shapes: ModelShapes, tiny: bool = False) -> list[TuneCase]:
    """The shapes swept per head size, the benchmark's (benchmarks/bench_attention.py)
    at the model's heads: decode of B64 over 4,096 keys and B256 over 1,024; a dense
    causal prefill of B8 x 2,048; 512 new tokens on 4,096 cached ones (B8, paged).
    ``tiny``: toy sizes of the same kinds (a CPU dry run)."""
    sizes = ([(2, 1, 64)], (2, 64), (2, 8, 48)) if tiny else ([(64, 1, 4096), (256, 1, 1024)], (8, 2048), (8, 512, 4096))
    decodes, (dense_b, dense_s), (paged_b, paged_q, paged_ctx) = sizes
    common = dict(num_q_heads=shapes.num_q_heads, num_kv_heads=shapes.num_kv_heads, block_size=shapes.block_size,
                  dtype=shapes.dtype)
    cases = []
    for d in shapes.head_sizes:
        cases += [TuneCase("DECODE_TABLE", d, batch=b, q_len=q, context=c, **common) for b, q, c in decodes]
        cases.append(TuneCase("PREFILL_TABLE", d, batch=dense_b, q_len=dense_s, context=dense_s, paged=False,
                              **common))
        cases.append(TuneCase("PREFILL_TABLE", d, batch=paged_b, q_len=paged_q, context=paged_ctx, **common))
    return cases


def make_caller(case: TuneCase, interpret: bool = False, seed: int = 0) -> Callable[[Config], Callable[[], Any]]:
    """Random inputs of ``case`` on the device, and a function from a config to a
    zero-argument call of the kernel on them (inputs made once for every config)."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 3)
    pages_per_seq = -(-case.context // case.block_size)
    pages = case.batch * pages_per_seq
    table = jnp.asarray(rng.permutation(pages).reshape(case.batch, pages_per_seq).astype(np.int32))
    cache_shape = (pages, case.block_size, case.num_kv_heads, case.head_size)
    k_cache, v_cache = (jax.random.normal(k, cache_shape, case.dtype) for k in keys[1:])
    if case.table == "DECODE_TABLE":
        q = jax.random.normal(keys[0], (case.batch, 1, case.num_q_heads, case.head_size), case.dtype)
        seqlens = jnp.full((case.batch,), case.context, jnp.int32)
        return lambda config: decode_call(q, k_cache, v_cache, seqlens, table, config, interpret)
    q = jax.random.normal(keys[0], (case.batch * case.q_len, case.num_q_heads, case.head_size), case.dtype)
    cu_q = jnp.arange(case.batch + 1, dtype=jnp.int32) * case.q_len
    cu_k = jnp.arange(case.batch + 1, dtype=jnp.int32) * case.context
    k, v, block_table = k_cache, v_cache, table
    if not case.paged:  # packed keys: the cache's rows in order, one sequence after the other
        k, v, block_table = (k.reshape(-1, *cache_shape[2:])[:case.batch * case.context],
                             v.reshape(-1, *cache_shape[2:])[:case.batch * case.context], None)
    return lambda config: prefill_call(q, k, v, cu_q, cu_k, block_table, case.q_len, case.context, config, interpret)


# --------------------------------------------------------------------------- the sweep
Measure = Callable[[TuneCase, Config], float]
"""Times one config on one shape: milliseconds per call (raises where the config fails)."""


def kernel_measure(interpret: bool = False, warmup: int = 3, reps: int = 10) -> Measure:
    """The `Measure` that runs the kernels (`time_jax`); inputs are made once per shape."""
    callers: dict[TuneCase, Callable[[Config], Callable[[], Any]]] = {}

    def measure(case: TuneCase, config: Config) -> float:
        if case not in callers:
            callers.clear()  # one shape's inputs at a time (GBs of cache at the decode shapes)
            callers[case] = make_caller(case, interpret)
        return time_jax(callers[case](config), warmup, reps, min_calls=1 if interpret else 2)[0]

    return measure


Times = dict[tuple[str, tuple], dict[Config, dict[str, float]]]
"""(table, key) -> config -> shape label -> ms."""


def sweep(cases: Sequence[TuneCase], measure: Measure, device: tuning.TuningDevice, quick: bool = False,
          ignore_shipped: bool = False, log: Callable[[str], None] = print) -> tuple[Times, list[str]]:
    """Times every candidate config on every case: the config the package now gives the
    case first (the defaults alone with ``ignore_shipped``), then its grid. Returns the
    times and the failures (a config that does not compile or run on a shape)."""
    times: Times = {}
    failures = []
    for case in cases:
        with warnings.catch_warnings():  # (no table for this GPU yet: what the sweep is for)
            warnings.simplefilter("ignore", tuning.UntunedDeviceWarning)
            current = case.current(device, () if ignore_shipped else tuning.TABLE_SOURCES)
        configs = list(dict.fromkeys([current] + case.grid(quick)))
        log(f"{case.label}: {len(configs)} configs")
        for config in configs:
            try:
                ms = measure(case, config)
            except Exception as e:  # noqa: BLE001 - a config that fails (shared memory) is left out
                failures.append(f"{case.label} {config}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            times.setdefault((case.table, case.key), {}).setdefault(config, {})[case.label] = ms
            log(f"  {ms:9.4f} ms  {config}{'  (current)' if config == current else ''}")
    return times, failures


def choose(times: dict[Any, dict[Any, dict[Any, float]]]) -> dict[Any, tuple[Any, float, list]]:
    """Per table key, the config with the best geometric mean over the key's shapes of
    (the shape's best time / the config's time), among the configs that ran on every
    shape where any ran: ``{key: (config, score in (0, 1], sorted shapes)}``."""
    chosen = {}
    for key, per_config in times.items():
        shapes = sorted({shape for per_shape in per_config.values() for shape in per_shape})
        best = {s: min(p[s] for p in per_config.values() if s in p) for s in shapes}
        candidates = [(math.exp(statistics.fmean(math.log(best[s] / per_shape[s]) for s in shapes)), i, config)
                      for i, (config, per_shape) in enumerate(per_config.items()) if set(per_shape) == set(shapes)]
        if candidates:
            score, _, config = max(candidates, key=lambda c: (c[0], -c[1]))  # ties: the first tried
            chosen[key] = (config, score, shapes)
    return chosen


def tune(cases: Sequence[TuneCase], measure: Measure, device: tuning.TuningDevice, command: str, *,
         directory: str | os.PathLike | None = None, quick: bool = False, ignore_shipped: bool = False,
         log: Callable[[str], None] = print) -> tuple[pathlib.Path, dict]:
    """Sweeps ``cases`` (`sweep`), chooses per key (`choose`) and writes the user table of
    ``device`` (`tuning.write_user_table`; ``directory``: default `tuning.user_tables_dir`),
    keeping the entries of other keys from a valid table of the same GPU and JAX version
    already there. Returns its path and the choices."""
    path = tuning.user_table_path(device.kind, directory)
    if path is None:
        raise ValueError(f"user tables are off (${tuning.USER_TABLES_ENV}=off): pass --tuning-dir")
    times, failures = sweep(cases, measure, device, quick, ignore_shipped, log)
    chosen = choose(times)
    if not chosen:
        raise RuntimeError("no config ran on any shape: nothing to write" + "".join(f"\n  {f}" for f in failures))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measured = {"date": now, "gpu": device.kind, "jax": jax.__version__, "command": command}
    entries: dict[str, dict[str, dict]] = {name: {} for name in tuning.TABLE_NAMES}
    if path.exists():
        try:
            tuning.read_user_table(path, device.kind, jax.__version__)  # checked whole before any entry is kept
            previous = json.loads(path.read_text())
            for name in tuning.TABLE_NAMES:
                entries[name] = {json.dumps(e["key"]): e for e in previous.get(name, [])}
        except (OSError, ValueError) as e:
            log(f"replacing {path}: {e}")
    for (name, key), (config, score, shapes) in chosen.items():
        entries[name][json.dumps(list(key))] = tuning.table_entry(
            device.kind, key, dataclasses.asdict(config), score, shapes, measured)
        log(f"{name}[{key}] = {config}  (score {score:.3f} over {len(shapes)} shape(s))")
    document = tuning.user_table_document(device.kind, jax.__version__, now, command,
                                          {name: list(e.values()) for name, e in entries.items()})
    tuning.write_user_table(path, document)
    tuning.forget_user_tables()
    for failure in failures:
        log(f"failed: {failure}")
    log(f"wrote {path}")
    return path, chosen


def compare(cases: Sequence[TuneCase], measure: Measure, device: tuning.TuningDevice, rounds: int = 3,
            log: Callable[[str], None] = print) -> list[tuple[str, float, float]]:
    """Times each case's user-table config against the shipped table's (else the
    defaults') in ``rounds`` alternating rounds; logs and returns ``(shape, user ms,
    shipped ms)`` per case the user table holds a config for (the medians)."""
    user = tuning.user_table(device.kind)
    if user is None:
        raise ValueError(f"no usable user table for the {device.kind} (`{tuning.TUNE_COMMAND}` writes one)")
    pairs = [(case, user.tables[case.table][case.key], case.current(device, ("shipped",)))
             for case in cases if case.key in user.tables.get(case.table, {})]
    samples: dict[str, tuple[list[float], list[float]]] = {case.label: ([], []) for case, _, _ in pairs}
    for _ in range(rounds):
        for case, mine, shipped in pairs:
            samples[case.label][0].append(measure(case, mine))
            samples[case.label][1].append(measure(case, shipped))
    rows = []
    for case, mine, shipped in pairs:
        user_ms, shipped_ms = (statistics.median(s) for s in samples[case.label])
        flag = "" if user_ms <= shipped_ms * 1.05 else "  (user table > 5 % slower)"
        log(f"{case.label}: user {user_ms:.4f} ms, shipped {shipped_ms:.4f} ms, shipped/user "
            f"x{shipped_ms / user_ms:.3f}{'  (same config)' if mine == shipped else ''}{flag}")
        rows.append((case.label, user_ms, shipped_ms))
    return rows


# --------------------------------------------------------------------------- command
def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m jax_paged_attn.tune", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", help="a Hugging Face config.json (or its folder): the shapes")
    parser.add_argument("--head-sizes", type=_int_list, help="comma-separated head sizes (without --model-config)")
    parser.add_argument("--num-q-heads", type=int, help="query heads (without --model-config)")
    parser.add_argument("--num-kv-heads", type=int, help="KV heads (default: the query heads)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (default 16)")
    parser.add_argument("--dtype", default=None, help="bfloat16 (default) or float16")
    parser.add_argument("--quick", action="store_true", help="a few configs per shape")
    parser.add_argument("--ignore-shipped", action="store_true",
                        help="sweep as if the package had no table for this GPU (grid from the defaults)")
    parser.add_argument("--compare", action="store_true",
                        help="write nothing: time the user table's configs against the shipped ones")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of --compare (default 3)")
    parser.add_argument("--tuning-dir", default=None,
                        help=f"folder of the user tables (default: ${tuning.USER_TABLES_ENV}, else "
                             f"$XDG_CACHE_HOME/jax_paged_attn/tuning)")
    parser.add_argument("--interpret", action="store_true",
                        help="CPU dry run: toy shapes in Pallas interpret mode (times mean nothing)")
    args = parser.parse_args(argv)
    try:
        if args.model_config is not None:
            if args.head_sizes or args.num_q_heads:
                parser.error("give --model-config or --head-sizes / --num-q-heads, not both")
            args.shapes = ModelShapes.from_hf_config(args.model_config, args.block_size)
            if args.dtype:
                args.shapes = dataclasses.replace(args.shapes, dtype=args.dtype)
        elif args.head_sizes and args.num_q_heads:
            args.shapes = ModelShapes(args.head_sizes, args.num_q_heads, args.num_kv_heads or args.num_q_heads,
                                      args.block_size, args.dtype or "bfloat16")
        else:
            parser.error("give --model-config, or --head-sizes and --num-q-heads")
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv: Sequence[str] | None = None, measure: Measure | None = None) -> int:
    """The command (see the module docstring); ``measure`` replaces the kernel timing
    (tests). Exit code 0, 2 without a GPU (unless --interpret), 1 when nothing ran."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    jax_device = jax.devices()[0]
    if jax_device.platform != "gpu" and not args.interpret:
        print(f"jax_paged_attn.tune: no GPU here (JAX's default device is {jax_device.device_kind!r}, platform "
              f"{jax_device.platform!r}): there is nothing to measure. Run it on the GPU the table is for; "
              f"--interpret is a CPU dry run.", file=sys.stderr)
        return 2
    if jax_device.platform == "gpu":
        device = tuning.target_device()
    else:  # a dry run: its table is the CPU's, which no GPU reads
        device = tuning.TuningDevice(jax_device.device_kind, tuning.REFERENCE_DEVICE.shared_memory_per_block)
    if args.tuning_dir is not None:
        os.environ[tuning.USER_TABLES_ENV] = str(pathlib.Path(args.tuning_dir).expanduser().resolve())
        tuning.forget_user_tables()
    cases = tune_cases(args.shapes, tiny=args.interpret)
    measure = measure or kernel_measure(args.interpret, *((1, 1) if args.interpret else ()))
    print(f"{device.kind} | jax {jax.__version__} | {args.shapes}")
    try:
        if args.compare:
            compare(cases, measure, device, args.rounds)
        else:
            tune(cases, measure, device, " ".join([tuning.TUNE_COMMAND, *argv]), quick=args.quick,
                 ignore_shipped=args.ignore_shipped)
    except (ValueError, RuntimeError) as e:
        print(f"jax_paged_attn.tune: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
