"""Paged KV-cache operations: vLLM's cache ops (``csrc/cache_kernels.cu``) as pure JAX.

vLLM's FlashAttention backend keeps, per layer, one array
``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 the keys,
1 the values; `get_kv_cache_shape`). Token slot ``s`` is row ``s % block_size`` of
block ``s // block_size``. vLLM mutates its caches in place; here every op is a pure
function returning the new cache, written so that XLA can update in place:

* `reshape_and_cache_flash` / `reshape_and_cache_flash_kv` write new tokens' keys and
  values at their slots: on CUDA a Pallas Triton kernel that stores each token's row
  into the cache buffer (`jax_paged_attn.kernels.triton_cache`), elsewhere (and with
  ``implementation="xla"``) one XLA scatter on the ``[num_blocks * block_size, Hk, D]``
  view of the cache; both write the same bits;
* `copy_blocks` / `copy_kv_cache_blocks` copy whole blocks inside each layer's cache
  (copy-on-write after a fork, beam search);
* `swap_blocks` moves whole blocks between a device cache and a host cache
  (preemption by swapping).

**In place, through donation.** A pure function that returns an updated copy of a
multi-GiB cache would double the memory and copy it on every call. Under
``jax.jit(fn, donate_argnums=...)`` with the cache arguments donated, XLA aliases the
output to the donated input buffer and the update touches only the written rows::

    write = jax.jit(reshape_and_cache_flash, donate_argnums=(2, 3),
                    static_argnames="kv_cache_dtype")
    key_cache, value_cache = write(key, value, key_cache, value_cache, slot_mapping)

The donated arrays are deleted by the call: always keep the returned ones. Called
without jit (or without donation) the ops are still correct, only not in place.
Two CPU-only traps make a donation silently copy instead: a cache made by
``jax.device_put`` of a NumPy array may share the NumPy memory (create caches with
`allocate_kv_cache` / `allocate_host_kv_cache` or any jitted computation), and in
jax >= 0.11 a cache once read with ``np.asarray`` keeps a zero-copy view that blocks
reuse (read a copy: ``np.asarray(jnp.array(cache, copy=True))``).
Called eagerly between steps, `swap_blocks` donates ``dst`` itself (``donate=True``);
under jit it is pure like the others (``jax.jit(swap_blocks, donate_argnums=1)``).

**Padding and out-of-range ids.** ``PAD_SLOT_ID`` (-1) in a slot mapping, and -1 in
either column of a block mapping, mark padding that is skipped, so a fixed-size
(jit-friendly) mapping can carry a variable number of entries. On concrete arrays
(eager calls, or NumPy arrays closed over by a jitted function) every other id must
be in range and destinations must be distinct, else ``ValueError``. Under ``jax.jit``
values cannot be checked: entries with an out-of-range id are dropped (nothing is
written anywhere else, no memory outside the cache is touched) and the winner among
duplicate destinations is unspecified (as in vLLM's kernels).

**fp8 caches.** With ``kv_cache_dtype`` ``"fp8"`` / ``"fp8_e4m3"`` (float8_e4m3fn) or
``"fp8_e5m2"`` (float8_e5m2) the cache stores ``x / scale`` rounded to nearest, clipped
to the format's largest finite value first (vLLM's ``scaled_fp8_conversion`` with
``__NV_SATFINITE``: overflow and ±inf saturate, NaN stays NaN). Readers compute
``cache * scale`` (`jax_paged_attn.reference.dequantize`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import checks, dispatch, plans, reference
from jax_paged_attn.spec import PAD_BLOCK_ID, PAD_SLOT_ID  # noqa: F401  (re-exported: they lived here)

Array = jax.Array

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""Accepted ``kv_cache_dtype`` strings (vLLM's ``--kv-cache-dtype`` choices)."""

_FP8_BY_NAME = {
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}

_INT32_MAX = np.iinfo(np.int32).max


# --------------------------------------------------------------------------- shapes and dtypes


