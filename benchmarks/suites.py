"""The suites' shapes: the cases of the decode, prefill, varlen, prefix and cache suites,
the useful work each is credited with, and the inputs every implementation of a case runs on.

Owns: the work arithmetic (bytes of K and V a decode step reads, flash-attention's dense
causal FLOP count, the exact bottom-right causal work of varlen and prefix shapes, the
bytes a cache write moves); the case types (`DecodeCase`, `AttentionCase`, `CacheCase`),
the full suites (`FULL_CASES`) and their tiny CPU twins (`TINY_CASES`), the suites' table
titles; and the inputs (`build_decode_inputs`, `build_attention_inputs`,
`build_cache_inputs`: bf16 data drawn on the device, vLLM's cache layout, permuted block
tables) that `bench_attention.py`, the peers and the parts scripts share.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


SUITES = ("decode", "prefill", "varlen", "prefix", "cache")
TUNABLE_SUITES = ("decode", "prefill", "varlen", "prefix")
DEFAULT_TUNE_SUITES = ("decode", "prefill")


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
    """One query token per sequence; every sequence holds ``context`` cached tokens, or,
    in a ragged batch (`ragged`), sequence b holds ``contexts[b]`` (``context`` is then
    their maximum, the block table's width)."""

    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"
    contexts: tuple[int, ...] = ()

    def __post_init__(self):
        if self.contexts and (len(self.contexts) != self.batch or max(self.contexts) != self.context):
            raise ValueError(f"contexts: {len(self.contexts)} lengths up to {max(self.contexts)} for "
                             f"batch {self.batch} and context {self.context}")

    @classmethod
    def ragged(cls, contexts: Sequence[int], q_heads: int, kv_heads: int, head_dim: int, **kw) -> "DecodeCase":
        """A batch of sequences of different lengths, as a serving step decodes them."""
        contexts = tuple(int(n) for n in contexts)
        return cls(len(contexts), max(contexts), q_heads, kv_heads, head_dim, contexts=contexts, **kw)

    @property
    def label(self) -> str:
        if self.contexts:
            lens = f"ragged B{self.batch} ctx{min(self.contexts)}-{self.context} (mean {sum(self.contexts) // self.batch})"
        else:
            lens = f"B{self.batch} ctx{self.context}"
        return f"{lens} Hq{self.q_heads} Hk{self.kv_heads} D{self.head_dim} page{self.page_size}"

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def seqlens(self) -> tuple[int, ...]:
        return self.contexts or (self.context,) * self.batch

    @property
    def work(self) -> float:
        """Bytes of K and V the step must read: each sequence's own context."""
        return decode_kv_bytes(1, sum(self.seqlens), self.kv_heads, self.head_dim, _itemsize(self.dtype))


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
    # Serving's batches (bench_serving.py: prompts of 32-2,048 tokens, outputs of 16-512):
    # a decode step's sequences hold 32-2,560 tokens, at the 1.1B Llama's heads and an 8B's.
    DecodeCase.ragged(mixed_lengths(256, 32, 2560, seed=5), 32, 4, 64),
    DecodeCase.ragged(mixed_lengths(64, 32, 2560, seed=6), 32, 8, 128),
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
    "decode": (DecodeCase(2, 64, 4, 2, 32), DecodeCase.ragged((9, 64, 30), 4, 2, 32)),
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
        seqlens=jnp.asarray(case.seqlens, jnp.int32),
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


def cumulative(lengths: Sequence[int]) -> Array:
    """i32[B + 1]: 0 then the running sums of ``lengths`` (cu_seqlens)."""
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
    return AttentionInputs(q, k, v, cumulative(q_lens), cumulative(k_lens), block_table, q_lens, k_lens)


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


INPUT_BUILDERS = {"decode": build_decode_inputs, "prefill": build_attention_inputs,
                  "varlen": build_attention_inputs, "prefix": build_attention_inputs,
                  "cache": build_cache_inputs}
