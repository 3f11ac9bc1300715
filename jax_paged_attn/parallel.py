"""Tensor parallelism over attention heads (Megatron-style), with `jax.sharding`.

Layout on a mesh with a tensor-parallel axis (default name ``"tp"``) of size ``tp``:

* the fused q/k/v projection and the MLP's fused gate / up projection are column-
  parallel: their kernels are sharded on an output axis, so each device computes the
  heads (and the MLP columns) it owns. ``qkv_proj.kernel`` ``[hidden, Hk, Hq/Hk + 2, D]``
  is sharded on its KV-head axis (``P(None, "tp", None, None)``): device ``i`` computes
  KV heads ``[i*Hk/tp, (i+1)*Hk/tp)`` with their GQA groups of query heads, exactly the
  heads its attention shard reads. ``gate_up_proj.kernel`` ``[hidden, 2, intermediate]``
  is sharded on the intermediate axis (``P(None, None, "tp")``): each device's gate and
  up columns pair up;
* o_proj and down_proj are row-parallel (``P("tp", None)``): each device multiplies its
  slice of the contraction axis and XLA inserts the all-reduce (the ``psum``);
* the LM head is column-parallel over the vocabulary when it divides by ``tp``;
  embeddings and norms are replicated;
* each layer's KV cache ``[2, num_blocks, block_size, Hk, D]`` is sharded by KV head
  (axis 3): device ``i`` holds KV heads ``[i*Hk/tp, (i+1)*Hk/tp)``, which serve query
  heads ``[i*Hq/tp, (i+1)*Hq/tp)`` (GQA groups never straddle devices);
* with fewer KV heads than devices (``tp % Hk == 0``, vLLM's scheme) each KV head is
  replicated on ``r = tp // Hk`` devices (`kv_head_replicas`): the model stores ``Hk * r =
  tp`` KV heads, in the kernel ``[hidden, tp, Hq/tp + 2, D]`` (`replicate_kv_heads`) and
  in the caches ``[2, num_blocks, block_size, tp, D]``, one a device; device ``d`` holds
  KV head ``d // r`` and query heads ``[d*Hq/tp, (d+1)*Hq/tp)``, which all use it. The
  model's config keeps the checkpoint's ``Hk`` (the replication follows from the mesh:
  ``LlamaForCausalLM.kv_head_replicas``), checkpoints load each device's copy from the
  same rows and save one copy;
* the attention call itself (`jax_paged_attn.layer.paged_attention`, whose Pallas
  kernels XLA cannot partition) runs under `jax.shard_map` on each device's heads
  (`head_parallel`), and so does the fused rotary embedding + cache write on each
  device's KV heads (`kv_head_parallel`); the attention metadata is replicated.

The matmuls are partitioned by XLA's SPMD partitioner from the parameter shardings
(`param_sharding`; a model built with ``mesh=`` creates each parameter's shards on their
devices, `init_sharded`; `shard_model` places an existing model's), inside or outside
`jax.jit`; only attention is manually partitioned.
Requirements: ``Hq`` divisible by ``tp``, and ``Hk`` either divisible by ``tp`` or
smaller than it and dividing it (checked, ValueError: `kv_head_replicas`); an
intermediate size or vocabulary that does not divide is replicated instead.

A Hugging Face checkpoint loads straight into this layout
(`jax_paged_attn.models.load_checkpoint`): each device's shard of each parameter is read
from the safetensors files by slicing, so a device reads only its heads, columns or rows.

Multi-host (several processes, one per host)
--------------------------------------------
The same code runs across hosts with `jax.distributed`:

1. on every host, before any other JAX call::

       jax.distributed.initialize()  # or (coordinator_address=..., num_processes=..., process_id=...)

2. build the mesh over the global devices, e.g. ``tensor_parallel_mesh()`` (all devices
   of all hosts on the ``"tp"`` axis), or a 2-D ``Mesh`` with a data-parallel axis across
   hosts and ``"tp"`` within a host (keep tensor parallelism on NVLink);
3. every host builds the same model (same seed, or `load_llama` from the same checkpoint
   on each host) with ``mesh=``: each host creates (`init_sharded`) or loads only the
   shards of its own devices, and `load_llama` reads only those shards' slices of the
   files;
4. every host runs the same program on the same step inputs (token ids, positions and
   metadata are replicated, so each host passes identical host arrays; with a data-
   parallel axis, build global arrays with `jax.make_array_from_process_local_data`);
   logits come back sharded or replicated; read them with ``jax.device_get`` on a
   replicated array (or `jax.experimental.multihost_utils.process_allgather`).
The scheduler (the engine) runs on every host and must take identical decisions, e.g.
by running it on host 0 and broadcasting each step's inputs
(`jax.experimental.multihost_utils.broadcast_one_to_all`).
"""
from __future__ import annotations