def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, int, int, int, int]:
    """Shape of one layer's KV cache: ``(2, num_blocks, block_size, num_kv_heads, head_size)``.

    Index 0 of the first axis holds the keys, 1 the values. Raises ``ValueError`` when
    ``block_size`` is not a positive multiple of 16 or ``head_size`` is unsupported
    (`jax_paged_attn.checks.supported_head_sizes`).
    """
    num_blocks = checks.check_static_int(num_blocks, "num_blocks")
    block_size = checks.check_static_int(block_size, "block_size")
    num_kv_heads = checks.check_static_int(num_kv_heads, "num_kv_heads")
    head_size = checks.check_static_int(head_size, "head_size")
    checks.check_block_size(block_size)
    checks.check_head_size(head_size)
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def get_kv_cache_dtype(kv_cache_dtype: str, model_dtype: Any) -> jnp.dtype:
    """The cache's element type for vLLM's ``kv_cache_dtype`` string.

    ``"auto"`` -> ``model_dtype`` (float16 / bfloat16 / float32); ``"fp8"`` and
    ``"fp8_e4m3"`` -> float8_e4m3fn; ``"fp8_e5m2"`` -> float8_e5m2. (vLLM's
    ``get_kv_cache_torch_dtype``.)
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}.")
    if kv_cache_dtype in _FP8_BY_NAME:
        return _FP8_BY_NAME[kv_cache_dtype]
    try:
        dtype = jnp.dtype(model_dtype)
    except TypeError as e:
        raise TypeError(f"model_dtype must be a dtype, got {model_dtype!r}.") from e
    if dtype not in checks.QUERY_DTYPES:
        raise TypeError(f"model_dtype must be float16, bfloat16 or float32, got {dtype}.")
    return dtype


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    *,
    kv_cache_dtype: str = "auto",
    model_dtype: Any = jnp.bfloat16,
    sharding: jax.sharding.Sharding | jax.Device | None = None,
) -> Array:
    """Zeros of `get_kv_cache_shape` in `get_kv_cache_dtype` (one layer's cache).

    ``sharding`` places it (default: JAX's default device, device memory).
    """
    shape = get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    dtype = get_kv_cache_dtype(kv_cache_dtype, model_dtype)
    if isinstance(sharding, jax.Device):
        sharding = jax.sharding.SingleDeviceSharding(sharding)
    return _zeros(shape, dtype, sharding)


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding | None) -> Array:
    """Zeros in a buffer XLA owns. (On CPU, `jax.device_put` of a NumPy array may alias
    the NumPy memory; XLA cannot reuse such a buffer, so donating it would copy.)"""
    return _zeros_program(shape, jnp.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding | None) -> Any:
    # One jitted function per cache shape: a fresh jit of a fresh partial would compile
    # again for every engine that allocates the same caches.
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def host_kv_cache_sharding(device: jax.Device | None = None) -> jax.sharding.Sharding:
    """Where `allocate_host_kv_cache` puts a host-side (swap) cache for ``device``'s cache.

    * ``device``'s ``"pinned_host"`` memory when it exposes one (GPUs; CPUs in
      jax >= 0.10 too): page-locked host RAM the accelerator reads and writes by DMA.
      On a GPU, `swap_blocks`' gather / scatter on that side run as XLA host compute.
    * otherwise the first device of JAX's CPU backend (ordinary host RAM); transfers
      go through `jax.device_put` between the two backends.

    ``device`` defaults to ``jax.devices()[0]``.
    """
    device = jax.devices()[0] if device is None else device
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        kinds = set()  # backends without memory kinds (older plugins)
    if "pinned_host" in kinds:
        return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


def allocate_host_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    *,
    kv_cache_dtype: str = "auto",
    model_dtype: Any = jnp.bfloat16,
    device: jax.Device | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> Array:
    """Zeros of `get_kv_cache_shape` in host memory: the swap space of one layer.

    Placed by ``sharding`` if given, else by `host_kv_cache_sharding` (``device``'s
    pinned host memory when available). Blocks move between it and the device cache
    with `swap_blocks` (swap out: ``swap_blocks(device_cache, host_cache, mapping)``,
    swap in: ``swap_blocks(host_cache, device_cache, mapping)``).
    """
    shape = get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    dtype = get_kv_cache_dtype(kv_cache_dtype, model_dtype)
    sharding = host_kv_cache_sharding(device) if sharding is None else sharding
    # Zeros made on the host and copied in: no computation runs in host memory, and the
    # array's type records its host memory space (a jitted fill would type it as device
    # memory in jax 0.10.2).
    zeros = np.zeros(shape, dtype)
    cache = jax.device_put(zeros, sharding)
    aliased = (len(cache.addressable_shards) == 1
               and cache.unsafe_buffer_pointer() == zeros.ctypes.data)  # the CPU client shares NumPy memory
    if aliased:
        cache = jax.device_put(cache, sharding, may_alias=False)
    return cache


# --------------------------------------------------------------------------- reshape_and_cache_flash


def check_kv_cache_dtype(kv_cache_dtype: str, key_dtype: Any, cache_dtype: Any, cache_name: str) -> None:
    """Raises ValueError unless ``cache_name``'s dtype is what ``kv_cache_dtype`` makes of ``key_dtype``."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}.")
    expected = get_kv_cache_dtype(kv_cache_dtype, key_dtype)
    if jnp.dtype(cache_dtype) != expected:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with {jnp.dtype(key_dtype)} keys stores "
            f"{expected}, but {cache_name} has dtype {jnp.dtype(cache_dtype)}."
        )


def _quantize(x: Array, cache_dtype: Any, scale: Array) -> Array:
    """``x / scale`` saturated to ``cache_dtype``'s finite range (vLLM ``__NV_SATFINITE``)."""
    cache_dtype = jnp.dtype(cache_dtype)
    if cache_dtype not in checks.FP8_DTYPES:
        return x.astype(cache_dtype)
    largest = float(jnp.finfo(cache_dtype).max)
    scaled = x.astype(jnp.float32) / scale
    # jnp.clip keeps NaN (min/max propagate it), as the CUDA conversion does.
    return jnp.clip(scaled, -largest, largest).astype(cache_dtype)


def _check_slot_mapping_values(slot_mapping: Any, num_slots: int) -> None:
    """Value check (eager only): PAD_SLOT_ID or an existing slot, no slot written twice."""
    if not checks.is_concrete(slot_mapping):
        return
    slots = np.asarray(slot_mapping).astype(np.int64)
    bad = slots[(slots != PAD_SLOT_ID) & ((slots < 0) | (slots >= num_slots))]
    if bad.size:
        raise ValueError(
            f"slot_mapping entries must be PAD_SLOT_ID ({PAD_SLOT_ID}) or slots in "
            f"[0, {num_slots}) (num_blocks * block_size), got {bad[:8].tolist()}."
        )
    used = slots[slots >= 0]
    values, counts = np.unique(used, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"slot_mapping writes slots {values[counts > 1][:8].tolist()} more than once.")


def _scatter_indices(ids: Array, num_targets: int) -> Array:
    """i32 ids with every invalid entry (padding, out of range) moved to its own index
    past the end, so a ``mode="drop"`` scatter skips it and the indices stay distinct."""
    ids = ids.astype(jnp.int32)
    past_end = num_targets + jnp.arange(ids.shape[0], dtype=jnp.int32)
    return jnp.where((ids >= 0) & (ids < num_targets), ids, past_end)


