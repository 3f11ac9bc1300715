"""The decoder's configuration: one dataclass for every family the decoder runs.

`LlamaConfig` holds a Hugging Face config.json's architecture. The families differ in a
few declared places, each a field here (`FAMILY_TRAITS` lists each family's values):

=============  ======================================================================
family         what differs from Llama
=============  ======================================================================
llama          (the base: RMSNorm, SwiGLU, rotary embeddings, no biases)
mistral        a sliding window on every layer
qwen2          bias on q / k / v (``attention_bias``); windows on layers from
               ``max_window_layers`` on when ``use_sliding_window``
qwen3          RMSNorm over each head's q and k before the rotation (``qk_norm``);
               head_dim apart from hidden / heads; windows as Qwen2
gemma2         GeGLU with gelu-tanh, four norms a layer (``sandwich_norms``) scaling by
               ``1 + weight`` (``norm_unit_offset``), embeddings times sqrt(hidden),
               ``query_pre_attn_scalar ** -0.5`` as the softmax scale, attention and
               final logits soft-capped, a window on every other layer (even indices)
=============  ======================================================================

`LlamaConfig.from_hf_config` reads a config.json by its ``model_type`` (or
``architectures``); every field it cannot honour is a ValueError naming the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
}
"""config.json ``architectures`` entry -> the ``model_type`` it is."""
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The MLP's gate activations: SwiGLU's SiLU, GeGLU's tanh-approximated GELU."""
LAYER_TYPES = ("full_attention", "sliding_attention")

FAMILY_TRAITS: Mapping[str, Mapping[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(qk_norm=True),
    "gemma2": dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, sandwich_norms=True,
                   scale_embeddings=True),
}
"""The fields each family fixes (the others keep `LlamaConfig`'s defaults)."""

