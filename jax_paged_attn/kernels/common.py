"""Helpers shared by the kernel bodies (jax.numpy / lax only: any Pallas lowering).

* Base-2 softmax constants: `LOG2E` (from `jax_paged_attn.plans`, which also scales
  the ALiBi slopes with it) and `LN_2`; `RUNNING_MAX_INIT`, the running max of a row
  that has seen no key yet.
* Integer division of non-negative int32 indices: `div`, `rem`, `cdiv`.
* Tile masks: `col_mask` (head-dim padding), `rows_and_cols` (a row mask times it).
* Optional inputs, one convention for every kernel: an absent optional input (ALiBi
  slopes, fp8 scales, a block table) is left out of the ``pallas_call`` operands
  (`append_optional`), never passed as a dummy array, and the kernel body takes the
  present ones, in order, from the refs after its fixed inputs (`pop_optional`), None
  for an absent one; the static flags saying which are present are kernel arguments.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_paged_attn.plans import LOG2E

Array = jax.Array

__all__ = ["LOG2E", "LN_2", "RUNNING_MAX_INIT", "div", "rem", "cdiv", "col_mask", "rows_and_cols",
           "append_optional", "pop_optional"]

LN_2 = math.log(2.0)
"""Converts a base-2 log-sum-exp back to natural log."""

RUNNING_MAX_INIT = float(jnp.finfo(jnp.float32).min)
"""Running max of a row that has seen no key. Finite (not -inf), so that
``exp2(m_old - m_new)`` never computes ``-inf - -inf = NaN`` for a fully masked row and
``exp2(-inf - init)`` of a masked score is exactly 0."""


def div(x: Array, divisor: int) -> Array:
    """``x // divisor`` for non-negative int32 ``x`` (lax.div: no floor-division fixups)."""
    return lax.div(x, jnp.int32(divisor))


def rem(x: Array, divisor: int) -> Array:
    """``x % divisor`` for non-negative int32 ``x``."""
    return lax.rem(x, jnp.int32(divisor))


def cdiv(x: Array, divisor: int) -> Array:
    """``ceil(x / divisor)`` for non-negative int32 ``x``."""
    return div(x + (divisor - 1), divisor)


def col_mask(padded_head_size: int, head_size: int) -> tuple[Array, Array | None]:
    """``(col, col_ok)``: the head-dim column indices ``[Dp]`` of a tile and the mask of
    the real ones, None when the head size is not padded."""
    col = lax.iota(jnp.int32, padded_head_size)
    return col, (None if padded_head_size == head_size else col < head_size)


def rows_and_cols(row_mask: Array | None, col_ok: Array | None, rows: int, cols: int) -> Array | None:
    """``[rows, cols]`` load / store mask from a ``[rows]`` row mask and a ``[cols]`` (or
    already expanded ``[1, cols]``) column mask, either None for all-true; None when
    both are."""
    def expanded(cols_mask: Array) -> Array:
        return cols_mask[None, :] if cols_mask.ndim == 1 else cols_mask

    if row_mask is None and col_ok is None:
        return None
    if row_mask is None:
        return jnp.broadcast_to(expanded(col_ok), (rows, cols))
    mask = jnp.broadcast_to(row_mask[:, None], (rows, cols))
    return mask if col_ok is None else mask & expanded(col_ok)


def append_optional(inputs: list, array: Array | None, in_specs: list | None = None, spec=None) -> None:
    """Adds an optional ``pallas_call`` operand (and its BlockSpec to ``in_specs``, when
    the call has them); nothing when ``array`` is None."""
    if array is not None:
        inputs.append(array)
        if in_specs is not None:
            in_specs.append(spec)


def pop_optional(refs: list, present: bool):
    """The next optional input ref from the kernel's remaining refs, or None when absent."""
    return refs.pop(0) if present else None
