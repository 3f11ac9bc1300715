#!/usr/bin/env python3
"""Benchmarks jax_paged_attn's kernels against their peers, in one run, on one GPU.

    python benchmarks/bench_attention.py [--suite decode,prefill,varlen,prefix,cache]
                                         [--tune] [--out DIR] [--quick]

Suites (bf16, vLLM cache layout, permuted block tables):

* ``decode``: one query token per sequence over a paged cache (page 16).
  GB/s = bytes of K and V to read (2 * B * ctx * Hk * D * itemsize) / time.
* ``prefill``: dense causal self-attention, B sequences of S tokens, packed.
  TFLOP/s = 4 * B * Hq * D * S^2 / 2 / time (flash-attention's benchmark convention).
* ``varlen``: causal self-attention over packed sequences of mixed lengths.
* ``prefix``: prefill of new tokens on a cached prefix, keys read from a paged cache.
  varlen / prefix TFLOP/s count the exact bottom-right causal work:
  4 * Hq * D * sum over sequences of the visible keys summed over queries.
* ``cache``: ``reshape_and_cache_flash`` under jit with donated caches.
  GB/s = (bytes of key + value read, bytes written to the caches, slot ids) / time.

Every implementation of a shape is credited with the same useful work, so the ratio
ours / peer printed next to each peer is the peer's time over ours; each output is
compared with ours. Each peer runs inside its own try/except: a failure is recorded
(with its message) and the run goes on. Each suite runs in its own process, so a job
that kills it (a CUDA fault poisons the context) costs that job, not the run
(``--no-isolate`` runs everything in this process). Results go to ``--out`` (default:
``benchmarks/results/``) as ``<date>-<device>.md`` and ``.json`` (``--stem`` names them),
rewritten after every suite; the committed ``benchmarks/RESULTS.md`` is written only
with ``--update-committed-md``.

``--tune`` instead sweeps our kernels' configs (`jax_paged_attn.tuning.DecodeConfig` /
`PrefillConfig`) on the selected suites (default decode,prefill), writes
``<date>-<device>-tuning.md`` and ``.json``, and prints dict literals ready to paste
into tuning.py's tables. The grids, the timing loop and the choice are the package's
(`jax_paged_attn.tune`, whose ``python3 -m jax_paged_attn.tune`` is the users' command).

Without a GPU the run stops at once with an error (exit code 2), unless ``--tiny`` or
``--interpret`` asks for a CPU dry run of the harness. It exits with 1 when no job
measured anything (every one failed or was skipped).

The run keeps to a time budget (``--budget-s``, compile time included, counted from the
start of `main`; ``inf`` for none): each suite gets a share of what is left, sweeps stop
early and late measurements are recorded as skipped when their share is spent.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import inspect
import itertools
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

# Run as a script from the repo root: make the working tree's jax_paged_attn and the
# sibling report module importable whatever the installed packages are.
_BENCH_DIR = pathlib.Path(__file__).resolve().parent
for _path in (_BENCH_DIR.parent, _BENCH_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import report  # noqa: E402
from jax_paged_attn import tune, tuning  # noqa: E402

Array = jax.Array

SUITES = ("decode", "prefill", "varlen", "prefix", "cache")
TUNABLE_SUITES = ("decode", "prefill", "varlen", "prefix")
DEFAULT_TUNE_SUITES = ("decode", "prefill")
# Share of the time budget per suite (of what is left when the suite starts).
SUITE_WEIGHTS = {"decode": 30, "prefill": 35, "varlen": 12, "prefix": 13, "cache": 10}
TUNE_WEIGHTS = {"decode": 45, "prefill": 40, "varlen": 8, "prefix": 7}
DEFAULT_BUDGET_S = 330.0
XLA_REFERENCE_MAX_BYTES = 16 << 30
"""The XLA reference materializes [B, Hq, max_q, max_k] f32 scores (a few copies);
bigger shapes are skipped rather than run out of memory."""


# =========================================================================== work arithmetic


def decode_kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V a decode step must read: 2 * B * ctx * Hk * D * itemsize."""
    return 2 * batch * context * kv_heads * head_dim * itemsize


def dense_causal_flops(batch: int, seq_len: int, q_heads: int, head_dim: int) -> float:
    """Causal prefill work as flash-attention's benchmarks count it: 4 * B * Hq * D * S^2 / 2."""
    return 4.0 * batch * q_heads * head_dim * seq_len * seq_len / 2


def causal_visible_pairs(q_len: int, k_len: int) -> int:
    """(query, key) pairs under the bottom-right causal mask (query i sees key j iff
    ``j <= i + k_len - q_len``), summed over the sequence's queries."""
    # Query i sees min(k_len, i + k_len - q_len + 1) keys, clamped at 0; the count
    # never exceeds k_len for i < q_len, so only the clamp at 0 matters.
    first = k_len - q_len + 1  # keys seen by query 0 (may be <= 0)
    start = max(0, 1 - first)  # first query that sees at least one key
    seeing = q_len - start
    if seeing <= 0:
        return 0
    low, high = first + start, first + q_len - 1
    return seeing * (low + high) // 2


def varlen_causal_flops(q_lens: Sequence[int], k_lens: Sequence[int], q_heads: int, head_dim: int) -> float:
    """Exact causal work: 4 * Hq * D * sum over sequences of `causal_visible_pairs`."""
    pairs = sum(causal_visible_pairs(int(q), int(k)) for q, k in zip(q_lens, k_lens))
    return 4.0 * q_heads * head_dim * pairs


def cache_write_bytes(tokens: int, kv_heads: int, head_dim: int, in_itemsize: int, cache_itemsize: int) -> int:
    """Bytes a cache write moves: key + value read, the same rows written, int32 slot ids."""
    rows = 2 * tokens * kv_heads * head_dim
    return rows * (in_itemsize + cache_itemsize) + 4 * tokens


def mixed_lengths(count: int, low: int, high: int, seed: int = 0) -> tuple[int, ...]:
    """Deterministic sequence lengths drawn uniformly from [low, high]."""
    rng = np.random.default_rng(seed)
    return tuple(int(n) for n in rng.integers(low, high + 1, size=count))


