"""Hugging Face checkpoints (config.json + safetensors) <-> `LlamaForCausalLM`, of every
family the decoder runs (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2: config.json's
``model_type`` / ``architectures``, `jax_paged_attn.models.config`).

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``).
Tensor names and layouts are Hugging Face's. ``L`` is ``model.layers.{i}`` (Hugging Face),
``l`` is ``model.layers[i]`` (NNX):

===============================================  ==================================  ======================
Hugging Face tensor                              NNX parameter                       the part it fills
===============================================  ==================================  ======================
``model.embed_tokens.weight``                    ``model.embed_tokens.embedding``    all
``L.self_attn.q_proj.weight``                    ``l.self_attn.qkv_proj.kernel``     ``[:, :, :group]``
``L.self_attn.k_proj.weight``                    ``l.self_attn.qkv_proj.kernel``     ``[:, :, group]``
``L.self_attn.v_proj.weight``                    ``l.self_attn.qkv_proj.kernel``     ``[:, :, group + 1]``
``L.self_attn.o_proj.weight``                    ``l.self_attn.o_proj.kernel``       all
``L.mlp.gate_proj.weight``                       ``l.mlp.gate_up_proj.kernel``       ``[:, 0]``
``L.mlp.up_proj.weight``                         ``l.mlp.gate_up_proj.kernel``       ``[:, 1]``
``L.mlp.down_proj.weight``                       ``l.mlp.down_proj.kernel``          all
``L.{input,post_attention}_layernorm.weight``    ``l.{input,post_attention}_``       all
                                                 ``layernorm.weight``
``L.self_attn.{q,k,v}_proj.bias`` (Qwen2)        ``l.self_attn.qkv_proj.bias``       ``[:, :group]``, ...
``L.self_attn.o_proj.bias`` (attention_bias)     ``l.self_attn.o_proj.bias``         all
``L.self_attn.{q,k}_norm.weight`` (Qwen3)        ``l.self_attn.{q,k}_norm.weight``   all
``L.{pre,post}_feedforward_layernorm.weight``    ``l.{pre,post}_feedforward_``       all
(Gemma 2)                                        ``layernorm.weight``
``model.norm.weight``                            ``model.norm.weight``               all
``lm_head.weight`` (absent when tied)            ``lm_head.kernel``                  all
===============================================  ==================================  ======================

Shapes, with ``group = Hq // Hk``: Hugging Face's q_proj ``[Hq * D, hidden]``, k_proj and
v_proj ``[Hk * D, hidden]``, gate_proj and up_proj ``[intermediate, hidden]``; the fused
``qkv_proj.kernel`` ``[hidden, Hk, group + 2, D]`` and ``gate_up_proj.kernel``
``[hidden, 2, intermediate]`` (`LlamaAttention` and `LlamaMLP` in
`jax_paged_attn.models.llama`). Projection weights (``*_proj``, ``lm_head``) are stored
``[out, in]`` by Hugging Face and ``[in, *out]`` here: transposed, then ``out`` reshaped
to the part's trailing axes, so q_proj's row ``h * D + c`` (query head ``h``, channel
``c``) is ``qkv_proj.kernel[:, h // group, h % group, c]``. `hf_parameter_map` lists
every placement. Saving writes the separate Hugging Face tensors back, so transformers
loads the files.

Besides config.json, an optional ``generation_config.json`` is read for its
``eos_token_id`` (which wins over config.json's, as in Hugging Face's ``generate``).
`load_llama` computes in the dtype config.json names (``dtype``, transformers 5's key,
or ``torch_dtype``) unless told otherwise.

Only the local filesystem is read (no download), with `safetensors.safe_open` (numpy),
one parameter at a time:

* without a mesh, each parameter is assembled from its whole tensors (a fused one: one
  layer's q, k and v), read from the file mapped into memory (`_MappedTensors`: no copy
  out of the file) and transposed in tiles on several threads (`contiguous_transpose`),
  so host memory holds one parameter at a time;
* with a mesh (tensor parallelism, `jax_paged_attn.parallel`), each parameter is built
  shard by shard in its tensor-parallel layout: for each distinct shard (a box of the
  parameter), the matching part of each Hugging Face tensor is read through
  ``get_slice(name)[rows, columns]``, which reads only those bytes
  (`HFTensorPlacement.read_shard` maps the box back: a q/k/v shard of KV heads
  ``[a, b)`` reads q_proj's rows of query heads ``[a*group, b*group)`` and k_proj's and
  v_proj's rows of KV heads ``[a, b)``; a row-parallel o_proj / down_proj shard reads
  columns), is transposed (`contiguous_transpose`) / reshaped into the fused layout on the host, and goes to the
  devices holding it before the next shard is read. Host memory holds about one shard
  at a time; a replicated parameter (embeddings, norms) is read once for all devices.
  With fewer KV heads than devices, the copies of a KV head
  (`LlamaForCausalLM.kv_head_replicas`) are filled from the same k_proj / v_proj rows,
  and `save_checkpoint` writes the first copy: the files a single-device model writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged_attn.models.llama import LlamaConfig, LlamaForCausalLM

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes ``dtype="auto"`` may pick (the model computes in them)."""

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes: skipped when loading.
_IGNORED_TENSORS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


