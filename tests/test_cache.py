"""KV-cache ops (`jax_paged_attn.cache`) against plain NumPy, plus donation and placement.

Every comparison is bit-exact: the ops only move (or, for fp8, round once) values.
The NumPy versions below are written from vLLM's kernel semantics (one loop per token
or block pair), independently of the implementation.

The cache-write kernel (``implementation="triton"``, Pallas interpret mode on CPU) is
compared bit for bit with the XLA scatter, and its aliasing is checked both by buffer
pointers (interpret mode) and in the module lowered for CUDA.

The ``gpu``-marked tests at the end run only on a CUDA host (``pytest -m gpu``); the
CPU command deselects them with ``-m "not gpu"``.
"""
from __future__ import annotations

import contextlib
import functools
import io
import math
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_paged_attn import cache, dispatch, tuning
from jax_paged_attn.kernels import triton_cache
from jax_paged_attn.cache import PAD_BLOCK_ID, PAD_SLOT_ID
from conftest import cuda_lowering_target

pytestmark = pytest.mark.covering  # products: a covering subset by default, all with --full (conftest.py)

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 32


# --------------------------------------------------------------------------- NumPy semantics


def numpy_fp8(x: np.ndarray, scale: float, fp8_dtype) -> np.ndarray:
    """vLLM's scaled_fp8_conversion: x / scale in float32, saturated, rounded to nearest even."""
    largest = float(ml_dtypes.finfo(fp8_dtype).max)
    return np.clip(x.astype(np.float32) / np.float32(scale), -largest, largest).astype(fp8_dtype)


def host_copy(x) -> np.ndarray:
    """A NumPy copy of ``x`` that leaves no view of x's buffer behind. (``np.asarray`` of
    a CPU jax.Array caches a zero-copy view on it; jax >= 0.11 then refuses to reuse the
    buffer when x is donated, and copies instead.)"""
    return np.array(jnp.array(x, copy=True))


def numpy_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    key_cache, value_cache = host_copy(key_cache), host_copy(value_cache)
    block_size = key_cache.shape[1]
    fp8 = key_cache.dtype.itemsize == 1
    for token, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k, v = key[token], value[token]
        if fp8:
            k, v = numpy_fp8(k, k_scale, key_cache.dtype), numpy_fp8(v, v_scale, value_cache.dtype)
        key_cache[block, offset] = k
        value_cache[block, offset] = v
    return key_cache, value_cache


def numpy_copy_blocks(caches: list[np.ndarray], pairs: np.ndarray, axis: int = 0) -> list[np.ndarray]:
    """Reads every source block first, then writes (the documented overlap semantics)."""
    out = []
    for c in caches:
        c = host_copy(c)
        live = [(s, d) for s, d in np.asarray(pairs).tolist() if s >= 0 and d >= 0]
        blocks = [np.take(c, s, axis=axis).copy() for s, _ in live]
        for (_, d), block in zip(live, blocks):
            if axis == 0:
                c[d] = block
            else:
                c[:, d] = block
        out.append(c)
    return out


def assert_bits_equal(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype.itemsize == 1:  # fp8: every NaN is the same value
        got_f, want_f = got.astype(np.float32), want.astype(np.float32)
        assert np.array_equal(np.isnan(got_f), np.isnan(want_f))
        got, want = np.where(np.isnan(got_f), 0, got_f), np.where(np.isnan(want_f), 0, want_f)
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- builders


def random_tokens(rng, num_tokens, dtype, scale=1.0):
    shape = (num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    key = jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)
    value = jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)
    return key, value


def random_cache(rng, num_blocks, dtype, leading=()):
    """Random cache in a buffer XLA owns (copied, not aliasing NumPy memory), so that
    donating it can reuse the buffer."""
    shape = (*leading, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    values = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return jnp.array(values, copy=True)


def zeros_at(shape, dtype, sharding):
    """Zeros placed by ``sharding`` in a buffer XLA owns (see `cache.allocate_host_kv_cache`)."""
    return jax.device_put(jax.device_put(np.zeros(shape, dtype), sharding), sharding, may_alias=False)


def random_slots(rng, num_tokens, num_blocks, num_padding, first=()):
    """Distinct slots over the whole cache with ``num_padding`` PAD_SLOT_IDs mixed in
    (after the leading tokens, which get the slots ``first``)."""
    free = np.setdiff1d(np.arange(num_blocks * BLOCK_SIZE), first)
    slots = np.concatenate([first, rng.choice(free, size=num_tokens - len(first), replace=False)])
    slots[len(first) + rng.choice(num_tokens - len(first), size=num_padding, replace=False)] = PAD_SLOT_ID
    return jnp.asarray(slots, jnp.int32)


# --------------------------------------------------------------------------- shapes and dtypes


def test_kv_cache_shape_and_dtype():
    assert cache.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert cache.get_kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert cache.get_kv_cache_dtype("auto", "float16") == jnp.float16
    assert cache.get_kv_cache_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    assert cache.get_kv_cache_dtype("fp8_e4m3", jnp.float32) == jnp.float8_e4m3fn
    assert cache.get_kv_cache_dtype("fp8_e5m2", jnp.float16) == jnp.float8_e5m2


@pytest.mark.parametrize("kv_cache_dtype, model_dtype, cache_dtype", [
    ("auto", jnp.float16, jnp.float16), ("fp8_e5m2", jnp.bfloat16, jnp.float8_e5m2)])
def test_allocate_kv_cache(kv_cache_dtype, model_dtype, cache_dtype):
    kv = cache.allocate_kv_cache(3, 32, 4, 64, kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype)
    assert kv.shape == (2, 3, 32, 4, 64) and kv.dtype == cache_dtype
    assert not np.any(np.asarray(kv.astype(jnp.float32)))
    host = cache.allocate_host_kv_cache(5, 32, 4, 64, kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype)
    assert host.shape == (2, 5, 32, 4, 64) and host.dtype == cache_dtype
    assert host.sharding == cache.host_kv_cache_sharding()
    assert not np.any(np.asarray(host.astype(jnp.float32)))


def test_host_placement_uses_pinned_host_memory_where_exposed():
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    sharding = cache.host_kv_cache_sharding(device)
    if "pinned_host" in kinds:  # CPU in jax 0.10.2 exposes device / pinned_host / unpinned_host
        assert sharding.memory_kind == "pinned_host" and sharding.device_set == {device}
    else:
        assert {d.platform for d in sharding.device_set} == {"cpu"}


def test_empty_token_batch_and_empty_block_mapping_change_nothing():
    rng = np.random.default_rng(13)
    key, value = random_tokens(rng, 0, jnp.float16)
    key_cache, value_cache = random_cache(rng, 2, jnp.float16), random_cache(rng, 2, jnp.float16)
    got = cache.reshape_and_cache_flash(key, value, key_cache, value_cache, jnp.zeros((0,), jnp.int32))
    assert_bits_equal(got[0], np.asarray(key_cache))
    assert_bits_equal(got[1], np.asarray(value_cache))
    got_k, got_v = cache.copy_blocks([key_cache], [value_cache], jnp.zeros((0, 2), jnp.int32))
    assert_bits_equal(got_k[0], np.asarray(key_cache))
    assert_bits_equal(got_v[0], np.asarray(value_cache))
    assert cache.copy_blocks([], [], jnp.zeros((0, 2), jnp.int32)) == ([], [])


@pytest.mark.parametrize("call, error, match", [
    (lambda: cache.get_kv_cache_shape(4, 8, 2, 64), ValueError, "block_size=8"),
    (lambda: cache.get_kv_cache_shape(4, 16, 2, 40), ValueError, "head_size=40"),
    (lambda: cache.get_kv_cache_shape(0, 16, 2, 64), ValueError, "num_blocks"),
    (lambda: cache.get_kv_cache_shape(4, 16.0, 2, 64), TypeError, "block_size"),
    (lambda: cache.get_kv_cache_dtype("fp16", jnp.float16), ValueError, "kv_cache_dtype"),
    (lambda: cache.get_kv_cache_dtype("auto", jnp.int8), TypeError, "model_dtype"),
    (lambda: cache.allocate_kv_cache(4, 16, 2, 64, kv_cache_dtype="int8"), ValueError, "kv_cache_dtype"),
])
def test_shape_and_dtype_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------- reshape_and_cache_flash


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_reshape_and_cache_matches_numpy(dtype, jit):
    rng = np.random.default_rng(1)
    num_blocks, num_tokens = 6, 40
    key, value = random_tokens(rng, num_tokens, dtype)
    key_cache, value_cache = random_cache(rng, num_blocks, dtype), random_cache(rng, num_blocks, dtype)
    slots = random_slots(rng, num_tokens, num_blocks, num_padding=7)
    want = numpy_reshape_and_cache(np.asarray(key), np.asarray(value), key_cache, value_cache, slots)
    fn = jax.jit(cache.reshape_and_cache_flash) if jit else cache.reshape_and_cache_flash
    got = fn(key, value, key_cache, value_cache, slots)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)