_HF_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    # config.json keys transformers' config classes default when a file omits them.
    "llama": dict(rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mistral": dict(rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2": dict(rms_norm_eps=1e-6, tie_word_embeddings=False, max_window_layers=28),
    "qwen3": dict(rms_norm_eps=1e-6, tie_word_embeddings=False, max_window_layers=28),
    "gemma2": dict(rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a decoder of any supported family (a Hugging Face config.json).

    Frozen and hashable: the config is a static attribute of the NNX modules, so it is
    part of the graph definition that `jax.jit` caches on. The name is historical: the
    same config (and `jax_paged_attn.models.LlamaForCausalLM`) serves every family of
    `SUPPORTED_MODEL_TYPES`; `for_family` builds one with a family's traits.

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
        (``factor``), "llama3" (``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``), "dynamic" (``factor``; NTK scaling by the
        sequence's length, `jax_paged_attn.models.rope`) or "yarn"
        (``original_max_position_embeddings``, optionally ``factor``,
        ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``,
        ``mscale_all_dim``, ``truncate``). Use `rope_scaling_dict` to read it.
      max_position_embeddings: the longest sequence the engine admits by default (and
        dynamic NTK's original context).
      tie_word_embeddings: the output projection is the transposed input embedding.
      sliding_window: None, or the number of most recent tokens (the current one
        included) a windowed layer's token attends to (Mistral's convention).
      layer_types: None (every layer windowed when ``sliding_window`` is set), or one of
        `LAYER_TYPES` per layer: which layers use the window (`layer_window`).
      model_type: one of `SUPPORTED_MODEL_TYPES` (config.json's ``architectures`` and
        the family's config.json keys when written back).
      attention_bias: q / k / v projections have a bias (Qwen2; ``attention_bias`` of
        the other families).
      o_proj_bias: the output projection has a bias (``attention_bias`` of Llama, Qwen3,
        Gemma 2; never Qwen2's).
      qk_norm: an RMSNorm over each head's D channels of q and of k before the rotation
        (Qwen3's ``q_norm`` / ``k_norm``).
      hidden_act: the gate's activation, one of `HIDDEN_ACTIVATIONS`.
      norm_unit_offset: every RMSNorm scales by ``1 + weight`` in float32, then rounds
        (Gemma's); else by ``weight`` after rounding (Llama's).
      sandwich_norms: four norms a layer (Gemma 2): attention's and the MLP's outputs are
        normed before their residual adds, and the MLP's input has its own norm.
      scale_embeddings: embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to
        the compute dtype, as Hugging Face does).
      query_pre_attn_scalar: None (softmax scale ``D ** -0.5``) or ``s`` (scale
        ``s ** -0.5``).
      attn_logit_softcapping: None, or ``c``: attention scores become ``c * tanh(s / c)``
        (through the kernels' ``softcap``).
      final_logit_softcapping: None, or ``c``: logits become ``c * tanh(logits / c)``.
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
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

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
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"LlamaConfig.hidden_act must be one of {HIDDEN_ACTIVATIONS}, got {self.hidden_act!r}.")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            _check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window, "LlamaConfig")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _positive_number(value, f"LlamaConfig.{name}"))
        _check_rope_scaling(self.rope_scaling_dict(), "LlamaConfig.rope_scaling")
        object.__setattr__(self, "eos_token_id",
                           _normalize_eos_token_id(self.eos_token_id, "LlamaConfig.eos_token_id"))

    def rope_scaling_dict(self) -> dict[str, Any]:
        """The ``rope_scaling`` entries as a dict (empty when there is none)."""
        return dict(self.rope_scaling or ())

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to every earlier token)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_cache_window(self) -> int | None:
        """The window outside which the KV cache may drop a sequence's blocks: the window
        when every layer has it, else None (a layer that reads the whole sequence needs
        every block; the engine then keeps them all and windowed layers mask)."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence the model serves: ``max_position_embeddings``, times
        ``factor`` with dynamic NTK rope (which scales past the original context)."""
        if self.rope_depends_on_length:
            return int(self.max_position_embeddings * float(self.rope_scaling_dict()["factor"]))
        return self.max_position_embeddings

    @property
    def rope_depends_on_length(self) -> bool:
        """Whether a key's rotation depends on its sequence's length (dynamic NTK rope): a
        cached block is then only right for the length that wrote it, so the engine turns
        prefix caching off."""
        return self.rope_scaling_dict().get("rope_type") == "dynamic"

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale: ``query_pre_attn_scalar ** -0.5`` or ``D ** -0.5``."""
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @classmethod
    def for_family(cls, model_type: str, **fields: Any) -> "LlamaConfig":
        """A config of ``model_type`` with its `FAMILY_TRAITS` (``fields`` win)."""
        if model_type not in FAMILY_TRAITS:
            raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}.")
        return cls(**{**FAMILY_TRAITS[model_type], "model_type": model_type, **fields})

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "LlamaConfig":
        """Builds a config from the dict of a Hugging Face ``config.json``.

        The family comes from ``model_type`` (else the first ``architectures`` entry).
        Reads the rope settings in both spellings (``rope_theta`` /
        ``rope_scaling``, and transformers 5's ``rope_parameters``), ``layer_types`` (else
        the family's rule: Qwen's ``use_sliding_window`` / ``max_window_layers``, Gemma
        2's every other layer) and ``eos_token_id`` (an int or a list).

        Raises ValueError naming the field for features this model does not implement
        (an MLP bias, an activation the family does not use, a rope type outside
        `SUPPORTED_ROPE_TYPES`, per-layer-type rope parameters, bidirectional attention)
        and for spellings that disagree.
        """
        if not isinstance(hf_config, Mapping):
            raise TypeError(f"hf_config must be a dict (a parsed config.json), got {type(hf_config).__name__}.")
        model_type = _model_type(hf_config)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf_config]
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}.")
        hf_config = {**_HF_DEFAULTS[model_type], **{k: v for k, v in hf_config.items() if v is not None or k in (
            "sliding_window", "final_logit_softcapping", "attn_logit_softcapping")}}
        if hf_config.get("mlp_bias", False):
            raise ValueError("config.json sets mlp_bias=true; biases in the MLP are not supported.")
        if hf_config.get("use_bidirectional_attention", False):
            raise ValueError("config.json sets use_bidirectional_attention=true; this decoder is causal.")
        # transformers' Gemma 2 reads hidden_activation alone (its hidden_act is informational).
        act_key = "hidden_activation" if model_type == "gemma2" else "hidden_act"
        want_act = FAMILY_TRAITS[model_type].get("hidden_act", "silu")
        act = hf_config.get(act_key, want_act)
        if act != want_act:
            raise ValueError(f"config.json {act_key}={act!r}; {model_type} runs {want_act!r} only.")
        num_heads = int(hf_config["num_attention_heads"])
        num_layers = int(hf_config["num_hidden_layers"])
        head_dim = hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads
        rope_theta, rope_scaling = _rope_from_hf_config(hf_config)
        sliding_window, layer_types = _windows_from_hf_config(hf_config, model_type, num_layers)
        bias = bool(hf_config.get("attention_bias", False))
        fields: dict[str, Any] = dict(FAMILY_TRAITS[model_type])
        fields.update(
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=int(hf_config["hidden_size"]),
            intermediate_size=int(hf_config["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf_config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config["rms_norm_eps"]),  # _HF_DEFAULTS holds the default
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf_config["tie_word_embeddings"]),
            sliding_window=sliding_window,
            layer_types=layer_types,
            model_type=model_type,
            # Qwen2's q / k / v always carry a bias and its o_proj never does.
            attention_bias=True if model_type == "qwen2" else bias,
            o_proj_bias=False if model_type == "qwen2" else bias,
            eos_token_id=_normalize_eos_token_id(hf_config.get("eos_token_id"), "config.json eos_token_id"),
        )
        if model_type == "gemma2":
            fields.update(
                query_pre_attn_scalar=_positive_number(hf_config["query_pre_attn_scalar"],
                                                       "config.json query_pre_attn_scalar"),
                attn_logit_softcapping=_optional_positive(hf_config.get("attn_logit_softcapping"),
                                                          "config.json attn_logit_softcapping"),
                final_logit_softcapping=_optional_positive(hf_config.get("final_logit_softcapping"),
                                                           "config.json final_logit_softcapping"),
            )
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict that `from_hf_config` reads back to this config (and
        that transformers reads as its family's config)."""
        architecture = next(a for a, t in ARCHITECTURES.items() if t == self.model_type)
        out: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_activation" if self.model_type == "gemma2" else "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling_dict(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_proj_bias if self.model_type != "qwen2" else False,
            "sliding_window": self.sliding_window,
            "layer_types": [("sliding_attention" if self.layer_window(i) is not None else "full_attention")
                            for i in range(self.num_hidden_layers)],
        }
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            # transformers' Qwen configs drop sliding_window unless use_sliding_window.
            out["use_sliding_window"] = self.sliding_window is not None
        if self.model_type == "gemma2":
            scalar = self.query_pre_attn_scalar
            # transformers' Gemma2Config takes an int here (its strict check refuses 24.0).
            out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                       attn_logit_softcapping=self.attn_logit_softcapping,
                       final_logit_softcapping=self.final_logit_softcapping)
        if self.eos_token_id is not None:
            out["eos_token_id"] = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return out

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """A 2-layer model for tests: hidden 64, 4 query heads, 2 KV heads of size 32, vocab 128
        (``model_type=`` picks a family's traits, `for_family`)."""
        fields = dict(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512,
        )
        fields.update(overrides)
        return cls.for_family(fields.pop("model_type", "llama"), **fields)


def _model_type(hf_config: Mapping[str, Any]) -> str:
    """The family of a config.json: ``model_type``, else its first ``architectures`` entry."""
    model_type = hf_config.get("model_type")
    if model_type is None:
        architectures = hf_config.get("architectures") or ["LlamaForCausalLM"]
        if not isinstance(architectures, list) or architectures[0] not in ARCHITECTURES:
            raise ValueError(f"config.json has no model_type and its architectures {architectures!r} name no "
                             f"supported model; supported: {sorted(ARCHITECTURES)}.")
        model_type = ARCHITECTURES[architectures[0]]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}.")
    return model_type


def _check_layer_types(layer_types: tuple[Any, ...], num_layers: int, sliding_window: Any, owner: str) -> None:
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"{owner} layer_types must list one of {LAYER_TYPES} per layer ({num_layers}), "
                         f"got {list(layer_types)!r}.")
    if sliding_window is None and "sliding_attention" in layer_types:
        raise ValueError(f"{owner} layer_types names sliding_attention layers but sliding_window is null.")