def _check_token_args(key: Any, value: Any, slot_mapping: Any) -> None:
    for name, x in (("key", key), ("value", value)):
        checks.check_ndim(x, 3, f"{name} ([num_tokens, num_kv_heads, head_size])")
        checks.check_query_dtype(x, name)
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {key.shape} and {value.shape}.")
    if key.dtype != value.dtype:
        raise TypeError(f"key and value must have the same dtype, got {key.dtype} and {value.dtype}.")
    checks.check_head_size(key.shape[2], "head size of key (key.shape[2])")
    _check_slot_mapping(slot_mapping, key.shape[0], "key")


def _check_slot_mapping(slot_mapping: Any, num_tokens: int, tokens_name: str) -> None:
    if not hasattr(slot_mapping, "dtype") or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise TypeError(
            f"slot_mapping must be an integer array, got {getattr(slot_mapping, 'dtype', type(slot_mapping).__name__)}."
        )
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must have shape [num_tokens] = [{num_tokens}] (one slot per row of "
            f"{tokens_name}), got {tuple(slot_mapping.shape)}."
        )


def _check_cache_matches_tokens(cache: Any, key: Any, name: str, expected_ndim: int) -> None:
    layout = ("[num_blocks, block_size, num_kv_heads, head_size]" if expected_ndim == 4
              else "[2, num_blocks, block_size, num_kv_heads, head_size]")
    checks.check_ndim(cache, expected_ndim, f"{name} ({layout})")
    if tuple(cache.shape[-2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"{name} holds [num_kv_heads, head_size] = {list(cache.shape[-2:])} per slot but key "
            f"rows are {list(key.shape[1:])}."
        )
    checks.check_block_size(cache.shape[-3], f"block size of {name} ({name}.shape[{expected_ndim - 3}])")
    num_slots = cache.shape[-4] * cache.shape[-3]
    if num_slots + key.shape[0] > _INT32_MAX:
        raise ValueError(f"{name} has {num_slots} slots; int32 slot ids need fewer than {_INT32_MAX - key.shape[0]}.")


def reshape_and_cache_flash(
    key: Array,  # [T, Hk, D] f16 / bf16 / f32
    value: Array,  # [T, Hk, D] same dtype as key
    key_cache: Array,  # [num_blocks, block_size, Hk, D] key dtype or fp8
    value_cache: Array,  # [num_blocks, block_size, Hk, D] same dtype as key_cache
    slot_mapping: Array,  # int[T], PAD_SLOT_ID for tokens not written
    kv_cache_dtype: str = "auto",
    k_scale: Array | float = 1.0,
    v_scale: Array | float = 1.0,
    *,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Writes each token's key and value into its cache slot; returns the new caches.

    Token ``t`` goes to ``cache[s // block_size, s % block_size]`` with
    ``s = slot_mapping[t]``; ``s == PAD_SLOT_ID`` (-1) skips the token. Slots not
    written keep their contents.

    Args:
      key, value: ``[T, Hk, D]`` float16 / bfloat16 / float32, the same dtype.
      key_cache, value_cache: ``[num_blocks, block_size, Hk, D]`` (block size a multiple
        of 16), dtype ``get_kv_cache_dtype(kv_cache_dtype, key.dtype)``.
      slot_mapping: integer ``[T]`` (exactly one entry per row of key).
      kv_cache_dtype: ``"auto"`` (the cache has key's dtype) or ``"fp8"`` /
        ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (static under jit: ``static_argnames``).
      k_scale, v_scale: positive float32 scalars; fp8 caches store ``x / scale``
        (saturated to the largest finite fp8 value). Ignored for ``"auto"``.
      implementation: ``"xla"`` (the scatter), ``"triton"`` (the Pallas kernel; CUDA,
        or any backend with ``interpret=True``) or None / ``"auto"``: the kernel when
        lowered for CUDA, the scatter elsewhere (`_dispatch_write`). Static.
      interpret: run the kernel in Pallas interpret mode (CPU tests). Static.

    Returns:
      ``(key_cache, value_cache)`` with the same shapes, dtypes and placement.

    In place under ``jax.jit(..., donate_argnums=(2, 3), static_argnames="kv_cache_dtype")``.
    Checked always: ranks, shapes, dtypes, block and head size, kv_cache_dtype.
    Checked on concrete slot mappings: entries are -1 or in ``[0, num_blocks * block_size)``
    and no slot repeats; under jit out-of-range entries are dropped.
    """
    _check_token_args(key, value, slot_mapping)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache_matches_tokens(cache, key, name, 4)
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must have the same shape, got {key_cache.shape} and {value_cache.shape}."
        )
    check_kv_cache_dtype(kv_cache_dtype, key.dtype, key_cache.dtype, "key_cache")
    check_kv_cache_dtype(kv_cache_dtype, key.dtype, value_cache.dtype, "value_cache")
    k_scale, v_scale = checks.scale_array(k_scale, "k_scale"), checks.scale_array(v_scale, "v_scale")
    num_blocks, block_size = key_cache.shape[:2]
    num_slots = num_blocks * block_size
    _check_slot_mapping_values(slot_mapping, num_slots)

    return _dispatch_write(key, value, (key_cache, value_cache), jnp.asarray(slot_mapping), k_scale, v_scale,
                           implementation=implementation, interpret=interpret)


def reshape_and_cache_flash_kv(
    key: Array,  # [T, Hk, D] f16 / bf16 / f32
    value: Array,  # [T, Hk, D] same dtype as key
    kv_cache: Array,  # [2, num_blocks, block_size, Hk, D] key dtype or fp8
    slot_mapping: Array,  # int[T], PAD_SLOT_ID for tokens not written
    kv_cache_dtype: str = "auto",
    k_scale: Array | float = 1.0,
    v_scale: Array | float = 1.0,
    *,
    implementation: str | None = None,
    interpret: bool = False,
) -> Array:
    """`reshape_and_cache_flash` on one layer's stacked cache (`get_kv_cache_shape`).

    vLLM passes ``kv_cache[0]`` and ``kv_cache[1]`` (views) to the op; in JAX those
    would be copies, so this variant updates the ``[2, ...]`` array directly and stays
    in place under ``jax.jit(..., donate_argnums=2, static_argnames="kv_cache_dtype")``.
    Same arguments, checks and semantics; returns the new ``kv_cache``. The kernel
    writes a token's key and value in the same program.
    """
    _check_token_args(key, value, slot_mapping)
    _check_cache_matches_tokens(kv_cache, key, "kv_cache", 5)
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must have 2 on its first axis (keys, values), got shape {kv_cache.shape}.")
    check_kv_cache_dtype(kv_cache_dtype, key.dtype, kv_cache.dtype, "kv_cache")
    k_scale, v_scale = checks.scale_array(k_scale, "k_scale"), checks.scale_array(v_scale, "v_scale")
    num_blocks, block_size = kv_cache.shape[1:3]
    num_slots = num_blocks * block_size
    _check_slot_mapping_values(slot_mapping, num_slots)

    (kv_cache,) = _dispatch_write(key, value, (kv_cache,), jnp.asarray(slot_mapping), k_scale, v_scale,
                                  implementation=implementation, interpret=interpret)
    return kv_cache


def _xla_write(key: Array, value: Array, slot_mapping: Array, k_scale: Array, v_scale: Array,
               *caches: Array) -> tuple[Array, ...]:
    """The XLA path (and the kernel's reference): one scatter per cache, or one on the
    stacked cache. ``caches`` is ``(key_cache, value_cache)`` or ``(kv_cache,)``."""
    num_slots = caches[0].shape[-4] * caches[0].shape[-3]
    slots = _scatter_indices(slot_mapping, num_slots)
    row_shape = key.shape[1:]
    if len(caches) == 1:
        (kv_cache,) = caches
        rows = jnp.stack([_quantize(key, kv_cache.dtype, k_scale), _quantize(value, kv_cache.dtype, v_scale)])
        flat = kv_cache.reshape(2, num_slots, *row_shape)  # a bitcast: aliasing survives it
        flat = flat.at[:, slots].set(rows, mode="drop", wrap_negative_indices=False, unique_indices=True)
        return (flat.reshape(kv_cache.shape),)

    def write(cache: Array, rows: Array, scale: Array) -> Array:
        flat = cache.reshape(num_slots, *row_shape)  # a bitcast: aliasing survives it
        flat = flat.at[slots].set(_quantize(rows, cache.dtype, scale), mode="drop",
                                  wrap_negative_indices=False, unique_indices=True)
        return flat.reshape(cache.shape)

    key_cache, value_cache = caches
    return write(key_cache, key, k_scale), write(value_cache, value, v_scale)


def _kernel_unsupported_reason(caches: tuple[Array, ...]) -> str | None:
    """Why the cache-write kernel cannot write these caches (None when it can).

    Inside the kernel every index stays below 2**31 (slot ids are int32 and
    ``num_slots + num_tokens < 2**31``); Pallas' Triton lowering turns a store's
    ``(slot, column)`` into a flat element offset, in 64 bits for a cache of 2**31
    elements and more (`jax_paged_attn.kernels.triton_offsets` widens the offsets of
    an fp8 cache of 2 to 4 GiB, which the lowering alone would address with 32 bits).
    Only when that widening could not be installed is such an fp8 cache refused.
    """
    names = ("kv_cache",) if len(caches) == 1 else ("key_cache", "value_cache")
    return checks.narrow_offsets_reason(dict(zip(names, caches)))


def _kernel_write(key: Array, value: Array, slot_mapping: Array, k_scale: Array, v_scale: Array,
                  *caches: Array, interpret: bool) -> tuple[Array, ...]:
    from jax_paged_attn.kernels import triton_cache

    scales = plans.kv_scales(caches[0].dtype, caches[0].dtype, k_scale, v_scale)
    tiling = plans.plan_cache_write(*key.shape)
    return triton_cache.cache_write_call(key, value, slot_mapping, scales, caches, tiling=tiling,
                                         interpret=interpret)


def _dispatch_write(key: Array, value: Array, caches: tuple[Array, ...], slot_mapping: Array,
                    k_scale: Array, v_scale: Array, *, implementation: str | None,
                    interpret: bool) -> tuple[Array, ...]:
    """Picks the cache-write implementation with `dispatch.run_implementation`:
    ``"xla"`` the scatter, ``"triton"`` the kernel, auto the kernel when lowered for
    CUDA and the scatter elsewhere (warned once on a GPU, with the reason, when the
    kernel cannot write these caches, `_kernel_unsupported_reason`). An empty token
    batch always takes the scatter (nothing to write)."""
    args = (key, value, slot_mapping, k_scale, v_scale, *caches)
    if key.shape[0] == 0:
        dispatch.normalize_implementation(implementation)
        return _xla_write(*args)
    return tuple(dispatch.run_implementation(
        implementation, args, reference_fn=_xla_write,
        kernel_fn=functools.partial(_kernel_write, interpret=interpret),
        unsupported_reason=lambda: _kernel_unsupported_reason(caches),
    ))


# --------------------------------------------------------------------------- rotary embedding + cache write


def rotary_and_cache_flash_kv(
    qkv: Array,  # [T, Hk, G + 2, D] f16 / bf16 / f32
    cos: Array,  # [T, D] float
    sin: Array,  # [T, D] float
    kv_cache: Array,  # [2, num_blocks, block_size, Hk, D] qkv's dtype or fp8
    slot_mapping: Array,  # int[T], PAD_SLOT_ID for tokens not written
    kv_cache_dtype: str = "auto",
    k_scale: Array | float = 1.0,
    v_scale: Array | float = 1.0,
    *,
    partials: bool = False,
    dtype: Any = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """The rotary embedding of queries and keys fused with `reshape_and_cache_flash_kv`.

    vLLM runs ``rotary_embedding`` (in place on views of the projection's output) and
    then ``reshape_and_cache_flash``; in JAX the views would be copies, so this op reads
    the projection's output itself and returns the rotated queries beside the new cache.

    Args:
      qkv: ``[T, Hk, G + 2, D]`` float16 / bfloat16 / float32, one projection's output
        grouped by KV head: along axis 2, KV head ``j``'s ``G`` query heads (query heads
        ``j * G + i``), then its key, then its value. ``G >= 1``, ``D`` even and a
        supported head size.
      cos, sin: ``[T, D]`` float, each token's rotary angles' cosines / sines with the
        two halves equal (``concat([a, a])``; any rope scaling is the caller's).
      kv_cache: the layer's stacked cache (`get_kv_cache_shape`), dtype
        ``get_kv_cache_dtype(kv_cache_dtype, qkv.dtype)``.
      slot_mapping, kv_cache_dtype, k_scale, v_scale, implementation, interpret: as in
        `reshape_and_cache_flash_kv` (``implementation="xla"``: the rotation in
        `jax_paged_attn.reference.rotary_embedding` and the scatter).
      partials: ``qkv`` is ``[S, T, Hk, G + 2, D]``, a split-K product's float32 partials
        (`jax_paged_attn.matmul.linear_partials`), summed and rounded to ``dtype`` before
        the rotation: the product's own rounding, without a kernel of its own.
      dtype: with ``partials``, the projection's dtype (float16 / bfloat16 / float32):
        the queries' and, unless fp8, the cache's; else it must be qkv's, or None.

    Returns:
      ``(query [T, G * Hk, D] in qkv's dtype (``dtype``), kv_cache)``: queries rotated
      (`jax_paged_attn.reference.rotary_embedding`, rotate-half layout, float32 math
      rounded once), the cache holding each token's rotated key and its value at its
      slot. In place under ``jax.jit(..., donate_argnums=3, static_argnames="kv_cache_dtype")``.
    """
    if partials:
        checks.check_ndim(qkv, 5, "qkv partials ([splits, num_tokens, num_kv_heads, queries_per_kv_head + 2, "
                                  "head_size])")
        if not jnp.issubdtype(qkv.dtype, jnp.floating):
            raise TypeError(f"qkv partials must be a float array, got {qkv.dtype}.")
        if dtype is None:
            raise ValueError("dtype (the projection's dtype) is required with partials=True.")
        parts = qkv
    else:
        checks.check_ndim(qkv, 4, "qkv ([num_tokens, num_kv_heads, queries_per_kv_head + 2, head_size])")
        if dtype is not None and jnp.dtype(dtype) != qkv.dtype:
            raise TypeError(f"dtype must be qkv's ({qkv.dtype}) or None without partials, got {jnp.dtype(dtype)}.")
        dtype, parts = qkv.dtype, qkv[None]
    checks.check_query_dtype(jax.ShapeDtypeStruct((), dtype), "qkv" if not partials else "dtype")
    dtype = jnp.dtype(dtype)
    num_tokens, num_kv_heads, heads_per_kv, head_size = parts.shape[1:]
    if heads_per_kv < 3:
        raise ValueError(f"qkv.shape[2] must be queries_per_kv_head + 2 >= 3 (queries, key, value), got {heads_per_kv}.")
    checks.check_head_size(head_size, "head size of qkv (qkv.shape[3])")  # a multiple of 16: even
    for name, table in (("cos", cos), ("sin", sin)):
        checks.check_ndim(table, 2, f"{name} ([num_tokens, head_size])")
        if tuple(table.shape) != (num_tokens, head_size):
            raise ValueError(f"{name} must have shape [num_tokens, head_size] = [{num_tokens}, {head_size}], "
                             f"got {tuple(table.shape)}.")
        if not jnp.issubdtype(table.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {table.dtype}.")
    _check_slot_mapping(slot_mapping, num_tokens, "qkv")
    _check_cache_matches_tokens(kv_cache, jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_size), dtype),
                                "kv_cache", 5)
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must have 2 on its first axis (keys, values), got shape {kv_cache.shape}.")
    check_kv_cache_dtype(kv_cache_dtype, dtype, kv_cache.dtype, "kv_cache")
    k_scale, v_scale = checks.scale_array(k_scale, "k_scale"), checks.scale_array(v_scale, "v_scale")
    _check_slot_mapping_values(slot_mapping, kv_cache.shape[1] * kv_cache.shape[2])

    args = (parts, cos, sin, jnp.asarray(slot_mapping), k_scale, v_scale, kv_cache)
    xla = functools.partial(_xla_rotary_write, dtype=dtype)
    if num_tokens == 0:
        dispatch.normalize_implementation(implementation)
        return xla(*args)
    return tuple(dispatch.run_implementation(
        implementation, args, reference_fn=xla,
        kernel_fn=functools.partial(_kernel_rotary_write, dtype=dtype, interpret=interpret),
        unsupported_reason=lambda: _kernel_unsupported_reason((kv_cache,)),
    ))


def _xla_rotary_write(parts: Array, cos: Array, sin: Array, slot_mapping: Array, k_scale: Array, v_scale: Array,
                      kv_cache: Array, *, dtype: Any) -> tuple[Array, Array]:
    """The XLA path (and the fused kernel's reference): sum the partials ``[S, T, Hk, G +
    2, D]`` to ``dtype``, rotate, then `_xla_write`."""
    qkv = parts[0] if parts.shape[0] == 1 and parts.dtype == dtype else \
        jnp.sum(parts.astype(jnp.float32), axis=0).astype(dtype)
    num_tokens, num_kv_heads, heads_per_kv, head_size = qkv.shape
    group = heads_per_kv - 2
    query = reference.rotary_embedding(qkv[:, :, :group].reshape(num_tokens, num_kv_heads * group, head_size),
                                       cos, sin)
    key = reference.rotary_embedding(qkv[:, :, group], cos, sin)
    (kv_cache,) = _xla_write(key, qkv[:, :, group + 1], slot_mapping, k_scale, v_scale, kv_cache)
    return query, kv_cache


def _kernel_rotary_write(parts: Array, cos: Array, sin: Array, slot_mapping: Array, k_scale: Array,
                         v_scale: Array, kv_cache: Array, *, dtype: Any, interpret: bool) -> tuple[Array, Array]:
    from jax_paged_attn.kernels import triton_cache

    scales = plans.kv_scales(kv_cache.dtype, kv_cache.dtype, k_scale, v_scale)
    tiling = plans.plan_rotary_cache_write(parts.shape[1], parts.shape[3] - 2, parts.shape[4])
    return triton_cache.rotary_cache_write_call(parts, cos, sin, slot_mapping, scales, kv_cache, tiling=tiling,
                                                dtype=dtype, interpret=interpret)


# --------------------------------------------------------------------------- block mappings


def _check_block_mapping(block_mapping: Any, name: str = "block_mapping") -> None:
    checks.check_int_array(block_mapping, name, (None, 2))


def _check_block_mapping_values(block_mapping: Any, num_src_blocks: int, num_dst_blocks: int,
                                name: str = "block_mapping") -> None:
    """Value check (eager only): ids are PAD_BLOCK_ID or existing blocks, destinations distinct."""
    if not checks.is_concrete(block_mapping):
        return
    pairs = np.asarray(block_mapping).astype(np.int64).reshape(-1, 2)
    for column, what, limit in ((0, "source", num_src_blocks), (1, "destination", num_dst_blocks)):
        ids = pairs[:, column]
        bad = ids[(ids != PAD_BLOCK_ID) & ((ids < 0) | (ids >= limit))]
        if bad.size:
            raise ValueError(
                f"{name}[:, {column}] ({what} blocks) must be PAD_BLOCK_ID ({PAD_BLOCK_ID}) or in "
                f"[0, {limit}), got {bad[:8].tolist()}."
            )
    live = pairs[(pairs[:, 0] >= 0) & (pairs[:, 1] >= 0)]
    values, counts = np.unique(live[:, 1], return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"{name} copies into destination blocks {values[counts > 1][:8].tolist()} more than once.")


def _pair_ids(block_mapping: Array, num_src_blocks: int, num_dst_blocks: int) -> tuple[Array, Array]:
    """(src, dst) i32 ids; a pair with any invalid id reads block 0 and writes past the end."""
    pairs = jnp.asarray(block_mapping).astype(jnp.int32)
    src, dst = pairs[:, 0], pairs[:, 1]
    valid = (src >= 0) & (src < num_src_blocks) & (dst >= 0) & (dst < num_dst_blocks)
    past_end = num_dst_blocks + jnp.arange(pairs.shape[0], dtype=jnp.int32)
    return jnp.where(valid, src, 0), jnp.where(valid, dst, past_end)


def _copy_blocks_in(cache: Array, block_mapping: Array, axis: int) -> Array:
    num_blocks = cache.shape[axis]
    src, dst = _pair_ids(block_mapping, num_blocks, num_blocks)
    blocks = jnp.take(cache, src, axis=axis, mode="clip")  # every read happens before any write
    index = (slice(None),) * axis + (dst,)
    return cache.at[index].set(blocks, mode="drop", wrap_negative_indices=False, unique_indices=True)


def _check_layer_list(caches: Any, name: str) -> list:
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"{name} must be a list of per-layer caches, got {type(caches).__name__}.")
    return list(caches)


def copy_blocks(
    key_caches: Sequence[Array],  # per layer [num_blocks, block_size, Hk, D]
    value_caches: Sequence[Array],  # per layer, same shape and dtype as key_caches[i]
    block_mapping: Array,  # int[N, 2] (src, dst) pairs, -1 pairs skipped
) -> tuple[list[Array], list[Array]]:
    """Copy-on-write: block ``dst`` receives block ``src``'s contents in every layer.

    Args:
      key_caches, value_caches: lists (one entry per layer) of
        ``[num_blocks, block_size, Hk, D]`` caches; layer i's key and value caches
        have the same shape and dtype (layers may differ).
      block_mapping: integer ``[N, 2]``, rows ``(src, dst)``. A row with
        ``PAD_BLOCK_ID`` (-1) in either column is skipped.

    Returns:
      ``(key_caches, value_caches)`` as new lists.

    Every block is read before any is written: with pairs ``(a, b), (b, c)``, block c
    receives b's contents from before the call. A block may be a source several
    times; ``(a, a)`` leaves a unchanged. In place under
    ``jax.jit(copy_blocks, donate_argnums=(0, 1))``. Checked on a concrete mapping:
    ids are -1 or in range, no destination repeats; under jit, pairs with an
    out-of-range id are skipped.
    """
    key_caches = _check_layer_list(key_caches, "key_caches")
    value_caches = _check_layer_list(value_caches, "value_caches")
    if len(key_caches) != len(value_caches):
        raise ValueError(
            f"key_caches and value_caches must have one entry per layer, got {len(key_caches)} and "
            f"{len(value_caches)}."
        )
    _check_block_mapping(block_mapping)
    for layer, (k, v) in enumerate(zip(key_caches, value_caches)):
        checks.check_ndim(k, 4, f"key_caches[{layer}] ([num_blocks, block_size, Hk, D])")
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(
                f"key_caches[{layer}] and value_caches[{layer}] must have the same shape and dtype, got "
                f"{k.shape} {k.dtype} and {v.shape} {v.dtype}."
            )
    if not key_caches:
        return [], []
    num_blocks = min(k.shape[0] for k in key_caches)
    _check_block_mapping_values(block_mapping, num_blocks, num_blocks)
    return ([_copy_blocks_in(k, block_mapping, 0) for k in key_caches],
            [_copy_blocks_in(v, block_mapping, 0) for v in value_caches])


def copy_kv_cache_blocks(
    kv_caches: Sequence[Array],  # per layer [2, num_blocks, block_size, Hk, D]
    block_mapping: Array,  # int[N, 2] (src, dst) pairs, -1 pairs skipped
) -> list[Array]:
    """`copy_blocks` on stacked per-layer caches (`get_kv_cache_shape`), the signature of
    vLLM's ``FlashAttentionBackend.copy_blocks``. In place under
    ``jax.jit(copy_kv_cache_blocks, donate_argnums=0)``; same semantics and checks."""
    kv_caches = _check_layer_list(kv_caches, "kv_caches")
    _check_block_mapping(block_mapping)
    for layer, kv in enumerate(kv_caches):
        checks.check_ndim(kv, 5, f"kv_caches[{layer}] ([2, num_blocks, block_size, Hk, D])")
        if kv.shape[0] != 2:
            raise ValueError(f"kv_caches[{layer}] must have 2 on its first axis, got shape {kv.shape}.")
    if not kv_caches:
        return []
    num_blocks = min(kv.shape[1] for kv in kv_caches)
    _check_block_mapping_values(block_mapping, num_blocks, num_blocks)
    return [_copy_blocks_in(kv, block_mapping, 1) for kv in kv_caches]


# --------------------------------------------------------------------------- swap_blocks


def _in_host_memory(x: Any) -> bool:
    """Whether JAX's type of ``x`` (an array, or a tracer inside jit) places it in host
    memory (memory kind ``pinned_host`` / ``unpinned_host``)."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def _host_compute(fn: Callable[..., Array], out_space: Any) -> Callable[..., Array]:
    """``fn`` as XLA host computation (`jax.experimental.compute_on`, compute type
    ``device_host``), its result placed in memory space ``out_space``.

    Gathers and scatters whose operand is a host-memory cache run on the host, next to
    the data, so only the chosen blocks cross between memories. jax 0.10 / 0.11 spell it
    ``compute_on2(f, ...)``; later versions ``compute_on(f, ...)``.
    """
    from jax.experimental import compute_on as compute_on_lib

    wrap = getattr(compute_on_lib, "compute_on2", None) or compute_on_lib.compute_on
    return wrap(fn, compute_type="device_host", out_memory_spaces=out_space)


def _take_blocks(src: Array, ids: Array, *, axis: int, to_host: bool) -> Array:
    """``src``'s blocks ``ids`` (i32[N], clipped), gathered where src lives; returned in
    host memory if ``to_host``, else in device memory."""
    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def take(cache: Array, block_ids: Array) -> Array:
        return jnp.take(cache, block_ids, axis=axis, mode="clip")

    if _in_host_memory(src):
        # A gather's operands share one memory space: the ids go to the host too.
        return _host_compute(take, host if to_host else device)(src, jax.device_put(ids, host))
    blocks = take(src, ids)
    return jax.device_put(blocks, host) if to_host else blocks


def _put_blocks(dst: Array, ids: Array, blocks: Array, *, axis: int) -> Array:
    """``dst`` with ``blocks`` (in dst's memory) written at ``ids`` (i32[N], distinct; an
    id past the end is dropped), scattered where dst lives."""
    def put(cache: Array, block_ids: Array, values: Array) -> Array:
        index = (slice(None),) * axis + (block_ids,)
        return cache.at[index].set(values, mode="drop", wrap_negative_indices=False, unique_indices=True)

    if _in_host_memory(dst):
        host = jax.memory.Space.Host
        return _host_compute(put, host)(dst, jax.device_put(ids, host), blocks)
    return put(dst, ids, blocks)


def _swap_impl(src: Array, dst: Array, src_ids: Array, dst_ids: Array, *, axis: int) -> Array:
    """The swap as one traceable function: gather where src lives, move only the blocks
    to dst's memory, scatter where dst lives."""
    blocks = _take_blocks(src, src_ids, axis=axis, to_host=_in_host_memory(dst))
    return _put_blocks(dst, dst_ids, blocks, axis=axis)


@functools.lru_cache(maxsize=None)
def _swap_program(axis: int, donate: bool, sharding: jax.sharding.Sharding) -> Callable[..., Array]:
    """The jitted swap between caches of one device set; the result keeps dst's sharding."""
    return jax.jit(functools.partial(_swap_impl, axis=axis), donate_argnums=(1,) if donate else (),
                   out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _take_program(axis: int, to_host: bool) -> Callable[..., Array]:
    return jax.jit(functools.partial(_take_blocks, axis=axis, to_host=to_host))


@functools.lru_cache(maxsize=None)
def _put_program(axis: int, donate: bool, sharding: jax.sharding.Sharding) -> Callable[..., Array]:
    return jax.jit(functools.partial(_put_blocks, axis=axis), donate_argnums=(0,) if donate else (),
                   out_shardings=sharding)


def _block_axis(cache: Any, name: str) -> int:
    """0 for a ``[num_blocks, bs, Hk, D]`` cache, 1 for a stacked ``[2, num_blocks, ...]`` one."""
    checks.check_ndim(cache, (4, 5), f"{name} ([num_blocks, block_size, Hk, D] or [2, num_blocks, block_size, Hk, D])")
    return cache.ndim - 4


def swap_blocks(src: Array, dst: Array, block_mapping: Any, *, donate: bool = True) -> Array:
    """Copies blocks ``src[block_mapping[:, 0]]`` into ``dst[block_mapping[:, 1]]``; returns the new dst.

    ``src`` and ``dst`` may live in different memories (device HBM and host memory,
    see `allocate_host_kv_cache`): swap out with ``swap_blocks(device_cache,
    host_cache, mapping)``, swap in with ``swap_blocks(host_cache, device_cache,
    mapping)``. The chosen blocks are gathered where src lives, only they cross to
    dst's memory, and they are scattered where dst lives; on a host-memory cache the
    gather / scatter run as XLA host compute (`jax.experimental.compute_on`).

    Args:
      src, dst: both ``[num_blocks, block_size, Hk, D]`` (one of vLLM's key / value
        caches) or both ``[2, num_blocks, block_size, Hk, D]`` (a whole layer: keys and
        values in one call, as vLLM's ``FlashAttentionBackend.swap_blocks``); the same
        dtype and per-block shape, any number of blocks each.
      block_mapping: integer ``[N, 2]`` (NumPy or JAX), rows ``(src_block, dst_block)``;
        rows with ``PAD_BLOCK_ID`` (-1) are skipped. Concrete ids are checked (in
        range, no destination twice).
      donate: eager calls only: reuse dst's buffer for the result (in place); the
        ``dst`` passed in is then deleted, use the returned array. With
        ``donate=False`` dst is copied. Under jit, donate dst through your own
        ``jax.jit(..., donate_argnums=...)``.

    Returns:
      The updated dst, with dst's sharding (and memory kind).

    **Eagerly** (concrete arrays, between steps) the number of pairs is padded to a
    power of two, so a serving loop compiles a handful of programs, not one per mapping
    size; caches on different devices (a host cache on JAX's CPU backend, the fallback
    of `host_kv_cache_sharding`) are joined with `jax.device_put`.

    **Under jax.jit** it is a pure function: ``jax.jit(swap_blocks, donate_argnums=1)``
    updates dst in place, the mapping may be traced (pairs with an out-of-range id are
    then skipped, and the winner among repeated destinations is unspecified). src and
    dst must then be on the same devices; their memory kinds come from JAX's types of
    them (``jax.typeof(x).memory_space``): device <-> device always; device <->
    ``pinned_host`` in every supported jax (0.10.2, tested on CPU, whose devices expose
    ``device`` / ``pinned_host`` / ``unpinned_host`` memories; 0.11.x on GPUs): an
    argument in ``pinned_host`` memory is typed as host memory inside jit, keeps that
    memory kind as the output it is donated to, and the gather / scatter on it lower to
    host compute (``compute_on2`` in these versions). Host caches from
    `allocate_host_kv_cache` are in ``pinned_host`` where the device has it; a host
    cache on JAX's CPU backend (its fallback) can only be swapped eagerly.
    """
    for name, x in (("src", src), ("dst", dst)):
        if not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a jax.Array (its placement says where the blocks live), "
                            f"got {type(x).__name__}.")
    axis = _block_axis(src, "src")
    if _block_axis(dst, "dst") != axis:
        raise ValueError(f"src and dst must have the same rank, got shapes {src.shape} and {dst.shape}.")
    if axis == 1 and (src.shape[0] != 2 or dst.shape[0] != 2):
        raise ValueError(f"stacked caches must have 2 on their first axis, got {src.shape} and {dst.shape}.")
    block_shape = src.shape[:axis] + src.shape[axis + 1:]
    if block_shape != dst.shape[:axis] + dst.shape[axis + 1:]:
        raise ValueError(
            f"src and dst must have the same shape apart from the number of blocks, got {src.shape} and {dst.shape}."
        )
    if src.dtype != dst.dtype:
        raise TypeError(f"src and dst must have the same dtype, got {src.dtype} and {dst.dtype}.")
    if not hasattr(block_mapping, "dtype"):
        block_mapping = np.asarray(block_mapping)
    _check_block_mapping(block_mapping)
    num_src, num_dst = src.shape[axis], dst.shape[axis]
    _check_block_mapping_values(block_mapping, num_src, num_dst)

    if any(isinstance(x, jax.core.Tracer) for x in (src, dst, block_mapping)):
        src_ids, dst_ids = _pair_ids(block_mapping, num_src, num_dst)
        return _swap_impl(src, dst, src_ids, dst_ids, axis=axis)

    pairs = np.asarray(block_mapping)
    pairs = pairs[(pairs[:, 0] >= 0) & (pairs[:, 1] >= 0)].astype(np.int32)
    if pairs.shape[0] == 0:
        return dst
    bucket = 1 << (pairs.shape[0] - 1).bit_length()
    src_ids = np.zeros(bucket, np.int32)  # padding reads block 0 ...
    dst_ids = num_dst + np.arange(bucket, dtype=np.int32)  # ... and writes nowhere
    src_ids[:pairs.shape[0]], dst_ids[:pairs.shape[0]] = pairs[:, 0], pairs[:, 1]

    if src.sharding.device_set == dst.sharding.device_set:
        return _swap_program(axis, donate, dst.sharding)(src, dst, src_ids, dst_ids)
    blocks = _take_program(axis, _in_host_memory(src))(src, src_ids)
    blocks = jax.device_put(blocks, dst.sharding)
    return _put_program(axis, donate, dst.sharding)(dst, dst_ids, blocks)
