"""64-bit element offsets for Pallas Triton refs of ``2**31`` elements and more.

Why a private function of JAX is wrapped. Pallas' Triton lowering turns every ref
access into a pointer plus a tensor of flat element offsets, computed by
``jax._src.pallas.triton.lowering._compute_offsets_from_indices``. It picks the offset
width from the ref's size *in bytes*: 64 bits above ``2**32`` bytes, signed 32 bits
otherwise. The offsets count *elements*, so a ref of 1-byte elements holding ``2**31``
to ``2**32`` of them (an fp8 KV cache of 2 to 4 GiB) gets 32-bit offsets that wrap
negative past ``2**31 - 1``: the kernels would read and write the wrong memory. The
paged caches reach that size in practice (one stacked ``[2, num_blocks, block_size,
Hk, D]`` fp8 layer of a large model), and every kernel here addresses the whole stacked
cache as one ref (`jax_paged_attn.kv_view`). No public option of Pallas changes the
width, so this module wraps that function.

What the wrapper does. For a ref that `plans.narrow_offsets_overflow` flags (``2**31``
elements or more, at most 4 GiB) it calls the original with the same ``BlockInfo``
except for the dtype of ``full_shape_dtype``, replaced by a 4-byte dtype of the same
shape. The original uses that dtype for nothing but the byte size behind the width
choice (checked below, on its source, before installing), so the offsets come out the
same, only computed in 64 bits. Every other ref is passed through untouched. The
wrapper therefore only ever widens offsets: it cannot change any kernel's results
except by removing the overflow (a kernel with a smaller ref keeps its 32-bit offsets
and its register use).

Guard. The wrapper is installed once, on import of `jax_paged_attn.kernels` (importing
a kernel module imports the package first), and only when JAX's code is the one it was
written against: the function's source must size the decision as
``math.prod(full_shape) * array_dtype.itemsize`` compared with ``2**32``, must read the
dtype of ``full_shape_dtype`` exactly once and ``block_info`` only through its fields;
every use of the name in the lowering module must be a call looked up in the module's
globals from inside a function (so replacing the module attribute reaches every
caller), and ``BlockInfo`` must be a dataclass (the wrapper replaces one field).
Checked against jax 0.10.2 and 0.11.2, whose function is the same. When anything
differs (a later JAX), nothing is installed: `INSTALLED` is False, `REASON` says why,
and the wrappers keep such caches off the kernels
(`jax_paged_attn.checks.narrow_offsets_reason`: auto runs the XLA path and says so
once, an explicit ``implementation="triton"`` raises).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any, Callable

import jax.numpy as jnp

from jax_paged_attn import plans

_NAME = "_compute_offsets_from_indices"
_MARK = "_jax_paged_attn_widens_offsets"  # set on the wrapper: installing twice is a no-op
_WIDE_DTYPE = jnp.dtype(jnp.int32)  # 4 bytes: 2**31 elements of it are > 2**32 bytes

INSTALLED: bool = False
"""Whether the lowering now addresses refs of ``2**31`` elements and more with 64-bit offsets."""

REASON: str = "not installed yet"
"""Why `INSTALLED` is False ("" once installed)."""


def _source_mismatch(fn: Callable[..., Any]) -> str | None:
    """Why ``fn`` is not the offsets function the wrapper was written for, or None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {_NAME} cannot be read ({e})"
    func = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(func, ast.FunctionDef) or [a.arg for a in func.args.args] != ["block_info", "nd_indexer"]:
        return f"{_NAME} no longer takes (block_info, nd_indexer)"
    text = " ".join(ast.unparse(func).split())
    for expected in ("full_size = math.prod(full_shape) * array_dtype.itemsize",
                     "ir.IntegerType.get_signless(64 if full_size > 2 ** 32 else 32)"):
        if expected not in text:
            return f"{_NAME} no longer chooses the offset width by '{expected}'"
    parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    dtype_reads = 0
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and node.id == "block_info":
            parent = parents.get(node)
            if not (isinstance(parent, ast.Attribute)
                    and parent.attr in ("full_shape_dtype", "block_shape", "start_indices")):
                return f"{_NAME} passes block_info on or reads another field of it"
        if isinstance(node, ast.Attribute) and node.attr == "full_shape_dtype":
            parent = parents.get(node)
            if not (isinstance(parent, ast.Attribute) and parent.attr in ("shape", "dtype")):
                return f"{_NAME} uses full_shape_dtype for more than its shape and dtype"
            dtype_reads += parent.attr == "dtype"
        if isinstance(node, ast.Name) and node.id == "array_dtype" and isinstance(node.ctx, ast.Load):
            parent = parents.get(node)
            if not (isinstance(parent, ast.Attribute) and parent.attr == "itemsize"):
                return f"{_NAME} uses the ref's dtype for more than its item size"
    if dtype_reads != 1:
        return f"{_NAME} reads the ref's dtype {dtype_reads} times, not once"
    return None


