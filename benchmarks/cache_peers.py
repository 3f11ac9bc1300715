"""The cache suite's implementations: ``reshape_and_cache_flash`` (ours, our XLA path)
beside an XLA scatter and two copy ceilings (torch ``copy_``, a jitted elementwise op).

Owns: the donated-cache step every cache write is timed through (`DonatedStep`), the
rows a write must leave in the cache (`expected_cache_rows`, what every cache row is
checked against) and the suite's columns (`CACHE_IMPLS`).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from peers import Impl
from suites import CacheCase, CacheInputs
from timing import Context, Measurement, to_numpy

Array = jax.Array


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
