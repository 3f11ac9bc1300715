"""Rotary position embeddings of every rope type the decoder reads from config.json.

Hugging Face's rope types ("default", "linear", "llama3", "dynamic", "yarn"), computed as
transformers computes them (`transformers.modeling_rope_utils`):

* "default", "linear", "llama3", "yarn": fixed inverse frequencies
  (`rope_inverse_frequencies`); yarn also scales cos and sin by its attention factor
  (`rope_attention_factor`).
* "dynamic" (NTK): the base grows with the sequence's length ``L`` once ``L`` exceeds
  ``max_position_embeddings``: ``theta * (factor * L / max_pos - (factor - 1)) **
  (D / (D - 2))``. transformers takes ``L`` as the longest position of the forward + 1
  (and keeps the grown frequencies for later calls). Here each token takes its own
  sequence's length at the end of the forward (`dynamic_inverse_frequencies`): the same
  numbers for one sequence's prefill and each of its decode steps (what
  ``generate`` computes), while keys already in the cache keep the rotation they were
  written with, as in transformers. A sequence recomputed after preemption is rotated
  at its length then (transformers' result for that forward over the whole sequence,
  not ``generate``'s cache: preempt by swapping to keep those numbers). The engine turns
  prefix caching off for these models (`LlamaConfig.rope_depends_on_length`): a cached
  block holds keys rotated at the length of the sequence that wrote it.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import reference
from jax_paged_attn.models.config import LlamaConfig

Array = jax.Array


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 ``[head_dim // 2]``: the rotary angle per position of each pair of channels.

    Hugging Face's "default", "linear", "llama3" and "yarn" rope types; for "dynamic",
    the unscaled frequencies (a sequence no longer than ``max_position_embeddings``).
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
    elif rope_type == "yarn":
        inv_freq = _yarn_inverse_frequencies(config, scaling, inv_freq)
    return inv_freq.astype(np.float32)


def _yarn_factor(config: LlamaConfig, scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:  # transformers infers it from the two context lengths
        return config.max_position_embeddings / float(scaling["original_max_position_embeddings"])
    return float(factor)


def _yarn_inverse_frequencies(config: LlamaConfig, scaling: dict[str, Any], inv_freq: np.ndarray) -> np.ndarray:
    """YaRN's blend of interpolated (``inv_freq / factor``) and extrapolated (``inv_freq``)
    frequencies, ramped over the channels between beta_fast's and beta_slow's rotations."""
    dim, base = config.head_dim, config.rope_theta
    factor = _yarn_factor(config, scaling)
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(config: LlamaConfig) -> float:
    """The factor cos and sin are multiplied by: yarn's ``attention_factor`` (given, or
    ``0.1 * ln(factor) + 1`` with ``mscale`` / ``mscale_all_dim`` as transformers has it),
    else 1."""
    scaling = config.rope_scaling_dict()
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config, scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"])))
    return float(mscale(factor))


def dynamic_inverse_frequencies(config: LlamaConfig, seq_lens: Array) -> Array:
    """float32 ``[..., D // 2]``: dynamic NTK's frequencies for sequences of ``seq_lens``
    ``[...]`` tokens (int), in float32 as transformers computes them."""
    dim = config.head_dim
    factor = float(config.rope_scaling_dict()["factor"])
    max_pos = float(config.max_position_embeddings)
    length = jnp.maximum(seq_lens.astype(jnp.float32), max_pos)[..., None]
    base = config.rope_theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def rope_cos_sin(positions: Array, inv_freq: np.ndarray | Array, dtype: Any,
                 attention_factor: float = 1.0) -> tuple[Array, Array]:
    """``(cos, sin)`` ``[..., D]`` in ``dtype`` of each token's rotary angles
    (``positions`` ``[...]`` int; ``inv_freq`` ``[D/2]``, or ``[..., D/2]`` per token),
    both halves equal; angles computed in float32, scaled by ``attention_factor`` and,
    like Hugging Face, cast to the activations' dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def config_cos_sin(config: LlamaConfig, positions: Array, dtype: Any,
                   seq_lens: Array | None = None) -> tuple[Array, Array]:
    """`rope_cos_sin` of ``config``'s rope type: ``positions`` ``[...]`` int; ``seq_lens``
    ``[...]`` int, each token's sequence length (read by "dynamic" only; None: the
    positions' count along the last axis, a dense forward's)."""
    if config.rope_depends_on_length:
        if seq_lens is None:
            seq_lens = jnp.full(positions.shape, positions.shape[-1], jnp.int32)
        inv_freq = dynamic_inverse_frequencies(config, seq_lens)
    else:
        inv_freq = rope_inverse_frequencies(config)
    return rope_cos_sin(positions, inv_freq, dtype, rope_attention_factor(config))


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates ``x`` ``[..., H, D]`` by its token's position ``positions`` ``[...]`` (int).

    Rotate-half layout: channel ``c < D/2`` pairs with ``c + D/2``
    (`jax_paged_attn.reference.rotary_embedding`: float32 math over x and the cos / sin
    of `rope_cos_sin`, rounded once to x's dtype, as the fused rotary + cache-write
    kernel computes it).
    """
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    return reference.rotary_embedding(x, cos, sin)