def _windows_from_hf_config(hf_config: Mapping[str, Any], model_type: str,
                            num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a config.json: ``layer_types`` when it has
    them, else the family's rule (Qwen: layers ``>= max_window_layers`` when
    ``use_sliding_window``; Gemma 2: even layers; Llama / Mistral: every layer)."""
    window = hf_config.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf_config.get("use_sliding_window", False):
        window = None  # transformers' Qwen configs ignore the window unless use_sliding_window
    if window is not None:
        window = int(_positive_number(window, "config.json sliding_window"))
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)):
            raise ValueError(f"config.json layer_types must be a list, got {layer_types!r}.")
        layer_types = tuple(layer_types)
        if window is None and model_type in ("qwen2", "qwen3"):
            # Qwen's config keeps sliding layer types with the window switched off.
            layer_types = ("full_attention",) * num_layers if len(layer_types) == num_layers else layer_types
        _check_layer_types(layer_types, num_layers, window, "config.json")
    elif window is None:
        return None, None
    elif model_type in ("qwen2", "qwen3"):
        first = int(hf_config["max_window_layers"])
        layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    elif model_type == "gemma2":
        layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None, None
    if layer_types is not None and all(t == "sliding_attention" for t in layer_types):
        layer_types = None  # every layer windowed: the plain (Mistral) form
    return window, layer_types


def _positive_number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field} must be a positive number, got {value!r}.")
    return float(value)


def _optional_positive(value: Any, field: str) -> float | None:
    return None if value is None else _positive_number(value, field)


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
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
}
"""The entries each supported rope type reads (besides ``rope_type`` and ``rope_theta``)."""
ROPE_OPTIONAL_KEYS = {
    "yarn": ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
"""Numeric entries a rope type reads when present (yarn's ``truncate`` is a bool)."""


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
    for key in ROPE_OPTIONAL_KEYS.get(rope_type, ()):
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{field}[{key!r}] must be a positive number or absent for rope_type {rope_type!r}, "
                             f"got {value!r}.")


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
        return _positive_number(theta, "config.json rope_theta"), legacy_scaling
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
    elif legacy_theta is not None and _positive_number(legacy_theta, "config.json rope_theta") != _positive_number(
            theta, "config.json rope_parameters['rope_theta']"):
        raise ValueError(
            f"config.json sets rope_theta = {legacy_theta!r} and rope_parameters['rope_theta'] = {theta!r}; "
            f"they must agree.")
    scaling = _frozen_scaling(params, "rope_parameters")
    if legacy is not None and legacy_scaling != scaling:
        raise ValueError(
            f"config.json sets rope_scaling = {hf_config.get('rope_scaling')!r} and rope_parameters = "
            f"{hf_config.get('rope_parameters')!r}; they must describe the same rope.")
    return _positive_number(theta, "config.json rope_parameters['rope_theta']"), scaling


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