@pytest.mark.parametrize("kv_cache_dtype, fp8_dtype, relative_step", [
    ("fp8", ml_dtypes.float8_e4m3fn, 2.0 ** -3), ("fp8_e5m2", ml_dtypes.float8_e5m2, 2.0 ** -2)])
def test_fp8_cache_rounds_once_and_saturates(kv_cache_dtype, fp8_dtype, relative_step):
    rng = np.random.default_rng(2)
    num_blocks, num_tokens, k_scale, v_scale = 4, 24, 0.05, 3.0
    key, value = random_tokens(rng, num_tokens, jnp.bfloat16)
    largest = float(ml_dtypes.finfo(fp8_dtype).max)
    # Row 0 overflows (|x / scale| > largest, and +-inf); row 1 carries a NaN.
    key = key.at[0, 0, :4].set(jnp.asarray([1e4, -1e4, jnp.inf, -jnp.inf], jnp.bfloat16))
    key = key.at[1, 1, 3].set(jnp.nan)
    value = value.at[0, 1, :2].set(jnp.asarray([largest * v_scale * 4, -largest * v_scale * 4], jnp.bfloat16))
    cache_dtype = jnp.dtype(fp8_dtype)
    key_cache = random_cache(rng, num_blocks, jnp.float32).astype(cache_dtype)
    value_cache = random_cache(rng, num_blocks, jnp.float32).astype(cache_dtype)
    slots = random_slots(rng, num_tokens, num_blocks, num_padding=3, first=(5, 17))
    want = numpy_reshape_and_cache(np.asarray(key), np.asarray(value), key_cache, value_cache, slots,
                                   k_scale, v_scale)
    write = jax.jit(cache.reshape_and_cache_flash, static_argnames="kv_cache_dtype")
    got_k, got_v = write(key, value, key_cache, value_cache, slots, kv_cache_dtype=kv_cache_dtype,
                         k_scale=jnp.float32(k_scale), v_scale=v_scale)
    assert_bits_equal(got_k, want[0])
    assert_bits_equal(got_v, want[1])

    stored_k = np.asarray(got_k.astype(jnp.float32))[0, 5, 0, :4]
    np.testing.assert_array_equal(stored_k, [largest, -largest, largest, -largest])
    np.testing.assert_array_equal(np.asarray(got_v.astype(jnp.float32))[0, 5, 1, :2], [largest, -largest])
    assert np.isnan(np.asarray(got_k.astype(jnp.float32))[1, 1, 1, 3])

    # Round trip of the ordinary (in-range) rows: dequantized within half an fp8 step.
    rows = np.flatnonzero(np.asarray(slots) >= 0)
    rows = rows[rows >= 2]
    block, offset = np.divmod(np.asarray(slots)[rows], BLOCK_SIZE)
    for got, x, scale in ((got_k, key, k_scale), (got_v, value, v_scale)):
        x = np.asarray(x.astype(jnp.float32))[rows]
        back = np.asarray(got.astype(jnp.float32))[block, offset] * scale
        smallest_normal = float(ml_dtypes.finfo(fp8_dtype).smallest_normal) * scale
        allowed = relative_step / 2 * np.maximum(np.abs(x), smallest_normal)
        assert np.all(np.abs(back - x) <= allowed)


def test_stacked_kv_cache_variant_matches():
    rng = np.random.default_rng(3)
    key, value = random_tokens(rng, 20, jnp.float32)
    kv = random_cache(rng, 5, jnp.float32, leading=(2,)).astype(jnp.float8_e4m3fn)
    slots = random_slots(rng, 20, 5, num_padding=4)
    want = cache.reshape_and_cache_flash(key, value, kv[0], kv[1], slots, "fp8", 0.5, 2.0)
    got = jax.jit(cache.reshape_and_cache_flash_kv, static_argnames="kv_cache_dtype")(
        key, value, kv, slots, kv_cache_dtype="fp8", k_scale=0.5, v_scale=2.0)
    assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[1], want[1])


def test_jit_drops_out_of_range_slots():
    rng = np.random.default_rng(4)
    num_blocks = 3
    key, value = random_tokens(rng, 5, jnp.float32)
    key_cache, value_cache = random_cache(rng, num_blocks, jnp.float32), random_cache(rng, num_blocks, jnp.float32)
    num_slots = num_blocks * BLOCK_SIZE
    slots = jnp.asarray([7, num_slots, -5, num_slots + 100, 2 * BLOCK_SIZE], jnp.int32)
    got_k, got_v = jax.jit(cache.reshape_and_cache_flash)(key, value, key_cache, value_cache, slots)
    want_k, want_v = numpy_reshape_and_cache(np.asarray(key), np.asarray(value), key_cache, value_cache,
                                             np.asarray([7, -1, -1, -1, 2 * BLOCK_SIZE]))
    assert_bits_equal(got_k, want_k)
    assert_bits_equal(got_v, want_v)


# --------------------------------------------------------------------------- copy_blocks


def test_copy_blocks_across_layers_matches_numpy():
    rng = np.random.default_rng(5)
    num_layers, num_blocks = 3, 9
    key_caches = [random_cache(rng, num_blocks, jnp.bfloat16) for _ in range(num_layers)]
    value_caches = [random_cache(rng, num_blocks, jnp.bfloat16) for _ in range(num_layers)]
    # Fork a -> several destinations, a chain 2 -> 4 -> 6 (reads before writes), a self-copy
    # and padding pairs.
    pairs = np.asarray([[1, 0], [1, 8], [2, 4], [4, 6], [3, 3], [PAD_BLOCK_ID, 5], [7, PAD_BLOCK_ID]], np.int32)
    got_k, got_v = cache.copy_blocks(key_caches, value_caches, jnp.asarray(pairs))
    jit_k, jit_v = jax.jit(cache.copy_blocks)(key_caches, value_caches, jnp.asarray(pairs))
    want_k, want_v = numpy_copy_blocks(key_caches, pairs), numpy_copy_blocks(value_caches, pairs)
    for layer in range(num_layers):
        for got in (got_k[layer], jit_k[layer]):
            assert_bits_equal(got, want_k[layer])
        for got in (got_v[layer], jit_v[layer]):
            assert_bits_equal(got, want_v[layer])
    # The chain reads block 4 before it is overwritten.
    assert_bits_equal(got_k[0][6], np.asarray(key_caches[0])[4])


