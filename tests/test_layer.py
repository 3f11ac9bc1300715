"""The attention layer (`jax_paged_attn.layer`) against a direct float64 attention.

Each scenario is one step of a serving batch: sequences with a context already in the
cache (written beforehand with `reshape_and_cache_flash_kv`) and new tokens (prompts,
prompt chunks, decodes). Metadata comes from the real builder, with its padding. The
expected output of every real sequence is plain softmax attention of its new queries
over its whole key history, written here in NumPy independently of the package.

Every cache slot no sequence owns starts as NaN and padding rows of q / k / v are NaN,
so reading padding shows up in the output.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_paged_attn import cache as cache_ops
from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence, sequence_rows
from jax_paged_attn.layer import PagedAttention, paged_attention, window_size

NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 32
BLOCK_SIZE = 16
NUM_BLOCKS = 24
SCALE = HEAD_SIZE ** -0.5
IMPLEMENTATIONS = [
    pytest.param(dict(implementation="xla"), id="xla"),
    # The Pallas kernels in interpret mode (slow on CPU: one scenario covers every path).
    pytest.param(dict(implementation="triton", interpret=True), id="triton"),
]


# --------------------------------------------------------------------------- direct attention


def direct_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = True,
                     sliding_window: int | None = None, softcap: float = 0.0,
                     alibi: np.ndarray | None = None, encoder_window: bool = False) -> np.ndarray:
    """float64 attention of queries ``[Sq, Hq, D]`` (the last Sq positions) over keys ``[Sk, Hk, D]``."""
    sq, sk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * SCALE
    if softcap:
        s = softcap * np.tanh(s / softcap)
    qpos = np.arange(sq)[:, None] + sk - sq
    kpos = np.arange(sk)[None, :]
    if alibi is not None:
        s = s - alibi[:, None, None] * np.abs(qpos - kpos)[None]
    visible = np.ones((sq, sk), bool)
    if causal:
        visible &= kpos <= qpos
    if sliding_window is not None:
        visible &= kpos > qpos - sliding_window
        if encoder_window:
            visible &= kpos < qpos + sliding_window
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def fp8_round_trip(x: np.ndarray, scale: float, dtype: Any) -> np.ndarray:
    """What a reader of an fp8 cache of ``dtype`` sees for values x written with ``scale``."""
    return np.asarray(x / scale, np.float32).astype(dtype).astype(np.float64) * scale


# --------------------------------------------------------------------------- scenarios


@dataclasses.dataclass
class Step:
    """One batch: the layer's inputs and, per real sequence, what it must output."""

    query: jax.Array  # [T, Hq * D]
    key: jax.Array  # [T, Hk * D]
    value: jax.Array
    kv_cache: jax.Array  # [2, N, bs, Hk, D] with the contexts written
    metadata: Any
    expected: np.ndarray  # [T, Hq, D]; padding rows 0
    new_slots: list[tuple[int, np.ndarray, np.ndarray]]  # (slot, k [Hk, D], v [Hk, D]) written now


