"""In-place views of the K and V halves of a stacked paged cache.

A layer's cache is one array ``[2, num_blocks, block_size, Hk, D]`` (index 0 keys, 1
values; `jax_paged_attn.cache.get_kv_cache_shape`). Slicing ``kv_cache[0]`` in JAX makes
a new array, and XLA materializes such a slice when it feeds a custom call (a Pallas
kernel): every layer of every step would copy half its cache. `CachePlane` names one
half *without slicing*: the kernels receive the whole stacked array and address the
plane themselves (a block index on the leading axis), so nothing is copied.

A `CachePlane` looks like the 4-D array it stands for (``shape``, ``dtype``, ``ndim``,
``size``), so shape checks treat it as a cache ``[num_blocks, block_size, Hk, D]``; the
pure-jnp reference reads `CachePlane.materialize` (inside XLA, where the slice fuses into
the gather that reads it).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CachePlane:
    """Plane ``plane`` of ``array`` ``[planes, num_blocks, block_size, Hk, D]``, read in place.

    Attributes:
      array: the stacked cache (a pytree leaf, traced under jit).
      plane: which leading index this view is (static).
    """

    array: Array
    plane: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return 4

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def materialize(self) -> Array:
        """The plane as an array ``[num_blocks, block_size, Hk, D]`` (a slice: a copy
        where it feeds a custom call; free where XLA fuses it into its reader)."""
        return self.array[self.plane]


def cache_planes(kv_cache: Array) -> tuple[CachePlane, CachePlane]:
    """``(keys, values)`` views of a stacked cache ``[2, num_blocks, block_size, Hk, D]``.

    Pass them as ``k_cache`` / ``v_cache`` (or ``k`` / ``v`` with a ``block_table``) to
    `flash_attn_with_kvcache` / `flash_attn_varlen_func`: the kernels then read the
    stacked cache in place instead of a copy of each half.
    """
    if getattr(kv_cache, "ndim", None) != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got shape "
            f"{getattr(kv_cache, 'shape', None)}.")
    return CachePlane(kv_cache, 0), CachePlane(kv_cache, 1)


def as_plane(cache: Array | CachePlane) -> CachePlane:
    """A `CachePlane` for a 4-D cache (a free reshape to one plane) or the plane itself."""
    if isinstance(cache, CachePlane):
        return cache
    return CachePlane(cache.reshape(1, *cache.shape), 0)


def stored_array(x: Array | CachePlane) -> Array:
    """The array a kernel addresses for ``x``: a `CachePlane`'s whole stacked cache, or
    ``x`` itself."""
    return x.array if isinstance(x, CachePlane) else x


def materialize(x: Array | CachePlane | None) -> Array | None:
    """The array a (possible) `CachePlane` stands for; other values unchanged."""
    return x.materialize() if isinstance(x, CachePlane) else x