def test_copy_kv_cache_blocks_and_jit_drops_out_of_range_pairs():
    rng = np.random.default_rng(6)
    kv_caches = [random_cache(rng, 6, jnp.float16, leading=(2,)) for _ in range(2)]
    pairs = np.asarray([[0, 5], [5, 1], [9, 2], [3, 40]], np.int32)  # last two out of range
    got = jax.jit(cache.copy_kv_cache_blocks)(kv_caches, jnp.asarray(pairs))
    want = numpy_copy_blocks(kv_caches, pairs[:2], axis=1)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    eager = cache.copy_kv_cache_blocks(kv_caches, pairs[:2])
    for g, w in zip(eager, want):
        assert_bits_equal(g, w)


# --------------------------------------------------------------------------- donation


def test_reshape_and_cache_donation_updates_in_place():
    rng = np.random.default_rng(7)
    key, value = random_tokens(rng, 8, jnp.bfloat16)
    key_cache, value_cache = random_cache(rng, 4, jnp.bfloat16), random_cache(rng, 4, jnp.bfloat16)
    slots = random_slots(rng, 8, 4, num_padding=2)
    want = numpy_reshape_and_cache(np.asarray(key), np.asarray(value), key_cache, value_cache, slots)
    pointers = key_cache.unsafe_buffer_pointer(), value_cache.unsafe_buffer_pointer()
    write = jax.jit(cache.reshape_and_cache_flash, donate_argnums=(2, 3), static_argnames="kv_cache_dtype")
    assert "tf.aliasing_output" in write.lower(key, value, key_cache, value_cache, slots).as_text()
    new_k, new_v = write(key, value, key_cache, value_cache, slots)
    assert key_cache.is_deleted() and value_cache.is_deleted()
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    assert_bits_equal(new_k, want[0])
    assert_bits_equal(new_v, want[1])

    kv = random_cache(rng, 4, jnp.bfloat16, leading=(2,))
    pointer = kv.unsafe_buffer_pointer()
    new_kv = jax.jit(cache.reshape_and_cache_flash_kv, donate_argnums=2)(key, value, kv, slots)
    assert kv.is_deleted() and new_kv.unsafe_buffer_pointer() == pointer


def test_copy_blocks_donation_updates_in_place():
    rng = np.random.default_rng(8)
    key_caches = [random_cache(rng, 5, jnp.float32) for _ in range(2)]
    value_caches = [random_cache(rng, 5, jnp.float32) for _ in range(2)]
    pairs = jnp.asarray([[0, 1], [1, 2]], jnp.int32)
    want_k = numpy_copy_blocks(key_caches, np.asarray(pairs))
    pointers = [c.unsafe_buffer_pointer() for c in key_caches + value_caches]
    new_k, new_v = jax.jit(cache.copy_blocks, donate_argnums=(0, 1))(key_caches, value_caches, pairs)
    assert all(c.is_deleted() for c in key_caches + value_caches)
    assert [c.unsafe_buffer_pointer() for c in new_k + new_v] == pointers
    for g, w in zip(new_k, want_k):
        assert_bits_equal(g, w)

    kv_caches = [random_cache(rng, 5, jnp.float32, leading=(2,))]
    pointer = kv_caches[0].unsafe_buffer_pointer()
    (new_kv,) = jax.jit(cache.copy_kv_cache_blocks, donate_argnums=0)(kv_caches, pairs)
    assert kv_caches[0].is_deleted() and new_kv.unsafe_buffer_pointer() == pointer


# --------------------------------------------------------------------------- swap_blocks