import contextlib
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Array = jax.Array

TENSOR_PARALLEL_AXIS = "tp"
"""Default name of the tensor-parallel mesh axis."""

COLUMN_PARALLEL: Mapping[str, int] = MappingProxyType({"qkv_proj": 1, "gate_up_proj": 2, "lm_head": 1})
"""Linear layers whose output features are sharded -> the kernel axis sharded: the KV heads
of ``qkv_proj`` ``[hidden, Hk, Hq/Hk + 2, D]``, the intermediate axis of ``gate_up_proj``
``[hidden, 2, intermediate]``, the vocabulary of ``lm_head`` ``[hidden, vocab]``."""
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
"""Linear layers whose input features are sharded (their outputs are all-reduced)."""


def tensor_parallel_mesh(tensor_parallel_size: int | None = None, *, axis_name: str = TENSOR_PARALLEL_AXIS,
                         devices: Any = None) -> Mesh:
    """A 1-D mesh of ``tensor_parallel_size`` devices (default: all of `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    size = len(devices) if tensor_parallel_size is None else tensor_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size must be an int in [1, {len(devices)}] (the devices given), got {size!r}.")
    return Mesh(np.asarray(devices[:size]), (axis_name,))


def _axis_size(mesh: Mesh, axis_name: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis_name!r} (its axes: {tuple(mesh.shape)}).")
    return mesh.shape[axis_name]


def tensor_parallel_size(mesh: Mesh, axis_name: str = TENSOR_PARALLEL_AXIS) -> int:
    """The size of ``mesh``'s tensor-parallel axis (TypeError / ValueError for a bad mesh or axis)."""
    return _axis_size(mesh, axis_name)


def param_partition_spec(path: tuple[Any, ...], shape: tuple[int, ...], *, axis_name: str, tp_size: int) -> P:
    """The `PartitionSpec` of one parameter, from its NNX path (e.g. ``(..., "qkv_proj", "kernel")``).

    A kernel whose sharded axis does not divide by ``tp_size`` is replicated.
    """
    names = [str(p) for p in path]
    owner = names[-2] if len(names) >= 2 else ""
    if names[-1] != "kernel":
        return P()
    if owner in COLUMN_PARALLEL:
        axis = COLUMN_PARALLEL[owner]
        if axis < len(shape) and shape[axis] % tp_size == 0:
            return P(*(axis_name if i == axis else None for i in range(len(shape))))
    if owner in ROW_PARALLEL and len(shape) == 2 and shape[0] % tp_size == 0:
        return P(axis_name, None)
    return P()


def shard_model(model: nnx.Module, mesh: Mesh, axis_name: str = TENSOR_PARALLEL_AXIS) -> None:
    """Places every parameter of ``model`` on ``mesh`` by `param_partition_spec` (in place)."""
    _axis_size(mesh, axis_name)  # validates mesh and axis before touching the model
    # nnx.state holds the model's own Variables: setting their values updates the model.
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        var.set_value(jax.device_put(value, param_sharding(path, value.shape, mesh, axis_name)))


def param_sharding(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh,
                   axis_name: str = TENSOR_PARALLEL_AXIS) -> NamedSharding:
    """`NamedSharding` of the parameter at NNX ``path`` with ``shape`` (`param_partition_spec`)."""
    spec = param_partition_spec(path, tuple(shape), axis_name=axis_name, tp_size=_axis_size(mesh, axis_name))
    return NamedSharding(mesh, spec)


INIT_PROGRAM_BYTES = 4 << 30
"""Most bytes of parameters a device receives from one program of `init_sharded`. A
program holds the random bits of everything it draws at once (XLA:CPU keeps several times
the parameters' bytes of them): Llama 3 70B's shape in bf16 over 2 devices is drawn by 17
programs (each held 16-23 GB of bits on XLA:CPU beside its 4 GB), not one that would need
a few times a device's memory."""