_TRANSPOSE_TILE = 256  # 256 x 256 tiles of 2 bytes: a tile's source and destination stay in the L2 cache
_transpose_pool: ThreadPoolExecutor | None = None


def contiguous_transpose(matrix: np.ndarray) -> np.ndarray:
    """``np.ascontiguousarray(matrix.T)`` of a 2-D array, copied in square tiles on up to 8
    threads.

    NumPy copies a transposed view element by element along the destination's rows, so each
    read of the source lands a row apart: a 2-byte ``[5632, 2048]`` weight took 83 ms this
    way and 34 ms in tiles on one core (18 ms on four threads; 2026-12). A Hugging Face
    checkpoint's projection weights are stored ``[out, in]`` and the model's ``[in, out]``,
    so a warm start spends its host time on these copies: every weight but the
    embedding's goes through here. The tiles are copied as unsigned integers of the
    element's size (NumPy's own loops, which release the GIL, whatever the dtype).
    """
    rows, columns = matrix.shape
    if (matrix.size * matrix.itemsize < (1 << 20) or matrix.itemsize not in (1, 2, 4, 8)
            or matrix.flags.f_contiguous):  # (small, odd-sized, or its transpose already row-major)
        return np.ascontiguousarray(matrix.T)
    bits = np.dtype(f"u{matrix.itemsize}")
    source = matrix.view(bits)  # (a view of the same item size keeps any strides: no copy)
    out = np.empty((columns, rows), bits)

    def copy_row_tiles(start: int) -> None:
        stop = min(start + _TRANSPOSE_TILE, rows)
        for column in range(0, columns, _TRANSPOSE_TILE):
            out[column:column + _TRANSPOSE_TILE, start:stop] = source[start:stop, column:column + _TRANSPOSE_TILE].T

    global _transpose_pool
    if _transpose_pool is None:
        _transpose_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                             thread_name_prefix="checkpoint-transpose")
    list(_transpose_pool.map(copy_row_tiles, range(0, rows, _TRANSPOSE_TILE)))
    return out.view(matrix.dtype)


