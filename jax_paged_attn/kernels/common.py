"""Helpers shared by the kernel bodies (jax.numpy / lax only: any Pallas lowering).

* Base-2 softmax constants: `LOG2E` (from `jax_paged_attn.plans`, which also scales
  the ALiBi slopes with it) and `LN_2`; `RUNNING_MAX_INIT`, the running max of a row
  that has seen no key yet.
* Integer division of non-negative int32 indices: `div`, `rem`, `cdiv`.
* Tile masks: `col_mask` (head-dim padding), `rows_and_cols` (a row mask times it).
* `exp2_fma`: 2**x for the softmax's x <= 0 from adds, multiplies and integer bits (the
  FMA and ALU pipes) instead of the XU's exp2.
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
           "append_optional", "pop_optional", "exp2_fma"]

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


EXP2_FMA_COEFFS = (0.6932829, 0.24221037, 0.05500858)
"""``c1, c2, c3`` of ``1 + c1 f + c2 f^2 + c3 f^3`` ~ 2**f on [-1/2, 1/2] (fitted for the
least largest relative error with the constant term fixed at 1, so 2**0 is exactly 1):
relative error <= 1.02e-4 over the range, 26x under a bf16 probability's rounding."""

_ROUND_MAGIC = 12582912.0
"""1.5 * 2**23: ``x + it`` rounds x (|x| < 2**22) to an integer held in the sum's low
mantissa bits, with no float-to-int conversion (a conversion runs on the XU)."""


def exp2_fma(x: Array) -> Array:
    """2**x of f32 ``x <= 0`` (the softmax's ``s - max``), computed without the XU's exp2:
    x rounded to j + f (j an integer, |f| <= 1/2) by adding and subtracting
    `_ROUND_MAGIC`, 2**f by a cubic in Horner form (`EXP2_FMA_COEFFS`), 2**j added to its
    exponent bits: integer arithmetic on the bit patterns (the sum's low bits are j; shifted
    23 left they are j in the exponent field, two's complement wrapping included).

    Why: at head size 64 a prefill block's exp2 keeps the XU as busy as its matmuls keep
    the tensor cores (benchmarks/NOTES.md, 2026-12-05), so taking part of a block's
    exponentials to the FMA pipe (FlashAttention-4's split) shortens its softmax.

    x below -126 gives 2**-126 (the least normal float), not less, so it is for scores
    that some key of the row reaches (an unmasked block: no -inf); relative error <=
    1.02e-4 above it. A NaN x gives NaN or an arbitrary finite value: the caller keeps
    NaN rows NaN through their running max (a row whose max is NaN is NaN whatever its
    probabilities)."""
    x = jnp.maximum(x, -126.0)
    # The barrier keeps a compiler from folding (x + magic) - magic into x (XLA's does).
    shifted = lax.optimization_barrier(x + _ROUND_MAGIC)
    frac = x - (shifted - _ROUND_MAGIC)
    c1, c2, c3 = EXP2_FMA_COEFFS
    poly = ((c3 * frac + c2) * frac + c1) * frac + 1.0
    bits = lax.bitcast_convert_type(poly, jnp.int32) + lax.shift_left(
        lax.bitcast_convert_type(shifted, jnp.int32), jnp.int32(23))
    return lax.bitcast_convert_type(bits, jnp.float32)


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


NONFINITE_SUM_SCALE = 2.0 ** -9
"""Scales a key's values before summing them over the head dim (at most 256 columns):
any sum of finite values stays finite (256 * f32 max * 2**-9 = f32 max / 2), so a
non-finite sum means a non-finite value. A power of 2: the scaling itself is exact."""


def nonfinite_rows(v: Array, *more_columns: Array, channel_axis: int = 1) -> Array:
    """bool ``[N]``: row ``n`` of ``v`` ``[N, D]`` (with the same rows of ``more_columns``,
    further column chunks of one row of at most 256 columns in all) holds a NaN / inf.
    The row is summed scaled by `NONFINITE_SUM_SCALE` (a sum of finite values stays
    finite), and ``x - x`` is 0 for a finite sum, NaN otherwise: no ``isfinite``, which
    the Mosaic GPU lowering has no rule for. ``channel_axis=0`` reads ``v`` transposed,
    ``[D, N]``, one row a column."""
    total = jnp.sum(v.astype(jnp.float32) * NONFINITE_SUM_SCALE, axis=channel_axis)
    for columns in more_columns:
        total = total + jnp.sum(columns.astype(jnp.float32) * NONFINITE_SUM_SCALE, axis=channel_axis)
    return (total - total) != 0