def init_sharded(factory: Callable[[nnx.Rngs], Any], rngs: nnx.Rngs, mesh: Mesh,
                 axis_name: str = TENSOR_PARALLEL_AXIS) -> Any:
    """``factory(rngs)`` with its parameters created on ``mesh``: each device computes
    only its own shard of each parameter (`param_sharding` by NNX path), so no device
    ever holds a whole sharded parameter (a 70B model's parameters need not fit one
    device).

    ``factory`` builds NNX modules (a module, or a dict of modules and None, whose keys
    start the parameter paths) from ``rngs``; it is never run eagerly: it is traced for
    the shapes, then once per `jax.jit` program whose ``out_shardings`` are the
    parameters' shardings, each program keeping the parameters (in NNX path order) of at
    most `INIT_PROGRAM_BYTES` per device (XLA drops the others' work). ``rngs`` advances
    as a plain ``factory(rngs)`` would advance it. Inside an outer trace (``rngs``' keys
    traced, as under `nnx.eval_shape`) it returns ``factory(rngs)``: nothing is created.

    The values are those ``factory(rngs)`` gives without a mesh: the threefry bits of
    `jax.random` are computed per element, whatever the sharding, under
    ``jax_threefry_partitionable``, which JAX enables by default and which these programs
    turn on for themselves (without it, every device would draw the whole parameter).
    """
    _axis_size(mesh, axis_name)
    rngs_graphdef, rngs_state = nnx.split(rngs)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(rngs_state)):
        # Inside an outer trace (`load_llama` builds its model under `nnx.eval_shape`)
        # nothing is created here: the programs would only be traced, once each.
        return factory(rngs)
    traced: dict[str, Any] = {}

    def create(rngs_state: Any) -> tuple[list[Array], Any]:
        inner_rngs = nnx.merge(rngs_graphdef, rngs_state)
        graphdef, state = nnx.split(factory(inner_rngs))
        flat = nnx.to_flat_state(state)
        traced.update(graphdef=graphdef, state=state, paths=[path for path, _ in flat])
        return [var.get_value() for _, var in flat], nnx.state(inner_rngs)

    partitionable = getattr(jax, "threefry_partitionable", None)  # JAX drops the flag once it is the only way
    with partitionable(True) if partitionable is not None else contextlib.nullcontext():
        shapes, _ = jax.eval_shape(create, rngs_state)
        shardings = [param_sharding(path, x.shape, mesh, axis_name) for path, x in zip(traced["paths"], shapes)]
        device_bytes = [math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                        for s, x in zip(shardings, shapes)]
        values: list[Array] = []
        new_rngs_state = rngs_state
        for part in _consecutive_parts(device_bytes, INIT_PROGRAM_BYTES):
            def init_sharded_parameters(rngs_state: Any, part: slice = part) -> tuple[list[Array], Any]:
                params, rngs_after = create(rngs_state)
                return params[part], rngs_after

            created, new_rngs_state = jax.jit(init_sharded_parameters, out_shardings=(
                shardings[part], NamedSharding(mesh, P())))(rngs_state)
            values.extend(created)
    # The keys go back where they were (an Rngs on one device stays there); inside an
    # outer trace they have no sharding to go back to.
    new_rngs_state = jax.tree.map(
        lambda new, old: new if getattr(old, "sharding", None) is None else jax.device_put(new, old.sharding),
        new_rngs_state, rngs_state)
    nnx.update(rngs, new_rngs_state)
    # Fresh Variables: the traced ones belong to the trace.
    state = nnx.from_flat_state([(path, var.replace(value))
                                 for (path, var), value in zip(nnx.to_flat_state(traced["state"]), values)])
    return nnx.merge(traced["graphdef"], state)


def _consecutive_parts(sizes: Sequence[int], budget: int) -> list[slice]:
    """``sizes`` cut into consecutive slices of at most ``budget`` in total each (an item
    larger than the budget alone); one empty slice for no sizes."""
    parts, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            parts.append(slice(start, i))
            start, total = i, 0
        total += size
    parts.append(slice(start, len(sizes)))
    return parts


def kv_cache_spec(axis_name: str = TENSOR_PARALLEL_AXIS) -> P:
    """`PartitionSpec` of a ``[2, num_blocks, block_size, Hk, D]`` cache: sharded by KV head."""
    return P(None, None, None, axis_name, None)


def kv_cache_sharding(mesh: Mesh, axis_name: str = TENSOR_PARALLEL_AXIS) -> NamedSharding:
    """`NamedSharding` for one layer's KV cache on ``mesh`` (see `kv_cache_spec`)."""
    _axis_size(mesh, axis_name)
    return NamedSharding(mesh, kv_cache_spec(axis_name))