@pytest.mark.parametrize("stacked", [False, True], ids=["per_cache", "stacked_kv"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e5m2])
def test_swap_out_and_in_round_trip_is_bit_exact(stacked, dtype):
    rng = np.random.default_rng(9)
    leading = (2,) if stacked else ()
    axis = len(leading)
    device_cache = random_cache(rng, 8, jnp.float32, leading=leading).astype(dtype)
    original = host_copy(device_cache)
    host_shape = (*leading, 11, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    if stacked:  # the engine's allocation path (must come back in place from a donation)
        kv_cache_dtype = "auto" if dtype == jnp.bfloat16 else "fp8_e5m2"
        host = cache.allocate_host_kv_cache(11, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                                            kv_cache_dtype=kv_cache_dtype, model_dtype=jnp.bfloat16)
    else:
        host = zeros_at(host_shape, dtype, cache.host_kv_cache_sharding())
    host_pointer = host.unsafe_buffer_pointer()

    # Swap out device blocks 1, 6, 3 to host blocks 10, 0, 4 (3 pairs: padded to 4 inside).
    out_pairs = np.asarray([[1, 10], [6, 0], [PAD_BLOCK_ID, PAD_BLOCK_ID], [3, 4]])
    host = cache.swap_blocks(device_cache, host, out_pairs)
    assert host.sharding == cache.host_kv_cache_sharding()
    assert host.unsafe_buffer_pointer() == host_pointer  # donated: written in place
    want_host = np.zeros(host_shape, dtype)
    for s, d in ((1, 10), (6, 0), (3, 4)):
        if axis == 0:
            want_host[d] = original[s]
        else:
            want_host[:, d] = original[:, s]
    assert_bits_equal(host, want_host)

    # Clobber the device cache, then swap the blocks back in to new places.
    device_cache = jnp.zeros_like(device_cache)
    device_pointer = device_cache.unsafe_buffer_pointer()
    in_pairs = jnp.asarray([[10, 2], [0, 7], [4, 5]], jnp.int32)
    restored = cache.swap_blocks(host, device_cache, in_pairs)
    assert device_cache.is_deleted() and restored.unsafe_buffer_pointer() == device_pointer
    assert restored.sharding.memory_kind == jax.devices()[0].default_memory().kind
    got = np.asarray(restored)
    for s, d in ((1, 2), (6, 7), (3, 5)):
        assert_bits_equal(np.take(got, d, axis=axis), np.take(original, s, axis=axis))
    untouched = [b for b in range(8) if b not in (2, 7, 5)]
    assert not np.any(np.take(got, untouched, axis=axis).astype(np.float32))


def test_swap_without_donation_and_empty_mapping():
    rng = np.random.default_rng(10)
    src = random_cache(rng, 4, jnp.float32)
    dst = random_cache(rng, 4, jnp.float32)
    before = np.asarray(dst)
    out = cache.swap_blocks(src, dst, np.asarray([[0, 3]]), donate=False)
    assert not dst.is_deleted()
    assert_bits_equal(dst, before)
    assert_bits_equal(out[3], np.asarray(src)[0])
    assert cache.swap_blocks(src, dst, np.zeros((0, 2), np.int32)) is dst


def test_swap_blocks_under_jit_device_to_device_in_place():
    rng = np.random.default_rng(13)
    src = random_cache(rng, 6, jnp.float32, leading=(2,))
    dst = random_cache(rng, 5, jnp.float32, leading=(2,))
    src_np, dst_np = host_copy(src), host_copy(dst)
    traces = []

    def swap(s, d, mapping):
        traces.append(1)
        return cache.swap_blocks(s, d, mapping)

    swap = jax.jit(swap, donate_argnums=1)
    # A padding row and an out-of-range row (only legal under jit, where they are skipped).
    mapping = jnp.asarray([[5, 0], [PAD_BLOCK_ID, 3], [2, 4], [9, 1]], jnp.int32)
    pointer = dst.unsafe_buffer_pointer()
    out = swap(src, dst, mapping)
    assert dst.is_deleted() and out.unsafe_buffer_pointer() == pointer  # in place
    want = dst_np.copy()
    want[:, 0], want[:, 4] = src_np[:, 5], src_np[:, 2]
    assert_bits_equal(out, want)
    out = swap(src, out, jnp.asarray([[0, 1], [1, 2], [PAD_BLOCK_ID, PAD_BLOCK_ID], [3, 3]], jnp.int32))
    want[:, 1], want[:, 2], want[:, 3] = src_np[:, 0], src_np[:, 1], src_np[:, 3]
    assert_bits_equal(out, want)
    assert len(traces) == 1  # a traced mapping: one program for every mapping of that size


@pytest.mark.parametrize("stacked", [False, True], ids=["per_cache", "stacked_kv"])
def test_swap_blocks_under_jit_through_pinned_host_memory(stacked):
    """jax 0.10.2 on CPU exposes a pinned_host memory (as GPUs do); a jitted swap moves
    blocks out to it and back in, each in place, and keeps each cache's memory kind."""
    device = jax.devices()[0]
    assert "pinned_host" in {m.kind for m in device.addressable_memories()}
    rng = np.random.default_rng(14)
    leading = (2,) if stacked else ()
    axis = len(leading)
    device_cache = random_cache(rng, 8, jnp.bfloat16, leading=leading)
    original = host_copy(device_cache)
    host = zeros_at((*leading, 6, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), jnp.bfloat16,
                    cache.host_kv_cache_sharding(device))
    assert host.sharding.memory_kind == "pinned_host"
    swap = jax.jit(cache.swap_blocks, donate_argnums=1)

    host_pointer = host.unsafe_buffer_pointer()
    host = swap(device_cache, host, jnp.asarray([[1, 5], [6, 0], [3, 2]], jnp.int32))
    assert host.sharding.memory_kind == "pinned_host" and host.unsafe_buffer_pointer() == host_pointer
    got = host_copy(host)
    for s, d in ((1, 5), (6, 0), (3, 2)):
        assert_bits_equal(np.take(got, d, axis=axis), np.take(original, s, axis=axis))

    device_cache = jnp.zeros_like(device_cache)
    device_pointer = device_cache.unsafe_buffer_pointer()
    restored = swap(host, device_cache, jnp.asarray([[5, 7], [0, 4], [2, 0]], jnp.int32))
    assert restored.sharding.memory_kind == "device" and restored.unsafe_buffer_pointer() == device_pointer
    got = host_copy(restored)
    for s, d in ((1, 7), (6, 4), (3, 0)):
        assert_bits_equal(np.take(got, d, axis=axis), np.take(original, s, axis=axis))


def test_jitted_swap_runs_the_host_side_as_host_compute_when_lowered_for_cuda():
    """Cross-lowered for CUDA on this host: the host cache is a pinned_host argument and
    result of the program, its scatter (swap out) or gather (swap in) is XLA host
    compute, and a device-to-device swap has none."""
    device = jax.devices()[0]
    rng = np.random.default_rng(15)
    device_cache = random_cache(rng, 8, jnp.bfloat16, leading=(2,))
    host = zeros_at((2, 6, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), jnp.bfloat16, cache.host_kv_cache_sharding(device))
    mapping = jnp.asarray([[1, 5], [6, 0]], jnp.int32)

    def cuda_text(src, dst):
        with cuda_lowering_target():
            return jax.jit(cache.swap_blocks, donate_argnums=1).trace(src, dst, mapping).lower(
                lowering_platforms=("cuda",)).as_text()

    def host_side(text, op):
        """Whether every ``op`` of the module runs in its host computation: in the body of
        the function called with ``_xla_compute_type = "host"``, or of one called only
        from there (jnp.take lowers to a nested call)."""
        bodies = {chunk.split("(", 1)[0].split("@")[-1].strip(): chunk for chunk in text.split("func.func")[1:]}
        on_host = {"compute_on"}
        for name, body in bodies.items():
            callers = {caller for caller, other in bodies.items() if f"call @{name}(" in other}
            if callers and callers <= on_host:
                on_host.add(name)
        holding = {name for name, body in bodies.items() if op in body}
        return bool(holding) and holding <= on_host

    out_text, in_text = cuda_text(device_cache, host), cuda_text(host, device_cache)
    for text in (out_text, in_text):
        assert 'mhlo.memory_kind = "pinned_host"' in text
        assert 'call @compute_on(' in text and '_xla_compute_type = "host"' in text
    assert host_side(out_text, "stablehlo.scatter") and not host_side(out_text, "stablehlo.gather")  # swap out
    assert host_side(in_text, "stablehlo.gather") and not host_side(in_text, "stablehlo.scatter")  # swap in
    assert "compute_on" not in cuda_text(device_cache, jnp.zeros_like(device_cache))


# --------------------------------------------------------------------------- the Triton kernel

TRITON_CALL = "__gpu$xla.gpu.triton"


def kernel_case(rng, dtype, cache_dtype, num_kv_heads, head_size, num_blocks=4, num_tokens=37):
    """Tokens, both cache layouts and slots with padding and out-of-range entries (only
    legal under jit, where they are dropped). fp8 cases carry overflow, +-inf and NaN."""
    shape = (num_tokens, num_kv_heads, head_size)
    key = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    value = jnp.asarray(4 * rng.standard_normal(shape), jnp.float32).astype(dtype)
    if jnp.dtype(cache_dtype).itemsize == 1:
        key = key.at[0, 0, :4].set(jnp.asarray([1e4, -1e4, jnp.inf, -jnp.inf], dtype))
        value = value.at[1, -1, -1].set(jnp.nan)
    cache_shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    kv = jnp.array(jnp.asarray(rng.standard_normal(cache_shape), jnp.float32).astype(cache_dtype), copy=True)
    num_slots = num_blocks * BLOCK_SIZE
    interior = 1 + rng.permutation(num_slots - 2)[:num_tokens - 2]
    slots = np.concatenate([[0, num_slots - 1], interior]).astype(np.int32)  # distinct, first and last rows
    slots[[3, 11]] = PAD_SLOT_ID
    slots[[5, 20, 21]] = [num_slots, num_slots + 1000, -7]  # out of range: dropped
    return key, value, kv, jnp.asarray(slots)


KERNEL_DTYPES = [  # (token dtype, kv_cache_dtype, Hk, D, k_scale, v_scale)
    (jnp.bfloat16, "auto", 2, 64, 1.0, 1.0),
    (jnp.float16, "auto", 3, 80, 1.0, 1.0),  # Hk * D = 240: columns padded in-kernel
    (jnp.float32, "auto", 1, 128, 1.0, 1.0),
    (jnp.bfloat16, "fp8", 3, 80, 0.05, 3.0),
    (jnp.float32, "fp8_e5m2", 2, 64, 0.3, 7.0),
]


@pytest.mark.parametrize("dtype, kv_cache_dtype, num_kv_heads, head_size, k_scale, v_scale", KERNEL_DTYPES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_triton_kernel_writes_the_same_bits_as_xla(dtype, kv_cache_dtype, num_kv_heads, head_size,
                                                   k_scale, v_scale):
    rng = np.random.default_rng(20)
    cache_dtype = cache.get_kv_cache_dtype(kv_cache_dtype, dtype)
    key, value, kv, slots = kernel_case(rng, dtype, cache_dtype, num_kv_heads, head_size)
    static = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    want_k, want_v = jax.jit(functools.partial(cache.reshape_and_cache_flash, implementation="xla", **static))(
        key, value, kv[0], kv[1], slots)
    valid = np.where((np.asarray(slots) >= 0) & (np.asarray(slots) < kv.shape[1] * BLOCK_SIZE), slots, -1)
    numpy_k, numpy_v = numpy_reshape_and_cache(np.asarray(key), np.asarray(value), kv[0], kv[1], valid,
                                               k_scale, v_scale)
    assert_bits_equal(want_k, numpy_k)
    assert_bits_equal(want_v, numpy_v)

    triton = dict(implementation="triton", interpret=True, **static)
    got_k, got_v = jax.jit(functools.partial(cache.reshape_and_cache_flash, **triton))(
        key, value, kv[0], kv[1], slots)
    got_kv = jax.jit(functools.partial(cache.reshape_and_cache_flash_kv, **triton))(key, value, kv, slots)
    for got in ((got_k, got_v), got_kv):
        assert_bits_equal(got[0], want_k)
        assert_bits_equal(got[1], want_v)


def test_triton_kernel_multi_program_grid_and_eager_call():
    """Several token tiles with a partial last one, and several column blocks per row
    (a tiling smaller than the defaults), through the kernel builder; and the public
    function called eagerly (concrete, checked slots)."""
    from jax_paged_attn.kernels import triton_cache

    rng = np.random.default_rng(21)
    key, value, kv, slots = kernel_case(rng, jnp.bfloat16, jnp.bfloat16, 3, 80, num_blocks=3, num_tokens=23)
    want_k, want_v = cache.reshape_and_cache_flash(key, value, kv[0], kv[1], jnp.where(
        (slots >= 0) & (slots < 3 * BLOCK_SIZE), slots, PAD_SLOT_ID), implementation="xla")
    tiling = tuning.CacheWriteConfig(tokens_per_program=4, cols_per_program=64)
    (got_kv,) = triton_cache.cache_write_call(key, value, slots, None, (kv,), interpret=True, tiling=tiling)
    assert_bits_equal(got_kv[0], want_k)
    assert_bits_equal(got_kv[1], want_v)

    padded = jnp.where((slots >= 0) & (slots < 3 * BLOCK_SIZE), slots, PAD_SLOT_ID)
    eager_k, eager_v = cache.reshape_and_cache_flash(key, value, kv[0], kv[1], padded,
                                                     implementation="triton", interpret=True)
    assert_bits_equal(eager_k, want_k)
    assert_bits_equal(eager_v, want_v)


def test_triton_kernel_updates_donated_caches_in_place():
    rng = np.random.default_rng(22)
    key, value, kv, slots = kernel_case(rng, jnp.bfloat16, jnp.float8_e4m3fn, 2, 64)
    key_cache, value_cache = jnp.array(kv[0], copy=True), jnp.array(kv[1], copy=True)
    static = dict(kv_cache_dtype="fp8", k_scale=0.5, v_scale=2.0)
    want = jax.jit(functools.partial(cache.reshape_and_cache_flash_kv, implementation="xla", **static))(
        key, value, kv, slots)
    triton = dict(implementation="triton", interpret=True, **static)

    pointers = key_cache.unsafe_buffer_pointer(), value_cache.unsafe_buffer_pointer()
    write = jax.jit(functools.partial(cache.reshape_and_cache_flash, **triton), donate_argnums=(2, 3))
    new_k, new_v = write(key, value, key_cache, value_cache, slots)
    assert key_cache.is_deleted() and value_cache.is_deleted()
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    assert_bits_equal(new_k, want[0])
    assert_bits_equal(new_v, want[1])

    pointer = kv.unsafe_buffer_pointer()
    new_kv = jax.jit(functools.partial(cache.reshape_and_cache_flash_kv, **triton), donate_argnums=2)(
        key, value, kv, slots)
    assert kv.is_deleted() and new_kv.unsafe_buffer_pointer() == pointer
    assert_bits_equal(new_kv, want)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_auto_lowers_to_aliased_triton_kernel_for_cuda(kv_cache_dtype):
    """Cross-lowering on this CPU host: with the default implementation the module for
    CUDA holds the kernel, its output aliased to the donated cache; the CPU module
    holds the scatter."""
    cache_dtype = cache.get_kv_cache_dtype(kv_cache_dtype, jnp.bfloat16)
    key = jnp.ones((40, 3, 80), jnp.bfloat16)
    kv = jnp.zeros((2, 5, BLOCK_SIZE, 3, 80), cache_dtype)
    slots = jnp.arange(40, dtype=jnp.int32)
    static = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=2.0)
    for fn, caches, donate in ((cache.reshape_and_cache_flash_kv, (kv,), 2),
                               (cache.reshape_and_cache_flash, (kv[0], kv[1]), (2, 3))):
        def call(key, value, slots, *caches, fn=fn):
            return fn(key, value, *caches, slots, **static)

        jitted = jax.jit(lambda key, value, *caches, slots, call=call: call(key, value, slots, *caches),
                         donate_argnums=tuple(range(2, 2 + len(caches))))
        with cuda_lowering_target():
            cuda = jitted.trace(key, key, *caches, slots=slots).lower(lowering_platforms=("cuda",)).as_text()
        traced = jitted.trace(key, key, *caches, slots=slots)
        assert TRITON_CALL in cuda
        assert cuda.count("tf.aliasing_output") == len(caches)
        assert "output_operand_aliases" in cuda  # the custom call writes into its cache operand
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
        assert TRITON_CALL not in cpu and "scatter" in cpu


def test_implementation_errors():
    args = _args()
    with pytest.raises(ValueError, match="implementation must be one of"):
        cache.reshape_and_cache_flash(**args, implementation="cuda")


def _triton_module_of_cuda_lowering(fn, *args, monkeypatch) -> tuple[str, str]:
    """(StableHLO for CUDA, the Triton modules Pallas printed while lowering it)."""
    monkeypatch.setattr(triton_cache.pl, "pallas_call", functools.partial(triton_cache.pl.pallas_call, debug=True))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), cuda_lowering_target():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text, printed.getvalue()


