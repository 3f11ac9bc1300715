"""Llama-family decoder (Llama 2/3, Mistral) in Flax NNX on the paged attention layer.

The model follows Hugging Face's ``LlamaForCausalLM`` numerics: RMSNorm in float32
then cast, rotary embeddings in the rotate-half (GPT-NeoX) layout (cos / sin cast to
the activations' dtype as Hugging Face does, the rotation then computed in float32 and
rounded once, where Hugging Face rounds each product: the fused rotary + cache-write
kernel's arithmetic, shared by every forward), grouped-query
attention, a SwiGLU MLP, tied or separate input / output embeddings. Parameter
paths mirror the Hugging Face names (``model.layers[i].self_attn.o_proj.kernel`` is
``model.layers.{i}.self_attn.o_proj.weight`` transposed), except two fused projections
(vLLM's QKVParallelLinear and MergedColumnParallelLinear), which turn seven skinny
matmuls per layer into four:

* ``self_attn.qkv_proj.kernel`` ``[hidden, Hk, group + 2, D]`` (``group = Hq // Hk``):
  per KV head ``j``, its query heads ``j * group ... j * group + group - 1``, then its
  key head, then its value head. Query head ``h`` is Hugging Face's query head ``h``.
* ``mlp.gate_up_proj.kernel`` ``[hidden, 2, intermediate]``: gate, then up.

`jax_paged_attn.models.checkpoint` maps Hugging Face's separate q / k / v and gate / up
tensors into and out of them.

Two forwards share the parameters:

* `LlamaForCausalLM.__call__`: the serving forward. Tokens of all sequences are
  packed along one axis (``[T]``, vLLM's layout: prefill tokens first, then decode
  tokens), attention reads and writes a paged KV cache per layer through
  `jax_paged_attn.layer.PagedAttention`, the batch is described by a
  `FlashAttentionMetadata`.
* `LlamaForCausalLM.forward_dense`: a plain causal forward over ``[B, S]`` token
  ids with no cache, in `jax.numpy`: the oracle the paged forward and the engine
  are tested against.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged_attn import cache as cache_ops
from jax_paged_attn import matmul, norm, reference
from jax_paged_attn.layer import PagedAttention

Array = jax.Array

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family model (the fields of a Hugging Face config.json).

    Frozen and hashable: the config is a static attribute of the NNX modules, so it is
    part of the graph definition that `jax.jit` caches on.

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_hidden_layers: as in Hugging Face.
      num_attention_heads: query heads ``Hq``.
      num_key_value_heads: KV heads ``Hk`` (``Hq`` must be a multiple: GQA / MQA).
      head_dim: ``D``; a supported head size (multiples of 16 from 32 to 256).
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: rotary base.
      rope_scaling: None (plain rotary embeddings, Hugging Face's rope type "default"),
        or the scaling entries of Hugging Face's ``rope_scaling`` / ``rope_parameters``
        dict frozen as sorted ``(key, value)`` pairs, with ``rope_type`` "linear"
        (needs ``factor``) or "llama3" (needs ``factor``, ``low_freq_factor``,
        ``high_freq_factor``, ``original_max_position_embeddings``). Use
        `rope_scaling_dict` to read it.
      max_position_embeddings: informational (positions are not bounded by the model).
      tie_word_embeddings: the output projection is the transposed input embedding.
      sliding_window: None, or the number of most recent tokens (the current one
        included) a token attends to (Mistral's convention).
      model_type: "llama" or "mistral" (only written back to config.json).
      eos_token_id: the token id(s) that end a generation: None, an int, or a tuple of
        ints (Llama 3 instruct models have several). Not part of the architecture:
        `jax_paged_attn.models.load_checkpoint` ignores it when it compares configs.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even (rotary pairs), got {self.head_dim}.")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(f"LlamaConfig.sliding_window must be None or an int >= 1, got {self.sliding_window!r}.")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}.")
        _check_rope_scaling(self.rope_scaling_dict(), "LlamaConfig.rope_scaling")
        object.__setattr__(self, "eos_token_id",
                           _normalize_eos_token_id(self.eos_token_id, "LlamaConfig.eos_token_id"))

    def rope_scaling_dict(self) -> dict[str, Any]:
        """The ``rope_scaling`` entries as a dict (empty when there is none)."""
        return dict(self.rope_scaling or ())

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "LlamaConfig":
        """Builds a config from the dict of a Hugging Face ``config.json``.

        Reads the rope settings in both spellings (``rope_theta`` / ``rope_scaling``, and
        transformers 5's ``rope_parameters``) and ``eos_token_id`` (an int or a list).

        Raises ValueError naming the field for features this model does not implement
        (biases in the projections, an activation other than SiLU, a rope type other
        than "default", "linear" and "llama3", per-layer-type rope parameters) and for
        rope spellings that disagree.
        """
        if not isinstance(hf_config, Mapping):
            raise TypeError(f"hf_config must be a dict (a parsed config.json), got {type(hf_config).__name__}.")
        model_type = hf_config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}.")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf_config]
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}.")
        for flag in ("attention_bias", "mlp_bias"):
            if hf_config.get(flag, False):
                raise ValueError(f"config.json sets {flag}=true; biases in the projections are not supported.")
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r}; only 'silu' (SwiGLU) is supported.")
        num_heads = int(hf_config["num_attention_heads"])
        head_dim = hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads
        rope_theta, rope_scaling = _rope_from_hf_config(hf_config)
        sliding_window = hf_config.get("sliding_window")
        if hf_config.get("use_sliding_window") is False:
            sliding_window = None
        return cls(
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=int(hf_config["hidden_size"]),
            intermediate_size=int(hf_config["intermediate_size"]),
            num_hidden_layers=int(hf_config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf_config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            sliding_window=None if sliding_window is None else int(sliding_window),
            model_type=model_type,
            eos_token_id=_normalize_eos_token_id(hf_config.get("eos_token_id"), "config.json eos_token_id"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict that `from_hf_config` reads back to this config."""
        out: dict[str, Any] = {
            "architectures": ["MistralForCausalLM" if self.model_type == "mistral" else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling_dict(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.eos_token_id is not None:
            out["eos_token_id"] = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return out

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """A 2-layer model for tests: hidden 64, 4 query heads, 2 KV heads of size 32, vocab 128."""
        fields = dict(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512,
        )
        fields.update(overrides)
        return cls(**fields)


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


DEFAULT_ROPE_THETA = 10000.0
"""Hugging Face's rotary base when a config names none."""

ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""The entries each supported rope type reads (besides ``rope_type`` and ``rope_theta``)."""


def _check_rope_scaling(scaling: Mapping[str, Any], field: str) -> None:
    """Raises ValueError naming ``field`` for an unsupported rope type or a missing / bad entry."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{field}['rope_type'] = {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES} "
            f"(other rope types would silently give wrong positions)."
        )
    for key in ROPE_REQUIRED_KEYS[rope_type]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{field}[{key!r}] must be a positive number for rope_type {rope_type!r}, got {value!r}.")


def _rope_entries(value: Any, field: str) -> dict[str, Any] | None:
    """A config.json rope dict as a plain dict with ``rope_type`` (older files spell it ``type``)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"config.json {field} must be a dict or null, got {value!r}.")
    entries = {str(k): v for k, v in value.items()}
    if "type" in entries and "rope_type" not in entries:
        entries["rope_type"] = entries.pop("type")
    return entries


def _frozen_scaling(entries: dict[str, Any], field: str) -> tuple[tuple[str, Any], ...] | None:
    """`LlamaConfig.rope_scaling` of a rope dict: None for plain rotary embeddings."""
    scaling = {k: v for k, v in entries.items() if k != "rope_theta"}
    _check_rope_scaling(scaling, f"config.json {field}")
    if scaling.get("rope_type", "default") == "default":
        return None
    return tuple(sorted((k, _freeze(v)) for k, v in scaling.items()))


def _rope_from_hf_config(hf_config: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """``(rope_theta, rope_scaling)`` of a config.json in either spelling.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling`` (null, or a dict with
    ``rope_type``); transformers 5 writes one ``rope_parameters`` dict holding
    ``rope_type``, ``rope_theta`` and the scaling entries. Both are read. When a file
    has both spellings they must agree: whichever one we picked, the other could be the
    one the checkpoint was trained with.
    """
    legacy_theta = hf_config.get("rope_theta")
    legacy = _rope_entries(hf_config.get("rope_scaling"), "rope_scaling")
    legacy_scaling = None if legacy is None else _frozen_scaling(legacy, "rope_scaling")
    params = _rope_entries(hf_config.get("rope_parameters"), "rope_parameters")
    if params is None:
        theta = DEFAULT_ROPE_THETA if legacy_theta is None else legacy_theta
        return _rope_theta(theta, "rope_theta"), legacy_scaling
    nested = sorted(k for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        raise ValueError(
            f"config.json rope_parameters holds one dict per layer type ({nested}); this model uses one "
            f"rotary embedding in every layer."
        )
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(
            f"config.json rope_parameters['partial_rotary_factor'] = {partial!r} is not supported (only 1.0: "
            f"every channel rotates).")
    theta = params.get("rope_theta")
    if theta is None:
        theta = DEFAULT_ROPE_THETA if legacy_theta is None else legacy_theta
    elif legacy_theta is not None and _rope_theta(legacy_theta, "rope_theta") != _rope_theta(
            theta, "rope_parameters['rope_theta']"):
        raise ValueError(
            f"config.json sets rope_theta = {legacy_theta!r} and rope_parameters['rope_theta'] = {theta!r}; "
            f"they must agree.")
    scaling = _frozen_scaling(params, "rope_parameters")
    if legacy is not None and legacy_scaling != scaling:
        raise ValueError(
            f"config.json sets rope_scaling = {hf_config.get('rope_scaling')!r} and rope_parameters = "
            f"{hf_config.get('rope_parameters')!r}; they must describe the same rope.")
    return _rope_theta(theta, "rope_parameters['rope_theta']"), scaling


def _rope_theta(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config.json {field} must be a positive number, got {value!r}.")
    return float(value)


def _normalize_eos_token_id(value: Any, field: str) -> int | tuple[int, ...] | None:
    """None, an int id, or a tuple of ids (a list becomes a tuple: the config is hashable)."""

    def token_id(x: Any) -> int:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"{field} must be None, a token id (int >= 0) or a list of them, got {value!r}.")
        return int(x)

    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        ids = tuple(token_id(x) for x in value)
        return ids or None  # an empty list names no end token, like null
    return token_id(value)


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 ``[head_dim // 2]``: the rotary angle per position of each pair of channels.

    Implements Hugging Face's "default", "linear" and "llama3" rope types.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling_dict()
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: Array, inv_freq: np.ndarray, dtype: Any) -> tuple[Array, Array]:
    """``(cos, sin)`` ``[..., D]`` in ``dtype`` of each token's rotary angles
    (``positions`` ``[...]`` int), both halves equal; angles computed in float32 and, like
    Hugging Face, cast to the activations' dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates ``x`` ``[..., H, D]`` by its token's position ``positions`` ``[...]`` (int).

    Rotate-half layout: channel ``c < D/2`` pairs with ``c + D/2``
    (`jax_paged_attn.reference.rotary_embedding`: float32 math over x and the cos / sin
    of `rope_cos_sin`, rounded once to x's dtype, as the fused rotary + cache-write
    kernel computes it).
    """
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    return reference.rotary_embedding(x, cos, sin)


class RMSNorm(nnx.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalized in float32 then cast back to x's dtype."""

    def __init__(self, features: int, *, eps: float, param_dtype: Any = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = self.weight[...] * normed.astype(x.dtype)
        return out.astype(x.dtype)

    def add_and_norm(self, partials: Array, residual: Array, *, implementation: str | None,
                     interpret: bool) -> tuple[Array, Array]:
        """``(hidden, self(hidden))`` for ``hidden = residual + partials.sum(0)`` (the sum
        rounded once to the residual's dtype), in one kernel (`jax_paged_attn.norm.add_rms_norm`)."""
        return norm.add_rms_norm(partials, residual, self.weight[...], eps=self.eps, partials=True,
                                 implementation=implementation, interpret=interpret)


def _linear(in_features: int, out_features: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def _project(module: nnx.Linear | nnx.LinearGeneral, x: Array, *, serving: bool, implementation: str | None,
             interpret: bool, partials: bool = False) -> Array:
    """``module(x)``; in the serving forward through `jax_paged_attn.matmul.linear` over the
    module's kernel (``implementation`` picks XLA's dot or the weight-streaming matmul), in
    the module's compute dtype as the module would; ``partials``: as
    `jax_paged_attn.matmul.linear_partials`' ``[S, ..., *out]``."""
    if not serving:
        return module(x)
    product = matmul.linear_partials if partials else matmul.linear
    return product(x.astype(module.dtype or x.dtype), module.kernel[...], implementation=implementation,
                   interpret=interpret)


def kv_head_replicas_on(config: LlamaConfig, mesh: jax.sharding.Mesh | None, tensor_parallel_axis: str) -> int:
    """Copies of each KV head a model of ``config`` stores on ``mesh``: 1 without a mesh,
    else `jax_paged_attn.parallel.kv_head_replicas` for the mesh's tensor-parallel size
    (its ValueError names head counts the mesh cannot split)."""
    if mesh is None:
        return 1
    from jax_paged_attn import parallel

    return parallel.kv_head_replicas(config.num_attention_heads, config.num_key_value_heads,
                                     parallel.tensor_parallel_size(mesh, tensor_parallel_axis))


class LlamaAttention(nnx.Module):
    """Self-attention: the fused q/k/v projection, rotary embeddings, paged attention, o_proj.

    ``qkv_proj.kernel`` is ``[hidden, Hk, group + 2, D]`` with ``group = Hq // Hk``: along
    axis 2, KV head ``j``'s ``group`` query heads (query heads ``j * group + i``, Hugging
    Face's order), then its key head, then its value head. One matmul computes all three;
    tensor parallelism shards axis 1 (`jax_paged_attn.parallel`), so each device computes
    whole GQA groups with their keys and values for any degree dividing ``Hk``, and no
    output needs re-sharding before attention.

    With fewer KV heads than devices (a mesh of ``tp > Hk`` devices, ``tp % Hk == 0``)
    each KV head is stored ``r = tp // Hk`` times (`kv_head_replicas`,
    `jax_paged_attn.parallel.kv_head_replicas`): the kernel is ``[hidden, Hk * r, group / r
    + 2, D]`` in `jax_paged_attn.parallel.replicate_kv_heads`' layout and the cache holds
    ``Hk * r`` heads, one a device. The copies are drawn once (the same draw as without
    replication, so a model with and without a mesh from one seed are the same model)
    and a checkpoint fills them from the same tensors.
    """

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, kv_cache_dtype: str,
                 implementation: str | None, interpret: bool, mesh: jax.sharding.Mesh | None,
                 tensor_parallel_axis: str, rngs: nnx.Rngs, matmul_implementation: str | None = None):
        self.config = config
        self.matmul_implementation = matmul_implementation
        self.interpret = interpret
        self.kv_head_replicas = kv_head_replicas_on(config, mesh, tensor_parallel_axis)
        hq, hk, d = config.num_attention_heads, self.num_kv_heads, config.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # LinearGeneral contracts x's last axis with the 4-D kernel in one dot_general (no
        # reshape of the kernel) and initializes it like a [hidden, (group + 2) * Hk * D] Linear.
        self.qkv_proj = nnx.LinearGeneral(config.hidden_size, (hk, self.queries_per_kv_head + 2, d),
                                          use_bias=False, kernel_init=self._replicated_kernel_init(), **kw)
        self.o_proj = _linear(hq * d, config.hidden_size, **kw)
        self.attn = PagedAttention(
            num_heads=hq, head_size=d, num_kv_heads=hk, scale=d ** -0.5,
            sliding_window=config.sliding_window, kv_cache_dtype=kv_cache_dtype,
            implementation=implementation, interpret=interpret, mesh=mesh,
            tensor_parallel_axis=tensor_parallel_axis,
        )

    @property
    def num_kv_heads(self) -> int:
        """The KV heads the kernel and the cache hold: ``Hk * kv_head_replicas``."""
        return self.config.num_key_value_heads * self.kv_head_replicas

    @property
    def queries_per_kv_head(self) -> int:
        """``group = Hq // num_kv_heads``: the query heads that share one stored KV head."""
        return self.config.num_attention_heads // self.num_kv_heads

    def _replicated_kernel_init(self) -> Callable[..., Array]:
        """LinearGeneral's default initializer for the flat ``[hidden, out]`` kernel,
        drawing the unreplicated kernel and copying its KV heads (`kv_head_replicas`), so
        the copies are equal and the draw is the one a model without replication makes."""
        from jax_paged_attn import parallel

        cfg, replicas = self.config, self.kv_head_replicas
        original = (cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads + 2, cfg.head_dim)

        def init(key: Array, shape: tuple[int, ...], dtype: Any) -> Array:
            kernel = nnx.nn.linear.default_kernel_init(key, (shape[0], math.prod(original)), dtype)
            kernel = parallel.replicate_kv_heads(kernel.reshape(shape[0], *original), cfg.num_attention_heads,
                                                 replicas)
            return kernel.reshape(shape)

        return init

    def _qkv(self, x: Array, positions: Array, *, serving: bool, partials: bool = False
             ) -> tuple[Array, Array, Array]:
        """``x`` ``[..., hidden]`` -> (the fused projection ``[..., Hk, group + 2, D]``, and
        cos / sin ``[..., D]`` of the tokens' rotary angles in its dtype) (``serving``: the
        product through `jax_paged_attn.matmul.linear`; ``partials``: as its split-K
        partials ``[S, ..., Hk, group + 2, D]``)."""
        qkv = _project(self.qkv_proj, x, serving=serving, implementation=self.matmul_implementation,
                       interpret=self.interpret, partials=partials)
        dtype = self.qkv_proj.dtype or x.dtype
        cos, sin = rope_cos_sin(positions, rope_inverse_frequencies(self.config), dtype)
        return qkv, cos, sin

    def project_qkv(self, x: Array, positions: Array, *, serving: bool = False) -> tuple[Array, Array, Array]:
        """``x`` ``[..., hidden]`` -> rotated q ``[..., Hq, D]``, rotated k and v ``[..., Hk, D]``
        (``serving``: the product through `jax_paged_attn.matmul.linear`)."""
        cfg = self.config
        group = self.queries_per_kv_head
        qkv, cos, sin = self._qkv(x, positions, serving=serving)
        # Merging (Hk, group) gives query head j * group + i; the merged axis keeps the Hk
        # axis's sharding (it is the major one), so this reshape moves no data across devices.
        q = qkv[..., :group, :].reshape(*x.shape[:-1], cfg.num_attention_heads, cfg.head_dim)
        k = qkv[..., group, :]
        v = qkv[..., group + 1, :]
        return reference.rotary_embedding(q, cos, sin), reference.rotary_embedding(k, cos, sin), v

    def fuses_rotary_and_cache(self, kv_cache: Array, metadata: Any) -> bool:
        """Whether the serving forward rotates q / k and writes the cache in one op
        (`jax_paged_attn.cache.rotary_and_cache_flash_kv`): with a cache, when every
        token's attention reads its keys from the cache (decodes, and prefills through
        block tables). Static: shapes and metadata's static fields."""
        return kv_cache.size > 0 and (metadata.num_prefill_tokens == 0 or metadata.has_block_tables)

    def _rotary_and_cache(self, qkv: Array, cos: Array, sin: Array, kv_cache: Array,
                          slot_mapping: Array, *, partials: bool = False) -> tuple[Array, Array]:
        """`jax_paged_attn.cache.rotary_and_cache_flash_kv` with the layer's cache settings;
        with a mesh, on each device's KV heads (`jax_paged_attn.parallel.kv_head_parallel`).
        ``partials``: ``qkv`` is the projection's split-K partials (no mesh: the kernel
        that makes them is not partitioned)."""
        attn = self.attn
        extra = dict(partials=True, dtype=cos.dtype) if partials else {}

        def write(qkv, cos, sin, kv_cache, slot_mapping, k_scale, v_scale):
            return cache_ops.rotary_and_cache_flash_kv(
                qkv, cos, sin, kv_cache, slot_mapping, attn.kv_cache_dtype, k_scale, v_scale,
                implementation=attn.implementation, interpret=self.interpret, **extra)

        if attn.mesh is not None:
            assert not partials, "split-K partials come from the weight-streaming kernel, never with a mesh"
            from jax_paged_attn import parallel

            write = parallel.kv_head_parallel(write, mesh=attn.mesh, axis_name=attn.tensor_parallel_axis)
        return write(qkv, cos, sin, kv_cache, slot_mapping, attn.k_scale, attn.v_scale)

    def __call__(self, x: Array, positions: Array, kv_cache: Array, metadata: Any, *,
                 partials: bool = False) -> tuple[Array, Array]:
        """Packed tokens ``x`` ``[T, hidden]`` -> (``[T, hidden]``, the updated kv_cache);
        ``partials`` (the fused decoder layers): the o projection as
        `jax_paged_attn.matmul.linear_partials`' ``[S, T, hidden]``, and the q/k/v
        projection's partials summed by the fused rotary + cache write."""
        num_tokens = x.shape[0]
        if self.fuses_rotary_and_cache(kv_cache, metadata):
            # [T, Hk, group + 2, D] (partials: [S, T, ...], summed by the fused op), [T, D] x 2
            qkv, cos, sin = self._qkv(x, positions, serving=True, partials=partials)
            q, kv_cache = self._rotary_and_cache(qkv, cos, sin, kv_cache, metadata.slot_mapping, partials=partials)
            out, kv_cache = self.attn(q.reshape(num_tokens, -1), None, None, kv_cache, metadata)
        else:
            q, k, v = self.project_qkv(x, positions, serving=True)
            out, kv_cache = self.attn(
                q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), kv_cache, metadata
            )
        return _project(self.o_proj, out, serving=True, implementation=self.matmul_implementation,
                        interpret=self.interpret, partials=partials), kv_cache

    def dense(self, x: Array) -> Array:
        """``[B, S, hidden]`` -> ``[B, S, hidden]``: causal attention over the whole sequence, no cache."""
        cfg = self.config
        batch, seq = x.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        q, k, v = self.project_qkv(x, positions)
        hk, group, d = self.num_kv_heads, self.queries_per_kv_head, cfg.head_dim
        # Heads first and a KV head's query heads stacked along the rows, so both products
        # are plain batched matmuls ([B, Hk] batches): on a CPU, 2-3x faster than the same
        # contraction with the group axis between heads and rows.
        qg = q.astype(jnp.float32).reshape(batch, seq, hk, group, d).transpose(0, 2, 3, 1, 4)
        kt, vt = (t.astype(jnp.float32).transpose(0, 2, 1, 3) for t in (k, v))  # [B, Hk, S, D]
        scores = jnp.einsum("bhmd,bhkd->bhmk", qg.reshape(batch, hk, group * seq, d), kt,
                            precision=jax.lax.Precision.HIGHEST) * (d ** -0.5)
        i = jnp.arange(seq)[:, None]
        j = jnp.arange(seq)[None, :]
        visible = j <= i
        if cfg.sliding_window is not None:
            visible &= j > i - cfg.sliding_window
        scores = jnp.where(visible, scores.reshape(batch, hk, group, seq, seq), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).reshape(batch, hk, group * seq, seq)
        out = jnp.einsum("bhmk,bhkd->bhmd", probs, vt, precision=jax.lax.Precision.HIGHEST)
        out = out.reshape(batch, hk, group, seq, d).transpose(0, 3, 1, 2, 4)
        out = out.reshape(batch, seq, cfg.num_attention_heads * d).astype(x.dtype)
        return self.o_proj(out)


@functools.lru_cache(maxsize=None)  # one function per size: an initializer a module keeps is in its graphdef
def _gate_up_kernel_init(intermediate_size: int) -> Callable[..., Array]:
    """`nnx.LinearGeneral`'s default draw of the flat ``[hidden, 2 * intermediate]``
    kernel (LeCun normal, fan-in ``hidden``; the same values, which threefry draws per
    flat index), drawn in the ``[hidden, 2, intermediate]`` shape. Tensor parallelism
    shards the intermediate axis, minor to the 2 in the flat kernel: XLA would draw the
    flat kernel whole on every device (`jax_paged_attn.parallel.init_sharded`); drawn
    in this shape each device draws only its own columns."""
    draw = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))

    def init(key: Array, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        return draw(key, (shape[0], 2, intermediate_size), dtype).reshape(shape)

    return init


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate) * up)`` with gate and up from one fused projection.

    ``gate_up_proj.kernel`` is ``[hidden, 2, intermediate]`` (index 0 gate, 1 up): one
    matmul instead of two. Tensor parallelism shards the intermediate (last) axis, so each
    device's gate and up columns pair up locally.
    """

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
                 matmul_implementation: str | None = None, interpret: bool = False):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.matmul_implementation = matmul_implementation
        self.interpret = interpret
        self.gate_up_proj = nnx.LinearGeneral(config.hidden_size, (2, config.intermediate_size), use_bias=False,
                                              kernel_init=_gate_up_kernel_init(config.intermediate_size), **kw)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, **kw)

    def __call__(self, x: Array, *, serving: bool = False) -> Array:
        """``[..., hidden]`` -> ``[..., hidden]`` (``serving``: products through
        `jax_paged_attn.matmul.linear`)."""
        how = dict(serving=serving, implementation=self.matmul_implementation, interpret=self.interpret)
        gate_up = _project(self.gate_up_proj, x, **how)  # [..., 2, intermediate]
        return _project(self.down_proj, jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], **how)

    def partials(self, x: Array) -> Array:
        """The serving forward as `jax_paged_attn.matmul.linear_partials`' ``[S, ..., hidden]``,
        the activation inside the gate/up product (`jax_paged_attn.matmul.gated_linear`)."""
        how = dict(implementation=self.matmul_implementation, interpret=self.interpret)
        x = x.astype(self.gate_up_proj.dtype or x.dtype)
        hidden = matmul.gated_linear(x, self.gate_up_proj.kernel[...], **how)
        return _project(self.down_proj, hidden, serving=True, partials=True, **how)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP. Arguments as `LlamaForCausalLM`'s."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, kv_cache_dtype: str,
                 implementation: str | None, interpret: bool, mesh: jax.sharding.Mesh | None,
                 tensor_parallel_axis: str, rngs: nnx.Rngs, matmul_implementation: str | None = None):
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = LlamaAttention(
            config, dtype=dtype, param_dtype=param_dtype, kv_cache_dtype=kv_cache_dtype,
            implementation=implementation, interpret=interpret, mesh=mesh,
            tensor_parallel_axis=tensor_parallel_axis, rngs=rngs, matmul_implementation=matmul_implementation)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = LlamaMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                            matmul_implementation=matmul_implementation, interpret=interpret)

    def __call__(self, x: Array, positions: Array, kv_cache: Array, metadata: Any) -> tuple[Array, Array]:
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x), serving=True), kv_cache

    def fused(self, x: Array, pending: Array | None, positions: Array, kv_cache: Array, metadata: Any, *,
              norm_implementation: str | None) -> tuple[Array, Array, Array]:
        """The serving forward with each residual add fused into the next norm
        (`RMSNorm.add_and_norm`): ``x`` ``[T, hidden]`` is the residual stream before
        ``pending``, the previous layer's MLP output as partial products ``[S, T, hidden]``
        (None for the first layer). Returns (the residual stream after attention, this
        layer's MLP output as partials, the updated kv_cache)."""
        how = dict(implementation=norm_implementation, interpret=self.self_attn.interpret)
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(pending, x, **how)
        attn_partials, kv_cache = self.self_attn(h, positions, kv_cache, metadata, partials=True)
        x, h = self.post_attention_layernorm.add_and_norm(attn_partials, x, **how)
        return x, self.mlp.partials(h), kv_cache

    def dense(self, x: Array) -> Array:
        x = x + self.self_attn.dense(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    """Embedding, decoder layers and the final norm (Hugging Face's ``model.`` prefix).
    Arguments as `LlamaForCausalLM`'s."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, kv_cache_dtype: str,
                 implementation: str | None, interpret: bool, mesh: jax.sharding.Mesh | None,
                 tensor_parallel_axis: str, rngs: nnx.Rngs, matmul_implementation: str | None = None):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            LlamaDecoderLayer(config, dtype=dtype, param_dtype=param_dtype, kv_cache_dtype=kv_cache_dtype,
                              implementation=implementation, interpret=interpret, mesh=mesh,
                              tensor_parallel_axis=tensor_parallel_axis, rngs=rngs,
                              matmul_implementation=matmul_implementation)
            for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)


class LlamaForCausalLM(nnx.Module):
    """Llama-family causal LM over a paged KV cache.

    Args:
      config: the `LlamaConfig`.
      rngs: initializes the parameters (ignored values when a checkpoint is loaded).
      dtype: compute dtype of activations (float32, bfloat16, float16).
      param_dtype: dtype parameters are stored in.
      kv_cache_dtype: "auto" (the compute dtype), "fp8" / "fp8_e4m3" (float8_e4m3fn) or
        "fp8_e5m2": what `allocate_kv_caches` allocates and the layers write.
      implementation: attention implementation, None / "auto", "xla" or "triton"
        (see `jax_paged_attn.dispatch`).
      matmul_implementation: the decoder layers' projections in the serving forward
        (`__call__`): "xla" (XLA's dot), "weight_streaming" (the Pallas kernel; refused
        with a mesh, where the kernel is not partitioned over devices) or None / "auto"
        (the kernel for 16-bit decode-sized products on the H200 without a mesh, else
        XLA's dot: `jax_paged_attn.matmul.AUTO_CHOICE`). With the kernel, a
        forward of at most `tuning.MATMUL_MAX_ROWS` tokens also fuses each residual add
        into the next RMSNorm and the SwiGLU into the gate/up product
        (`LlamaDecoderLayer.fused`); larger forwards (prefills) use XLA's dot. The dense
        forward and the LM head always use XLA's dot.
      interpret: run Pallas kernels in interpret mode (CPU tests).
      mesh, tensor_parallel_axis: tensor parallelism over heads; see
        `jax_paged_attn.parallel`. With a mesh each device creates only its own shard of
        each parameter (`parallel.init_sharded`; the values are those the same ``rngs``
        give without a mesh) and attention runs under `jax.shard_map`. A mesh with more
        devices than KV heads replicates them (`kv_head_replicas`); ``config`` stays the
        checkpoint's.

    Attributes:
      kv_head_replicas: copies of each KV head the model stores: 1, or ``tp // Hk`` on a
        mesh of ``tp`` devices with fewer KV heads than devices
        (`jax_paged_attn.parallel.kv_head_replicas`, whose ValueError names the head
        counts a mesh cannot split); ``num_cache_kv_heads`` is ``Hk * kv_head_replicas``.

    Parameter paths: ``model.embed_tokens.embedding`` ``[vocab, hidden]``,
    ``model.layers[i].self_attn.qkv_proj.kernel`` ``[hidden, Hk', Hq // Hk' + 2, D]`` with
    ``Hk' = num_cache_kv_heads`` (`LlamaAttention`),
    ``model.layers[i].self_attn.o_proj.kernel`` ``[Hq * D, hidden]``,
    ``model.layers[i].mlp.gate_up_proj.kernel`` ``[hidden, 2, intermediate]`` (`LlamaMLP`),
    ``model.layers[i].mlp.down_proj.kernel`` ``[intermediate, hidden]``,
    ``model.layers[i].{input,post_attention}_layernorm.weight``, ``model.norm.weight``,
    ``lm_head.kernel`` ``[hidden, vocab]`` (absent when embeddings are tied).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        kv_cache_dtype: str = "auto",
        implementation: str | None = None,
        interpret: bool = False,
        mesh: jax.sharding.Mesh | None = None,
        tensor_parallel_axis: str = "tp",
        matmul_implementation: str | None = None,
    ):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}.")
        matmul.check_implementation(matmul_implementation, "matmul_implementation")
        if mesh is not None and matmul_implementation == "weight_streaming":
            raise ValueError("matmul_implementation='weight_streaming' cannot run with a mesh: the kernel is "
                             "not partitioned over devices; use None or 'xla'.")
        self.matmul_implementation = matmul_implementation
        # Auto never takes the kernel with a mesh: it is not partitioned over devices.
        layers_matmul = "xla" if mesh is not None and matmul_implementation in (None, "auto") \
            else matmul_implementation
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.mesh = mesh
        self.tensor_parallel_axis = tensor_parallel_axis
        # Derived from the mesh, not stored in config: config stays the checkpoint's, which
        # load_checkpoint compares with config.json. Raises for heads the mesh cannot split.
        self.kv_head_replicas = kv_head_replicas_on(config, mesh, tensor_parallel_axis)
        # Validates the cache dtype name early (raises ValueError naming kv_cache_dtype).
        cache_ops.get_kv_cache_dtype(kv_cache_dtype, self.dtype)

        def build(rngs: nnx.Rngs) -> dict[str, Any]:
            model = LlamaModel(
                config, dtype=self.dtype, param_dtype=param_dtype, kv_cache_dtype=kv_cache_dtype,
                implementation=implementation, interpret=interpret, mesh=mesh,
                tensor_parallel_axis=tensor_parallel_axis, rngs=rngs, matmul_implementation=layers_matmul,
            )
            lm_head = None if config.tie_word_embeddings else _linear(
                config.hidden_size, config.vocab_size, dtype=self.dtype, param_dtype=param_dtype, rngs=rngs)
            return {"model": model, "lm_head": lm_head}  # the keys begin the parameter paths

        if mesh is None:
            parts = build(rngs)
        else:
            from jax_paged_attn import parallel

            parts = parallel.init_sharded(build, rngs, mesh, tensor_parallel_axis)
        self.model, self.lm_head = parts["model"], parts["lm_head"]

    # --- KV cache -------------------------------------------------------------------

    @property
    def num_cache_kv_heads(self) -> int:
        """KV heads of the fused q/k/v kernel and of each cache: ``Hk * kv_head_replicas``."""
        return self.config.num_key_value_heads * self.kv_head_replicas

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache: ``(2, num_blocks, block_size, num_cache_kv_heads, D)``."""
        return tuple(cache_ops.get_kv_cache_shape(
            num_blocks, block_size, self.num_cache_kv_heads, self.config.head_dim))

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[Array]:
        """Zeroed caches, one per layer, in ``kv_cache_dtype``; sharded over KV heads with a mesh."""
        sharding = None
        if self.mesh is not None:
            from jax_paged_attn import parallel

            sharding = parallel.kv_cache_sharding(self.mesh, self.tensor_parallel_axis)
        return [
            cache_ops.allocate_kv_cache(
                num_blocks, block_size, self.num_cache_kv_heads, self.config.head_dim,
                kv_cache_dtype=self.kv_cache_dtype, model_dtype=self.dtype, sharding=sharding,
            )
            for _ in range(self.config.num_hidden_layers)
        ]

    # --- forwards -------------------------------------------------------------------

    def __call__(
        self,
        input_ids: Array,
        positions: Array,
        kv_caches: Sequence[Array],
        metadata: Any,
        *,
        logits_indices: Array | None = None,
    ) -> tuple[Array, list[Array]]:
        """Serving forward over packed tokens.

        Args:
          input_ids: int32 ``[T]``, tokens of all sequences packed (prefills, then decodes,
            then optional padding, as `FlashAttentionMetadata` describes).
          positions: int32 ``[T]``, each token's position in its sequence (context
            length + index within the new tokens).
          kv_caches: one ``[2, num_blocks, block_size, num_cache_kv_heads, D]`` cache per layer
            (`allocate_kv_caches`), or empty arrays (size 0) for a profiling run that
            writes no cache.
          metadata: the batch's `FlashAttentionMetadata`.
          logits_indices: optional int32 ``[N]``: compute logits only for these token rows
            (e.g. `last_token_indices(metadata)`), avoiding ``T x vocab`` work.

        Returns:
          (logits float32 ``[T, vocab]`` or ``[N, vocab]``, the updated caches as a list).
        """
        if input_ids.ndim != 1:
            raise ValueError(f"input_ids must be [num_tokens], got shape {input_ids.shape}.")
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions must have input_ids' shape {input_ids.shape}, got {positions.shape}.")
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"kv_caches must hold one cache per layer ({self.config.num_hidden_layers}), got {len(kv_caches)}."
            )
        x = self.model.embed_tokens(input_ids)
        new_caches = []
        if self.fuses_residual_norms(x):
            pending = None
            how = dict(norm_implementation=self._norm_implementation())
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, pending, kv_cache = layer.fused(x, pending, positions, kv_cache, metadata, **how)
                new_caches.append(kv_cache)
            if logits_indices is not None:
                x, pending = x[logits_indices], pending[:, logits_indices]
            _, h = self.model.norm.add_and_norm(pending, x, implementation=how["norm_implementation"],
                                                interpret=self.model.layers[0].self_attn.interpret)
            return self.compute_logits(h), new_caches
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, kv_cache = layer(x, positions, kv_cache, metadata)
            new_caches.append(kv_cache)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.compute_logits(self.model.norm(x)), new_caches

    def fuses_residual_norms(self, x: Array) -> bool:
        """Whether the serving forward of these ``[T, hidden]`` tokens runs the fused
        decoder layers (`LlamaDecoderLayer.fused`): when the weight-streaming kernel takes
        its products (`jax_paged_attn.matmul.streams`: ``matmul_implementation=
        "weight_streaming"`` or auto's choice, at most `tuning.MATMUL_MAX_ROWS` tokens),
        whose split-K partials the fused residual add + norm sums. Static: x's shape
        and dtype."""
        layers = self.model.layers
        return bool(layers) and matmul.streams(x, layers[0].mlp.matmul_implementation)

    def _norm_implementation(self) -> str | None:
        """The fused norm's implementation from the attention's: XLA with XLA, the Triton
        kernel with Triton, else auto (the Triton kernel on CUDA: it has no Mosaic GPU form)."""
        attention = self.model.layers[0].self_attn.attn.implementation
        return attention if attention in ("xla", "triton") else None

    def compute_logits(self, hidden: Array) -> Array:
        """Final hidden states ``[..., hidden]`` (already normed) -> float32 logits ``[..., vocab]``."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)

    def forward_dense(self, input_ids: Array) -> Array:
        """Reference forward without a cache: token ids int ``[B, S]`` -> float32 logits ``[B, S, vocab]``.

        Every row is one sequence starting at position 0, attended causally (and with the
        sliding window, if any). Rows may be right-padded: logits at positions before a
        row's padding do not depend on it.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {input_ids.shape}.")
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer.dense(x)
        return self.compute_logits(self.model.norm(x))


def last_token_indices(metadata: Any) -> Array:
    """int32 ``[num_seqs]``: the packed row of each sequence's last new token.

    Pass as ``logits_indices`` to get one logits row per sequence (what sampling needs).
    Built from ``metadata.query_start_loc`` (``[num_seqs + 1]``): row ``b`` of the result is
    metadata sequence ``b`` (prefills, then decodes; `jax_paged_attn.builder.sequence_rows`
    maps scheduled sequences to these rows). Rows of padding sequences are meaningless.
    """
    starts = metadata.query_start_loc
    return (starts[1:] - 1).astype(jnp.int32)


def jit_forward(model: LlamaForCausalLM, *, donate_kv_caches: bool = True) -> Callable[..., tuple[Array, list[Array]]]:
    """The serving forward of ``model`` compiled with `jax.jit`, caches donated (updated in place).

    Returns ``forward(input_ids, positions, kv_caches, metadata, logits_indices=None)
    -> (logits, new_kv_caches)`` with `LlamaForCausalLM.__call__`'s contract. The
    parameters are captured when this is called (later changes to ``model`` are not
    seen) and passed as arguments, not baked into the program. One program is compiled
    per distinct set of shapes and static metadata fields. With ``donate_kv_caches``
    the caches passed in are consumed: keep the returned ones.
    """
    graphdef, state = nnx.split(model)

    def run(state: nnx.State, input_ids: Array, positions: Array, kv_caches: list[Array], metadata: Any,
            logits_indices: Array | None) -> tuple[Array, list[Array]]:
        return nnx.merge(graphdef, state)(input_ids, positions, kv_caches, metadata, logits_indices=logits_indices)

    compiled = jax.jit(run, donate_argnums=(3,) if donate_kv_caches else ())

    def forward(input_ids: Array, positions: Array, kv_caches: Sequence[Array], metadata: Any,
                logits_indices: Array | None = None) -> tuple[Array, list[Array]]:
        return compiled(state, input_ids, positions, list(kv_caches), metadata, logits_indices)

    return forward


def jit_forward_dense(model: LlamaForCausalLM) -> Callable[[Array], Array]:
    """`LlamaForCausalLM.forward_dense` compiled with `jax.jit` (parameters captured now)."""
    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda state, input_ids: nnx.merge(graphdef, state).forward_dense(input_ids))
    return lambda input_ids: compiled(state, input_ids)


def dense_greedy_generate(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]],
                          max_tokens: int) -> list[list[int]]:
    """Reference generation with no cache: greedy argmax over `LlamaForCausalLM.forward_dense`.

    Every step re-runs the whole (right-padded) batch from position 0, so it shares no
    code with the paged path (no cache, no metadata, no scheduler): the oracle the
    engine is tested against. One compiled program for the whole loop.
    """
    lengths = [len(p) for p in prompts]
    width = max(lengths) + max_tokens
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_tokens(state: Any, tokens: Array, last: Array) -> Array:
        logits = nnx.merge(graphdef, state).forward_dense(tokens)  # [B, S, V]
        return jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1)

    outputs: list[list[int]] = [[] for _ in prompts]
    cur = np.asarray(lengths)
    for _ in range(max_tokens):
        nxt = np.asarray(next_tokens(state, tokens, cur - 1))
        tokens[np.arange(len(prompts)), cur] = nxt
        for i, t in enumerate(nxt.tolist()):
            outputs[i].append(int(t))
        cur = cur + 1
    return outputs