def check_head_divisibility(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """ValueError unless both head counts divide by the tensor-parallel size.

    The heads an attention layer is given are the ones it shards: a model with fewer KV
    heads than devices replicates them first (`kv_head_replicas`) and passes the
    replicated count.
    """
    if num_heads % tp_size or num_kv_heads % tp_size:
        hint = (f" With fewer KV heads than devices, replicate each KV head tp // num_kv_heads times "
                f"(parallel.kv_head_replicas; LlamaForCausalLM does it) and pass the replicated count."
                if num_kv_heads < tp_size and num_heads % tp_size == 0 else "")
        raise ValueError(
            f"tensor parallelism over {tp_size} devices needs num_heads ({num_heads}) and num_kv_heads "
            f"({num_kv_heads}) divisible by {tp_size}.{hint}"
        )


def kv_head_replicas(num_attention_heads: int, num_key_value_heads: int, tp_size: int) -> int:
    """How many copies of each KV head a model stores for tensor parallelism over ``tp_size``.

    1 when ``Hk`` divides by ``tp`` (device ``i`` holds KV heads ``[i*Hk/tp, (i+1)*Hk/tp)``).
    With fewer KV heads than devices (vLLM's scheme) each KV head is replicated on
    ``r = tp // Hk`` consecutive devices: the model stores ``Hk * r = tp`` KV heads
    (`replicate_kv_heads`), one a device, and device ``d`` holds original KV head ``d // r``
    with query heads ``[d*Hq/tp, (d+1)*Hq/tp)``. Those query heads all belong to KV head
    ``d // r`` (query head ``h`` uses KV head ``h // (Hq/Hk)``, and ``Hq/Hk = r * Hq/tp``),
    so GQA groups still never straddle devices.

    Raises:
      ValueError: ``num_attention_heads`` does not divide by ``tp_size``; or
        ``num_key_value_heads`` divides neither by ``tp_size`` (when it is at least
        ``tp_size``) nor into it (when it is smaller).
    """
    if num_attention_heads % tp_size:
        raise ValueError(f"tensor parallelism over {tp_size} devices needs num_attention_heads "
                         f"({num_attention_heads}) divisible by {tp_size}.")
    if num_key_value_heads >= tp_size:
        if num_key_value_heads % tp_size:
            raise ValueError(f"tensor parallelism over {tp_size} devices needs num_key_value_heads "
                             f"({num_key_value_heads}) divisible by {tp_size} (or smaller than {tp_size} and "
                             f"dividing it, for KV-head replication).")
        return 1
    if tp_size % num_key_value_heads:
        raise ValueError(f"num_key_value_heads ({num_key_value_heads}) is smaller than the tensor-parallel size "
                         f"{tp_size} and does not divide it: KV heads can only be replicated tp // "
                         f"num_key_value_heads times when num_key_value_heads divides {tp_size}.")
    return tp_size // num_key_value_heads


def replicated_qkv_sources(num_attention_heads: int, num_key_value_heads: int, replicas: int) -> np.ndarray:
    """int64 ``[Hk * r, Hq / (Hk * r) + 2]``: where each slot of the replicated fused q/k/v
    layout comes from in the original one.

    The original ``qkv_proj`` layout is ``[..., Hk, G + 2, D]`` (``G = Hq // Hk``: KV head
    ``j``'s query heads ``j*G ... j*G + G - 1``, its key, its value); the replicated one
    is ``[..., Hk * r, G / r + 2, D]``: stored KV head ``e`` is copy ``e % r`` of KV head
    ``j = e // r``, with query heads ``e*G/r ... (e+1)*G/r - 1`` (a slice of ``j``'s group)
    and ``j``'s key and value. Entry ``[e, s]`` is the flat index ``j * (G + 2) + s'`` of the
    original ``[Hk, G + 2]`` slot it copies.
    """
    group = num_attention_heads // num_key_value_heads
    if replicas < 1 or group % replicas:
        raise ValueError(f"replicas ({replicas}) must be >= 1 and divide the query heads per KV head ({group}).")
    local_group = group // replicas
    stored = np.arange(num_key_value_heads * replicas)
    original, copy = stored // replicas, stored % replicas
    queries = copy[:, None] * local_group + np.arange(local_group)[None, :]  # slots within j's group
    key_value = np.broadcast_to(np.array([group, group + 1]), (stored.size, 2))
    return original[:, None] * (group + 2) + np.concatenate([queries, key_value], axis=1)


def replicate_kv_heads(qkv_kernel: Any, num_attention_heads: int, replicas: int) -> Any:
    """The fused q/k/v kernel ``[..., Hk, G + 2, D]`` in the replicated layout
    ``[..., Hk * r, G / r + 2, D]`` (`replicated_qkv_sources`); NumPy or JAX arrays, any
    dtype. ``replicas == 1`` returns it unchanged."""
    if replicas == 1:
        return qkv_kernel
    *lead, num_kv_heads, width, head_dim = qkv_kernel.shape
    sources = replicated_qkv_sources(num_attention_heads, num_kv_heads, replicas)
    flat = qkv_kernel.reshape(*lead, num_kv_heads * width, head_dim)[..., sources.ravel(), :]
    return flat.reshape(*lead, *sources.shape, head_dim)


def kv_head_parallel(
    write_fn: Callable[..., tuple[Array, Array]],
    *,
    mesh: Mesh,
    axis_name: str = TENSOR_PARALLEL_AXIS,
) -> Callable[..., tuple[Array, Array]]:
    """Runs ``write_fn`` on each device's KV heads under `jax.shard_map`.

    ``write_fn(qkv, cos, sin, kv_cache, slot_mapping, k_scale, v_scale) -> (query,
    kv_cache)`` (`jax_paged_attn.cache.rotary_and_cache_flash_kv` with its
    ``kv_cache_dtype`` bound) is called per device with its slice of ``qkv [T, Hk, G + 2, D]`` along
    the KV heads and its KV heads of the cache; ``cos`` / ``sin`` / ``slot_mapping`` and
    the fp8 scales are replicated. The queries ``[T, Hq, D]`` come back split by head:
    a device's KV heads own a contiguous run of query heads, so nothing moves between
    devices. The returned function takes the same positional arguments with global shapes.
    """
    _axis_size(mesh, axis_name)
    heads = P(None, axis_name)
    cache = kv_cache_spec(axis_name)

    def sharded(qkv: Array, cos: Array, sin: Array, kv_cache: Array, slot_mapping: Array, k_scale: Any,
                v_scale: Any) -> tuple[Array, Array]:
        def local(qkv, cos, sin, kv_cache, slot_mapping, scales):
            return write_fn(qkv, cos, sin, kv_cache, slot_mapping, scales[0], scales[1])

        scales = (jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))
        return jax.shard_map(local, mesh=mesh, in_specs=(heads, P(), P(), cache, P(), P()),
                             out_specs=(heads, cache), check_vma=False)(qkv, cos, sin, kv_cache, slot_mapping,
                                                                        scales)

    return sharded