def _store_offset_types(triton_text: str) -> set[str]:
    """Element types of the offsets added to the cache pointers that ``tt.store`` writes."""
    offsets = {}
    for line in triton_text.splitlines():
        match = re.search(r"(%\w+) = tt\.addptr .*: tensor<[^>]*!tt\.ptr<\w+>>, tensor<[0-9x]*(i\d+)>", line)
        if match:
            offsets[match.group(1)] = match.group(2)
    stored = re.findall(r"tt\.store (%\w+),", triton_text)
    assert stored, "no store in the Triton module"
    return {offsets[name] for name in stored}


@pytest.mark.parametrize("layout", ["stacked_kv", "per_cache"])
def test_kernel_writes_caches_of_2_31_elements_and_more_with_64_bit_offsets(layout, monkeypatch):
    """Abstract caches past 2**31 elements (4.3 GB of bf16, never allocated): with the
    default implementation the CUDA module holds the kernel (no fallback to the scatter),
    and the kernel's stores address the cache with 64-bit offsets; a small cache keeps
    32-bit ones."""
    key = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((64,), jnp.int32)
    for num_blocks, offset_type in ((2**17 + 16, "i64"), (4096, "i32")):
        kv_shape = (2, num_blocks, BLOCK_SIZE, 8, 128)
        if layout == "stacked_kv":
            caches = (jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16),)
            fn = cache.reshape_and_cache_flash_kv
        else:  # each cache alone holds 2**31 + 2**21 elements
            caches = (jax.ShapeDtypeStruct(kv_shape[1:], jnp.bfloat16),) * 2
            fn = cache.reshape_and_cache_flash
        elements = math.prod(caches[0].shape)
        assert (elements > 2**31) == (offset_type == "i64")
        text, triton_text = _triton_module_of_cuda_lowering(
            lambda k, v, s, *c: fn(k, v, *c, s), key, key, slots, *caches, monkeypatch=monkeypatch)
        assert TRITON_CALL in text
        assert _store_offset_types(triton_text) == {offset_type}


