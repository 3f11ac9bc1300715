"""Test-only: what jax 0.10.2's Mosaic GPU interpreter lacks and jax 0.11 has.

The Mosaic GPU decode kernel (`jax_paged_attn.kernels.mosaic_decode`) uses two things
jax 0.10.2's interpreter (``jax._src.pallas.mosaic_gpu.interpret``) cannot run, and
jax 0.11's runs: a wgmma whose shared-memory operand carries a transpose (its Q K^T),
and ``layout_cast`` (a register-layout hint, the identity on values). `install` teaches
the 0.10.2 interpreter both, so CI (jax 0.10.2 on a CPU) interprets that kernel too; on
jax >= 0.11 it does nothing. Nothing in the package imports this module.

The wgmma callback below is 0.10.2's own (read the operands from the interpreter's
shared memory, add ``a @ b`` to the accumulator) with the transpose applied to an operand
that has one, as 0.11's callback does.
"""
from __future__ import annotations

import jax
import numpy as np

_installed = False


def _split_transpose(transforms) -> tuple[tuple, tuple[int, ...] | None]:
    """(the indexing transforms, the permutation of a trailing transpose or None)."""
    from jax._src.state import types as state_types

    rest, permutation = [], None
    for transform in tuple(transforms):
        if isinstance(transform, state_types.TransposeTransform):
            assert permutation is None, "one transpose per operand"
            permutation = tuple(int(p) for p in transform.permutation)
        else:
            assert permutation is None, "indexing after a transpose"
            rest.append(transform)
    return tuple(rest), permutation


def install() -> None:
    global _installed
    if _installed or jax.__version_info__ >= (0, 11):
        return
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu import core as mosaic_core
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        device_id, thread_id = int(device_id), int(thread_id)
        key = callbacks.HostAllocationKey.from_array
        acc_key, a_key, b_key = key(acc_allocation_key_as_array), key(a_allocation_key_as_array), \
            key(b_allocation_key_as_array)
        a_index, a_perm = _split_transpose(callbacks._remove_noop_transforms(a_transforms))
        b_index, b_perm = _split_transpose(callbacks._remove_noop_transforms(b_transforms))
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
    mlir.register_lowering(mosaic_core.layout_cast_p,
                           mlir.lower_fun(lambda x, new_layout: x, multiple_results=False))
    _installed = True