def nan_rows_scale(inv_sum: Array, acc: Array, *more_columns: Array, channel_axis: int = 1) -> Array:
    """The output's row scale ``inv_sum`` f32 ``[M]`` (1 / softmax denominator), NaN for
    each row whose accumulator ``acc`` ``[M, D]`` (and ``more_columns``, its further column
    chunks) holds a NaN / inf in any channel, so that the whole row of the output is NaN.

    The package's NaN rule (`jax_paged_attn.reference`): a non-finite K or V value that a
    query sees makes its whole (query, head) row NaN. A non-finite score does that by
    itself (the softmax's max and sum), and masked tiles flag rows that see a non-finite
    value (`quarantine_nonfinite_values`), but P·V over an unmasked tile puts a
    non-finite value only into its own channel: this row check, once per output tile
    after the KV loop, finishes those rows. It costs one scaled row sum of the
    accumulator per output tile, nothing inside the KV loop."""
    return jnp.where(nonfinite_rows(acc, *more_columns, channel_axis=channel_axis), jnp.nan, inv_sum)


def wgmma_accumulator_load(acc_ref, *, wait_n: int) -> Array:
    """The value of a wgmma accumulator once at most ``wait_n`` wgmma groups are still in
    flight (``acc_ref[...]`` waits for all of them): ``plgpu.wgmma_accumulator_load`` where
    jax exports it, else its private home (jax 0.10 and 0.11 have it there)."""
    from jax._src.pallas.mosaic_gpu import primitives
    from jax.experimental.pallas import mosaic_gpu as plgpu

    load = getattr(plgpu, "wgmma_accumulator_load", None) or getattr(primitives, "wgmma_accumulator_load", None)
    if load is None:
        raise NotImplementedError(
            f"jax {jax.__version__}'s Mosaic GPU has no wgmma_accumulator_load: use the Mosaic GPU prefill "
            "with MosaicPrefillConfig.overlap_softmax=False.")
    return load(acc_ref, wait_n=wait_n)


def mosaic_smem_union(*groups: tuple, interpret: bool) -> object:
    """Scratch entry for shared-memory ref groups with disjoint lifetimes: a
    ``plgpu.RefUnion`` (the groups share memory), but separate buffers in the Mosaic GPU
    interpreter of jax 0.10, which rejects the aliasing transform (the interpreter has
    no shared-memory limit to respect). Either way the kernel unpacks it as ``groups``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpret and tuple(int(part) for part in jax.__version__.split(".")[:2]) < (0, 11):
        return groups
    return plgpu.RefUnion(*groups)


def mosaic_interpret_params() -> object:
    """Mosaic GPU interpret-mode parameters (``InterpretGPUParams``): public as
    ``plgpu.InterpretGPUParams`` from jax 0.11, only internal in jax 0.10. Every Mosaic
    GPU kernel run in interpret mode asks for them first, so on jax 0.10 this is where
    the interpreter learns what the kernels need of it (`_teach_jax010_mosaic_interpreter`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        _teach_jax010_mosaic_interpreter()
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


_jax010_mosaic_interpreter_taught = False


def _teach_jax010_mosaic_interpreter() -> None:
    """Gives jax 0.10's Mosaic GPU interpreter the two things the Mosaic GPU kernels use
    and only jax 0.11's interpreter runs: a wgmma whose shared-memory operand carries a
    transpose (decode's Q K^T), and a CPU rule for ``layout_cast`` (a register-layout
    hint, the identity on values). Without them interpret mode fails on jax 0.10 (no
    MLIR rule for ``layout_cast`` on cpu). It also gets jax 0.11's compile-once run of a
    simulated thread (`_run_thread_jaxpr`). Only jax < 0.11 calls this (jax 0.11 has
    public ``InterpretGPUParams`` and both features), once per process; the compiled
    kernels never go through the interpreter, so nothing changes for them.

    The wgmma callback is jax 0.10's own (read the operands from the interpreter's shared
    memory, add ``a @ b`` to the accumulator) with the transpose applied to the operand
    that has one, as jax 0.11's callback does. It replaces the module attribute that the
    interpreter looks up at each wgmma."""
    global _jax010_mosaic_interpreter_taught
    if _jax010_mosaic_interpreter_taught:
        return
    import numpy as np
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu import core as mosaic_core
    from jax._src.pallas.mosaic.interpret import thread_map
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks
    from jax._src.state import types as state_types

    def split_transpose(transforms) -> tuple[tuple, tuple[int, ...] | None]:
        """(the indexing transforms, the permutation of a trailing transpose or None)."""
        rest, permutation = [], None
        for transform in tuple(transforms):
            if isinstance(transform, state_types.TransposeTransform):
                if permutation is not None:
                    raise NotImplementedError("a wgmma operand with two transposes")
                permutation = tuple(int(p) for p in transform.permutation)
            elif permutation is not None:
                raise NotImplementedError("a wgmma operand indexed after its transpose")
            else:
                rest.append(transform)
        return tuple(rest), permutation

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        device_id, thread_id = int(device_id), int(thread_id)
        key = callbacks.HostAllocationKey.from_array
        acc_key, a_key, b_key = key(acc_allocation_key_as_array), key(a_allocation_key_as_array), \
            key(b_allocation_key_as_array)
        a_index, a_perm = split_transpose(callbacks._remove_noop_transforms(a_transforms))
        b_index, b_perm = split_transpose(callbacks._remove_noop_transforms(b_transforms))
        acc_index = jax.tree.map(int, callbacks._remove_noop_transforms(acc_transforms))
        memory = callbacks._get_shared_memory()
        thread = memory.get_global_thread_id(device_id, thread_id)
        log = interpret_utils.GPULoggingInfo(device_id=device_id, thread_id=thread_id, source_info=source_info,
                                             grid_point_coords=tuple(int(x) for x in grid_point_coords))
        a, _, _ = memory.get_buffer_content(a_key, interpret_utils.to_range(jax.tree.map(int, a_index)), thread,
                                            logging_info=log)
        b, _, _ = memory.get_buffer_content(b_key, interpret_utils.to_range(jax.tree.map(int, b_index)), thread,
                                            logging_info=log)
        a = np.transpose(a, a_perm) if a_perm else a
        b = np.transpose(b, b_perm) if b_perm else b
        acc_range = interpret_utils.to_range(acc_index)
        acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=log)
        result = acc + np.matmul(a.astype(np.float32), b.astype(np.float32), dtype=acc_dtype)
        memory.store_buffer_content(acc_key, acc_range, result, thread, logging_info=log)
        return token

    callbacks.wgmma = wgmma
    mlir.register_lowering(mosaic_core.layout_cast_p, mlir.lower_fun(lambda x, new_layout: x, multiple_results=False))
    thread_map._run_jaxpr = _run_thread_jaxpr
    _jax010_mosaic_interpreter_taught = True


