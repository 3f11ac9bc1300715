"""Weight-streaming matmul for decode-sized batches: the Pallas kernel and its
`pallas_call` (Triton lowering).

``y[M, N] = x[M, K] @ w[K, N]`` for a few rows (``M`` <= 128; the dot's rows are ``M``
rounded up to a power of 2 >= 16, the missing ones masked in the kernel, as a separate
pad and slice cost two kernel launches per product in a decode step). Such a product reads each weight once and does little math per
byte, so it runs at the pace of its weight reads; the kernel is laid out for that:

* one program computes ``block_n`` output columns over one of ``split_k`` equal
  ranges of ``K`` (the split is what lets a narrow ``N`` keep every SM reading);
* it walks its range ``block_k`` rows of ``w`` at a time (each row segment is
  ``block_n`` contiguous elements), in a loop Triton's pipeliner keeps
  ``num_stages - 1`` weight tiles in flight for;
* weight tiles are loaded with an eviction hint (they are read once per step, and the
  activations and the KV cache are the data worth keeping in L2);
* ``x`` and ``w`` are whole-array refs the program addresses itself, so ``K`` and ``N``
  need only be multiples of the tile, not powers of 2.

With one split the program writes ``y`` in the output dtype; with several it writes
its float32 partial product, summed by the caller.

The gated form (``tiling.gated``, a gated MLP's gate/up projection) multiplies by
``w[K, 2, I]``: a program reads the same ``block_n`` columns of the gate half and of
the up half and writes ``act(x @ w_gate) * (x @ w_up)`` (``tiling.activation``: SwiGLU's
SiLU or GeGLU's tanh GELU; one split: the activation needs the whole sum), so the
product's ``[M, 2, I]`` output never goes to memory.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged_attn.plans import MatmulTiling

Array = jax.Array


def _matmul_kernel(x_ref, w_ref, o_ref, *, tiling: MatmulTiling, k_per_split: int):
    # x_ref: [M, K] whole; w_ref: [K, N] whole (gated: [K, 2 * I], gate columns then up
    # columns); o_ref: [M, N] whole in the output dtype (one split), or the f32
    # [split_k, M, N] partials. M may be below tiling.rows: the dot's missing rows are
    # loaded as zeros and never stored, so the caller neither pads x nor slices the output.
    num_rows = x_ref.shape[0]
    block_k, block_n = tiling.block_k, tiling.block_n
    col0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
    k0 = pl.program_id(1) * k_per_split
    halves = [pl.ds(col0, block_n)]
    if tiling.gated:
        halves.append(pl.ds(col0 + w_ref.shape[1] // 2, block_n))
    row = lax.iota(jnp.int32, tiling.rows)
    row_ok = (row < num_rows)[:, None] if num_rows < tiling.rows else None
    k_offsets = lax.iota(jnp.int32, block_k)

    # float32 operands: full-precision products, not TF32 (a float32 model asks for that)
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def step(i, accs):
        k = pl.multiple_of(k0 + i * block_k, block_k)
        if row_ok is None:
            x = x_ref[:, pl.ds(k, block_k)]
        else:
            x = plgpu.load(x_ref.at[row[:, None], (k + k_offsets)[None, :]], mask=row_ok, other=0)
        return tuple(
            acc + plgpu.dot(x, plgpu.load(w_ref.at[pl.ds(k, block_k), cols], eviction_policy=tiling.eviction_policy),
                            precision=precision)
            for acc, cols in zip(accs, halves))

    zeros = tuple(jnp.zeros((tiling.rows, block_n), jnp.float32) for _ in halves)
    accs = lax.fori_loop(0, k_per_split // block_k, step, zeros)
    if tiling.gated:
        gate, up = accs
        if tiling.activation == "gelu_pytorch_tanh":
            out = jax.nn.gelu(gate, approximate=True) * up
        else:
            out = gate * jax.nn.sigmoid(gate) * up
    else:
        out = accs[0]
    col = col0 + lax.iota(jnp.int32, block_n)
    index = (row[:, None], col[None, :])
    target = o_ref.at[index] if tiling.split_k == 1 else o_ref.at[(pl.program_id(1), *index)]
    plgpu.store(target, out.astype(o_ref.dtype), mask=None if row_ok is None else jnp.broadcast_to(row_ok, out.shape))


def matmul_call(x: Array, w: Array, tiling: MatmulTiling, *, out_dtype, interpret: bool = False) -> Array:
    """``x`` ``[M, K]`` (``M`` at most ``tiling.rows``), ``w`` ``[K, N]`` -> ``[M, N]`` in
    ``out_dtype`` (one split) or the float32 partials ``[split_k, M, N]``; gated
    (``tiling.gated``, one split): ``w`` ``[K, 2 * I]`` -> ``act(x @ w[:, :I]) * (x @
    w[:, I:])`` ``[M, I]``, ``act`` the tiling's activation.

    The wrapper (`jax_paged_attn.matmul`) has checked that ``block_n`` divides ``N``
    (gated: ``I``) and ``split_k * block_k`` divides ``K``."""
    rows, depth = x.shape
    cols = w.shape[1] // 2 if tiling.gated else w.shape[1]
    if tiling.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((rows, cols), out_dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((tiling.split_k, rows, cols), jnp.float32)
    kernel = functools.partial(_matmul_kernel, tiling=tiling, k_per_split=depth // tiling.split_k)
    return pl.pallas_call(  # whole-array refs: the kernel addresses them itself
        kernel,
        out_shape=out_shape,
        grid=(cols // tiling.block_n, tiling.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="weight_streaming_matmul",
    )(x, w)