@pytest.mark.parametrize("layout", ["stacked_kv", "per_cache"])
def test_kernel_writes_an_fp8_cache_of_2_31_to_2_32_elements_with_64_bit_offsets(layout, monkeypatch):
    """An fp8 cache of 2**31 + 2**21 elements (2.1 GB, abstract): Pallas' Triton lowering
    alone would address it with 32-bit offsets (it sizes its choice in bytes);
    `kernels.triton_offsets` widens them, so auto writes it with the kernel, whose
    stores use 64-bit offsets, and says nothing."""
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    monkeypatch.setattr(dispatch, "default_platform", lambda: "cuda")
    key = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((4,), jnp.int32)
    if layout == "stacked_kv":
        caches = (jax.ShapeDtypeStruct((2, 2**16 + 16, BLOCK_SIZE, 8, 128), jnp.float8_e4m3fn),)
        fn = functools.partial(cache.reshape_and_cache_flash_kv, kv_cache_dtype="fp8")
    else:
        caches = (jax.ShapeDtypeStruct((2**17 + 32, BLOCK_SIZE, 8, 128), jnp.float8_e5m2),) * 2
        fn = functools.partial(cache.reshape_and_cache_flash, kv_cache_dtype="fp8_e5m2")
    assert 2**31 < math.prod(caches[0].shape) <= 2**32
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)
        text, triton_text = _triton_module_of_cuda_lowering(
            lambda k, v, s, *c: fn(k, v, *c, s), key, key, slots, *caches, monkeypatch=monkeypatch)
    assert TRITON_CALL in text
    assert _store_offset_types(triton_text) == {"i64"}


def test_fp8_cache_is_refused_or_warned_about_without_the_64_bit_offsets(monkeypatch):
    """Where the widening could not be installed (a JAX whose lowering differs from the
    one it was checked against; pretended here), the explicit kernel refuses an fp8
    cache of 2**31 to 2**32 elements, naming it and the reason, and auto writes it with
    the scatter and, on a CUDA device, says so once. Past 2**32 elements (more than
    4 GiB) the lowering's own 64-bit offsets serve and the kernel takes it."""
    from jax_paged_attn.kernels import triton_offsets

    monkeypatch.setattr(triton_offsets, "INSTALLED", False)
    monkeypatch.setattr(triton_offsets, "REASON", "pretended for the test")
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    monkeypatch.setattr(dispatch, "default_platform", lambda: "cuda")
    key = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((4,), jnp.int32)
    band = jax.ShapeDtypeStruct((2, 2**16 + 16, BLOCK_SIZE, 8, 128), jnp.float8_e4m3fn)  # 2**31 + 2**21 elements
    fn = functools.partial(cache.reshape_and_cache_flash_kv, kv_cache_dtype="fp8")
    why = r"kv_cache is 2148007936 float8_e4m3fn elements .* signed 32-bit .* not installed: pretended for the test"
    with pytest.raises(NotImplementedError, match=why):
        jax.eval_shape(functools.partial(fn, implementation="triton"), key, key, band, slots)
    with pytest.warns(dispatch.ReferenceFallbackWarning, match=why), cuda_lowering_target():
        text = jax.jit(fn).trace(key, key, band, slots).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON_CALL not in text and "scatter" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.ReferenceFallbackWarning)  # said once, not twice
        jax.eval_shape(fn, key, key, band, slots)
        big = jax.ShapeDtypeStruct((2, 2**17 + 16, BLOCK_SIZE, 8, 128), jnp.float8_e4m3fn)  # 4.3e9 bytes
        with cuda_lowering_target():
            text = jax.jit(fn).trace(key, key, big, slots).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON_CALL in text


# --------------------------------------------------------------------------- errors


def _args(dtype=jnp.bfloat16, num_tokens=4, num_blocks=2, cache_dtype=None):
    rng = np.random.default_rng(11)
    key, value = random_tokens(rng, num_tokens, dtype)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    k_cache = random_cache(rng, num_blocks, jnp.float32).astype(cache_dtype)
    return dict(key=key, value=value, key_cache=k_cache, value_cache=k_cache,
                slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32))


def _with(**changes):
    args = _args()
    args.update(changes)
    return args


@pytest.mark.parametrize("args, error, match", [
    (_with(key=jnp.zeros((4, 2 * 32), jnp.bfloat16)), ValueError, "key .*rank 3"),
    (_with(value=jnp.zeros((4, 2, 64), jnp.bfloat16)), ValueError, "key and value must have the same shape"),
    (_with(key=jnp.zeros((4, 2, 32), jnp.int32)), TypeError, "key must be float16"),
    (_with(key_cache=jnp.zeros((2, 16, 2, 64), jnp.bfloat16)), ValueError, "key_cache holds"),
    (_with(value_cache=jnp.zeros((2, 16, 2, 32, 1), jnp.bfloat16)), ValueError, "value_cache .*rank 4"),
    (_with(key_cache=jnp.zeros((2, 8, 2, 32), jnp.bfloat16),
           value_cache=jnp.zeros((2, 8, 2, 32), jnp.bfloat16)), ValueError, "block size of key_cache"),
    (_with(value_cache=jnp.zeros((3, 16, 2, 32), jnp.bfloat16)), ValueError, "same shape"),
    (_with(value_cache=jnp.zeros((2, 16, 2, 32), jnp.float16)), ValueError, "value_cache has dtype float16"),
    (_with(slot_mapping=jnp.arange(3, dtype=jnp.int32)), ValueError, r"slot_mapping must have shape \[num_tokens\]"),
    (_with(slot_mapping=jnp.arange(4, dtype=jnp.float32)), TypeError, "slot_mapping must be an integer"),
    (_with(slot_mapping=jnp.asarray([0, 1, 32, -1])), ValueError, r"slot_mapping entries .* got \[32\]"),
    (_with(slot_mapping=jnp.asarray([0, -2, 3, 4])), ValueError, r"slot_mapping entries .* got \[-2\]"),
    (_with(slot_mapping=jnp.asarray([5, 1, 5, -1])), ValueError, r"writes slots \[5\] more than once"),
])
def test_reshape_and_cache_errors(args, error, match):
    with pytest.raises(error, match=match):
        cache.reshape_and_cache_flash(**args)


