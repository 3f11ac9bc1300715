"""Input validation shared by every implementation and lowering.

Two kinds of checks, as in JAX's TPU ragged paged attention:

* **static** checks look only at shapes, dtypes and Python values. They run on every
  call, under `jax.jit` too (at trace time), and raise `ValueError` / `TypeError`
  naming the offending argument.
* **value** checks look at array contents (cu_seqlens monotone, block ids and
  lengths in range). They need concrete arrays, so they run only when the argument
  is not a tracer (eager calls, and the host-side metadata builder). Under `jax.jit`
  they are skipped: the kernels then clamp out-of-range page ids rather than read
  outside the cache, but the numbers are meaningless, so validate on the host.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import plans
from jax_paged_attn.kv_view import CachePlane, stored_array

MIN_HEAD_SIZE = 32
MAX_HEAD_SIZE = 256
HEAD_SIZE_MULTIPLE = 16
BLOCK_SIZE_MULTIPLE = 16

QUERY_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def supported_head_sizes() -> list[int]:
    """Head sizes every implementation supports: multiples of 16 from 32 to 256."""
    return list(range(MIN_HEAD_SIZE, MAX_HEAD_SIZE + 1, HEAD_SIZE_MULTIPLE))


def is_concrete(x: Any) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


def check_head_size(head_size: int, name: str = "head_size") -> None:
    if head_size not in supported_head_sizes():
        raise ValueError(
            f"{name}={head_size} is not supported; supported head sizes are "
            f"{supported_head_sizes()} (multiples of {HEAD_SIZE_MULTIPLE} from "
            f"{MIN_HEAD_SIZE} to {MAX_HEAD_SIZE})."
        )


def check_block_size(block_size: int, name: str = "block_size") -> None:
    if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE != 0:
        raise ValueError(f"{name}={block_size} must be a positive multiple of {BLOCK_SIZE_MULTIPLE}.")


def check_ndim(x: Any, ndim: int | Sequence[int], name: str) -> None:
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if not hasattr(x, "ndim") or x.ndim not in ndims:
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have rank {' or '.join(map(str, ndims))}, got shape {got}.")


def check_int_array(x: Any, name: str, shape: tuple[int | None, ...]) -> None:
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {getattr(x, 'dtype', type(x).__name__)}.")
    if x.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
        want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}.")


def check_query_dtype(q: Any, name: str = "q") -> None:
    if jnp.dtype(q.dtype) not in QUERY_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {q.dtype}.")


def check_kv_dtype(k: Any, q_dtype: Any, name: str) -> None:
    dt = jnp.dtype(k.dtype)
    if dt != jnp.dtype(q_dtype) and dt not in FP8_DTYPES:
        raise TypeError(
            f"{name} has dtype {k.dtype}; it must match the query dtype ({q_dtype}) or be an "
            f"fp8 cache dtype (float8_e4m3fn, float8_e5m2)."
        )


def check_heads(num_q_heads: int, num_kv_heads: int, q_name: str = "q", k_name: str = "k") -> None:
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"the number of query heads of {q_name} ({num_q_heads}) must be a multiple of the "
            f"number of KV heads of {k_name} ({num_kv_heads})."
        )


def check_static_int(x: Any, name: str, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int (it fixes shapes, so it is static), got {type(x).__name__}.")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}.")
    return int(x)


def check_alibi_slopes(alibi_slopes: Any, num_q_heads: int) -> None:
    if alibi_slopes is None:
        return
    if not hasattr(alibi_slopes, "shape") or tuple(alibi_slopes.shape) != (num_q_heads,):
        raise ValueError(
            f"alibi_slopes must have shape [num_q_heads] = [{num_q_heads}], "
            f"got {getattr(alibi_slopes, 'shape', type(alibi_slopes).__name__)}."
        )


def check_scale(scale: Any, name: str) -> None:
    shape = getattr(scale, "shape", ())
    if tuple(shape) not in ((), (1,)):
        raise ValueError(f"{name} must be a scalar (per-tensor fp8 scale), got shape {tuple(shape)}.")
    # An infinite scale passes "> 0" but quantizes every value to 0 and dequantizes to NaN.
    if is_concrete(scale):
        value = float(np.asarray(scale, np.float64).reshape(-1)[0])
        if not (value > 0 and np.isfinite(value)):
            raise ValueError(f"{name} must be > 0 and finite, got {value}.")


def scale_array(scale: Any, name: str) -> jax.Array:
    """A checked per-tensor fp8 scale as an f32 scalar array (`check_scale`)."""
    check_scale(scale, name)
    return jnp.asarray(scale, jnp.float32).reshape(())


def check_nonnegative_values(x: Any, name: str) -> None:
    """Value check (eager only): every entry >= 0."""
    if is_concrete(x) and np.any(np.asarray(x) < 0):
        raise ValueError(f"{name} must be >= 0, got {np.asarray(x).tolist()}.")


def check_cu_seqlens_values(cu: Any, name: str, total: int | None = None) -> None:
    """Value check (eager only): cu_seqlens starts at 0 and never decreases."""
    if not is_concrete(cu):
        return
    c = np.asarray(cu)
    if c.size and c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {c[0]}.")
    if np.any(np.diff(c) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {c.tolist()}.")
    if total is not None and c.size and c[-1] > total:
        raise ValueError(f"{name}[-1] = {c[-1]} exceeds the {total} rows of the packed tensor.")


def check_varlen_length_values(cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any | None,
                               max_seqlen_q: int, max_seqlen_k: int, *, packed: bool) -> None:
    """Value checks (eager only) of the per-sequence lengths of a varlen call.

    Implementations attend at most ``max_seqlen_q`` queries and ``max_seqlen_k`` keys of
    a sequence, so a bound below a true length would silently drop queries or keys: it
    raises, except for sequences where nothing is dropped (no keys, or no queries).
    With packed keys, ``seqused_k`` past its ``cu_seqlens_k`` segment would read the
    next sequence's keys. Call after `check_cu_seqlens_values`.
    """
    q_lens = np.diff(np.asarray(cu_seqlens_q)) if is_concrete(cu_seqlens_q) else None
    segments = np.diff(np.asarray(cu_seqlens_k)) if is_concrete(cu_seqlens_k) else None
    if seqused_k is None:
        k_lens, k_name = segments, "cu_seqlens_k"
    else:
        k_lens, k_name = (np.asarray(seqused_k) if is_concrete(seqused_k) else None), "seqused_k"
    if packed and seqused_k is not None and k_lens is not None and segments is not None:
        over = np.nonzero(k_lens > segments)[0]
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"seqused_k[{b}] = {k_lens[b]} exceeds the {segments[b]} keys of sequence {b} in "
                f"cu_seqlens_k (with packed k / v it would read the next sequence's keys).")
    # A bound only matters for sequences that have work on the other side too.
    for lens, other, bound, name, what, source, effect in (
            (q_lens, k_lens, max_seqlen_q, "max_seqlen_q", "queries", "cu_seqlens_q", "get no output"),
            (k_lens, q_lens, max_seqlen_k, "max_seqlen_k", "keys", k_name, "be ignored")):
        if lens is None:
            continue
        counted = np.ones_like(lens, bool) if other is None else other > 0
        over = np.nonzero((lens > bound) & counted)[0]
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"{name}={bound} is below the {lens[b]} {what} of sequence {b} "
                f"({source}); {what} past it would silently {effect}.")


def check_block_table_values(block_table: Any, num_blocks: int, lengths: Any, block_size: int,
                             name: str = "block_table") -> None:
    """Value check (eager only): the blocks a sequence uses exist in the cache."""
    if not (is_concrete(block_table) and is_concrete(lengths)):
        return
    bt = np.asarray(block_table)
    lens = np.asarray(lengths)
    for b, n in enumerate(lens.tolist()):
        used = -(-int(n) // block_size)
        if used > bt.shape[1]:
            raise ValueError(
                f"sequence {b} has {n} tokens, needing {used} blocks, but {name} has only {bt.shape[1]} columns."
            )
        ids = bt[b, :used]
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            raise ValueError(
                f"{name}[{b}] uses block ids outside [0, {num_blocks}): {ids[(ids < 0) | (ids >= num_blocks)].tolist()}."
            )


def narrow_offsets_reason(refs: Mapping[str, Any]) -> str | None:
    """Why a Pallas Triton kernel cannot address these operands, or None (a support
    check: shapes and dtypes only).

    ``refs`` maps argument names to what a kernel receives as one ref each; a
    `CachePlane` stands for its whole stacked cache, which is what the kernels address.
    A ref that `plans.narrow_offsets_overflow` flags (``2**31`` to ``2**32`` one-byte
    elements: an fp8 cache of 2 to 4 GiB) would get wrapping 32-bit element offsets
    from Pallas' Triton lowering, unless `jax_paged_attn.kernels.triton_offsets` has
    widened them; only when it could not (a JAX it was not checked against) is there a
    reason.
    """
    for name, x in refs.items():
        if x is None:
            continue
        stacked = isinstance(x, CachePlane)
        array = stored_array(x)
        if not plans.narrow_offsets_overflow(tuple(array.shape), array.dtype):
            continue
        from jax_paged_attn.kernels import triton_offsets  # installs the fix on first import

        if triton_offsets.INSTALLED:
            return None
        elements, dtype = math.prod(array.shape), jnp.dtype(array.dtype)
        what = f"a plane of a stacked cache of {elements}" if stacked else f"{elements}"
        return (f"{name} is {what} {dtype.name} elements ({elements * dtype.itemsize} bytes, one ref in the "
                f"kernel): Pallas' Triton lowering addresses a ref of at most 4 GiB with "
                f"signed 32-bit element offsets, which reach 2**31 elements only, and their widening to 64 bits "
                f"(jax_paged_attn.kernels.triton_offsets) is not installed: {triton_offsets.REASON}")
    return None