class CheckpointError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mismatched tensors."""


@dataclasses.dataclass(frozen=True)
class HFTensorPlacement:
    """Where one Hugging Face tensor lives in the model.

    Attributes:
      param_path: the NNX path of the parameter holding it (``nnx.to_flat_state`` keys).
      index: the part of that parameter it fills, a NumPy index of ints and step-1
        slices (``()``: all of it).
      transpose: the tensor is a Hugging Face projection weight ``[out, in]`` and its part
        is ``[in, *out_axes]``: transposed, then ``out`` reshaped to the trailing axes.
      kv_head_replicas: the part's first ``out`` axis (the KV heads of k_proj / v_proj in
        ``qkv_proj.kernel``) holds each of the tensor's heads this many times in a row
        (`jax_paged_attn.parallel.kv_head_replicas`); the tensor holds each once.
      vector: the tensor is a projection's bias ``[out]`` and its part is ``[*out_axes]``
        (``out`` reshaped; with ``transpose`` False). Its first axis is the heads axis
        that ``kv_head_replicas`` repeats.
    """

    param_path: tuple[Any, ...]
    index: tuple[Any, ...] = ()
    transpose: bool = False
    kv_head_replicas: int = 1
    vector: bool = False

    @property
    def _heads_axis(self) -> int:
        """The part's axis of KV heads (the first ``out`` axis)."""
        return 0 if self.vector else 1

    def part_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of ``param[index]`` for a parameter of ``param_shape``."""
        # A broadcast view of one byte: indexing it allocates nothing.
        return np.broadcast_to(np.empty((), np.int8), tuple(param_shape))[self.index].shape

    def _unreplicated_part_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """`part_shape` with one copy of each KV head: the tensor's data in the part's layout."""
        part = list(self.part_shape(param_shape))
        if self.kv_head_replicas > 1:
            part[self._heads_axis] //= self.kv_head_replicas
        return tuple(part)

    def hf_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape, for a parameter of ``param_shape``."""
        part = self._unreplicated_part_shape(param_shape)
        if self.vector:
            return (math.prod(part),)
        return (math.prod(part[1:]), part[0]) if self.transpose else part

    def to_part(self, tensor: np.ndarray, param_shape: tuple[int, ...]) -> np.ndarray:
        """The Hugging Face ``tensor`` in the layout of ``param[index]`` (a view when possible;
        a transposed projection weight is a contiguous copy, `contiguous_transpose`)."""
        part = (contiguous_transpose(tensor) if self.transpose else tensor).reshape(
            self._unreplicated_part_shape(param_shape))
        return np.repeat(part, self.kv_head_replicas, axis=self._heads_axis) if self.kv_head_replicas > 1 else part

    def from_param(self, param: np.ndarray) -> np.ndarray:
        """The Hugging Face tensor held by ``param`` (the parameter's whole value); of
        replicated KV heads, the first copy."""
        part = param[self.index]
        if self.kv_head_replicas > 1:
            part = part[::self.kv_head_replicas] if self.vector else part[:, ::self.kv_head_replicas]
        if self.vector:
            return part.reshape(-1)
        return part.reshape(part.shape[0], -1).T if self.transpose else part

    def read_shard(self, tensor: Any, param_shape: tuple[int, ...],
                   shard: tuple[slice, ...]) -> tuple[tuple[Any, ...], np.ndarray] | None:
        """The part of one shard of the parameter that this tensor fills, reading only it.

        Args:
          tensor: the tensor's lazy view, indexable with slices (safetensors'
            ``get_slice(name)``, which reads only the bytes indexed).
          param_shape: the parameter's (global) shape.
          shard: the shard's box in the parameter, one slice per axis (as
            `jax.sharding.Sharding.addressable_devices_indices_map` gives).

        Returns:
          None when the tensor fills nothing of the shard, else ``(where, values)``:
          ``values`` in the part's layout, to be stored at ``shard_array[where]``.

        A shard of a projection's part must span whole trailing ``out`` axes (the
        Megatron layouts do: a shard splits only the first ``out`` axis or the ``in`` axis),
        so the Hugging Face rows it needs are contiguous.
        """
        index = self.index + (slice(None),) * (len(param_shape) - len(self.index))
        where, box = [], []  # where: in the shard; box: [lo, hi) in the part, per part axis
        for axis, (size, sub, part) in enumerate(zip(param_shape, shard, index)):
            shard_lo, shard_hi, _ = sub.indices(size)
            if isinstance(part, slice):
                part_lo, part_hi, step = part.indices(size)
                assert step == 1, f"{self.param_path}: a placement's slices have step 1"
                lo, hi = max(shard_lo, part_lo), min(shard_hi, part_hi)
                if lo >= hi:
                    return None
                where.append(slice(lo - shard_lo, hi - shard_lo))
                box.append((lo - part_lo, hi - part_lo))
            else:
                if not shard_lo <= part < shard_hi:
                    return None
                where.append(part - shard_lo)
        if self.vector:
            # The part is [lead, *trailing]: the tensor's entries (lead, *trailing) flattened.
            # Biases are replicated (`jax_paged_attn.parallel.param_partition_spec`), so the
            # box is the whole part; read it whole.
            part = self.to_part(np.asarray(tensor[:]), param_shape)
            return tuple(where), part[tuple(slice(lo, hi) for lo, hi in box)]
        if not self.transpose:
            return tuple(where), np.asarray(tensor[tuple(slice(lo, hi) for lo, hi in box)])
        # The part is [in, lead, *trailing] with the tensor's rows = (lead, *trailing) flattened.
        (in_lo, in_hi), (lead_lo, lead_hi), *trailing = box
        out_shape = self._unreplicated_part_shape(param_shape)[1:]
        if any((lo, hi) != (0, size) for (lo, hi), size in zip(trailing, out_shape[1:])):
            raise ValueError(f"{self.param_path}: a shard must span whole trailing axes of a projection's part, "
                             f"got the part's box {box} of {self.part_shape(param_shape)}.")
        replicas = self.kv_head_replicas
        first, last = lead_lo // replicas, -(-lead_hi // replicas)  # the tensor's entries the copies come from
        rows_per_entry = math.prod(out_shape[1:])
        rows = np.asarray(tensor[first * rows_per_entry:last * rows_per_entry, in_lo:in_hi])
        values = contiguous_transpose(rows).reshape(in_hi - in_lo, last - first, *out_shape[1:])
        if replicas > 1:
            start = lead_lo - first * replicas
            values = np.repeat(values, replicas, axis=1)[:, start:start + lead_hi - lead_lo]
        return tuple(where), values