def head_parallel(
    attention_fn: Callable[..., tuple[Array, Array]],
    *,
    mesh: Mesh,
    axis_name: str = TENSOR_PARALLEL_AXIS,
    num_heads: int,
    num_kv_heads: int,
) -> Callable[..., tuple[Array, Array]]:
    """Runs ``attention_fn`` on each device's heads under `jax.shard_map`.

    ``attention_fn(query, key, value, kv_cache, metadata, alibi_slopes, k_scale, v_scale,
    *, num_heads, num_kv_heads) -> (out, kv_cache)`` is called per device with its local
    head counts and slices: query ``[T, Hq/tp * D]``, key / value ``[T, Hk/tp * D]``, the
    cache's KV heads, ALiBi slopes ``[Hq/tp]`` (or None); metadata and fp8 scales are
    replicated. An empty cache (size 0, a profiling run) is replicated. The returned
    function takes the same positional arguments with global shapes.

    Pallas calls cannot be checked for varying-manual-axes, hence ``check_vma=False``.
    """
    tp_size = _axis_size(mesh, axis_name)
    check_head_divisibility(num_heads, num_kv_heads, tp_size)
    heads = P(None, axis_name)

    def sharded(query: Array, key: Array, value: Array, kv_cache: Array, metadata: Any,
                alibi_slopes: Array | None, k_scale: Any, v_scale: Any) -> tuple[Array, Array]:
        cache_spec = kv_cache_spec(axis_name) if kv_cache.ndim == 5 and kv_cache.size > 0 else P()
        has_alibi = alibi_slopes is not None

        def local(q, k, v, cache, meta, scales, *slopes):
            return attention_fn(
                q, k, v, cache, meta, slopes[0] if has_alibi else None, scales[0], scales[1],
                num_heads=num_heads // tp_size, num_kv_heads=num_kv_heads // tp_size,
            )

        scales = (jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))
        args = (query, key, value, kv_cache, metadata, scales) + ((alibi_slopes,) if has_alibi else ())
        in_specs = (heads, heads, heads, cache_spec, P(), P()) + ((P(axis_name),) if has_alibi else ())
        return jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=(heads, cache_spec), check_vma=False
        )(*args)

    return sharded