def make_step(
    rng: np.random.Generator,
    sequences: list[tuple[bool, int, int]],  # (is_prompt, context_len, query_len)
    *,
    chunked_prefill: bool = True,
    sliding_window: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    attention: dict[str, Any] | None = None,
    causal: bool = True,
    profile_run: bool = False,
) -> Step:
    attention = attention or {}
    lens = [ctx + n for _, ctx, n in sequences]
    blocks_needed = [-(-n // BLOCK_SIZE) for n in lens]
    perm = rng.permutation(NUM_BLOCKS)
    tables, next_block = [], 0
    for n in blocks_needed:
        tables.append(perm[next_block:next_block + n].tolist())
        next_block += n
    scheduled = [
        ScheduledSequence(is_prompt=p, seq_len=ctx + n, context_len=ctx, query_len=n,
                          block_table=None if profile_run else table)
        for (p, ctx, n), table in zip(sequences, tables)
    ]
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                            sliding_window=sliding_window, chunked_prefill=chunked_prefill)
    md = builder.build_host(scheduled)
    md = jax.device_put(md)

    hist_k = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)).astype(np.float32) for n in lens]
    hist_v = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)).astype(np.float32) for n in lens]
    new_q = [rng.standard_normal((n, NUM_HEADS, HEAD_SIZE)).astype(np.float32) for _, _, n in sequences]

    cache_dtype = cache_ops.get_kv_cache_dtype(kv_cache_dtype, jnp.float32)
    fp8 = kv_cache_dtype != "auto"
    if profile_run:
        kv_cache = jnp.zeros((0,), jnp.float32)
    else:
        # The contexts, written in NumPy as reshape_and_cache would (x / scale for fp8).
        cache = np.full((2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), np.nan, np.float32)
        for (_, ctx, _), table, hk, hv in zip(sequences, tables, hist_k, hist_v):
            pos = np.arange(ctx)
            blocks, offsets = np.asarray(table, np.int64)[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            cache[0, blocks, offsets] = hk[:ctx] / (k_scale if fp8 else 1.0)
            cache[1, blocks, offsets] = hv[:ctx] / (v_scale if fp8 else 1.0)
        kv_cache = jnp.asarray(cache.astype(cache_dtype))

    num_tokens = md.num_tokens
    q = np.full((num_tokens, NUM_HEADS, HEAD_SIZE), np.nan, np.float32)
    k = np.full((num_tokens, NUM_KV_HEADS, HEAD_SIZE), np.nan, np.float32)
    v = np.full((num_tokens, NUM_KV_HEADS, HEAD_SIZE), np.nan, np.float32)
    expected = np.zeros((num_tokens, NUM_HEADS, HEAD_SIZE))
    starts = np.asarray(md.query_start_loc)
    slots = np.asarray(md.slot_mapping)
    new_slots = []
    for row, (is_prompt, ctx, n), hk, hv, nq in zip(sequence_rows(md, scheduled), sequences, hist_k, hist_v, new_q):
        rows = slice(starts[row], starts[row] + n)
        q[rows], k[rows], v[rows] = nq, hk[ctx:], hv[ctx:]
        reads_cache = not profile_run and (chunked_prefill or not is_prompt)
        keys = fp8_round_trip(hk, k_scale, cache_dtype) if fp8 and reads_cache else hk
        values = fp8_round_trip(hv, v_scale, cache_dtype) if fp8 and reads_cache else hv
        expected[rows] = direct_attention(nq, keys, values, sliding_window=sliding_window, causal=causal,
                                          **attention)
        for t in range(n):
            if slots[starts[row] + t] >= 0:
                new_slots.append((int(slots[starts[row] + t]), hk[ctx + t], hv[ctx + t]))
    return Step(
        query=jnp.asarray(q.reshape(num_tokens, -1)), key=jnp.asarray(k.reshape(num_tokens, -1)),
        value=jnp.asarray(v.reshape(num_tokens, -1)), kv_cache=kv_cache, metadata=md,
        expected=expected, new_slots=new_slots,
    )


@functools.lru_cache(maxsize=None)
def jitted_layer(**static: Any):
    """`paged_attention` with its static arguments bound, jitted once per configuration."""
    return jax.jit(functools.partial(paged_attention, num_heads=NUM_HEADS, head_size=HEAD_SIZE,
                                     num_kv_heads=NUM_KV_HEADS, scale=SCALE, **static))


def run_layer(step: Step, impl: dict[str, Any], **kwargs: Any) -> tuple[np.ndarray, jax.Array]:
    """The layer under jit (one compilation instead of one per op; static args bound)."""
    alibi = kwargs.pop("alibi_slopes", None)
    layer = jitted_layer(**kwargs, **impl)
    out, new_cache = layer(step.query, step.key, step.value, step.kv_cache, step.metadata, alibi_slopes=alibi)
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    return np.asarray(out).reshape(-1, NUM_HEADS, HEAD_SIZE), new_cache


def assert_matches(out: np.ndarray, step: Step, atol: float = 2e-5) -> None:
    assert np.all(np.isfinite(out)), "NaN / inf in the output: padding was read"
    err = np.abs(out - step.expected)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= atol, f"max error {err.max():.3g} at (row, head, dim) {worst}"


def assert_new_tokens_cached(new_cache: jax.Array, step: Step, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    flat = np.asarray(new_cache.astype(jnp.float32)).reshape(2, NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    fp8 = new_cache.dtype.itemsize == 1
    for slot, k, v in step.new_slots:
        want_k = fp8_round_trip(k, k_scale, new_cache.dtype) if fp8 else k
        want_v = fp8_round_trip(v, v_scale, new_cache.dtype) if fp8 else v
        np.testing.assert_allclose(flat[0, slot] * (k_scale if fp8 else 1), want_k, rtol=0, atol=1e-6)
        np.testing.assert_allclose(flat[1, slot] * (v_scale if fp8 else 1), want_v, rtol=0, atol=1e-6)


# Scenarios: (is_prompt, context_len, query_len) per sequence.
MIXED = [(True, 0, 7), (True, 20, 13), (False, 24, 1), (False, 39, 1)]  # fresh prompt, chunk, decodes
PROMPTS = [(True, 0, 5), (True, 0, 19), (True, 0, 1)]
SPECULATIVE_DECODES = [(False, 10, 3), (False, 30, 2), (False, 17, 1)]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_mixed_prefill_and_decode_batch(impl):
    step = make_step(np.random.default_rng(0), MIXED)
    assert step.metadata.num_prefills and step.metadata.num_decode_tokens  # both paths run
    out, new_cache = run_layer(step, impl)
    assert_matches(out, step, atol=2e-5 if impl["implementation"] == "xla" else 1e-4)
    assert_new_tokens_cached(new_cache, step)


def test_prompts_without_block_tables_attend_to_packed_keys():
    step = make_step(np.random.default_rng(1), PROMPTS, chunked_prefill=False)
    assert not step.metadata.has_block_tables
    out, new_cache = run_layer(step, dict(implementation="xla"))
    assert_matches(out, step)
    assert_new_tokens_cached(new_cache, step)


def test_decodes_with_several_query_tokens_use_varlen():
    step = make_step(np.random.default_rng(2), SPECULATIVE_DECODES)
    assert step.metadata.max_decode_query_len > 1
    out, new_cache = run_layer(step, dict(implementation="xla"))
    assert_matches(out, step)
    assert_new_tokens_cached(new_cache, step)


def test_sliding_window_over_the_paged_cache():
    # Decodes read block tables truncated to the window (builder); the prompt chunk
    # reads its context through the cache. Window 10 < every context.
    sequences = [(True, 0, 21), (True, 17, 9), (False, 33, 1), (False, 47, 1)]
    step = make_step(np.random.default_rng(3), sequences, sliding_window=10)
    assert np.asarray(step.metadata.seq_lens)[-1] < 48  # decode table truncated to the window
    out, _ = run_layer(step, dict(implementation="xla"), sliding_window=10)
    assert_matches(out, step)


def test_sliding_window_packed_prompts_then_truncated_decodes():
    rng = np.random.default_rng(4)
    step = make_step(rng, [(True, 0, 30), (True, 0, 6)], chunked_prefill=False, sliding_window=8)
    out, _ = run_layer(step, dict(implementation="xla"), sliding_window=8)
    assert_matches(out, step)
    step = make_step(rng, [(False, 40, 1), (False, 5, 1)], sliding_window=8)
    out, _ = run_layer(step, dict(implementation="xla"), sliding_window=8)
    assert_matches(out, step)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_with_scales(kv_cache_dtype):
    # The expectation attends to the fp8-rounded keys and values (x / scale rounded, times scale).
    k_scale, v_scale = 0.5, 2.0
    step = make_step(np.random.default_rng(5), MIXED, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                     v_scale=v_scale)
    out, new_cache = run_layer(step, dict(implementation="xla"), kv_cache_dtype=kv_cache_dtype,
                               k_scale=k_scale, v_scale=v_scale)
    assert new_cache.dtype == cache_ops.get_kv_cache_dtype(kv_cache_dtype, jnp.float32)
    assert_matches(out, step)
    assert_new_tokens_cached(new_cache, step, k_scale, v_scale)


def test_alibi_and_soft_cap():
    slopes = np.asarray([2.0 ** (-8 * (h + 1) / NUM_HEADS) for h in range(NUM_HEADS)], np.float32)
    attention = dict(softcap=5.0, alibi=slopes.astype(np.float64))
    step = make_step(np.random.default_rng(6), MIXED, attention=attention)
    out, _ = run_layer(step, dict(implementation="xla"), alibi_slopes=jnp.asarray(slopes), logits_soft_cap=5.0)
    assert_matches(out, step)


def test_encoder_only_is_bidirectional_and_leaves_the_cache():
    step = make_step(np.random.default_rng(7), PROMPTS, chunked_prefill=False, causal=False)
    out, new_cache = run_layer(step, dict(implementation="xla"), attn_type="encoder_only")
    assert_matches(out, step)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(step.kv_cache))
    step = make_step(np.random.default_rng(8), PROMPTS, chunked_prefill=False, causal=False, sliding_window=4,
                     attention=dict(encoder_window=True))
    out, _ = run_layer(step, dict(implementation="xla"), attn_type="encoder_only", sliding_window=4)
    assert_matches(out, step)


def test_window_size_convention():
    assert window_size(None) == (-1, -1)
    assert window_size(4096) == (4095, 0)
    assert window_size(8, "encoder_only") == (7, 7)
    with pytest.raises(ValueError, match="sliding_window"):
        window_size(0)


def test_profiling_run_with_empty_cache():
    step = make_step(np.random.default_rng(9), PROMPTS, chunked_prefill=False, profile_run=True)
    out, new_cache = run_layer(step, dict(implementation="xla"))
    assert_matches(out, step)
    assert new_cache.size == 0


def test_jit_with_donated_cache_updates_in_place():
    step = make_step(np.random.default_rng(10), MIXED)
    expected_out, expected_cache = run_layer(step, dict(implementation="xla"))
    layer = jax.jit(
        functools.partial(paged_attention, num_heads=NUM_HEADS, head_size=HEAD_SIZE, num_kv_heads=NUM_KV_HEADS,
                          scale=SCALE, implementation="xla"),
        donate_argnums=(3,),
    )
    cache_in = step.kv_cache.copy()
    out, new_cache = layer(step.query, step.key, step.value, cache_in, step.metadata)
    assert cache_in.is_deleted(), "the donated cache was not consumed"
    np.testing.assert_array_equal(np.asarray(out).reshape(expected_out.shape), expected_out)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(expected_cache))
    # The compiled program aliases the new cache (output 1) to the donated one (argument 3).
    compiled = layer.lower(step.query, step.key, step.value, new_cache, step.metadata).compile().as_text()
    assert "input_output_alias" in compiled, "the cache is not updated in place"
    # Another batch with the same static metadata reuses the program.
    other = make_step(np.random.default_rng(13), MIXED)
    assert jax.tree.structure(other.metadata) == jax.tree.structure(step.metadata)
    out, _ = layer(other.query, other.key, other.value, other.kv_cache, other.metadata)
    assert_matches(np.asarray(out).reshape(other.expected.shape), other)


def test_nnx_module_inside_a_model():
    class Block(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.proj = nnx.Linear(NUM_HEADS * HEAD_SIZE, NUM_HEADS * HEAD_SIZE, rngs=rngs)
            self.attn = PagedAttention(num_heads=NUM_HEADS, head_size=HEAD_SIZE, num_kv_heads=NUM_KV_HEADS,
                                       implementation="xla")

        def __call__(self, q, k, v, kv_cache, metadata):
            out, kv_cache = self.attn(q, k, v, kv_cache, metadata)
            return self.proj(out), kv_cache

    step = make_step(np.random.default_rng(11), MIXED)
    block = Block(rngs=nnx.Rngs(0))
    out, cache = nnx.jit(lambda m, *a: m(*a))(block, step.query, step.key, step.value, step.kv_cache,
                                              step.metadata)
    attn_out, expected_cache = run_layer(step, dict(implementation="xla"))
    expected = block.proj(jnp.asarray(attn_out.reshape(len(attn_out), -1)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(expected_cache))
    assert nnx.state(block.attn, nnx.Param) == nnx.State({})  # the layer itself has no parameters


def test_bad_inputs_raise_clear_errors():
    step = make_step(np.random.default_rng(12), MIXED)
    kw = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, scale=SCALE,
              implementation="xla")
    with pytest.raises(ValueError, match="metadata describes"):
        paged_attention(step.query[:-1], step.key[:-1], step.value[:-1], step.kv_cache, step.metadata, **kw)
    with pytest.raises(ValueError, match="query must have 4 heads"):
        paged_attention(step.query[:, :-HEAD_SIZE], step.key, step.value, step.kv_cache, step.metadata, **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        paged_attention(step.query, step.key, step.value, step.kv_cache, step.metadata,
                        kv_cache_dtype="fp8", **kw)
    with pytest.raises(ValueError, match="attn_type"):
        paged_attention(step.query, step.key, step.value, step.kv_cache, step.metadata, attn_type="cross", **kw)
    with pytest.raises(ValueError, match="kv_cache is empty"):
        paged_attention(step.query, step.key, step.value, jnp.zeros((0,)), step.metadata, **kw)
    with pytest.raises(ValueError, match="prefill-only"):
        paged_attention(step.query, step.key, step.value, step.kv_cache, step.metadata,
                        attn_type="encoder_only", **kw)
    with pytest.raises(TypeError, match="FlashAttentionMetadata"):
        paged_attention(step.query, step.key, step.value, step.kv_cache, {"slot_mapping": None}, **kw)
    with pytest.raises(ValueError, match="alibi_slopes"):
        PagedAttention(num_heads=NUM_HEADS, head_size=HEAD_SIZE, alibi_slopes=[1.0])
    with pytest.raises(ValueError, match="head_size"):
        PagedAttention(num_heads=NUM_HEADS, head_size=40)


def test_concrete_metadata_is_validated():
    """Eager calls check the metadata's values (against the cache too): bad bounds or
    offsets raise instead of silently giving rows of zeros. Under jit they cannot be seen."""
    step = make_step(np.random.default_rng(14), MIXED)
    kw = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, num_kv_heads=NUM_KV_HEADS, scale=SCALE,
              implementation="xla")
    md = step.metadata
    out, _ = paged_attention(step.query, step.key, step.value, step.kv_cache, md, **kw)
    assert_matches(np.asarray(out).reshape(step.expected.shape), step)

    def call(**changes):
        return paged_attention(step.query, step.key, step.value, step.kv_cache,
                               dataclasses.replace(md, **changes), **kw)

    with pytest.raises(ValueError, match=r"metadata\.max_query_len=8 is below the true maximum 13"):
        call(max_query_len=8)
    with pytest.raises(ValueError, match=r"metadata\.max_prefill_seq_len=16 is below the true maximum 33"):
        call(max_prefill_seq_len=16)
    short = np.asarray(md.query_start_loc).copy()
    short[-1] -= 1
    with pytest.raises(ValueError, match=r"metadata\.query_start_loc\[-1\] = \d+ must equal the \d+ token rows"):
        call(query_start_loc=jnp.asarray(short))
    tables = np.asarray(md.block_tables).copy()
    tables[0, 0] = NUM_BLOCKS
    with pytest.raises(ValueError, match=rf"metadata\.block_tables\[0\] uses block ids outside \[0, {NUM_BLOCKS}\)"):
        call(block_tables=jnp.asarray(tables))
    # The same bad bound under jit traces and runs (values are not visible there).
    out, _ = run_layer(dataclasses.replace(step, metadata=dataclasses.replace(md, max_query_len=8)),
                       dict(implementation="xla"))
    assert out.shape == step.expected.shape