def _itemsize(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


# =========================================================================== cases


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One query token per sequence; every sequence holds ``context`` cached tokens."""

    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        return (f"B{self.batch} ctx{self.context} Hq{self.q_heads} Hk{self.kv_heads} "
                f"D{self.head_dim} page{self.page_size}")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def work(self) -> float:
        return decode_kv_bytes(self.batch, self.context, self.kv_heads, self.head_dim, _itemsize(self.dtype))


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """Causal attention of packed queries over packed keys, or over a paged cache when
    ``page_size`` is set (the prefix-cached prefill). Sequence b has ``q_lens[b]``
    queries and ``k_lens[b]`` keys, its queries being its last ``q_lens[b]`` keys.

    ``dense`` cases (all lengths equal, no prefix) use the S^2/2 work count of flash-attention's benchmarks.
    """

    name: str
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int | None = None
    dtype: str = "bfloat16"
    dense: bool = False

    @staticmethod
    def dense_prefill(batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int) -> "AttentionCase":
        lens = (seq_len,) * batch
        return AttentionCase("dense", lens, lens, q_heads, kv_heads, head_dim, dense=True)

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def label(self) -> str:
        heads = f"Hq{self.q_heads} Hk{self.kv_heads} D{self.head_dim}"
        if self.dense:
            return f"B{self.batch} S{self.q_lens[0]} {heads}"
        if self.paged:
            lens = (f"q{self.q_lens[0]} on ctx{self.k_lens[0]}" if len(set(self.q_lens)) == 1
                    and len(set(self.k_lens)) == 1 else f"q{sum(self.q_lens)} k{sum(self.k_lens)}")
            return f"{self.name}: B{self.batch} {lens} {heads} page{self.page_size}"
        return (f"{self.name}: {self.batch} seqs {min(self.q_lens)}..{max(self.q_lens)} "
                f"T{sum(self.q_lens)} {heads}")

    @property
    def work(self) -> float:
        if self.dense:
            return dense_causal_flops(self.batch, self.q_lens[0], self.q_heads, self.head_dim)
        return varlen_causal_flops(self.q_lens, self.k_lens, self.q_heads, self.head_dim)


@dataclasses.dataclass(frozen=True)
class CacheCase:
    """``seqs`` sequences each write their last ``tokens_per_seq`` tokens (positions up
    to ``context``) into a paged cache of ``num_blocks`` pages."""

    name: str
    seqs: int
    tokens_per_seq: int
    context: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # vLLM's name: "auto" (cache in dtype) or "fp8"
    extra_blocks: int = 64

    @property
    def tokens(self) -> int:
        return self.seqs * self.tokens_per_seq

    @property
    def cache_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else "float8_e4m3fn"

    @property
    def num_blocks(self) -> int:
        return self.seqs * -(-self.context // self.page_size) + self.extra_blocks

    @property
    def label(self) -> str:
        return (f"{self.name}: {self.seqs}x{self.tokens_per_seq} tokens Hk{self.kv_heads} "
                f"D{self.head_dim} {self.cache_dtype} cache")

    @property
    def work(self) -> float:
        return cache_write_bytes(self.tokens, self.kv_heads, self.head_dim,
                                 _itemsize(self.dtype), _itemsize(self.cache_dtype))


DECODE_CASES = (
    DecodeCase(64, 4096, 32, 8, 128),
    DecodeCase(8, 32768, 32, 8, 128),
    DecodeCase(256, 1024, 32, 8, 128),
    DecodeCase(32, 8192, 64, 8, 128),
    # Head size 64 (the 1.1B Llama of bench_engine.py): 128-byte K/V rows per head, a
    # table key (64, 16, 4) of its own.
    DecodeCase(256, 1024, 32, 8, 64),
    DecodeCase(32, 4096, 32, 8, 64),
    # A GQA group of 8 at head size 64: no table entry of its own (it takes its
    # nearest measured key's config, `tuning.nearest_decode_key`).
    DecodeCase(256, 1024, 32, 4, 64),
)
PREFILL_CASES = (
    AttentionCase.dense_prefill(8, 2048, 32, 8, 128),
    AttentionCase.dense_prefill(1, 16384, 32, 8, 128),
    AttentionCase.dense_prefill(16, 1024, 32, 8, 64),
    AttentionCase.dense_prefill(4, 4096, 16, 16, 256),
)
_MIXED = mixed_lengths(16, 64, 4096, seed=0)
VARLEN_CASES = (AttentionCase("mixed", _MIXED, _MIXED, 32, 8, 128),)
# The engine's prompt steps: fresh prompts (nothing cached, so queries and keys are the same
# tokens) attended over the paged cache they were just written to, about one step of
# 8,192 prompt tokens, at the heads of the 1.1B Llama (bench_engine.py, bench_serving.py)
# and of an 8B one (bench_tp.py).
_ENGINE_PROMPTS = mixed_lengths(8, 128, 2048, seed=3)  # 8,218 tokens, 292..1,797
PREFIX_CASES = tuple(
    AttentionCase("prefix", (512,) * 8, (4096,) * 8, 32, 8, 128, page_size=page) for page in (16, 64)
) + (AttentionCase("prefix", (512,) * 8, (4096,) * 8, 32, 8, 64, page_size=16),
     AttentionCase("prompts", _ENGINE_PROMPTS, _ENGINE_PROMPTS, 32, 4, 64, page_size=16),
     AttentionCase("prompts", _ENGINE_PROMPTS, _ENGINE_PROMPTS, 32, 8, 128, page_size=16))
CACHE_CASES = (
    CacheCase("decode step", seqs=256, tokens_per_seq=1, context=1024, kv_heads=8, head_dim=128),
    CacheCase("prefill", seqs=16, tokens_per_seq=2048, context=2048, kv_heads=8, head_dim=128),
    CacheCase("prefill", seqs=16, tokens_per_seq=2048, context=2048, kv_heads=8, head_dim=128,
              kv_cache_dtype="fp8"),
)

# Tiny shapes for CPU dry runs (--tiny): same code paths, seconds to run.
_TINY_MIXED = (5, 40, 17)
TINY_CASES = {
    "decode": (DecodeCase(2, 64, 4, 2, 32),),
    "prefill": (AttentionCase.dense_prefill(2, 64, 4, 2, 32),),
    "varlen": (AttentionCase("mixed", _TINY_MIXED, _TINY_MIXED, 4, 2, 32),),
    "prefix": (AttentionCase("prefix", (8, 8), (48, 40), 4, 2, 32, page_size=16),),
    "cache": (CacheCase("prefill", seqs=2, tokens_per_seq=20, context=24, kv_heads=2, head_dim=32,
                        extra_blocks=2),),
}
FULL_CASES = {"decode": DECODE_CASES, "prefill": PREFILL_CASES, "varlen": VARLEN_CASES,
              "prefix": PREFIX_CASES, "cache": CACHE_CASES}

SUITE_TITLES = {
    "decode": "paged decode, GB/s of K+V read",
    "prefill": "dense causal prefill, TFLOP/s (4·B·Hq·D·S²/2)",
    "varlen": "varlen causal prefill, mixed lengths, TFLOP/s (exact causal work)",
    "prefix": "prefill on a cached prefix (paged keys), TFLOP/s (exact bottom-right causal work)",
    "cache": "reshape_and_cache_flash, GB/s (read + written + slot ids)",
}


# =========================================================================== inputs


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_normals(seed: int, shapes: tuple[tuple[int, ...], ...], dtype: str) -> tuple[Array, ...]:
    """Standard-normal arrays of the given shapes, made on the device in one compiled call.

    One draw sliced into the arrays, with XLA's RngBitGenerator ("unsafe_rbg"): the
    statistics do not matter here, the compile time (threefry's is several times
    longer) and the generation speed on multi-GiB caches do.
    """
    sizes = [math.prod(shape) for shape in shapes]
    flat = jax.random.normal(jax.random.key(seed, impl="unsafe_rbg"), (sum(sizes),), dtype)
    ends = np.cumsum(sizes)
    return tuple(flat[end - size:end].reshape(shape) for size, end, shape in zip(sizes, ends, shapes))


def random_permutation(seed: int, size: int) -> np.ndarray:
    """Page ids in random order (host side: block tables are small)."""
    return np.random.default_rng(seed).permutation(size).astype(np.int32)


@dataclasses.dataclass
class DecodeInputs:
    q: Array  # [B, 1, Hq, D]
    k_cache: Array  # [num_blocks, page, Hk, D], vLLM layout
    v_cache: Array
    block_table: Array  # i32[B, pages_per_seq], a random permutation of the pages
    seqlens: Array  # i32[B]

    def contiguous(self, cache: Array, context: int) -> Array:
        """[B, ctx, Hk, D] copy of the keys or values, for peers without paging."""
        batch, pages = self.block_table.shape
        gathered = cache[self.block_table]  # [B, pages, page, Hk, D]
        return gathered.reshape(batch, pages * cache.shape[1], *cache.shape[2:])[:, :context]


def build_decode_inputs(case: DecodeCase, seed: int = 0) -> DecodeInputs:
    num_blocks = case.batch * case.pages_per_seq
    cache_shape = (num_blocks, case.page_size, case.kv_heads, case.head_dim)
    q, k_cache, v_cache = random_normals(
        seed, ((case.batch, 1, case.q_heads, case.head_dim), cache_shape, cache_shape), case.dtype)
    return DecodeInputs(
        q=q, k_cache=k_cache, v_cache=v_cache,
        block_table=jnp.asarray(random_permutation(seed, num_blocks).reshape(case.batch, -1)),
        seqlens=jnp.full((case.batch,), case.context, jnp.int32),
    )


@dataclasses.dataclass
class AttentionInputs:
    """Arguments of `flash_attn_varlen_func` for an `AttentionCase`."""

    q: Array  # [Tq, Hq, D] packed
    k: Array  # [Tk, Hk, D] packed, or [num_blocks, page, Hk, D] when block_table is set
    v: Array
    cu_seqlens_q: Array  # i32[B + 1]
    cu_seqlens_k: Array  # i32[B + 1]
    block_table: Array | None  # i32[B, max_pages] or None
    q_lens: np.ndarray
    k_lens: np.ndarray

    @property
    def max_q(self) -> int:
        return int(self.q_lens.max())

    @property
    def max_k(self) -> int:
        return int(self.k_lens.max())

    def padded_q(self) -> Array:
        """[B, max_q, Hq, D] queries, zero-padded."""
        return _pad_packed(self.q, self.q_lens)

    def keys_values(self) -> tuple[Array, Array]:
        """Packed [Tk, Hk, D] keys and values (gathered from the cache when paged)."""
        if self.block_table is None:
            return self.k, self.v
        rows = _paged_rows(self.block_table, self.k.shape[1], self.k_lens)
        flat = (-1, *self.k.shape[2:])
        return self.k.reshape(flat)[rows], self.v.reshape(flat)[rows]

    def padded_kv(self) -> tuple[Array, Array]:
        k, v = self.keys_values()
        return _pad_packed(k, self.k_lens), _pad_packed(v, self.k_lens)

    def unpad(self, padded_out: Array) -> np.ndarray:
        """[B, max_q, Hq, D] -> packed [Tq, Hq, D] float32 numpy."""
        out = np.asarray(padded_out).astype(np.float32)
        return np.concatenate([out[b, :n] for b, n in enumerate(self.q_lens)])


def _cumulative(lengths: Sequence[int]) -> Array:
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _pad_packed(x: Array, lens: np.ndarray) -> Array:
    """Packed [T, H, D] -> [B, max(lens), H, D], zero past each sequence's length."""
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    offsets = np.arange(int(lens.max()))
    valid = offsets[None, :] < lens[:, None]
    rows = np.where(valid, starts[:, None] + offsets[None, :], 0)
    return jnp.where(jnp.asarray(valid)[:, :, None, None], x[jnp.asarray(rows)], 0).astype(x.dtype)


def _paged_rows(block_table: Array, page_size: int, lens: np.ndarray) -> Array:
    """Flat cache rows (page * page_size + slot) of every sequence's keys, packed."""
    table = np.asarray(block_table)
    rows = [table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
            for b, n in enumerate(lens)]
    return jnp.asarray(np.concatenate(rows), jnp.int32)


def build_attention_inputs(case: AttentionCase, seed: int = 0) -> AttentionInputs:
    q_lens, k_lens = np.asarray(case.q_lens), np.asarray(case.k_lens)
    q_shape = (int(q_lens.sum()), case.q_heads, case.head_dim)
    if not case.paged:
        kv_shape = (int(k_lens.sum()), case.kv_heads, case.head_dim)
        block_table = None
    else:
        pages = -(-k_lens // case.page_size)
        kv_shape = (int(pages.sum()), case.page_size, case.kv_heads, case.head_dim)
        perm = random_permutation(seed, kv_shape[0])
        table = np.zeros((case.batch, int(pages.max())), np.int32)  # unused entries: page 0
        starts = np.concatenate([[0], np.cumsum(pages)[:-1]])
        for b, (start, n) in enumerate(zip(starts, pages)):
            table[b, :n] = perm[start:start + n]
        block_table = jnp.asarray(table)
    q, k, v = random_normals(seed, (q_shape, kv_shape, kv_shape), case.dtype)
    return AttentionInputs(q, k, v, _cumulative(q_lens), _cumulative(k_lens), block_table, q_lens, k_lens)


@dataclasses.dataclass
class CacheInputs:
    key: Array  # [T, Hk, D] new tokens
    value: Array
    slot_mapping: Array  # i32[T]: page * page_size + slot of each token

    def empty_caches(self, case: CacheCase) -> tuple[Array, Array]:
        shape = (case.num_blocks, case.page_size, case.kv_heads, case.head_dim)
        return jnp.zeros(shape, case.cache_dtype), jnp.zeros(shape, case.cache_dtype)


def build_cache_inputs(case: CacheCase, seed: int = 0) -> CacheInputs:
    pages_per_seq = -(-case.context // case.page_size)
    table = random_permutation(seed, case.num_blocks)[:case.seqs * pages_per_seq].reshape(case.seqs, -1)
    positions = np.arange(case.context - case.tokens_per_seq, case.context)
    slots = table[:, positions // case.page_size] * case.page_size + positions % case.page_size
    shape = (case.tokens, case.kv_heads, case.head_dim)
    key, value = random_normals(seed, (shape, shape), case.dtype)
    return CacheInputs(key=key, value=value, slot_mapping=jnp.asarray(slots.reshape(-1), jnp.int32))


# =========================================================================== timing


class OutOfTime(Exception):
    """The suite's share of the time budget is spent."""


class Unavailable(Exception):
    """The peer cannot run here (library missing, shape it does not support by design)."""


@dataclasses.dataclass
class Deadline:
    end: float  # time.monotonic() value

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def check(self) -> None:
        if self.expired():
            raise OutOfTime("time budget of the suite spent")


@dataclasses.dataclass
class Measurement:
    ms: float  # median of the timed calls
    compile_s: float  # first call (compile + run)
    output: Any = None  # last call's output (canonical layout, float32 numpy) or None
    config: str | None = None
    note: str = ""
    sweep: list[dict[str, Any]] | None = None
    # Times the same compiled call again (ms; no compile): the alternating rounds (`run_jobs`).
    retime: Callable[[], float] | None = dataclasses.field(default=None, repr=False)


def _block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


@dataclasses.dataclass
class Timer:
    """Warm-up calls, then the median of ``reps`` timed samples: device time per call.

    A sample is ``calls`` back-to-back calls, divided by ``calls``. JAX: one
    `jax.block_until_ready` at the end; dispatch is asynchronous, so the host's
    per-call dispatch (tens of microseconds, more than a third of a 0.3 ms decode step)
    overlaps the previous call's GPU work instead of being counted, as in the jitted
    loops that run these ops. torch: CUDA events around the sample's calls. ``calls`` is
    chosen so that a sample lasts at least ``sample_ms`` (at least ``min_calls``, at
    most ``max_calls``): a sample's fixed cost (its first launch, the final wait) is
    spread over enough calls to vanish. With 2 ms samples it was not: the B64 ctx4096
    decode call read 3,164 GB/s that way on the H200, 4,028 with 40 ms samples and
    3,844 in a jitted loop of 20 calls (2026-12-04). `dry_run`: the fewest calls, for
    a CPU run that checks a script (its times mean nothing there; an interpret-mode
    kernel call takes seconds).
    """

    warmup: int = 3
    reps: int = 10
    sample_ms: float = 25.0
    min_calls: int = 2
    max_calls: int = 256

    @classmethod
    def dry_run(cls) -> "Timer":
        """One untimed call and one timed sample of one call."""
        return cls(warmup=1, reps=1, min_calls=1)

    def _calls(self, single_ms: float) -> int:
        return tune.calls_per_sample(single_ms, self.sample_ms, self.min_calls, self.max_calls)

    def jax(self, call: Callable[[], Any]) -> tuple[float, float, Any]:
        """Returns (median ms per call, first-call seconds, last output) of the zero-arg `call`."""
        return tune.time_jax(call, self.warmup, self.reps, self.sample_ms, self.min_calls, self.max_calls)

    def torch(self, torch: Any, call: Callable[[], Any]) -> tuple[float, float, Any]:
        start = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        single_ms = compile_s * 1e3
        for _ in range(self.warmup - 1):
            start = time.perf_counter()
            out = call()
            torch.cuda.synchronize()
            single_ms = (time.perf_counter() - start) * 1e3
        calls = self._calls(single_ms)
        times = []
        for _ in range(self.reps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                out = call()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / calls)
        return statistics.median(times), compile_s, out


def short_error(error: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line (without the notes JAX appends about tracebacks);
    a bare ``assert`` gets the file and line that raised it."""
    message = str(error).strip()
    if not message and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = f"at {pathlib.Path(frame.filename).name}:{frame.lineno}: {frame.line}"
    return " ".join(f"{type(error).__name__}: {message}".split())[:limit]


@dataclasses.dataclass
class Context:
    """What every implementation runner gets: timing, budget and run options."""

    timer: Timer
    deadline: Deadline
    ours_implementation: str = "triton"
    interpret: bool = False
    quick: bool = False
    max_configs: int = 0  # a sweep's first configs only (0: all)
    rounds: int = 1  # timings of every measured call, in alternating rounds (`run_jobs`)
    _torch: Any = None

    def time_jax(self, call: Callable[[], Any], to_numpy: Callable[[Any], np.ndarray] | None = None,
                 **fields: Any) -> Measurement:
        self.deadline.check()
        ms, compile_s, out = self.timer.jax(call)
        return Measurement(ms, compile_s, None if to_numpy is None else to_numpy(out),
                           retime=self._retimer(lambda: self.timer.jax(call)[0]), **fields)

    def _retimer(self, retime: Callable[[], float]) -> Callable[[], float] | None:
        """``retime`` where the run times in rounds (`run_jobs`); None measures once."""
        return retime if self.rounds > 1 else None

    def sweep(self, configs: Sequence[Any], make_call: Callable[[Any], Callable[[], Any]],
              describe: Callable[[Any], str] = repr,
              to_numpy: Callable[[Any], np.ndarray] | None = None) -> Measurement:
        """Times every config (failures and budget stops noted), returns the fastest."""
        best, best_out, trials = None, None, []
        if self.max_configs:
            configs = list(configs)[:self.max_configs]
        for config in configs:
            name = describe(config)
            if self.deadline.expired():
                trials.append({"config": name, "skipped": "time budget"})
                continue
            try:
                call = make_call(config)
                ms, compile_s, out = self.timer.jax(call)
            except Exception as e:  # noqa: BLE001 - one config failing must not stop the sweep
                trials.append({"config": name, "error": short_error(e, 300)})
                continue
            trials.append({"config": name, "ms": ms, "compile_s": compile_s})
            if best is None or ms < best[0]:
                best, best_out, best_call = (ms, compile_s, name), out, call
        if best is None:
            if all("skipped" in t for t in trials):
                raise OutOfTime("time budget of the suite spent before any config ran")
            reasons = list(dict.fromkeys(t.get("error") or t.get("skipped") for t in trials))
            where = "every config" if len(reasons) == 1 else "; ".join(
                f"{t['config']}: {t.get('error') or t.get('skipped')}" for t in trials)
            raise RuntimeError(f"no config ran ({reasons[0] if len(reasons) == 1 else where}) "
                               f"[{len(trials)} configs]"[:600])
        ok = sum("ms" in t for t in trials)
        return Measurement(best[0], best[1], None if to_numpy is None else to_numpy(best_out),
                           config=best[2], note=f"best of {ok}/{len(trials)} configs", sweep=trials,
                           retime=self._retimer(lambda: self.timer.jax(best_call)[0]))

    @property
    def torch(self) -> Any:
        """The torch module with CUDA, or `Unavailable`."""
        if self._torch is None:
            try:
                import torch
            except Exception as e:  # noqa: BLE001
                raise Unavailable(f"torch not importable: {short_error(e, 200)}") from e
            if not torch.cuda.is_available():
                raise Unavailable("torch has no CUDA device")
            self._torch = torch
        return self._torch

    def to_torch(self, x: Array) -> Any:
        """A CUDA torch tensor with x's values (zero-copy through DLPack when possible)."""
        torch = self.torch
        try:
            return torch.from_dlpack(x)
        except Exception:  # noqa: BLE001 - older pairs of versions: go through the host
            host = np.asarray(x.astype(jnp.float32))
            return torch.from_numpy(host).cuda().to(getattr(torch, str(x.dtype)))

    def time_torch(self, call: Callable[[], Any], to_numpy: Callable[[Any], np.ndarray] | None = None,
                   **fields: Any) -> Measurement:
        self.deadline.check()
        ms, compile_s, out = self.timer.torch(self.torch, call)
        return Measurement(ms, compile_s, None if to_numpy is None else to_numpy(out),
                           retime=self._retimer(lambda: self.timer.torch(self.torch, call)[0]), **fields)


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def torch_to_numpy(x: Any) -> np.ndarray:
    return x.float().cpu().numpy()


# =========================================================================== implementations


@dataclasses.dataclass(frozen=True)
class Impl:
    """One column of a suite: ``run(ctx, case, inputs) -> Measurement``."""

    name: str
    describe: str
    run: Callable[..., Measurement]
    is_ours: bool = False


def _ours_api():
    import jax_paged_attn

    return jax_paged_attn


def _softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# --------------------------------------------------------------------------- decode


def _decode_call(ctx: Context, x: DecodeInputs, implementation: str | None) -> tuple[Callable[..., Any], tuple]:
    """`flash_attn_with_kvcache` jitted with ``implementation``, and its arguments."""
    api = _ours_api()
    fn = jax.jit(functools.partial(api.flash_attn_with_kvcache, causal=True, implementation=implementation,
                                   interpret=ctx.interpret))
    return fn, (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)


def decode_ours(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    fn, args = _decode_call(ctx, x, ctx.ours_implementation)
    return ctx.time_jax(lambda: fn(*args), lambda o: to_numpy(o)[:, 0])


def decode_auto(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    """What a user's call runs: `flash_attn_with_kvcache` with ``implementation=None``
    (auto: the kernel the package picks for this GPU), checked against ours."""
    fn, args = _decode_call(ctx, x, None)
    return ctx.time_jax(lambda: fn(*args), lambda o: to_numpy(o)[:, 0], note=f"auto ran the {auto_kernel(fn, *args)}")


def auto_kernel(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Which kernel the jitted ``fn`` runs on ``args``, read from its lowered module (the
    custom calls a Pallas kernel lowers to), so the note says what auto really chose."""
    text = fn.lower(*args, **kwargs).as_text()
    markers = (("Mosaic GPU kernel", "custom_call @mosaic_gpu"), ("Triton kernel", "__gpu$xla.gpu.triton"))
    kernels = [name for name, marker in markers if marker in text]
    return " and ".join(kernels) if kernels else "XLA reference"


def mosaic_decode_grid(quick: bool) -> list[Any]:
    """MosaicDecodeConfigs the ours_mosaic_gpu peer sweeps, the package default first:
    (tile_keys, num_stages, target_programs, compute_warpgroups, items_per_program).
    Starting points: stage depth (bytes in flight per program) against programs per SM
    (shared memory ~ num_stages * 2 * tile_keys * 256 B at D 128 bf16, plus ~40 KiB),
    the warp-specialized forms and several sequences a program (0: one wave) first."""
    from jax_paged_attn.tuning import MOSAIC_DECODE_MEASURED, MosaicDecodeConfig

    choices = ((64, 4, 512, 1, 0), (64, 4, 512, 2, 1)) if quick else (
        (64, 4, 512, 1, 0), (64, 4, 512, 2, 0), (64, 4, 512, 1, 4), (64, 4, 512, 2, 1), (64, 4, 1024, 2, 1),
        (64, 4, 1024, 1, 1), (64, 2, 1024, 1, 1), (64, 2, 1024, 2, 1), (64, 4, 1024, 1, 0),
        (64, 3, 1024, 0, 1), (64, 6, 1024, 0, 1), (128, 2, 1024, 0, 1), (128, 3, 1024, 0, 1),
        (64, 4, 512, 0, 1), (64, 4, 2048, 0, 1), (64, 4, 4096, 0, 1),
    )
    grid = [MosaicDecodeConfig(tile_keys=t, num_stages=st, target_programs=p, compute_warpgroups=w,
                               items_per_program=i)
            for t, st, p, w, i in choices]
    return list(dict.fromkeys([MOSAIC_DECODE_MEASURED] + grid))


def decode_ours_mosaic_gpu(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    """Our decode kernel's Mosaic GPU lowering (`decode.paged_decode_attention`,
    lowering='mosaic_gpu'), best of `mosaic_decode_grid` (every config's time is kept in
    the row's sweep), checked against ours (the Triton tier unless --ours-impl)."""
    from jax_paged_attn import decode
    from jax_paged_attn.spec import AttentionSpec

    spec = AttentionSpec.create(case.head_dim, causal=True)
    scale = jnp.ones((), jnp.float32)

    def make_call(config):
        fn = jax.jit(functools.partial(decode.paged_decode_attention, spec=spec, lowering="mosaic_gpu",
                                       interpret=ctx.interpret, config=config))
        return lambda: fn(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, None, scale, scale)

    return ctx.sweep(mosaic_decode_grid(ctx.quick), make_call, repr, lambda o: to_numpy(o)[:, 0])


def stock_paged_grid(pages_per_seq: int, quick: bool) -> list[tuple[int, int]]:
    """(k_splits, pages_per_compute_block) pairs the stock kernel accepts for this length.

    It needs k_splits | pages_per_seq and min(block, pages per split) | pages per split;
    pairs that run the same kernel (block clipped to the split) are kept once.
    """
    splits = (16, 32) if quick else (4, 16, 32)
    blocks = (8,) if quick else (8, 16)
    grid = []
    for k_splits, per_block in itertools.product(splits, blocks):
        if pages_per_seq % k_splits:
            continue
        per_split = pages_per_seq // k_splits
        effective = min(per_block, per_split)
        if per_split % effective == 0 and (k_splits, effective) not in grid:
            grid.append((k_splits, effective))
    return grid


def decode_stock_pallas(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import paged_attention as stock

    # Stock layout [Hk, pages, page, D] (same page ids); it has no softmax scale: pre-scale q.
    k_pages = jnp.transpose(x.k_cache, (2, 0, 1, 3))
    v_pages = jnp.transpose(x.v_cache, (2, 0, 1, 3))
    q = (x.q[:, 0].astype(jnp.float32) * _softmax_scale(case.head_dim)).astype(x.q.dtype)

    def make_call(config):
        k_splits, per_block = config
        fn = jax.jit(functools.partial(stock.paged_attention, k_splits=k_splits,
                                       pages_per_compute_block=per_block))
        return lambda: fn(q, k_pages, v_pages, x.block_table, x.seqlens)

    grid = stock_paged_grid(case.pages_per_seq, ctx.quick)
    return ctx.sweep(grid, make_call, lambda c: f"k_splits={c[0]} pages_per_compute_block={c[1]}", to_numpy)


def decode_cudnn_paged(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    page_table = x.block_table[:, None, :, None]  # [B, 1, pages, 1]
    q_lens = jnp.ones((case.batch,), jnp.int32)
    fn = jax.jit(functools.partial(cudnn.paged_attention, scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(x.q, x.k_cache, x.v_cache, q_lens, x.seqlens, page_table, page_table),
                        lambda o: to_numpy(o)[:, 0])


def decode_cudnn_contiguous(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    k, v = x.contiguous(x.k_cache, case.context), x.contiguous(x.v_cache, case.context)
    fn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, implementation="cudnn"))
    return ctx.time_jax(lambda: fn(x.q, k, v, x.seqlens), lambda o: to_numpy(o)[:, 0])


def xla_gather_decode(q: Array, k_cache: Array, v_cache: Array, block_table: Array, seqlens: Array,
                      scale: float) -> Array:
    """Plain XLA decode: gather every page of each sequence, then einsum + softmax."""
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = block_table.shape[1] * k_cache.shape[1]
    k = k_cache[block_table].reshape(batch, keys, kv_heads, head_dim)
    v = v_cache[block_table].reshape(batch, keys, kv_heads, head_dim)
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = jnp.einsum("bhgd,bthd->bhgt", grouped, k, preferred_element_type=jnp.float32) * scale
    in_seq = jnp.arange(keys)[None, :] < seqlens[:, None]  # [B, keys]
    scores = jnp.where(in_seq[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgt,bthd->bhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)


def decode_xla_gather(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    fn = jax.jit(functools.partial(xla_gather_decode, scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(x.q, x.k_cache, x.v_cache, x.block_table, x.seqlens), to_numpy)


def _torch_sdpa(backend_name: str):
    def run(ctx: Context, case: Any, x: Any) -> Measurement:
        torch = ctx.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        if isinstance(case, DecodeCase):
            q = ctx.to_torch(x.q).transpose(1, 2).contiguous()  # [B, Hq, 1, D]
            k = ctx.to_torch(x.contiguous(x.k_cache, case.context)).transpose(1, 2).contiguous()
            v = ctx.to_torch(x.contiguous(x.v_cache, case.context)).transpose(1, 2).contiguous()
            causal, convert = False, lambda o: torch_to_numpy(o)[:, :, 0]
        else:  # dense prefill: [B, H, S, D]
            seq = case.q_lens[0]
            q = ctx.to_torch(x.q).reshape(case.batch, seq, case.q_heads, -1).transpose(1, 2).contiguous()
            k = ctx.to_torch(x.k).reshape(case.batch, seq, case.kv_heads, -1).transpose(1, 2).contiguous()
            v = ctx.to_torch(x.v).reshape(case.batch, seq, case.kv_heads, -1).transpose(1, 2).contiguous()
            causal = True
            convert = lambda o: torch_to_numpy(o.transpose(1, 2)).reshape(-1, case.q_heads, case.head_dim)

        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        measured = ctx.time_torch(call, convert)
        if measured.retime is None:  # measured once: free the inputs (kept for the rounds otherwise)
            del q, k, v, call
            torch.cuda.empty_cache()
        return measured

    return run


def _torch_varlen_attn(ctx: Context) -> tuple[Callable[..., Any], set[str]]:
    ctx.torch  # noqa: B018 - raises Unavailable without torch / CUDA
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"torch.nn.attention.varlen.varlen_attn missing: {short_error(e, 200)}") from e
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _torch_causal_kwargs(params: set[str]) -> dict[str, Any]:
    # Newer torch spells causal as window_size=(-1, 0) (bottom-right, flash-attention's).
    return {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}


def decode_torch_varlen_paged(ctx: Context, case: DecodeCase, x: DecodeInputs) -> Measurement:
    varlen_attn, params = _torch_varlen_attn(ctx)
    if "block_table" not in params:
        raise Unavailable("this torch's varlen_attn takes no block_table")
    torch = ctx.torch
    q = ctx.to_torch(x.q[:, 0])  # [B, Hq, D]: one query per sequence
    kc, vc = ctx.to_torch(x.k_cache), ctx.to_torch(x.v_cache)
    cu_q = torch.arange(case.batch + 1, dtype=torch.int32, device="cuda")
    cu_k = ctx.to_torch(jnp.arange(case.batch + 1, dtype=jnp.int32) * case.context)
    table, used = ctx.to_torch(x.block_table), ctx.to_torch(x.seqlens)
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}
    return ctx.time_torch(
        lambda: varlen_attn(q, kc, vc, cu_q, cu_k, 1, case.context, block_table=table, seqused_k=used,
                            **_torch_causal_kwargs(params), **extra),
        torch_to_numpy)


DECODE_IMPLS = (
    Impl("ours", "jax_paged_attn.flash_attn_with_kvcache (implementation='triton' unless --ours-impl), "
                 "vLLM cache layout, permuted block table", decode_ours, is_ours=True),
    Impl("auto", "jax_paged_attn.flash_attn_with_kvcache(implementation=None): the kernel the package runs by "
                 "default on this GPU", decode_auto),
    Impl("ours_mosaic_gpu", "our decode kernel's Mosaic GPU lowering (first cut; what "
                            "implementation='mosaic_gpu' runs), best of a MosaicDecodeConfig sweep, same inputs "
                            "as ours", decode_ours_mosaic_gpu),
    Impl("stock_pallas", "jax.experimental.pallas.ops.gpu.paged_attention, layout [Hk, pages, page, D], "
                         "best of a k_splits × pages_per_compute_block sweep (q pre-scaled: it takes no scale)",
         decode_stock_pallas),
    Impl("cudnn_paged", "JAX cuDNN paged attention (internal jax._src.cudnn.fused_attention_stablehlo."
                        "paged_attention), same cache and block table", decode_cudnn_paged),
    Impl("torch_sdpa_cudnn", "torch SDPA, CUDNN_ATTENTION backend, contiguous K/V, enable_gqa",
         _torch_sdpa("CUDNN_ATTENTION")),
    Impl("torch_sdpa_flash", "torch SDPA, FLASH_ATTENTION backend, contiguous K/V, enable_gqa",
         _torch_sdpa("FLASH_ATTENTION")),
    Impl("cudnn_contig", "jax.nn.dot_product_attention(implementation='cudnn') on contiguous [B, ctx, Hk, D] "
                         "K/V (not paged)", decode_cudnn_contiguous),
    Impl("xla_gather", "XLA: gather the pages, einsum, softmax, einsum", decode_xla_gather),
    Impl("torch_varlen_paged", "torch.nn.attention.varlen.varlen_attn with block_table (when this torch "
                               "has it)", decode_torch_varlen_paged),
)


# --------------------------------------------------------------------------- prefill / varlen / prefix


def _attention_call(ctx: Context, x: AttentionInputs, implementation: str | None
                    ) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """`flash_attn_varlen_func` jitted with ``implementation``, and its arguments."""
    api = _ours_api()
    fn = jax.jit(functools.partial(
        api.flash_attn_varlen_func, max_seqlen_q=x.max_q, max_seqlen_k=x.max_k, causal=True,
        implementation=implementation, interpret=ctx.interpret))
    return fn, (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k), dict(block_table=x.block_table)


def attention_ours(ctx: Context, case: AttentionCase, x: AttentionInputs, implementation: str | None = None
                   ) -> Measurement:
    fn, args, kwargs = _attention_call(ctx, x, implementation or ctx.ours_implementation)
    return ctx.time_jax(lambda: fn(*args, **kwargs), to_numpy)


def attention_auto(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    """What a user's call runs: `flash_attn_varlen_func` with ``implementation=None``
    (auto), checked against ours."""
    fn, args, kwargs = _attention_call(ctx, x, None)
    return ctx.time_jax(lambda: fn(*args, **kwargs), to_numpy,
                        note=f"auto ran the {auto_kernel(fn, *args, **kwargs)}")


def mosaic_prefill_grid(quick: bool, head_size: int) -> list[Any]:
    """MosaicPrefillConfigs the ours_mosaic_gpu peer sweeps, the package's default for the
    head size first (`tuning.mosaic_prefill_config`): the warp-specialized form with 2
    ping-ponged compute warpgroups, varying the masked blocks' non-finite check and
    value work tile, ``fence_softmax``, ``direct_output`` (off: the slab per tile),
    128-key blocks whose masked ones run in 64-key parts (block_k is shrunk to fit shared
    memory at large head sizes) and, second, the default with ``prefetch_queries``
    flipped and its warpgroups staggered across heads (``pingpong_across_items``),
    with one persistent program per SM of the device (also with the next item's queries
    prefetched and the stagger across items, and with the softmax beside the previous
    block's P·V) and with ``overlap_softmax``."""
    from jax_paged_attn import tuning
    from jax_paged_attn.tuning import MosaicPrefillConfig

    bk128 = dict(block_k=128, masked_block_k=64)
    choices = [dict(nonfinite_check="probe")] if quick else [
        dict(nonfinite_check="product"), dict(nonfinite_check="key_flags"), dict(nonfinite_check="probe"),
        dict(nonfinite_check="key_flags", value_work_tile="own"),
        dict(direct_output=False), dict(fence_softmax=True), dict(fence_softmax=True, nonfinite_check="probe"),
        dict(bk128, nonfinite_check="probe"), dict(bk128, nonfinite_check="probe", fence_softmax=True),
        dict(bk128, nonfinite_check="key_flags"),
    ]
    default = tuning.mosaic_prefill_config(head_size, "bfloat16")
    # Right after the default: it with its next heads' queries prefetched or not
    # (whichever it does not), its warpgroups staggered across heads (with and without
    # the prefetch), then 1, 4 and 2 heads per
    # program (those the default does not set), then one persistent program per SM (the
    # device's count; the next item's queries prefetched and the stagger across items;
    # the overlapped softmax too), then the default with the overlapped softmax.
    flipped = not default.prefetch_queries
    heads = [dataclasses.replace(default, prefetch_queries=flipped),
             dataclasses.replace(default, pingpong_across_items=True, prefetch_queries=flipped),
             dataclasses.replace(default, pingpong_across_items=True)] + [
        dataclasses.replace(default, heads_per_program=n) for n in (1, 4, 2) if n != default.heads_per_program]
    sms = getattr(jax.devices()[0], "core_count", 0) or 0
    persistent = []
    if sms > 0:
        one_per_sm = dataclasses.replace(default, persistent_programs=sms, heads_per_program=1)
        streaming = dataclasses.replace(one_per_sm, prefetch_queries=True, pingpong_across_items=True)
        persistent = [one_per_sm, streaming, dataclasses.replace(streaming, overlap_softmax=True)]
    overlapped = [dataclasses.replace(default, overlap_softmax=True)]
    grid = [MosaicPrefillConfig(**fields) for fields in choices]
    return list(dict.fromkeys([default] + heads + persistent + overlapped + grid))


def attention_ours_mosaic_gpu(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    """Our Mosaic GPU prefill tier beside the default (Triton) one
    (`prefill.varlen_attention`, lowering='mosaic_gpu'), best of `mosaic_prefill_grid`
    (every config's time is kept in the row's sweep); its output is checked against
    ours like a peer's."""
    from jax_paged_attn import prefill
    from jax_paged_attn.spec import AttentionSpec

    spec = AttentionSpec.create(case.head_dim, causal=True)

    def make_call(config):
        fn = jax.jit(functools.partial(prefill.varlen_attention, spec=spec, max_seqlen_q=x.max_q,
                                       max_seqlen_k=x.max_k, lowering="mosaic_gpu", interpret=ctx.interpret,
                                       config=config))
        return lambda: fn(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.block_table, None, None, 1.0, 1.0)

    # The interpreter (CPU dry runs) takes the package's interpret default alone: the
    # warp-specialized forms run there about ten times slower.
    configs = [None] if ctx.interpret else mosaic_prefill_grid(ctx.quick, case.head_dim)
    return ctx.sweep(configs, make_call, repr, to_numpy)


def attention_xla_reference(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    scores_bytes = 3 * 4 * case.batch * case.q_heads * x.max_q * x.max_k
    if scores_bytes > XLA_REFERENCE_MAX_BYTES:
        raise Unavailable(f"would materialize ~{scores_bytes / 2**30:.0f} GiB of f32 scores")
    return attention_ours(ctx, case, x, implementation="xla")


def _dense(x: Array, case: AttentionCase) -> Array:
    """Packed [B*S, H, D] -> [B, S, H, D] (a free reshape)."""
    return x.reshape(case.batch, case.q_lens[0], *x.shape[1:])


def prefill_jax_dpa(implementation: str):
    def run(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
        q, k, v = _dense(x.q, case), _dense(x.k, case), _dense(x.v, case)
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation=implementation))
        return ctx.time_jax(lambda: fn(q, k, v), lambda o: to_numpy(o).reshape(x.q.shape))

    return run


def _repeat_kv(k: Array, q_heads: int) -> Array:
    """Stock kernels without GQA: each KV head repeated for its query heads."""
    return jnp.repeat(k, q_heads // k.shape[-2], axis=-2)


def prefill_stock_mha(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import attention as stock

    q, k, v = _dense(x.q, case), _dense(x.k, case), _dense(x.v, case)
    k, v = _repeat_kv(k, case.q_heads), _repeat_kv(v, case.q_heads)
    fn = jax.jit(functools.partial(stock.mha, segment_ids=None, causal=True,
                                   sm_scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(q, k, v), lambda o: to_numpy(o).reshape(x.q.shape),
                        note="KV heads repeated")


def prefill_mosaic_fp16(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    # fp16 only in jax 0.11.2 (bf16 is rejected); it takes no scale: pre-scale q.
    q = (_dense(x.q, case).astype(jnp.float32) * _softmax_scale(case.head_dim)).astype(jnp.float16)
    k, v = _dense(x.k, case).astype(jnp.float16), _dense(x.v, case).astype(jnp.float16)
    grid = [(64, 128, 2)] if ctx.quick else [(64, 128, 2), (128, 128, 2), (64, 64, 2)]

    def make_call(config):
        block_q, block_kv, steps = config
        tuning = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=True)
        fn = jax.jit(functools.partial(mgpu.attention, config=tuning))
        return lambda: fn(q, k, v)

    result = ctx.sweep(grid, make_call, lambda c: f"block_q={c[0]} block_kv={c[1]} steps={c[2]}",
                       lambda o: to_numpy(o).reshape(x.q.shape))
    result.note = "fp16 inputs; " + result.note
    return result


def varlen_cudnn_padded(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    q = x.padded_q()
    k, v = x.padded_kv()
    q_lens, k_lens = jnp.asarray(x.q_lens, jnp.int32), jnp.asarray(x.k_lens, jnp.int32)
    fn = jax.jit(lambda q, k, v, ql, kl: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="cudnn"))
    return ctx.time_jax(lambda: fn(q, k, v, q_lens, k_lens), x.unpad,
                        note=f"padded to [{case.batch}, {x.max_q}]")


def varlen_stock_mha_segments(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    from jax.experimental.pallas.ops.gpu import attention as stock

    block = 128  # the stock kernel's default block; pad the token axis to a multiple
    tokens = x.q.shape[0]
    padded = -(-tokens // block) * block
    pad = ((0, padded - tokens), (0, 0), (0, 0))
    q = jnp.pad(x.q, pad)[None]
    k = jnp.pad(_repeat_kv(x.k, case.q_heads), pad)[None]
    v = jnp.pad(_repeat_kv(x.v, case.q_heads), pad)[None]
    seq_ids = np.repeat(np.arange(case.batch), x.q_lens)
    segments = jnp.asarray(np.concatenate([seq_ids, np.full(padded - tokens, case.batch)]), jnp.int32)[None]
    fn = jax.jit(functools.partial(stock.mha, causal=True, sm_scale=_softmax_scale(case.head_dim)))
    return ctx.time_jax(lambda: fn(q, k, v, segments), lambda o: to_numpy(o)[0, :tokens],
                        note="all sequences packed in one row with segment_ids; KV heads repeated")


def varlen_torch(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    varlen_attn, params = _torch_varlen_attn(ctx)
    q = ctx.to_torch(x.q)
    k, v = x.keys_values()
    note = ""
    if "enable_gqa" in params:
        extra = {"enable_gqa": True}
    else:
        k, v, extra, note = _repeat_kv(k, case.q_heads), _repeat_kv(v, case.q_heads), {}, "KV heads repeated"
    k, v = ctx.to_torch(k), ctx.to_torch(v)
    cu_q, cu_k = ctx.to_torch(x.cu_seqlens_q), ctx.to_torch(x.cu_seqlens_k)
    return ctx.time_torch(
        lambda: varlen_attn(q, k, v, cu_q, cu_k, x.max_q, x.max_k, **_torch_causal_kwargs(params), **extra),
        torch_to_numpy, note=note)


_CUDNN_PREFIX_NOTES = {
    "CAUSAL": "cuDNN's causal mask is top-left aligned, not vLLM's bottom-right: less work and a "
              "different result (cuDNN's mask alignment)",
    "NO_MASK": "no mask: every query attends all keys, more work than causal and a different "
               "result; brackets what a correct cuDNN paged prefill would take",
}


def prefix_cudnn_paged(mask_name: str):
    def run(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        q = x.padded_q()
        page_table = x.block_table[:, None, :, None]  # [B, 1, pages, 1]
        q_lens, k_lens = jnp.asarray(x.q_lens, jnp.int32), jnp.asarray(x.k_lens, jnp.int32)
        k, v = x.k, x.v
        if k.shape[0] < x.block_table.size:
            # cuDNN wants as many cache pages as the table has entries (its error otherwise:
            # "must have same number of blocks"); unequal lengths leave fewer: zero pages
            # appended, never read, outside the timing.
            pad = ((0, x.block_table.size - k.shape[0]),) + ((0, 0),) * (k.ndim - 1)
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        fn = jax.jit(functools.partial(cudnn.paged_attention, scale=_softmax_scale(case.head_dim),
                                       mask_type=getattr(cudnn.MaskType, mask_name)))
        note = _CUDNN_PREFIX_NOTES[mask_name]
        if mask_name == "CAUSAL" and tuple(x.q_lens) == tuple(x.k_lens):
            note = "nothing cached: cuDNN's top-left causal mask is the bottom-right one here"
        return ctx.time_jax(lambda: fn(q, k, v, q_lens, k_lens, page_table, page_table), x.unpad, note=note)

    return run


def prefix_torch_varlen_paged(ctx: Context, case: AttentionCase, x: AttentionInputs) -> Measurement:
    varlen_attn, params = _torch_varlen_attn(ctx)
    if "block_table" not in params:
        raise Unavailable("this torch's varlen_attn takes no block_table")
    q, kc, vc = ctx.to_torch(x.q), ctx.to_torch(x.k), ctx.to_torch(x.v)
    cu_q, cu_k = ctx.to_torch(x.cu_seqlens_q), ctx.to_torch(x.cu_seqlens_k)
    table, used = ctx.to_torch(x.block_table), ctx.to_torch(jnp.asarray(x.k_lens, jnp.int32))
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}
    return ctx.time_torch(
        lambda: varlen_attn(q, kc, vc, cu_q, cu_k, x.max_q, x.max_k, block_table=table, seqused_k=used,
                            **_torch_causal_kwargs(params), **extra),
        torch_to_numpy)


_OURS_ATTENTION = Impl("ours", "jax_paged_attn.flash_attn_varlen_func (implementation='triton' unless "
                               "--ours-impl), packed tokens; paged cache + block_table for prefix",
                       attention_ours, is_ours=True)
_OURS_MOSAIC_GPU = Impl("ours_mosaic_gpu", "jax_paged_attn.flash_attn_varlen_func(implementation='mosaic_gpu'): "
                                           "our Pallas Mosaic GPU prefill kernel (Hopper; first cut, "
                                           "warp-specialized), same inputs as ours", attention_ours_mosaic_gpu)
_AUTO_ATTENTION = Impl("auto", "jax_paged_attn.flash_attn_varlen_func(implementation=None): the kernel the "
                                "package runs by default on this GPU", attention_auto)
_XLA_REFERENCE = Impl("xla_ref", "jax_paged_attn.flash_attn_varlen_func(implementation='xla'), our reference "
                                 "(skipped when its f32 scores would not fit)", attention_xla_reference)

PREFILL_IMPLS = (
    _OURS_ATTENTION,
    _AUTO_ATTENTION,
    _OURS_MOSAIC_GPU,
    Impl("stock_mha", "jax.experimental.pallas.ops.gpu.attention.mha (Pallas Triton), KV heads repeated",
         prefill_stock_mha),
    Impl("cudnn", "jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)", prefill_jax_dpa("cudnn")),
    Impl("torch_sdpa_cudnn", "torch SDPA, CUDNN_ATTENTION backend, enable_gqa", _torch_sdpa("CUDNN_ATTENTION")),
    Impl("mosaic_fp16", "jax.experimental.pallas.ops.gpu.attention_mgpu (Pallas Mosaic GPU) in fp16 (its only "
                        "dtype in jax 0.11.2), best of a small block sweep", prefill_mosaic_fp16),
    Impl("torch_sdpa_flash", "torch SDPA, FLASH_ATTENTION backend, enable_gqa", _torch_sdpa("FLASH_ATTENTION")),
    Impl("xla", "jax.nn.dot_product_attention(implementation='xla', is_causal=True)", prefill_jax_dpa("xla")),
)
VARLEN_IMPLS = (
    _OURS_ATTENTION,
    _AUTO_ATTENTION,
    _OURS_MOSAIC_GPU,
    Impl("cudnn_padded", "jax.nn.dot_product_attention(implementation='cudnn') on the batch padded to the "
                         "longest sequence, with query/key lengths", varlen_cudnn_padded),
    Impl("stock_mha_segments", "Pallas Triton attention.mha on all tokens as one sequence with segment_ids "
                               "(KV heads repeated)", varlen_stock_mha_segments),
    Impl("torch_varlen", "torch.nn.attention.varlen.varlen_attn (packed, causal)", varlen_torch),
    _XLA_REFERENCE,
)
PREFIX_IMPLS = (
    _OURS_ATTENTION,
    _AUTO_ATTENTION,
    _OURS_MOSAIC_GPU,
    Impl("cudnn_paged", "JAX cuDNN paged_attention, MaskType.CAUSAL (top-left aligned: not the same "
                        "function)", prefix_cudnn_paged("CAUSAL")),
    Impl("cudnn_paged_nomask", "JAX cuDNN paged_attention without a mask (all keys: an upper bracket)",
         prefix_cudnn_paged("NO_MASK")),
    _XLA_REFERENCE,
    Impl("torch_varlen_paged", "torch varlen_attn with block_table (when this torch has it)",
         prefix_torch_varlen_paged),
)


# --------------------------------------------------------------------------- cache writes


class DonatedStep:
    """Calls ``fn(key, value, k_cache, v_cache, slots)`` with the caches donated, feeding
    each call's returned caches into the next (the caches are updated in place)."""

    def __init__(self, fn: Callable[..., tuple[Array, Array]], x: CacheInputs, case: CacheCase):
        self.fn = jax.jit(fn, donate_argnums=(2, 3))
        self.x = x
        self.k_cache, self.v_cache = x.empty_caches(case)

    def __call__(self) -> Array:
        self.k_cache, self.v_cache = self.fn(self.x.key, self.x.value, self.k_cache, self.v_cache,
                                             self.x.slot_mapping)
        return self.k_cache

    def written_rows(self) -> np.ndarray:
        """[T, Hk, D] float32 of what sits in the key cache at each token's slot."""
        flat = self.k_cache.reshape(-1, *self.k_cache.shape[2:])
        return to_numpy(flat[self.x.slot_mapping])


def expected_cache_rows(case: CacheCase, x: CacheInputs, scale: float = 1.0) -> np.ndarray:
    stored = (x.key.astype(jnp.float32) / scale).astype(case.cache_dtype)
    return to_numpy(stored)


def _measure_cache_step(ctx: Context, case: CacheCase, x: CacheInputs, fn: Callable[..., Any],
                        **fields: Any) -> Measurement:
    step = DonatedStep(fn, x, case)
    with warnings.catch_warnings():  # CPU dry runs cannot donate; that is fine there
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        result = ctx.time_jax(step, **fields)
    result.output = step.written_rows()
    return result


def cache_ours(ctx: Context, case: CacheCase, x: CacheInputs, implementation: str | None = None
               ) -> Measurement:
    from jax_paged_attn import cache

    fn = functools.partial(cache.reshape_and_cache_flash, kv_cache_dtype=case.kv_cache_dtype,
                           k_scale=1.0, v_scale=1.0,
                           implementation=implementation or ctx.ours_implementation, interpret=ctx.interpret)
    return _measure_cache_step(ctx, case, x, fn)


def cache_ours_xla(ctx: Context, case: CacheCase, x: CacheInputs) -> Measurement:
    return cache_ours(ctx, case, x, implementation="xla")


def xla_scatter_cache(key: Array, value: Array, k_cache: Array, v_cache: Array, slots: Array
                      ) -> tuple[Array, Array]:
    """Plain XLA cache write: scatter rows to their slots (negative slot = padding, dropped)."""
    def write(cache, rows):
        flat = cache.reshape(-1, *cache.shape[2:])
        index = jnp.where(slots >= 0, slots, flat.shape[0])
        return flat.at[index].set(rows.astype(cache.dtype), mode="drop").reshape(cache.shape)

    return write(k_cache, key), write(v_cache, value)


def cache_xla_scatter(ctx: Context, case: CacheCase, x: CacheInputs) -> Measurement:
    return _measure_cache_step(ctx, case, x, xla_scatter_cache)


def cache_torch_copy(ctx: Context, case: CacheCase, x: CacheInputs) -> Measurement:
    torch = ctx.torch
    size = int(case.work) // 2  # read `size` bytes, write `size` bytes: the same total as ours
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    measured = ctx.time_torch(lambda: dst.copy_(src), note=f"copy_ of {size / 2**20:.1f} MiB")
    if measured.retime is None:  # measured once: free the buffers (kept for the rounds otherwise)
        del src, dst
        torch.cuda.empty_cache()
    return measured


def cache_jax_elementwise(ctx: Context, case: CacheCase, x: CacheInputs) -> Measurement:
    elements = int(case.work) // 2 // 2
    data = jnp.ones((elements,), jnp.bfloat16)
    fn = jax.jit(lambda a: a + 1)
    return ctx.time_jax(lambda: fn(data), note="XLA elementwise op over the same bytes (not a true ceiling)")


CACHE_IMPLS = (
    Impl("ours", "jax_paged_attn.cache.reshape_and_cache_flash (implementation='triton' unless --ours-impl: "
                 "the Pallas cache-write kernel) under jit, caches donated", cache_ours, is_ours=True),
    Impl("ours_xla", "jax_paged_attn.cache.reshape_and_cache_flash(implementation='xla'): our XLA scatter "
                     "path, the kernel's reference", cache_ours_xla),
    Impl("xla_scatter", "XLA .at[slots].set scatter under jit, caches donated", cache_xla_scatter),
    Impl("torch_copy", "device copy ceiling: torch copy_ moving the same bytes", cache_torch_copy),
    Impl("jax_elementwise", "a jitted elementwise op moving the same bytes", cache_jax_elementwise),
)

SUITE_IMPLS = {"decode": DECODE_IMPLS, "prefill": PREFILL_IMPLS, "varlen": VARLEN_IMPLS,
               "prefix": PREFIX_IMPLS, "cache": CACHE_IMPLS}
INPUT_BUILDERS = {"decode": build_decode_inputs, "prefill": build_attention_inputs,
                  "varlen": build_attention_inputs, "prefix": build_attention_inputs,
                  "cache": build_cache_inputs}


# =========================================================================== rows


@dataclasses.dataclass
class Row:
    """One measurement (or failure) of one implementation on one shape: a JSON record."""

    suite: str
    case: str
    impl: str
    is_ours: bool
    metric: str
    work: float  # bytes or flops credited to every implementation of this shape
    status: str  # "ok" | "failed" | "skipped"
    ms: float | None = None
    value: float | None = None  # GB/s or TFLOP/s
    compile_s: float | None = None
    config: str | None = None
    note: str = ""
    error: str | None = None
    check_max_abs_diff: float | None = None
    check_against: str | None = None
    sweep: list[dict[str, Any]] | None = None
    rounds_ms: list[float] | None = None  # ms of each alternating round (`run_jobs`); ms is their median
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # tuning rows only
    table: str | None = None
    table_key: str | None = None
    is_default_config: bool = False


def metric_of(suite: str) -> str:
    return "GB/s" if suite in ("decode", "cache") else "TFLOP/s"


def throughput(work: float, ms: float, metric: str) -> float:
    """GB/s (1e9 bytes/s) or TFLOP/s (1e12 flop/s) from work and milliseconds."""
    per_second = work / (ms * 1e-3)
    return per_second / (1e9 if metric == "GB/s" else 1e12)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ValueError(f"output shape {a.shape} != {b.shape}")
    return float(np.max(np.abs(a - b), initial=0.0))


def log_row(row: Row) -> None:
    if row.status == "ok":
        extra = f" {row.config}" if row.config else ""
        if row.check_max_abs_diff is not None:
            extra += f" |Δ|={row.check_max_abs_diff:.3g}"
        print(f"[{row.suite}] {row.impl:<20} {row.case:<52} {row.ms:9.4f} ms {row.value:9.1f} {row.metric}"
              f" (first call {row.compile_s:.1f} s){extra}", flush=True)
    else:
        print(f"[{row.suite}] {row.impl:<20} {row.case:<52} {row.status}: {row.error}", flush=True)


# =========================================================================== tuning grids


def decode_table_key(case: DecodeCase) -> str:
    """DECODE_TABLE key: (head_size, block_size, query heads per KV head), rounded as tuning.py does."""
    from jax_paged_attn.tuning import next_power_of_2

    return repr((next_power_of_2(case.head_dim), case.page_size, next_power_of_2(case.q_heads // case.kv_heads)))


def prefill_table_key(case: AttentionCase) -> str:
    """PREFILL_TABLE key: (head_size rounded up to a power of 2, query dtype name, paged)."""
    from jax_paged_attn.tuning import next_power_of_2

    return repr((next_power_of_2(case.head_dim), case.dtype, case.page_size is not None))


def table_choice(suite: str, case: Any) -> Any:
    """The config the current tuning table gives this shape (what `ours` runs)."""
    from jax_paged_attn import tuning

    if suite == "decode":
        return tuning.decode_config(case.head_dim, case.page_size, case.q_heads // case.kv_heads)
    return tuning.prefill_config(case.head_dim, case.dtype, paged=case.page_size is not None)


def tune_grid(suite: str, cases: Sequence[Any], quick: bool) -> list[Any]:
    """The current table's choices first, then the package's grid (`jax_paged_attn.tune`:
    the decode grid, or the varlen kernel's over paged keys for the prefix suite, D 128's
    for varlen, every head size's for prefill), deduplicated, in order."""
    if suite == "decode":
        grid = tune.decode_grid(quick)
    else:
        grid = tune.prefill_grid({"prefix": "paged", "varlen": "varlen"}.get(suite, "dense"), quick)
    return list(dict.fromkeys([table_choice(suite, c) for c in cases] + grid))


def decode_with_config(ctx: Context, case: DecodeCase, x: DecodeInputs, config: Any) -> Callable[[], Any]:
    return tune.decode_call(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, config, ctx.interpret)


def prefill_with_config(ctx: Context, case: AttentionCase, x: AttentionInputs, config: Any) -> Callable[[], Any]:
    return tune.prefill_call(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.block_table, x.max_q, x.max_k,
                             config, ctx.interpret)


# =========================================================================== jobs


@dataclasses.dataclass(frozen=True)
class Job:
    """One row to produce: an implementation on a shape, or (tuning) one config of ours on a shape."""

    suite: str
    case: Any
    impl: Impl | None = None  # benchmark jobs
    config: Any = None  # tuning jobs

    def blank_row(self) -> Row:
        suite, case = self.suite, self.case
        row = Row(suite, case.label, self.impl.name if self.impl else "ours",
                  self.impl.is_ours if self.impl else True, metric_of(suite), float(case.work), "ok",
                  params=dataclasses.asdict(case))
        if self.config is not None:
            row.config = repr(self.config)
            row.table = "DECODE_TABLE" if suite == "decode" else "PREFILL_TABLE"
            row.table_key = decode_table_key(case) if suite == "decode" else prefill_table_key(case)
            row.is_default_config = self.config == table_choice(suite, case)
        return row


def select_cases(suite: str, args: argparse.Namespace) -> tuple[Any, ...]:
    cases = TINY_CASES[suite] if args.tiny else FULL_CASES[suite]
    if args.shapes:
        cases = tuple(c for c in cases if any(text in c.label for text in args.shapes))
    return cases[:1] if args.quick else cases


def select_impls(suite: str, args: argparse.Namespace) -> tuple[Impl, ...]:
    impls = SUITE_IMPLS[suite]
    if args.peer_names is None:
        return impls
    return tuple(i for i in impls if i.is_ours or i.name in args.peer_names)


def plan_jobs(suite: str, args: argparse.Namespace) -> list[Job]:
    """The suite's jobs in run order (deterministic: a restarted process resumes by index).

    Benchmarks: implementations outer (ours first), shapes inner, so when the budget
    runs short the last peers are skipped on every shape alike. Tuning: configs
    outer, so a sweep cut short still has the same configs on every shape.
    """
    cases = select_cases(suite, args)
    if args.tune:
        return [Job(suite, case, config=config) for config in tune_grid(suite, cases, args.quick)
                for case in cases]
    return [Job(suite, case, impl=impl) for impl in select_impls(suite, args) for case in cases]


class SuiteRunner:
    """Runs jobs of one suite in this process. Keeps each shape's inputs and ours' output
    (to compare every peer's output with it)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._inputs: dict[Any, Any] = {}
        self._ours_output: dict[Any, np.ndarray] = {}

    def inputs(self, suite: str, case: Any) -> Any:
        if case not in self._inputs:
            try:
                self._inputs[case] = INPUT_BUILDERS[suite](case)
            except Exception as e:  # noqa: BLE001 - remembered: every job of this shape fails alike
                self._inputs[case] = RuntimeError(f"building inputs: {short_error(e)}")
        if isinstance(self._inputs[case], Exception):
            raise self._inputs[case]
        return self._inputs[case]

    def run(self, job: Job) -> tuple[Row, Callable[[], float] | None]:
        """One job and its measured call's `Measurement.retime` (None where there is none);
        never raises (failures and skips are recorded in the row)."""
        row, retime = job.blank_row(), None
        try:
            self.ctx.deadline.check()
            x = self.inputs(job.suite, job.case)
            if job.config is not None:
                make_call = decode_with_config if job.suite == "decode" else prefill_with_config
                row.ms, row.compile_s, _ = self.ctx.timer.jax(make_call(self.ctx, job.case, x, job.config))
            else:
                result = job.impl.run(self.ctx, job.case, x)
                row.ms, row.compile_s, retime = result.ms, result.compile_s, result.retime
                row.config, row.note, row.sweep = result.config, result.note, result.sweep
                self._check(job, x, row, result.output)
            row.value = throughput(row.work, row.ms, row.metric)
        except (OutOfTime, Unavailable) as e:
            row.status, row.error = "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - every implementation is isolated from the others
            row.status, row.error = "failed", short_error(e)
        return row, retime

    def _check(self, job: Job, x: Any, row: Row, output: np.ndarray | None) -> None:
        """Cache writes: against the expected cache rows. Attention: against ours."""
        if output is None:
            return
        if job.suite == "cache":
            reference, against = expected_cache_rows(job.case, x), "expected"
        elif job.impl.is_ours:
            self._ours_output[job.case] = output
            return
        else:
            reference, against = self._ours_output.get(job.case), "ours"
        if reference is None:
            return
        try:
            row.check_max_abs_diff, row.check_against = max_abs_diff(output, reference), against
        except ValueError as e:
            row.note = (row.note + "; " if row.note else "") + f"not compared: {e}"


Emit = Callable[[Row, "int | None"], None]
"""Receives each job's row as it is measured (``None``), then, after the alternating
rounds, the row again with the index of the row it replaces among this call's rows."""


def run_jobs(jobs: Sequence[Job], ctx: Context, emit: Emit) -> None:
    """Runs the jobs in order, emitting each row as soon as it is measured (a crash loses
    only the job it happens in). Then, with ``ctx.rounds`` > 1, times every measured call
    again in ``ctx.rounds - 1`` more rounds, all of the suite's calls in job order per
    round (implementations and shapes alternating, as `prefill_parts.py --versus` does),
    while the suite's budget lasts: each row's ms becomes the median of its rounds
    (``rounds_ms``), so a GPU's drift between one implementation's turn and the next's (up
    to ~10 % between runs on the H200) reaches every column alike. Re-emits the rows it
    re-timed."""
    runner = SuiteRunner(ctx)
    timed = []  # (index, row, retime) of the rows to time again
    for i, job in enumerate(jobs):
        row, retime = runner.run(job)
        log_row(row)
        emit(row, None)
        if row.status == "ok" and retime is not None:
            timed.append((i, row, retime))
    for _, row, _ in timed:
        row.rounds_ms = [row.ms]
    for _ in range(ctx.rounds - 1):
        for _, row, retime in timed:
            if ctx.deadline.expired():
                break
            try:
                row.rounds_ms.append(retime())
            except Exception as e:  # noqa: BLE001 - keep the rounds it has
                row.note = (row.note + "; " if row.note else "") + f"a later round failed: {short_error(e, 200)}"
    for i, row, _ in timed:
        if len(row.rounds_ms) > 1:
            row.ms = statistics.median(row.rounds_ms)
            row.value = throughput(row.work, row.ms, row.metric)
            emit(row, i)


# =========================================================================== one process per suite

CHILD_GRACE_S = 120.0
"""A suite's process may overrun its share by this much (one long compile) before it is killed."""
MAX_RESTARTS = 3


def spawn(command: list[str], timeout_s: float) -> str | int:
    """Runs a child process (its output goes to ours); its exit code or 'timed out'.
    An infinite ``timeout_s`` (``--budget-s inf``) waits as long as the child runs."""
    try:
        return subprocess.run(command, timeout=timeout_s if math.isfinite(timeout_s) else None).returncode
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"


REPLACES = "replaces_row"
"""Key of a child's JSON line that replaces an earlier row of that child (its index):
the row again after the alternating rounds (`run_jobs`)."""


def _read_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    """A child's rows, each line a row or (`REPLACES`) a new version of an earlier one."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            break
        if REPLACES in record:
            rows[record.pop(REPLACES)] = record
        else:
            rows.append(record)
    return rows


def run_suite_isolated(suite: str, jobs: Sequence[Job], args: argparse.Namespace, deadline: Deadline,
                       workdir: pathlib.Path, spawn_fn: Callable[[list[str], float], str | int] = spawn
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs the suite's jobs in child processes: a job that kills its process (a CUDA
    fault poisons the whole context) is recorded as failed and the suite resumes after
    it in a fresh process, up to `MAX_RESTARTS` times. Returns (rows, device meta)."""
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    start, restarts = 0, 0
    while start < len(jobs):
        rows_path = workdir / f"{suite}.{restarts}.jsonl"
        meta_path = workdir / f"{suite}.{restarts}.meta.json"
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), *args.forwarded, "--suite", suite,
                   "--child-start", str(start), "--child-deadline", repr(deadline.end),
                   "--child-rows", str(rows_path), "--child-meta", str(meta_path)]
        outcome = spawn_fn(command, max(60.0, deadline.end - time.monotonic()) + CHILD_GRACE_S)
        new_rows = _read_rows(rows_path)
        rows += new_rows
        start += len(new_rows)
        if meta_path.exists() and not meta:
            meta = json.loads(meta_path.read_text())
        if start >= len(jobs):
            break
        how = outcome if isinstance(outcome, str) else f"exit code {outcome}"
        if not new_rows and not meta_path.exists():  # it never got to its first job
            for job in jobs[start:]:
                failed = job.blank_row()
                failed.status, failed.error = "failed", f"the suite's process did not start ({how}); see its output"
                rows.append(dataclasses.asdict(failed))
            break
        crashed = jobs[start].blank_row()
        crashed.status = "failed"
        crashed.error = f"the suite's process ended during this job ({how})"
        log_row(crashed)
        rows.append(dataclasses.asdict(crashed))
        start += 1
        restarts += 1
        if restarts > MAX_RESTARTS or deadline.expired():
            for job in jobs[start:]:
                skipped = job.blank_row()
                skipped.status, skipped.error = "skipped", "not run: the suite's process kept dying or time ran out"
                rows.append(dataclasses.asdict(skipped))
            break
    return rows, meta


def run_timer(args: argparse.Namespace) -> Timer:
    """``--warmup`` / ``--reps``; a ``--tiny`` dry run times samples of one call (`Timer.dry_run`)."""
    return Timer(args.warmup, args.reps, min_calls=1 if args.tiny else Timer.min_calls)


def child_main(args: argparse.Namespace) -> int:
    """A suite's process: runs its jobs from ``--child-start`` on, one JSON line per row."""
    suite = args.suites[0]
    jobs = plan_jobs(suite, args)[args.child_start:]
    meta = device_meta()
    pathlib.Path(args.child_meta).write_text(json.dumps(meta))
    print(f"[{suite}] process {os.getpid()}: {meta['gpu']} | torch {meta['torch']} | jobs {args.child_start}.."
          f"{args.child_start + len(jobs) - 1}", flush=True)
    ctx = Context(run_timer(args), Deadline(args.child_deadline), ours_implementation=args.ours_impl,
                  rounds=args.rounds, interpret=args.interpret, quick=args.quick, max_configs=args.max_configs)
    with open(args.child_rows, "w") as sink:
        def emit(row: Row, replaces: int | None) -> None:
            record = dataclasses.asdict(row)
            if replaces is not None:
                record[REPLACES] = replaces
            sink.write(json.dumps(record, default=str) + "\n")
            sink.flush()

        run_jobs(jobs, ctx, emit)
    return 0


# =========================================================================== driver


def run_meta(argv: Sequence[str], args: argparse.Namespace, started: datetime.datetime) -> dict[str, Any]:
    """What the run was (no device touched: the parent of isolated suites must leave the GPU alone)."""
    notes = []
    if args.ours_impl != "triton":
        notes.append(f"ours ran with implementation={args.ours_impl!r}")
    if args.quick:
        notes.append("--quick: first shape of each suite, reduced sweeps")
    if args.tiny:
        notes.append("--tiny: toy shapes for a dry run; the numbers mean nothing")
    if args.rounds > 1 and not args.tune:
        notes.append(f"each time: the median of up to {args.rounds} alternating rounds of the suite's calls "
                     "(rounds_ms in the JSON; fewer where the suite's budget ran out)")
    return {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "benchmarks/bench_attention.py", *argv]),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "budget_s": args.budget_s,
        "notes": notes,
    }


def device_meta() -> dict[str, Any]:
    """GPU name and library versions (initializes the JAX backend)."""
    device = jax.devices()[0]
    meta: dict[str, Any] = {
        "gpu": f"{getattr(device, 'device_kind', device.platform)} ({device.platform}, {len(jax.devices())} device(s))",
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        meta["jaxlib"] = "unknown"
    try:
        import torch

        meta["torch"] = f"{torch.__version__} (cuda available: {torch.cuda.is_available()})"
    except Exception as e:  # noqa: BLE001
        meta["torch"] = f"not importable ({short_error(e, 100)})"
    return meta


_PROBE = "import jax; d = jax.devices()[0]; print(d.platform); print(getattr(d, 'device_kind', d.platform))"
PROBE_TIMEOUT_S = 300.0


def probe_device(isolate: bool) -> tuple[str, str]:
    """(platform, device kind) of JAX's default device, e.g. ``("gpu", "NVIDIA H200")``.

    With isolated suites a short child process asks, so that this process never opens
    the GPU (JAX would hold its memory for the whole run); without isolation this
    process asks itself. A probe that fails reports ``("unknown", <why>)``.
    """
    if not isolate:
        device = jax.devices()[0]
        return device.platform, getattr(device, "device_kind", device.platform)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the probe only looks
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return "unknown", f"the device probe timed out after {PROBE_TIMEOUT_S:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or len(lines) < 2:
        tail = " ".join(done.stderr.strip().splitlines()[-1:]) or f"exit code {done.returncode}"
        return "unknown", f"the device probe failed: {tail[:300]}"
    return lines[-2].strip(), lines[-1].strip()


def no_gpu_message(platform_name: str, device_kind: str) -> str | None:
    """Why this host cannot run the benchmarks, or None on a GPU."""
    if platform_name == "gpu":
        return None
    return (f"bench_attention.py: no GPU here (JAX's default device: {device_kind}, platform "
            f"{platform_name!r}). The benchmarks time the Pallas GPU kernels against GPU peers; run "
            f"them on an NVIDIA GPU host, or pass --tiny (toy shapes) or --interpret (Pallas "
            f"interpret mode) for a CPU dry run of the harness.")


def device_slug(device_kind: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: the device part of the output file names."""
    return tuning.device_slug(device_kind)


def output_paths(args: argparse.Namespace, device_kind: str, started: datetime.datetime) -> list[pathlib.Path]:
    """Markdown files the run writes (the JSON sits next to the first one).

    ``--out``/``<stem>.md`` with the stem ``<YYYY-MM-DD-HHMM>-<device>`` (``-tuning``
    appended for a sweep) unless ``--stem`` names it; plus the committed
    ``benchmarks/RESULTS.md`` (``TUNING.md`` for a sweep) only with
    ``--update-committed-md``.
    """
    stem = args.stem
    if stem is None:
        stem = f"{started.strftime('%Y-%m-%d-%H%M')}-{device_slug(device_kind)}"
        if args.tune:
            stem += "-tuning"
    paths = [pathlib.Path(args.out) / f"{stem}.md"]
    if args.update_committed_md:
        paths.append(_BENCH_DIR / ("TUNING.md" if args.tune else "RESULTS.md"))
    return paths


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default=None,
                        help=f"comma-separated subset of {','.join(SUITES)} (default: all; with --tune: "
                             f"{','.join(DEFAULT_TUNE_SUITES)})")
    parser.add_argument("--tune", action="store_true", help="sweep our kernel configs instead of comparing peers")
    parser.add_argument("--out", default=str(_BENCH_DIR / "results"),
                        help="folder for the markdown and JSON (default: %(default)s)")
    parser.add_argument("--stem", default=None,
                        help="file name of the outputs without extension (default: <YYYY-MM-DD-HHMM>-<device>, "
                             "-tuning appended with --tune)")
    parser.add_argument("--update-committed-md", action="store_true",
                        help="also write the markdown to benchmarks/RESULTS.md (TUNING.md with --tune), the "
                             "committed copy; never done by default")
    parser.add_argument("--quick", action="store_true", help="first shape of each suite, smaller sweeps")
    parser.add_argument("--shapes", default=None, metavar="TEXT,...",
                        help="only the shapes whose label holds one of these texts (e.g. D64 or 'B256 ctx1024')")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="wall-clock budget of the whole run from its start, compile included; inf for none "
                             "(default: %(default)s)")
    parser.add_argument("--max-configs", type=int, default=0,
                        help="a swept peer's first N configs only, the package default first (default: all)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per measurement (median; default 10)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every measured call in this many alternating rounds, all of a suite's calls "
                             "per round, while its budget lasts; a row's time is the median (default 3; "
                             "with --tune, 1)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first, the first compiles (default 3)")
    parser.add_argument("--peers", default=None,
                        help="comma-separated implementation names to run besides ours (default: all)")
    parser.add_argument("--ours-impl", default="triton", choices=("triton", "xla", "auto"),
                        help="implementation= passed to our public API (default: triton)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes: a CPU dry run of the harness")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode for our kernels (CPU)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="run every suite in this process (default: one child process per suite, so a "
                             "CUDA fault loses one job, not the run)")
    for hidden in ("--child-rows", "--child-meta"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    default_suites = DEFAULT_TUNE_SUITES if args.tune else SUITES
    args.suites = tuple(s for s in (args.suite.split(",") if args.suite else default_suites) if s)
    allowed = TUNABLE_SUITES if args.tune else SUITES
    unknown = [s for s in args.suites if s not in allowed]
    if unknown:
        parser.error(f"unknown suite(s) {unknown} for {'--tune' if args.tune else 'a benchmark run'}; "
                     f"choose from {','.join(allowed)}")
    if args.reps < 1 or args.warmup < 1:
        parser.error("--reps and --warmup must be >= 1")
    if args.max_configs < 0:
        parser.error(f"--max-configs must be >= 0 (0: every config), got {args.max_configs}")
    if not args.budget_s > 0:  # also rejects nan
        parser.error(f"--budget-s must be > 0 (inf for no budget), got {args.budget_s}")
    if args.stem is not None and (not args.stem or "/" in args.stem or args.stem.startswith(".")):
        parser.error(f"--stem must be a plain file name, got {args.stem!r}")
    args.peer_names = None if args.peers is None else {p for p in args.peers.split(",") if p}
    args.shapes = [t for t in args.shapes.split(",") if t] if args.shapes else []
    known = {impl.name for suite in args.suites for impl in SUITE_IMPLS.get(suite, ())}
    # (A suite's child process gets the run's peers, some of them other suites': the
    # parent checked them against every suite of the run.)
    if args.peer_names and args.peer_names - known and args.child_rows is None:
        parser.error(f"unknown peer(s) {sorted(args.peer_names - known)} for suites {','.join(args.suites)}; "
                     f"known: {','.join(sorted(known))}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    # What a suite's child process must get to plan the same jobs and time them alike.
    args.forwarded = [flag for flag, on in (("--tune", args.tune), ("--quick", args.quick), ("--tiny", args.tiny),
                                            ("--interpret", args.interpret)) if on]
    args.forwarded += ["--reps", str(args.reps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                       "--ours-impl", args.ours_impl,
                       "--max-configs", str(args.max_configs)]
    if args.peers is not None:
        args.forwarded += ["--peers", args.peers]
    if args.shapes:
        args.forwarded += ["--shapes", ",".join(args.shapes)]
    return args


def suite_deadline(suite: str, remaining: Sequence[str], weights: dict[str, float], end: float) -> Deadline:
    """The suite's share of the time left, in proportion to the weights of the suites left."""
    now = time.monotonic()
    if math.isinf(end):
        return Deadline(end)
    share = weights[suite] / sum(weights[s] for s in remaining)
    return Deadline(now + max(0.0, end - now) * share)


def write_outputs(paths: Sequence[pathlib.Path], meta: dict[str, Any], rows: list[dict[str, Any]],
                  args: argparse.Namespace, start: float) -> str:
    """Writes the markdown to every path in ``paths`` and the JSON of raw rows next to the
    first one (same stem, ``.json``); returns the markdown. ``start``: `time.monotonic`
    at the start of the run."""
    meta = dict(meta, elapsed_s=round(time.monotonic() - start, 1))
    if args.tune:
        markdown = report.render_tuning(meta, rows)
    else:
        report.attach_ratios(rows)
        legends = {s: {i.name: i.describe for i in SUITE_IMPLS[s]} for s in SUITES}
        titles = [(s, SUITE_TITLES[s]) for s in args.suites]
        markdown = report.render_results(meta, rows, titles, legends)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown)
    with open(paths[0].with_suffix(".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return markdown


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks (see the module docstring); returns the exit code: 0 when some
    job measured something, 1 when none did, 2 without a GPU (unless a dry run)."""
    start = time.monotonic()  # the budget counts from here, however long ago the module was imported
    started = datetime.datetime.now(datetime.timezone.utc)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child_rows:
        return child_main(args)
    platform_name, device_kind = probe_device(args.isolate)
    refusal = no_gpu_message(platform_name, device_kind)
    if refusal and not (args.tiny or args.interpret):
        print(refusal, file=sys.stderr, flush=True)
        return 2
    end = start + args.budget_s
    weights = TUNE_WEIGHTS if args.tune else SUITE_WEIGHTS
    meta = run_meta(argv, args, started)
    if not args.isolate:
        meta.update(device_meta())
        print(f"{meta['gpu']} | jax {meta['jax']} | torch {meta['torch']}", flush=True)
    else:
        # This process only plans and collects: keep it off the GPU, whose memory the
        # suites' processes need (JAX preallocates most of it in the first to touch it).
        jax.config.update("jax_platforms", "cpu")
    paths = output_paths(args, device_kind, started)
    rows: list[dict[str, Any]] = []
    markdown = ""
    with tempfile.TemporaryDirectory(prefix="bench_attention_") as workdir:
        for index, suite in enumerate(args.suites):
            deadline = suite_deadline(suite, args.suites[index:], weights, end)
            jobs = plan_jobs(suite, args)
            print(f"== {suite}: {len(jobs)} job(s), {deadline.end - time.monotonic():.0f} s budget", flush=True)
            if args.isolate:
                suite_rows, child_meta = run_suite_isolated(suite, jobs, args, deadline, pathlib.Path(workdir))
                meta = {**child_meta, **meta} if child_meta else meta
            else:
                suite_rows = []
                ctx = Context(run_timer(args), deadline, ours_implementation=args.ours_impl, rounds=args.rounds,
                              interpret=args.interpret, quick=args.quick, max_configs=args.max_configs)
                def emit(row: Row, replaces: int | None) -> None:
                    if replaces is None:
                        suite_rows.append(dataclasses.asdict(row))
                    else:
                        suite_rows[replaces] = dataclasses.asdict(row)

                run_jobs(jobs, ctx, emit)
            rows += suite_rows
            markdown = write_outputs(paths, meta, rows, args, start)
    print()
    if args.tune:
        print(markdown)
    else:  # the full tables are in the file; keep the terminal's tail readable
        print(report.render_summary(rows, [(s, SUITE_TITLES[s]) for s in args.suites]))
    print(f"wrote {', '.join(str(p) for p in paths)} and {paths[0].with_suffix('.json').name} "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    measured = sum(row["status"] == "ok" for row in rows)
    if measured == 0:
        counts = {status: sum(row["status"] == status for row in rows) for status in ("failed", "skipped")}
        print(f"no job measured anything ({counts['failed']} failed, {counts['skipped']} skipped): see "
              f"'Not measured' in {paths[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