def _eval_thread_jaxpr(jaxpr, consts, *args) -> None:
    jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_thread_jaxpr(jaxpr, consts, *args) -> None:
    """One simulated thread (warpgroup) of a grid program, for jax 0.10's Mosaic GPU
    interpreter. Its own version jits a function it defines anew at each call, so every
    thread of every grid program traced, lowered and compiled the kernel body again (two
    thirds of a warp-specialized decode kernel's interpret time). A function defined once
    lets JAX's caches serve the same body, as jax 0.11's interpreter does; each thread
    still runs an AOT-compiled call, since the threads wait on each other at barriers."""
    compiled = jax.jit(_eval_thread_jaxpr, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
    compiled(consts, *args)


def quarantine_nonfinite_values(masked_scores: Array, v: Array, correction: Array
                                ) -> tuple[Array, Array]:
    """``(v, correction)`` for a masked tile's P·V step, so a NaN / inf value reaches only
    the rows that see its key (the kernels' form of
    `jax_paged_attn.reference.hide_masked_nonfinite_values`).

    masked_scores: f32 ``[M, N]`` scores, ``-inf`` where the mask hides the key;
    v: ``[N, D]`` values; correction: f32 ``[M]`` the rescale of the running output.
    Values of keys holding a non-finite value become 0 (a hidden key's probability is 0,
    and 0 * NaN would reach every row), and the correction of a row that sees such a key
    becomes NaN, which makes that row's running output NaN for good.

    Unlike the reference's form, which keeps the ``[M, N]`` visibility mask alive across
    the softmax and rewrites ``[M, N]`` probabilities, the extra state here is two
    vectors (which keys are bad, which rows see one) and one ``[N, D]`` select on the
    values. On the H200 neither form, in full-width masked steps, avoided slowing the
    Triton prefill kernel by 20-40 % (benchmarks/NOTES.md).
    """
    bad_key = nonfinite_rows(v)  # [N]
    v = jnp.where(bad_key[:, None], jnp.zeros_like(v), v)
    seen_bad = jnp.max(jnp.where(bad_key[None, :], masked_scores, -jnp.inf), axis=1)  # [M]
    # A visible score is > -inf (NaN when the key itself is NaN: that row's max is NaN anyway).
    correction = jnp.where(seen_bad > -jnp.inf, jnp.nan, correction)
    return v, correction