def hf_parameter_map(config: LlamaConfig, *, kv_head_replicas: int = 1) -> dict[str, HFTensorPlacement]:
    """Hugging Face tensor name -> its `HFTensorPlacement` in a model of ``config``.

    The placements of one parameter cover each of its elements exactly once: q, k and v
    fill ``qkv_proj.kernel``, gate and up fill ``gate_up_proj.kernel``.
    ``kv_head_replicas``: the model's (`LlamaForCausalLM.kv_head_replicas`); with ``r > 1``
    ``qkv_proj.kernel`` is ``[hidden, Hk * r, group / r + 2, D]``
    (`jax_paged_attn.parallel.replicate_kv_heads`): q_proj still fills ``[:, :, :group /
    r]`` in order, k_proj and v_proj fill each of their heads into ``r`` consecutive rows.
    """
    if isinstance(kv_head_replicas, bool) or not isinstance(kv_head_replicas, int) or kv_head_replicas < 1:
        raise ValueError(f"kv_head_replicas must be a positive int, got {kv_head_replicas!r}.")
    group = config.num_attention_heads // config.num_key_value_heads
    if group % kv_head_replicas:
        raise ValueError(f"kv_head_replicas ({kv_head_replicas}) must divide the query heads per KV head "
                         f"({group}).")
    group //= kv_head_replicas  # the query heads per stored KV head
    every = slice(None)
    mapping: dict[str, HFTensorPlacement] = {
        "model.embed_tokens.weight": HFTensorPlacement(("model", "embed_tokens", "embedding")),
        "model.norm.weight": HFTensorPlacement(("model", "norm", "weight")),
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        layer = ("model", "layers", i)
        qkv = layer + ("self_attn", "qkv_proj", "kernel")
        mapping[f"{prefix}.self_attn.q_proj.weight"] = HFTensorPlacement(qkv, (every, every, slice(0, group)), True)
        mapping[f"{prefix}.self_attn.k_proj.weight"] = HFTensorPlacement(
            qkv, (every, every, group), True, kv_head_replicas)
        mapping[f"{prefix}.self_attn.v_proj.weight"] = HFTensorPlacement(
            qkv, (every, every, group + 1), True, kv_head_replicas)
        mapping[f"{prefix}.self_attn.o_proj.weight"] = HFTensorPlacement(
            layer + ("self_attn", "o_proj", "kernel"), transpose=True)
        if config.attention_bias:
            qkv_bias = layer + ("self_attn", "qkv_proj", "bias")
            mapping[f"{prefix}.self_attn.q_proj.bias"] = HFTensorPlacement(
                qkv_bias, (every, slice(0, group)), vector=True)
            mapping[f"{prefix}.self_attn.k_proj.bias"] = HFTensorPlacement(
                qkv_bias, (every, group), kv_head_replicas=kv_head_replicas, vector=True)
            mapping[f"{prefix}.self_attn.v_proj.bias"] = HFTensorPlacement(
                qkv_bias, (every, group + 1), kv_head_replicas=kv_head_replicas, vector=True)
        if config.o_proj_bias:
            mapping[f"{prefix}.self_attn.o_proj.bias"] = HFTensorPlacement(layer + ("self_attn", "o_proj", "bias"))
        if config.qk_norm:
            for head_norm in ("q_norm", "k_norm"):
                mapping[f"{prefix}.self_attn.{head_norm}.weight"] = HFTensorPlacement(
                    layer + ("self_attn", head_norm, "weight"))
        gate_up = layer + ("mlp", "gate_up_proj", "kernel")
        mapping[f"{prefix}.mlp.gate_proj.weight"] = HFTensorPlacement(gate_up, (every, 0), True)
        mapping[f"{prefix}.mlp.up_proj.weight"] = HFTensorPlacement(gate_up, (every, 1), True)
        mapping[f"{prefix}.mlp.down_proj.weight"] = HFTensorPlacement(
            layer + ("mlp", "down_proj", "kernel"), transpose=True)
        norms = ("input_layernorm", "post_attention_layernorm")
        if config.sandwich_norms:
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        for norm in norms:
            mapping[f"{prefix}.{norm}.weight"] = HFTensorPlacement(layer + (norm, "weight"))
    if not config.tie_word_embeddings:
        mapping["lm_head.weight"] = HFTensorPlacement(("lm_head", "kernel"), transpose=True)
    return mapping


def _read_json(path: str) -> Any:
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
    """``safetensors.safe_open(path)`` (numpy) whose failures to read the file, at opening
    or at reading a tensor, are `CheckpointError`s naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="np") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); it may be empty or truncated "
            f"(an interrupted download or copy).") from e


class _MappedTensors:
    """A safetensors file's tensors as read-only NumPy views of the file mapped into memory.

    ``safe_open(...).get_tensor`` copies each tensor out of the file into a new buffer
    (1.1-1.8 s for the 2.2 GB of a 1.1B model's bf16 weights on a 2-core host, 2026-12);
    the loader then copies each projection weight again to transpose it, so reading the
    mapped bytes directly leaves one copy. The header is parsed here (JSON after its
    8-byte little-endian length, as the format defines), after `_open_safetensors` has
    opened the file; each tensor's byte range is checked against its shape and the
    file's size, a `CheckpointError` naming the file where it does not fit.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (header_size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_size))
            self.data = np.memmap(path, np.uint8, mode="r", offset=8 + header_size)
        except (OSError, ValueError, struct.error) as e:
            raise self._unreadable(str(e)) from e
        self.header = header

    def _unreadable(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a readable safetensors file ({why}); it may be empty or "
                               f"truncated (an interrupted download or copy).")

    def view(self, name: str) -> np.ndarray:
        entry = self.header.get(name)
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(x) for x in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise self._unreadable(f"no valid header entry for tensor {name!r}") from None
        if dtype is None or not 0 <= begin <= end <= self.data.size or end - begin != math.prod(shape) * dtype.itemsize:
            raise self._unreadable(f"tensor {name!r}'s bytes [{begin}, {end}) do not hold a {entry.get('dtype')} "
                                   f"tensor of shape {list(shape)} within the file's {self.data.size} data bytes")
        return self.data[begin:end].view(dtype).reshape(shape)


def _read_index(index_path: str) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, checked: tensor name ->
    a file name in the checkpoint's directory."""
    index = _read_json(index_path)
    if not isinstance(index, dict):
        raise CheckpointError(f"{index_path} must hold a JSON object, got {type(index).__name__}.")
    if "weight_map" not in index:
        raise CheckpointError(f"{index_path} has no 'weight_map' (tensor name -> shard file).")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index_path}: 'weight_map' must map tensor names to file names, got {type(weight_map).__name__}.")
    for name, file in weight_map.items():
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
            raise CheckpointError(
                f"{index_path}: 'weight_map'[{name!r}] must be a file name in the checkpoint's directory, "
                f"got {file!r}.")
    return weight_map


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``directory/config.json``: FileNotFoundError when ``directory`` does not
    exist or holds no config.json, NotADirectoryError when it is a file."""
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist.")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"checkpoint directory {directory!r} is a file, not a directory.")
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {directory!r}.")
    hf_config = _read_json(path)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(hf_config).__name__}.")
    return hf_config


def read_config(directory: str | os.PathLike) -> LlamaConfig:
    """`LlamaConfig` from ``directory/config.json`` (and ``generation_config.json``).

    ``eos_token_id`` comes from ``generation_config.json`` when that file exists and sets
    it (Hugging Face's ``generate`` reads it there), else from config.json.
    """
    directory = os.fspath(directory)
    hf_config = read_hf_config(directory)
    path = os.path.join(directory, CONFIG_FILE)
    generation_path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if os.path.isfile(generation_path):
        generation = _read_json(generation_path)
        if not isinstance(generation, dict):
            raise CheckpointError(f"{generation_path} must hold a JSON object, got {type(generation).__name__}.")
        if generation.get("eos_token_id") is not None:
            hf_config = {**hf_config, "eos_token_id": generation["eos_token_id"]}
            path = f"{path} (with {GENERATION_CONFIG_FILE}'s eos_token_id)"
    try:
        return LlamaConfig.from_hf_config(hf_config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def checkpoint_dtype(directory: str | os.PathLike) -> jnp.dtype:
    """The dtype a checkpoint says it holds: what ``load_llama(dtype="auto")`` computes in.

    config.json's ``dtype`` (transformers 5's key) or ``torch_dtype`` (older files); both
    may be present and must then agree. A config naming neither falls back to the dtype
    of the checkpoint's floating-point tensors (Hugging Face's rule for
    ``torch_dtype="auto"``) when they all share one of `COMPUTE_DTYPES`, else to
    float32, and logs one warning saying which and why.

    Raises:
      CheckpointError (a ValueError): the config names a dtype that is not one of
        `COMPUTE_DTYPES`, or its two keys disagree.
    """
    directory = os.fspath(directory)
    hf_config = read_hf_config(directory)
    path = os.path.join(directory, CONFIG_FILE)
    named = {}
    for key in ("dtype", "torch_dtype"):
        value = hf_config.get(key)
        if value is not None:
            # Some files write the torch repr ("torch.bfloat16").
            named[key] = str(value).removeprefix("torch.")
    if len(set(named.values())) > 1:
        raise CheckpointError(
            f"{path} sets dtype = {named['dtype']!r} and torch_dtype = {named['torch_dtype']!r}; they must agree "
            f"(or pass dtype= explicitly).")
    if named:
        key, name = next(iter(named.items()))
        if name not in COMPUTE_DTYPES:
            raise CheckpointError(
                f"{path} {key} = {name!r} is not a compute dtype of this model {COMPUTE_DTYPES}; pass dtype= "
                f"explicitly.")
        return jnp.dtype(name)
    files = _tensor_files(directory)
    found = set()
    for file, names in _by_file(files):
        with _open_safetensors(file) as f:
            for name in names:
                dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                    found.add(dtype.name)
    if len(found) == 1 and found <= set(COMPUTE_DTYPES):
        dtype, why = jnp.dtype(found.pop()), "the dtype of its tensors"
    else:
        dtype = jnp.dtype(jnp.float32)
        why = f"the default, as its floating-point tensors are {sorted(found) or 'absent'}"
    logger.warning("%s names no dtype (neither 'dtype' nor 'torch_dtype'); computing in %s, %s. "
                   "Pass dtype= to choose.", path, dtype.name, why)
    return dtype


def _tensor_files(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file path, from the index or the file(s) present."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_index(index_path)
        absent = sorted({file for file in weight_map.values() if not os.path.isfile(os.path.join(directory, file))})
        if absent:
            raise CheckpointError(f"{index_path} lists file(s) that do not exist: {absent}.")
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors file (nor {INDEX_FILE}) in {directory!r}.")
    files = {}
    for shard in shards:
        path = os.path.join(directory, shard)
        with _open_safetensors(path) as f:
            for name in f.keys():
                if name in files:
                    raise CheckpointError(f"tensor {name!r} appears in both {files[name]} and {path}.")
                files[name] = path
    return files


def _by_file(names: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
    grouped: dict[str, list[str]] = {}
    for name, path in names.items():
        grouped.setdefault(path, []).append(name)
    yield from sorted(grouped.items())


def load_checkpoint(
    model: LlamaForCausalLM,
    directory: str | os.PathLike,
    *,
    strict_dtype: bool = False,
) -> LlamaForCausalLM:
    """Loads a Hugging Face checkpoint directory into ``model`` (in place; returns it).

    ``directory/config.json`` must describe the same architecture as ``model.config``
    (``eos_token_id`` may differ: the model keeps its own).
    Floating-point tensors are cast to each parameter's dtype (bf16 checkpoint into a
    float32 model, ...) unless ``strict_dtype``, where any dtype difference is an error.
    With ``model.mesh``, each parameter is built in its tensor-parallel sharding from the
    slices of the tensors its devices hold, each distinct shard read once (see the
    module docstring); replicated KV heads (``model.kv_head_replicas``) are filled from
    the same rows.

    Raises:
      FileNotFoundError: no config.json.
      CheckpointError (a ValueError): config mismatch; tensors missing (named, with the
        file or index that should hold them), unexpected, of the wrong shape or dtype
        (each named with its file, expected and found shape / dtype). All problems are
        reported at once; the model is left unchanged when any is found.
    """
    directory = os.fspath(directory)
    config = read_config(directory)
    # eos_token_id says when to stop generating, not how to compute: it may differ.
    if dataclasses.replace(config, eos_token_id=None) != dataclasses.replace(model.config, eos_token_id=None):
        diff = {k: (getattr(config, k), getattr(model.config, k)) for k in config.__dataclass_fields__
                if getattr(config, k) != getattr(model.config, k) and k != "eos_token_id"}
        raise CheckpointError(
            f"{os.path.join(directory, CONFIG_FILE)} does not match the model's config; "
            f"(checkpoint, model) differ on: {diff}."
        )
    expected = hf_parameter_map(config, kv_head_replicas=model.kv_head_replicas)
    files = _tensor_files(directory)
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))

    problems: list[str] = []
    missing = sorted(set(expected) - set(files))
    if missing:
        where = INDEX_FILE if os.path.isfile(os.path.join(directory, INDEX_FILE)) else "the *.safetensors files"
        problems.append(f"missing tensor(s) {missing} (not in {where} of {directory!r})")
    unexpected = sorted(
        name for name in set(files) - set(expected)
        if not _IGNORED_TENSORS.match(name) and not (name == "lm_head.weight" and config.tie_word_embeddings)
    )
    if unexpected:
        problems.append(f"unexpected tensor(s) {[(n, files[n]) for n in unexpected]}")

    # First pass: shapes and dtypes from the headers only, so nothing is loaded when any is wrong.
    for path, names in _by_file({n: files[n] for n in expected if n in files}):
        with _open_safetensors(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    problems.append(f"missing tensor {name!r}: {INDEX_FILE} lists it in {path}, which lacks it")
                    continue
                placement = expected[name]
                target = variables[placement.param_path].get_value()
                want_shape = placement.hf_shape(target.shape)
                want_dtype = jnp.dtype(target.dtype)
                tensor = f.get_slice(name)
                shape = tuple(tensor.get_shape())
                if shape != want_shape:
                    problems.append(f"tensor {name!r} in {path} has shape {list(shape)}, expected {list(want_shape)}")
                dtype_name = tensor.get_dtype()
                dtype = _SAFETENSORS_DTYPES.get(dtype_name)
                if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                    problems.append(f"tensor {name!r} in {path} has dtype {dtype_name}, expected a floating dtype")
                elif strict_dtype and dtype != want_dtype:
                    problems.append(
                        f"tensor {name!r} in {path} has dtype {dtype.name}, expected {want_dtype.name} (strict_dtype)"
                    )
    if problems:
        raise CheckpointError(f"checkpoint {directory!r} does not match the model:\n  " + "\n  ".join(problems))

    # Second pass, one parameter at a time: a fused one gathers its tensors (q, k, v may sit
    # in different shard files, hence every file stays open).
    parts: dict[tuple[Any, ...], list[str]] = {}
    for name, placement in expected.items():
        parts.setdefault(placement.param_path, []).append(name)
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}

        def file_of(name: str) -> Any:
            if files[name] not in opened:
                opened[files[name]] = stack.enter_context(_open_safetensors(files[name]))
            return opened[files[name]]

        mapped: dict[str, _MappedTensors] = {}

        def tensor(name: str) -> np.ndarray:
            """The whole tensor: a read-only view of its bytes in the mapped file."""
            if files[name] not in mapped:
                mapped[files[name]] = _MappedTensors(files[name])
            return mapped[files[name]].view(name)

        for param_path, names in parts.items():
            var = variables[param_path]
            target = var.get_value()
            placements = [(expected[name], name) for name in names]
            if model.mesh is not None:
                from jax_paged_attn import parallel

                sharding = parallel.param_sharding(param_path, target.shape, model.mesh, model.tensor_parallel_axis)
                read = functools.partial(_read_shard, placements, file_of, tuple(target.shape),
                                         jnp.dtype(target.dtype))
                var.set_value(_assemble_sharded(tuple(target.shape), sharding, read))
                continue
            if len(names) == 1 and expected[names[0]].index == ():
                # A whole parameter: no second host buffer (the embedding alone can be a GB).
                array = expected[names[0]].to_part(tensor(names[0]), target.shape)
                array = np.ascontiguousarray(array.astype(target.dtype, copy=False))
                if not array.flags.writeable and _on_cpu(target):
                    # Still the file's mapped bytes: a CPU device may keep the host memory it
                    # is given, and a later write to the file must not change the model.
                    array = array.copy()
            else:
                array = np.empty(target.shape, target.dtype)
                for placement, name in placements:
                    # Casts to target.dtype.
                    array[placement.index] = placement.to_part(tensor(name), target.shape)
            var.set_value(jax.device_put(array, _placement(target)))
    return model


def _read_shard(placements: list[tuple[HFTensorPlacement, str]], file_of: Callable[[str], Any],
                param_shape: tuple[int, ...], dtype: jnp.dtype, shard: tuple[slice, ...]) -> np.ndarray:
    """One shard (a box of slices) of a parameter in ``dtype``, read from its tensors'
    ``get_slice`` views: only the bytes of the shard (`HFTensorPlacement.read_shard`)."""
    shard_shape = tuple(len(range(*sub.indices(size))) for sub, size in zip(shard, param_shape))
    if len(placements) == 1 and placements[0][0].index == ():
        # The whole parameter is one tensor: its slice is the shard (no second host buffer).
        placement, name = placements[0]
        _, values = placement.read_shard(file_of(name).get_slice(name), param_shape, shard)
        return np.ascontiguousarray(values.astype(dtype, copy=False))
    array = np.empty(shard_shape, dtype)  # the placements cover each element once
    for placement, name in placements:
        found = placement.read_shard(file_of(name).get_slice(name), param_shape, shard)
        if found is not None:
            where, values = found
            array[where] = values  # casts to dtype
    return array


def _assemble_sharded(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                      read_shard: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """The global array of ``shape`` laid out by ``sharding``, each distinct shard read
    once by ``read_shard(index)`` (index: the shard's box, one slice per axis) and
    placed on the process's devices that hold it before the next one is read.

    `jax.make_array_from_callback` has this contract but reads every addressable shard
    onto the host before one batched transfer (a whole parameter in host memory on one
    host); here host memory holds one shard at a time, and a replicated parameter (or
    a shard several devices share) is read once.
    """
    devices_by_shard: dict[tuple[Any, ...], tuple[tuple[slice, ...], list[jax.Device]]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((sub.start, sub.stop, sub.step) for sub in index)  # slices are unhashable before 3.12
        devices_by_shard.setdefault(key, (index, []))[1].append(device)
    arrays = []
    for index, devices in devices_by_shard.values():
        values = read_shard(index)
        arrays.extend(jax.device_put(values, device) for device in devices)
        del values
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


_SAFETENSORS_DTYPES = {
    "F64": jnp.dtype(jnp.float64), "F32": jnp.dtype(jnp.float32), "F16": jnp.dtype(jnp.float16),
    "BF16": jnp.dtype(jnp.bfloat16), "F8_E4M3": jnp.dtype(jnp.float8_e4m3fn),
    "F8_E5M2": jnp.dtype(jnp.float8_e5m2), "I64": jnp.dtype(jnp.int64), "I32": jnp.dtype(jnp.int32),
    "I16": jnp.dtype(jnp.int16), "I8": jnp.dtype(jnp.int8), "U8": jnp.dtype(jnp.uint8),
    "BOOL": jnp.dtype(jnp.bool_),
}


def _placement(target: Any) -> Any:
    """Where a loaded tensor of a model without a mesh goes: where the parameter is now
    (None, the default device, for an abstract model)."""
    if isinstance(target, jax.Array) and not isinstance(target, jax.core.Tracer):
        return target.sharding
    return None


def _on_cpu(target: Any) -> bool:
    """Whether a loaded tensor of a model without a mesh lands in a CPU device's memory."""
    placement = _placement(target)
    devices = placement.device_set if placement is not None else {jax.devices()[0]}
    return any(device.platform == "cpu" for device in devices)


def load_llama(
    directory: str | os.PathLike,
    *,
    dtype: Any = "auto",
    param_dtype: Any | None = None,
    strict_dtype: bool = False,
    **model_kwargs: Any,
) -> LlamaForCausalLM:
    """Builds a `LlamaForCausalLM` from ``directory`` (config.json + safetensors).

    Parameters are never randomly initialized: the model is built abstractly
    (`nnx.eval_shape`) and every parameter comes from the checkpoint, placed on the
    model's mesh with its tensor-parallel sharding when ``mesh=`` is given. The
    config's ``eos_token_id`` (generation_config.json's when it sets one) is on
    ``model.config``.

    Args:
      directory: a local checkpoint directory.
      dtype: compute dtype (float32, bfloat16, float16), or "auto": the dtype the
        checkpoint names (`checkpoint_dtype`; a warning is logged when it names none).
      param_dtype: storage dtype of parameters (default: dtype).
      strict_dtype: see `load_checkpoint`.
      model_kwargs: passed to `LlamaForCausalLM` (``kv_cache_dtype``, ``implementation``,
        ``interpret``, ``mesh``, ``tensor_parallel_axis``).
    """
    config = read_config(directory)
    if isinstance(dtype, str) and dtype == "auto":
        dtype = checkpoint_dtype(directory)
    else:
        requested = dtype
        try:
            dtype = None if dtype is None else jnp.dtype(dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.name not in COMPUTE_DTYPES:
            raise TypeError(f"dtype must be 'auto' or one of {COMPUTE_DTYPES}, got {requested!r}.")
    param_dtype = dtype if param_dtype is None else param_dtype

    def build() -> LlamaForCausalLM:
        return LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, **model_kwargs)

    model = nnx.eval_shape(build)
    return load_checkpoint(model, directory, strict_dtype=strict_dtype)


def save_checkpoint(
    model: LlamaForCausalLM,
    config: LlamaConfig,
    directory: str | os.PathLike,
    *,
    dtype: Any | None = None,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Writes ``model`` as a Hugging Face checkpoint that `load_checkpoint` reads back.

    Args:
      model: the model (sharded parameters are gathered to the host one at a time).
      config: its config (written as config.json; must equal ``model.config``).
      directory: created if needed; a checkpoint already there (model.safetensors, the
        index, model-*-of-*.safetensors shards) is replaced.
      dtype: cast every tensor to this dtype (default: keep each parameter's dtype).
      max_shard_bytes: if given, split tensors over ``model-0000i-of-0000n.safetensors``
        files of at most this many bytes each (a tensor larger than that gets its own
        file) and write ``model.safetensors.index.json``; else one ``model.safetensors``.

    Returns:
      The paths written.
    """
    from safetensors.numpy import save_file

    if config != model.config:
        raise ValueError("config must be the model's config (model.config).")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    # A stale index or shard of an earlier save would shadow (or mix with) the new files.
    for name in os.listdir(directory):
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.match(name):
            os.remove(os.path.join(directory, name))
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors: dict[str, np.ndarray] = {}
    param_path, param = None, None
    # Replicated KV heads are written once (their first copy): the files a tp=1 model writes.
    for name, placement in hf_parameter_map(config, kv_head_replicas=model.kv_head_replicas).items():
        if placement.param_path != param_path:  # a fused parameter's tensors come in a row: fetch it once
            param_path = placement.param_path
            param = np.asarray(jax.device_get(variables[param_path].get_value()))
        array = placement.from_param(param)
        if dtype is not None:
            array = array.astype(jnp.dtype(dtype))
        tensors[name] = np.ascontiguousarray(array)

    hf_config = config.to_hf_config()
    dtypes = {t.dtype for t in tensors.values()}
    # Both keys: transformers 5 writes "dtype", earlier versions "torch_dtype".
    hf_config["torch_dtype"] = hf_config["dtype"] = dtypes.pop().name if len(dtypes) == 1 else "float32"
    written = [os.path.join(directory, CONFIG_FILE)]
    with open(written[0], "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)

    metadata = {"format": "pt"}  # Hugging Face loaders expect this header entry.
    if max_shard_bytes is None:
        written.append(os.path.join(directory, SINGLE_FILE))
        save_file(tensors, written[-1], metadata=metadata)
        return written
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int or None, got {max_shard_bytes!r}.")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        written.append(os.path.join(directory, file))
        save_file(shard, written[-1], metadata=metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    written.append(os.path.join(directory, INDEX_FILE))
    with open(written[-1], "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return written


__all__ = [
    "COMPUTE_DTYPES",
    "CheckpointError",
    "HFTensorPlacement",
    "checkpoint_dtype",
    "hf_parameter_map",
    "load_checkpoint",
    "load_llama",
    "read_config",
    "read_hf_config",
    "save_checkpoint",
]