def test_reshape_and_cache_kv_cache_dtype_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        cache.reshape_and_cache_flash(**_args(), kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="'fp8'.*key_cache has dtype bfloat16"):
        cache.reshape_and_cache_flash(**_args(), kv_cache_dtype="fp8")
    fp8 = _args(cache_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="'auto'.*key_cache has dtype float8_e4m3fn"):
        cache.reshape_and_cache_flash(**fp8)
    with pytest.raises(ValueError, match="'fp8_e5m2'.*key_cache has dtype float8_e4m3fn"):
        cache.reshape_and_cache_flash(**fp8, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="k_scale must be > 0"):
        cache.reshape_and_cache_flash(**fp8, kv_cache_dtype="fp8", k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale must be a scalar"):
        cache.reshape_and_cache_flash(**fp8, kv_cache_dtype="fp8", v_scale=jnp.ones(2))
    # An infinite scale would store zeros that read back as NaN.
    with pytest.raises(ValueError, match="k_scale must be > 0 and finite, got inf"):
        cache.reshape_and_cache_flash(**fp8, kv_cache_dtype="fp8", k_scale=float("inf"))
    with pytest.raises(ValueError, match="v_scale must be > 0 and finite, got inf"):
        cache.reshape_and_cache_flash(**fp8, kv_cache_dtype="fp8", v_scale=jnp.float32(np.inf))
    fp8_kv = jnp.stack([fp8["key_cache"], fp8["value_cache"]])
    with pytest.raises(ValueError, match="v_scale must be > 0 and finite, got nan"):
        cache.reshape_and_cache_flash_kv(fp8["key"], fp8["value"], fp8_kv, fp8["slot_mapping"],
                                         kv_cache_dtype="fp8", v_scale=float("nan"))
    args = _args()
    kv = jnp.stack([args["key_cache"], args["value_cache"]])
    with pytest.raises(ValueError, match="kv_cache must have 2 on its first axis"):
        cache.reshape_and_cache_flash_kv(args["key"], args["value"], kv[:1], args["slot_mapping"])


def test_copy_blocks_errors():
    k = [jnp.zeros((4, 16, 2, 32))]
    ok = jnp.asarray([[0, 1]], jnp.int32)
    cases = [
        (lambda: cache.copy_blocks(k, k + k, ok), ValueError, "one entry per layer"),
        (lambda: cache.copy_blocks(k[0], k[0], ok), TypeError, "key_caches must be a list"),
        (lambda: cache.copy_blocks(k, [jnp.zeros((5, 16, 2, 32))], ok), ValueError, r"value_caches\[0\]"),
        (lambda: cache.copy_blocks(k, k, jnp.asarray([0, 1])), ValueError, r"block_mapping must have shape \[\?, 2\]"),
        (lambda: cache.copy_blocks(k, k, jnp.asarray([[0.0, 1.0]])), TypeError, "block_mapping must be an integer"),
        (lambda: cache.copy_blocks(k, k, jnp.asarray([[4, 1]])), ValueError, r"block_mapping\[:, 0\].* got \[4\]"),
        (lambda: cache.copy_blocks(k, k, jnp.asarray([[0, -3]])), ValueError, r"block_mapping\[:, 1\].* got \[-3\]"),
        (lambda: cache.copy_blocks(k, k, jnp.asarray([[0, 2], [1, 2]])), ValueError, r"destination blocks \[2\]"),
        (lambda: cache.copy_kv_cache_blocks(k, ok), ValueError, r"kv_caches\[0\] .*rank 5"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_swap_blocks_errors():
    a = jnp.zeros((4, 16, 2, 32))
    ok = np.asarray([[0, 1]])
    cases = [
        (lambda: cache.swap_blocks(np.zeros((4, 16, 2, 32)), a, ok), TypeError, "src must be a jax.Array"),
        (lambda: cache.swap_blocks(a, jnp.zeros((2, 4, 16, 2, 32)), ok), ValueError, "same rank"),
        (lambda: cache.swap_blocks(a, jnp.zeros((4, 16, 2, 64)), ok), ValueError, "apart from the number of blocks"),
        (lambda: cache.swap_blocks(a, a.astype(jnp.bfloat16), ok), TypeError, "same dtype"),
        (lambda: cache.swap_blocks(a, a, np.asarray([[0, 4]])), ValueError, r"block_mapping\[:, 1\].* \[0, 4\)"),
        (lambda: cache.swap_blocks(a, jnp.zeros((9, 16, 2, 32)), np.asarray([[5, 1]])), ValueError,
         r"block_mapping\[:, 0\].* \[0, 4\)"),
        (lambda: cache.swap_blocks(a, a, np.asarray([[0, 1], [2, 1]])), ValueError, "more than once"),
        (lambda: jax.jit(cache.swap_blocks)(a, a, ok.astype(np.float32)), TypeError,
         "block_mapping must be an integer array"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# --------------------------------------------------------------------------- GPU placement


@pytest.mark.gpu
def test_gpu_swap_round_trip_through_pinned_host_and_cpu_backend():
    """On a CUDA device: swap through the device's pinned host memory (the default) and
    through the CPU backend (the fallback placement); both bit-exact, both in place."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    gpu = jax.devices()[0]
    rng = np.random.default_rng(12)
    original = random_cache(rng, 64, jnp.bfloat16, leading=(2,))
    pairs = np.asarray([[3, 0], [17, 9], [63, 5]])
    for host_sharding in (cache.host_kv_cache_sharding(gpu), jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])):
        host = zeros_at((2, 10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), jnp.bfloat16, host_sharding)
        pointer = host.unsafe_buffer_pointer()
        host = cache.swap_blocks(original, host, pairs)
        assert host.sharding == host_sharding and host.unsafe_buffer_pointer() == pointer
        device_cache = jnp.zeros_like(original)
        restored = cache.swap_blocks(host, device_cache, pairs[:, ::-1])
        assert restored.sharding.memory_kind == "device" and device_cache.is_deleted()
        want = np.zeros_like(np.asarray(original))
        want[:, pairs[:, 0]] = np.asarray(original)[:, pairs[:, 0]]
        assert_bits_equal(restored, want)
    assert cache.host_kv_cache_sharding(gpu).memory_kind == "pinned_host"


@pytest.mark.gpu
def test_gpu_jitted_swap_through_pinned_host_is_in_place_and_bit_exact():
    """On a CUDA device, under jax.jit with donation: device -> pinned_host (scatter as
    host compute) and back (gather as host compute), a traced mapping, both in place."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    gpu = jax.devices()[0]
    rng = np.random.default_rng(16)
    original = random_cache(rng, 64, jnp.bfloat16, leading=(2,))
    host = cache.allocate_host_kv_cache(10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=gpu)
    assert host.sharding.memory_kind == "pinned_host"
    swap = jax.jit(cache.swap_blocks, donate_argnums=1)
    pairs = jnp.asarray([[3, 0], [17, 9], [63, 5], [PAD_BLOCK_ID, 1]], jnp.int32)
    pointer = host.unsafe_buffer_pointer()
    host = swap(original, host, pairs)
    assert host.sharding.memory_kind == "pinned_host" and host.unsafe_buffer_pointer() == pointer
    device_cache = jnp.zeros_like(original)
    pointer = device_cache.unsafe_buffer_pointer()
    restored = swap(host, device_cache, pairs[:, ::-1])
    assert restored.sharding.memory_kind == "device" and restored.unsafe_buffer_pointer() == pointer
    want = np.zeros_like(host_copy(original))
    want[:, [3, 17, 63]] = host_copy(original)[:, [3, 17, 63]]
    assert_bits_equal(restored, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_gpu_triton_kernel_matches_xla_and_updates_in_place(kv_cache_dtype):
    """Compiled on a CUDA device: the kernel writes the same bits as the XLA scatter
    (both layouts, Hk * D a power of 2 and not), into the donated buffers."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    for dtype, num_kv_heads, head_size, num_tokens in ((jnp.bfloat16, 8, 128, 3000), (jnp.float16, 3, 80, 257)):
        rng = np.random.default_rng(23)
        cache_dtype = cache.get_kv_cache_dtype(kv_cache_dtype, dtype)
        key, value, kv, slots = kernel_case(rng, dtype, cache_dtype, num_kv_heads, head_size,
                                            num_blocks=256, num_tokens=num_tokens)
        static = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.05, v_scale=3.0)
        want = jax.jit(functools.partial(cache.reshape_and_cache_flash_kv, implementation="xla", **static))(
            key, value, kv, slots)
        want = host_copy(want)
        key_cache, value_cache = jnp.array(kv[0], copy=True), jnp.array(kv[1], copy=True)
        pointers = key_cache.unsafe_buffer_pointer(), value_cache.unsafe_buffer_pointer()
        write = jax.jit(functools.partial(cache.reshape_and_cache_flash, **static), donate_argnums=(2, 3))
        assert TRITON_CALL in write.lower(key, value, key_cache, value_cache, slots).as_text()
        new_k, new_v = write(key, value, key_cache, value_cache, slots)
        assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
        assert_bits_equal(new_k, want[0])
        assert_bits_equal(new_v, want[1])
        pointer = kv.unsafe_buffer_pointer()
        new_kv = jax.jit(functools.partial(cache.reshape_and_cache_flash_kv, implementation="triton", **static),
                         donate_argnums=2)(key, value, kv, slots)
        assert new_kv.unsafe_buffer_pointer() == pointer
        assert_bits_equal(new_kv, want)


@pytest.mark.gpu
@pytest.mark.gpu_memory
@pytest.mark.parametrize("layout,num_blocks", [("stacked_kv", 2**16 + 16), ("per_cache", 2**17 + 16)])
def test_gpu_kernel_writes_a_cache_of_more_than_2_31_elements(layout, num_blocks):
    """Compiled on a CUDA device: bf16 caches of 2**31 + 2**21 elements each (4.3 GB; one
    stacked layer, or a key and a value cache) written by the kernel in place, with
    64-bit offsets; slots at both ends included; only the written rows change."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    num_kv_heads, head_size = 8, 128
    num_slots = num_blocks * BLOCK_SIZE
    rng = np.random.default_rng(24)
    key, value = (jnp.asarray(rng.standard_normal((64, num_kv_heads, head_size)), jnp.bfloat16) for _ in range(2))
    ends = np.asarray([0, 1, num_slots - 2, num_slots - 1])
    slots_np = np.concatenate([ends, rng.choice(np.arange(2, num_slots - 2), 60, replace=False)]).astype(np.int32)
    slots = jnp.asarray(slots_np)
    if layout == "stacked_kv":
        caches = (cache.allocate_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, head_size, model_dtype=jnp.bfloat16),)
        write = jax.jit(lambda k, v, c, s: (cache.reshape_and_cache_flash_kv(k, v, c, s),), donate_argnums=2)
    else:
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
        caches = tuple(jax.jit(functools.partial(jnp.zeros, shape, jnp.bfloat16))() for _ in range(2))
        write = jax.jit(cache.reshape_and_cache_flash, donate_argnums=(2, 3))
    assert all(math.prod(c.shape) > 2**31 for c in caches)
    assert TRITON_CALL in write.lower(key, value, *caches, slots).as_text()
    pointers = [c.unsafe_buffer_pointer() for c in caches]
    out = write(key, value, *caches, slots)
    assert [c.unsafe_buffer_pointer() for c in out] == pointers
    flat = [c.reshape(*c.shape[:-4], num_slots, num_kv_heads, head_size) for c in out]
    k_rows = flat[0][0][slots] if layout == "stacked_kv" else flat[0][slots]
    v_rows = flat[0][1][slots] if layout == "stacked_kv" else flat[1][slots]
    assert_bits_equal(k_rows, host_copy(key))
    assert_bits_equal(v_rows, host_copy(value))
    untouched = jnp.asarray(np.setdiff1d(np.arange(num_slots - 4096, num_slots), slots_np)[:256])
    rest = flat[0][:, untouched] if layout == "stacked_kv" else flat[0][untouched]
    assert not np.any(host_copy(rest.astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.gpu_memory
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout,num_blocks", [("stacked_kv", 2**16 + 16), ("per_cache", 2**18 - 32)])
def test_gpu_kernel_writes_an_fp8_cache_of_2_31_to_2_32_elements(layout, num_blocks, kv_cache_dtype):
    """Compiled on a CUDA device: fp8 caches of 2**31 to 2**32 elements (one stacked layer
    of 2**31 + 2**21 elements, 2.1 GB; or a key and a value cache of 2**32 - 2**19 each,
    4.3 GB apiece), which Pallas alone would address with wrapping 32-bit offsets.
    The default implementation runs the kernel (64-bit offsets, `kernels.triton_offsets`)
    and the whole cache equals, bit for bit, the XLA scatter's from the same zeros:
    slots at both ends and on both sides of element 2**31 included."""
    if jax.default_backend() != "gpu":
        pytest.fail("needs a CUDA device; deselect with -m 'not gpu' on CPU hosts")
    num_kv_heads, head_size = 8, 128
    row = num_kv_heads * head_size
    num_slots = num_blocks * BLOCK_SIZE
    dtype = cache.get_kv_cache_dtype(kv_cache_dtype, jnp.bfloat16)
    rng = np.random.default_rng(31)
    key, value = (jnp.asarray(4 * rng.standard_normal((64, num_kv_heads, head_size)), jnp.bfloat16)
                  for _ in range(2))
    # Element 2**31 is in slot 2**31 / row of a per-layer cache; in the stacked layout the
    # value plane starts at slot num_slots, so it is the value cache's slot 2**31 / row - num_slots.
    boundary = 2**31 // row - (num_slots if layout == "stacked_kv" else 0)
    edges = [0, 1, boundary - 1, boundary, boundary + 1, num_slots - 2, num_slots - 1]
    assert 0 < boundary - 1 and boundary + 1 < num_slots - 2
    top = np.setdiff1d(np.arange(num_slots - 8192, num_slots), edges)
    slots_np = np.concatenate([edges, rng.choice(top, 64 - len(edges), replace=False)]).astype(np.int32)
    slots = jnp.asarray(slots_np)
    scales = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=0.25)

    def zeros():
        if layout == "stacked_kv":
            return (cache.allocate_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, head_size,
                                            kv_cache_dtype=kv_cache_dtype),)
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
        return tuple(jax.jit(functools.partial(jnp.zeros, shape, dtype))() for _ in range(2))

    def writer(implementation):
        if layout == "stacked_kv":
            return jax.jit(lambda k, v, c, s: (cache.reshape_and_cache_flash_kv(
                k, v, c, s, implementation=implementation, **scales),), donate_argnums=2)
        return jax.jit(lambda k, v, kc, vc, s: cache.reshape_and_cache_flash(
            k, v, kc, vc, s, implementation=implementation, **scales), donate_argnums=(2, 3))

    caches = zeros()
    assert all(c.dtype == dtype and 2**31 < math.prod(c.shape) <= 2**32 for c in caches)
    kernel = writer(None)
    assert TRITON_CALL in kernel.lower(key, value, *caches, slots).as_text()
    by_kernel = kernel(key, value, *caches, slots)
    by_scatter = writer("xla")(key, value, *zeros(), slots)
    same = jax.jit(lambda a, b: jnp.array_equal(jax.lax.bitcast_convert_type(a, jnp.uint8),
                                                jax.lax.bitcast_convert_type(b, jnp.uint8)))
    for got, want in zip(by_kernel, by_scatter):
        assert bool(same(got, want))
    # The rows were written (not only equal zeros): the value rows at the edges hold v / 0.25.
    flat = by_kernel[-1].reshape(-1, num_slots, row)[-1]
    edge_rows = host_copy(flat[jnp.asarray(edges)].astype(jnp.float32))
    want_rows = numpy_fp8(host_copy(value.astype(jnp.float32)).reshape(64, row)[: len(edges)], 0.25, dtype)
    np.testing.assert_array_equal(edge_rows, want_rows.astype(np.float32))