def _callers_mismatch(module: Any) -> str | None:
    """Why replacing ``module``'s attribute might not reach every caller, or None."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {module.__name__} cannot be read ({e})"
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == _NAME]
    calls = []
    for top in tree.body:
        if isinstance(top, ast.FunctionDef) and top.name != _NAME:
            local = {a.arg for a in ast.walk(top.args) if isinstance(a, ast.arg)}
            if _NAME in local:
                return f"{top.name} takes {_NAME} as an argument"
            calls += [n.func for stmt in top.body for n in ast.walk(stmt)
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == _NAME]
    if not calls:
        return f"no function of {module.__name__} calls {_NAME}"
    if len(calls) != len(uses):  # a use outside a call inside a function body: bound early
        return f"{module.__name__} refers to {_NAME} other than by calling it from a function"
    return None


def _widened(original: Callable[..., Any], shaped_array: type) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if plans.narrow_offsets_overflow(tuple(aval.shape), aval.dtype):
            # Same shape, 4-byte dtype: only the byte size behind the width choice changes.
            block_info = dataclasses.replace(block_info, full_shape_dtype=shaped_array(aval.shape, _WIDE_DTYPE))
        return original(block_info, nd_indexer)

    setattr(compute_offsets, _MARK, True)
    return compute_offsets


def install() -> bool:
    """Installs the wrapper (once; later calls change nothing) and returns `INSTALLED`."""
    global INSTALLED, REASON
    try:
        from jax._src.pallas.triton import lowering
    except Exception as e:  # any failure to import means: no Triton lowering here to fix
        INSTALLED, REASON = False, f"Pallas' Triton lowering cannot be imported ({type(e).__name__}: {e})"
        return INSTALLED
    current = getattr(lowering, _NAME, None)
    if getattr(current, _MARK, False):
        INSTALLED, REASON = True, ""
        return INSTALLED
    if current is None:
        problem = f"{lowering.__name__} has no {_NAME}"
    else:
        problem = _source_mismatch(current) or _callers_mismatch(lowering)
    shaped_array = getattr(getattr(lowering, "jax_core", None), "ShapedArray", None)
    block_info = getattr(lowering, "BlockInfo", None)
    if problem is None and shaped_array is None:
        problem = f"{lowering.__name__} does not import jax's core as jax_core"
    if problem is None and not (dataclasses.is_dataclass(block_info) and "full_shape_dtype" in
                                {f.name for f in dataclasses.fields(block_info)}):
        problem = "its BlockInfo is not a dataclass with a full_shape_dtype field"
    if problem is not None:
        INSTALLED, REASON = False, f"this JAX's Pallas Triton lowering differs from the one checked: {problem}"
        return INSTALLED
    setattr(lowering, _NAME, _widened(current, shaped_array))
    INSTALLED, REASON = True, ""
    return INSTALLED


install()
