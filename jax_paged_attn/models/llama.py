"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2)
in Flax NNX on the paged attention layer.

One decoder serves every family: the families differ in the places `LlamaConfig`
declares (`jax_paged_attn.models.config`: q/k/v and o biases, Qwen3's per-head q / k
norms, Gemma 2's four norms a layer with ``1 + weight`` scaling, GeGLU, soft-capped
attention and logits, its softmax scale and embedding scale, each layer's window),
and each module reads them. The rest follows Hugging Face's ``LlamaForCausalLM``
numerics: RMSNorm in float32 then cast, rotary embeddings in the rotate-half (GPT-NeoX)
layout (cos / sin cast to the activations' dtype as Hugging Face does, the rotation
then computed in float32 and rounded once, where Hugging Face rounds each product: the
fused rotary + cache-write kernel's arithmetic, shared by every forward), grouped-query
attention, a gated MLP, tied or separate input / output embeddings. Parameter
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

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged_attn import cache as cache_ops
from jax_paged_attn import matmul, norm, reference
from jax_paged_attn.layer import PagedAttention
from jax_paged_attn.models.config import (  # noqa: F401 (re-exported: the config's historical home)
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    LlamaConfig,
)
from jax_paged_attn.models.rope import (  # noqa: F401 (re-exported)
    apply_rope,
    config_cos_sin,
    rope_cos_sin,
    rope_inverse_frequencies,
)

Array = jax.Array


class RMSNorm(nnx.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalized in float32 then cast back to x's dtype.

    ``unit_offset`` (Gemma's): the scale is ``1 + weight`` (weight initialized to 0),
    multiplied in float32 before the one rounding, as Hugging Face's ``Gemma2RMSNorm``;
    else Llama's: the normalized rows rounded to x's dtype, then times ``weight``.
    """

    def __init__(self, features: int, *, eps: float, param_dtype: Any = jnp.float32, unit_offset: bool = False):
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((features,), param_dtype))

    @property
    def scale(self) -> Array:
        """The ``[features]`` vector the normalized rows are multiplied by (float32 with ``unit_offset``)."""
        if self.unit_offset:
            return 1.0 + self.weight[...].astype(jnp.float32)
        return self.weight[...]

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * self.scale).astype(x.dtype)
        out = self.weight[...] * normed.astype(x.dtype)
        return out.astype(x.dtype)

    def add_and_norm(self, partials: Array, residual: Array, *, implementation: str | None, interpret: bool,
                     update_norm: "RMSNorm | None" = None) -> tuple[Array, Array]:
        """``(hidden, self(hidden))`` for ``hidden = residual + partials.sum(0)`` (the sum
        rounded once to the residual's dtype), in one kernel (`jax_paged_attn.norm.add_rms_norm`);
        with ``update_norm``, ``hidden = residual + update_norm(partials.sum(0))`` (a
        sublayer's output normed before its residual add: Gemma 2's sandwich norms)."""
        if update_norm is not None and (update_norm.unit_offset, update_norm.eps) != (self.unit_offset, self.eps):
            raise ValueError("update_norm must have this norm's unit_offset and eps (one kernel runs both).")
        return norm.add_rms_norm(partials, residual, self.scale, eps=self.eps, partials=True,
                                 round_before_scale=not self.unit_offset,
                                 update_norm_weight=None if update_norm is None else update_norm.scale,
                                 implementation=implementation, interpret=interpret)


def _linear(in_features: int, out_features: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
            use_bias: bool = False) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def _project(module: nnx.Linear | nnx.LinearGeneral, x: Array, *, serving: bool, implementation: str | None,
             interpret: bool, partials: bool = False) -> Array:
    """``module(x)``; in the serving forward through `jax_paged_attn.matmul.linear` over the
    module's kernel (``implementation`` picks XLA's dot or the weight-streaming matmul), in
    the module's compute dtype as the module would; ``partials``: as
    `jax_paged_attn.matmul.linear_partials`' ``[S, ..., *out]``, a bias added to the
    first partial (the sum is the biased product)."""
    if not serving:
        return module(x)
    product = matmul.linear_partials if partials else matmul.linear
    out = product(x.astype(module.dtype or x.dtype), module.kernel[...], implementation=implementation,
                  interpret=interpret)
    if module.bias is None:
        return out
    bias = module.bias[...].astype(out.dtype)
    return out.at[0].add(bias) if partials else out + bias


def token_seq_lens(metadata: Any, num_tokens: int) -> Array:
    """int32 ``[num_tokens]``: the length of each packed token's sequence after this step
    (``metadata.seq_lens`` of the sequence whose ``query_start_loc`` range holds it;
    padding rows get a real sequence's or 0: their outputs are discarded)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    sequence = jnp.searchsorted(metadata.query_start_loc[1:], rows, side="right")
    sequence = jnp.minimum(sequence, metadata.seq_lens.shape[0] - 1)
    return metadata.seq_lens[sequence].astype(jnp.int32)


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
                 tensor_parallel_axis: str, rngs: nnx.Rngs, matmul_implementation: str | None = None,
                 layer_index: int = 0):
        self.config = config
        self.matmul_implementation = matmul_implementation
        self.interpret = interpret
        self.kv_head_replicas = kv_head_replicas_on(config, mesh, tensor_parallel_axis)
        hq, hk, d = config.num_attention_heads, self.num_kv_heads, config.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # LinearGeneral contracts x's last axis with the 4-D kernel in one dot_general (no
        # reshape of the kernel) and initializes it like a [hidden, (group + 2) * Hk * D] Linear.
        # A bias (Qwen2) is [Hk, group + 2, D], zero-initialized: every KV head copy equal.
        self.qkv_proj = nnx.LinearGeneral(config.hidden_size, (hk, self.queries_per_kv_head + 2, d),
                                          use_bias=config.attention_bias,
                                          kernel_init=self._replicated_kernel_init(), **kw)
        self.o_proj = _linear(hq * d, config.hidden_size, use_bias=config.o_proj_bias, **kw)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's channels, shared by the heads
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = PagedAttention(
            num_heads=hq, head_size=d, num_kv_heads=hk, scale=config.softmax_scale,
            sliding_window=config.layer_window(layer_index), logits_soft_cap=config.attn_logit_softcapping,
            kv_cache_dtype=kv_cache_dtype, implementation=implementation, interpret=interpret, mesh=mesh,
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

    def _qkv(self, x: Array, positions: Array, *, serving: bool, partials: bool = False,
             seq_lens: Array | None = None) -> tuple[Array, Array, Array]:
        """``x`` ``[..., hidden]`` -> (the fused projection ``[..., Hk, group + 2, D]``
        with its bias and q / k norms, and cos / sin ``[..., D]`` of the tokens' rotary
        angles in its dtype) (``serving``: the product through
        `jax_paged_attn.matmul.linear`; ``partials``: as its split-K partials ``[S, ...,
        Hk, group + 2, D]``, only without q / k norms, which need the summed rows;
        ``seq_lens``: each token's sequence length, for dynamic rope scaling)."""
        assert not (partials and self.q_norm is not None), "q / k norms read the summed projection"
        qkv = _project(self.qkv_proj, x, serving=serving, implementation=self.matmul_implementation,
                       interpret=self.interpret, partials=partials)
        if self.q_norm is not None:
            group = self.queries_per_kv_head
            qkv = jnp.concatenate([self.q_norm(qkv[..., :group, :]), self.k_norm(qkv[..., group:group + 1, :]),
                                   qkv[..., group + 1:, :]], axis=-2)
        dtype = self.qkv_proj.dtype or x.dtype
        cos, sin = config_cos_sin(self.config, positions, dtype, seq_lens)
        return qkv, cos, sin

    def project_qkv(self, x: Array, positions: Array, *, serving: bool = False,
                    seq_lens: Array | None = None) -> tuple[Array, Array, Array]:
        """``x`` ``[..., hidden]`` -> rotated q ``[..., Hq, D]``, rotated k and v ``[..., Hk, D]``
        (``serving``: the product through `jax_paged_attn.matmul.linear`)."""
        cfg = self.config
        group = self.queries_per_kv_head
        qkv, cos, sin = self._qkv(x, positions, serving=serving, seq_lens=seq_lens)
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
        seq_lens = token_seq_lens(metadata, num_tokens) if self.config.rope_depends_on_length else None
        if self.fuses_rotary_and_cache(kv_cache, metadata):
            # q / k norms read whole rows: their layer's partials are summed by XLA first.
            qkv_partials = partials and self.q_norm is None
            # [T, Hk, group + 2, D] (partials: [S, T, ...], summed by the fused op), [T, D] x 2
            qkv, cos, sin = self._qkv(x, positions, serving=True, partials=qkv_partials, seq_lens=seq_lens)
            q, kv_cache = self._rotary_and_cache(qkv, cos, sin, kv_cache, metadata.slot_mapping,
                                                 partials=qkv_partials)
            out, kv_cache = self.attn(q.reshape(num_tokens, -1), None, None, kv_cache, metadata)
        else:
            q, k, v = self.project_qkv(x, positions, serving=True, seq_lens=seq_lens)
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
                            precision=jax.lax.Precision.HIGHEST) * cfg.softmax_scale
        if cfg.attn_logit_softcapping is not None:
            cap = cfg.attn_logit_softcapping
            scores = cap * jnp.tanh(scores / cap)
        i = jnp.arange(seq)[:, None]
        j = jnp.arange(seq)[None, :]
        visible = j <= i
        if self.attn.sliding_window is not None:
            visible &= j > i - self.attn.sliding_window
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


ACTIVATIONS = matmul.GATE_ACTIVATIONS
"""`LlamaConfig.hidden_act` -> the gate's activation."""


class LlamaMLP(nnx.Module):
    """A gated MLP: ``down_proj(act(gate) * up)`` with gate and up from one fused projection
    (SwiGLU with SiLU, Gemma's GeGLU with tanh-approximated GELU).

    ``gate_up_proj.kernel`` is ``[hidden, 2, intermediate]`` (index 0 gate, 1 up): one
    matmul instead of two. Tensor parallelism shards the intermediate (last) axis, so each
    device's gate and up columns pair up locally.
    """

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
                 matmul_implementation: str | None = None, interpret: bool = False):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.matmul_implementation = matmul_implementation
        self.interpret = interpret
        self.hidden_act = config.hidden_act
        self.gate_up_proj = nnx.LinearGeneral(config.hidden_size, (2, config.intermediate_size), use_bias=False,
                                              kernel_init=_gate_up_kernel_init(config.intermediate_size), **kw)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, **kw)

    def __call__(self, x: Array, *, serving: bool = False) -> Array:
        """``[..., hidden]`` -> ``[..., hidden]`` (``serving``: products through
        `jax_paged_attn.matmul.linear`)."""
        how = dict(serving=serving, implementation=self.matmul_implementation, interpret=self.interpret)
        gate_up = _project(self.gate_up_proj, x, **how)  # [..., 2, intermediate]
        activation = ACTIVATIONS[self.hidden_act]
        return _project(self.down_proj, activation(gate_up[..., 0, :]) * gate_up[..., 1, :], **how)

    def partials(self, x: Array) -> Array:
        """The serving forward as `jax_paged_attn.matmul.linear_partials`' ``[S, ..., hidden]``,
        the gate's activation (SwiGLU's SiLU, GeGLU's GELU) inside the gate/up product
        (`jax_paged_attn.matmul.gated_linear`)."""
        how = dict(implementation=self.matmul_implementation, interpret=self.interpret)
        x = x.astype(self.gate_up_proj.dtype or x.dtype)
        hidden = matmul.gated_linear(x, self.gate_up_proj.kernel[...], activation=self.hidden_act, **how)
        return _project(self.down_proj, hidden, serving=True, partials=True, **how)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP. Arguments as `LlamaForCausalLM`'s.

    Norms by Hugging Face's names: ``input_layernorm`` before attention; without
    ``sandwich_norms``, ``post_attention_layernorm`` before the MLP (Llama's name);
    with them (Gemma 2), ``post_attention_layernorm`` on attention's output,
    ``pre_feedforward_layernorm`` before the MLP and ``post_feedforward_layernorm`` on
    its output, each before the residual add.
    """

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, kv_cache_dtype: str,
                 implementation: str | None, interpret: bool, mesh: jax.sharding.Mesh | None,
                 tensor_parallel_axis: str, rngs: nnx.Rngs, matmul_implementation: str | None = None,
                 layer_index: int = 0):
        def rms_norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype,
                           unit_offset=config.norm_unit_offset)

        self.sandwich_norms = config.sandwich_norms
        self.input_layernorm = rms_norm()
        self.self_attn = LlamaAttention(
            config, dtype=dtype, param_dtype=param_dtype, kv_cache_dtype=kv_cache_dtype,
            implementation=implementation, interpret=interpret, mesh=mesh,
            tensor_parallel_axis=tensor_parallel_axis, rngs=rngs, matmul_implementation=matmul_implementation,
            layer_index=layer_index)
        self.post_attention_layernorm = rms_norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm()
            self.post_feedforward_layernorm = rms_norm()
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.mlp = LlamaMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                            matmul_implementation=matmul_implementation, interpret=interpret)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm of the MLP's input."""
        return self.pre_feedforward_layernorm if self.sandwich_norms else self.post_attention_layernorm

    def attention_update(self, attn_out: Array) -> Array:
        """Attention's output ``[..., hidden]`` as the residual add takes it (normed with sandwich norms)."""
        return self.post_attention_layernorm(attn_out) if self.sandwich_norms else attn_out

    def mlp_update(self, mlp_out: Array) -> Array:
        """The MLP's output ``[..., hidden]`` as the residual add takes it (normed with sandwich norms)."""
        return self.post_feedforward_layernorm(mlp_out) if self.sandwich_norms else mlp_out

    def __call__(self, x: Array, positions: Array, kv_cache: Array, metadata: Any) -> tuple[Array, Array]:
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)
        x = x + self.attention_update(attn_out)
        return x + self.mlp_update(self.mlp(self.mlp_norm(x), serving=True)), kv_cache

    @property
    def mlp_output_norm(self) -> RMSNorm | None:
        """The norm of the MLP's output before its residual add (sandwich norms), or None."""
        return self.post_feedforward_layernorm if self.sandwich_norms else None

    def fused(self, x: Array, pending: Array | None, positions: Array, kv_cache: Array, metadata: Any, *,
              norm_implementation: str | None, pending_norm: RMSNorm | None = None) -> tuple[Array, Array, Array]:
        """The serving forward with each residual add fused into the next norm
        (`RMSNorm.add_and_norm`): ``x`` ``[T, hidden]`` is the residual stream before
        ``pending``, the previous layer's MLP output as partial products ``[S, T, hidden]``
        (None for the first layer), to be normed by ``pending_norm`` (the previous layer's
        `mlp_output_norm`) before its add. Returns (the residual stream after attention,
        this layer's MLP output as partials, the updated kv_cache). With sandwich norms
        each sublayer's output norm runs in the kernel of the add that takes it."""
        how = dict(implementation=norm_implementation, interpret=self.self_attn.interpret)
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(pending, x, update_norm=pending_norm, **how)
        attn_partials, kv_cache = self.self_attn(h, positions, kv_cache, metadata, partials=True)
        attn_norm = self.post_attention_layernorm if self.sandwich_norms else None
        x, h = self.mlp_norm.add_and_norm(attn_partials, x, update_norm=attn_norm, **how)
        return x, self.mlp.partials(h), kv_cache

    def dense(self, x: Array) -> Array:
        x = x + self.attention_update(self.self_attn.dense(self.input_layernorm(x)))
        return x + self.mlp_update(self.mlp(self.mlp_norm(x)))


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
                              matmul_implementation=matmul_implementation, layer_index=i)
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype,
                            unit_offset=config.norm_unit_offset)
        self.scale_embeddings = config.scale_embeddings

    def embed(self, input_ids: Array) -> Array:
        """Token ids ``[...]`` -> embeddings ``[..., hidden]`` in the compute dtype; times
        ``sqrt(hidden)`` rounded to that dtype with ``scale_embeddings`` (Gemma's)."""
        x = self.embed_tokens(input_ids)
        if self.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(x.shape[-1]), x.dtype)
        return x


class LlamaForCausalLM(nnx.Module):
    """The causal LM of every supported family (`LlamaConfig.model_type`) over a paged KV cache.

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
        (the kernel for 16-bit decode-sized products without a mesh on the GPUs where it
        was measured faster, else XLA's dot: `jax_paged_attn.matmul.auto_choice`). With the kernel, a
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
    ``lm_head.kernel`` ``[hidden, vocab]`` (absent when embeddings are tied); by the
    config's declarations also ``model.layers[i].self_attn.qkv_proj.bias`` ``[Hk', Hq //
    Hk' + 2, D]`` (``attention_bias``), ``model.layers[i].self_attn.o_proj.bias``
    ``[hidden]`` (``o_proj_bias``), ``model.layers[i].self_attn.{q,k}_norm.weight``
    ``[D]`` (``qk_norm``), ``model.layers[i].{pre,post}_feedforward_layernorm.weight``
    (``sandwich_norms``).
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
        x = self.model.embed(input_ids)
        new_caches = []
        if self.fuses_residual_norms(x):
            pending, pending_norm = None, None
            how = dict(norm_implementation=self._norm_implementation())
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, pending, kv_cache = layer.fused(x, pending, positions, kv_cache, metadata, pending_norm=pending_norm,
                                                   **how)
                pending_norm = layer.mlp_output_norm
                new_caches.append(kv_cache)
            if logits_indices is not None:
                x, pending = x[logits_indices], pending[:, logits_indices]
            _, h = self.model.norm.add_and_norm(pending, x, update_norm=pending_norm,
                                                implementation=how["norm_implementation"],
                                                interpret=self.model.layers[0].self_attn.interpret)
            return self.compute_logits(h), new_caches
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, kv_cache = layer(x, positions, kv_cache, metadata)
            new_caches.append(kv_cache)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.compute_logits(self.model.norm(x)), new_caches

    def family_report(self) -> str:
        """The family, its layers' windows and the path its decode step takes, in words
        (the engine's start report says it: a family never leaves the fused path silently)."""
        cfg = self.config
        windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
        windowed = [i for i, w in enumerate(windows) if w is not None]
        if not windowed:
            window = "full attention in every layer"
        elif len(windowed) == len(windows):
            window = f"a {cfg.sliding_window}-token window in every layer (blocks outside it are freed)"
        else:
            window = (f"a {cfg.sliding_window}-token window in layers {windowed}, full attention in the others "
                      f"(the cache keeps every block: the full layers read them; the windowed layers mask)")
        path = ["decode steps rotate q / k and write the cache in one op (rotary + cache write)",
                "with the weight-streaming matmul each residual add is fused into the next norm"]
        if cfg.attention_bias or cfg.o_proj_bias:
            path.append("the projections' biases are added to their products (to the first split-K partial "
                        "in the fused layers)")
        if cfg.qk_norm:
            path.append("the per-head q / k RMSNorms run in XLA between the q/k/v product and the rotary + cache "
                        "write (a norm reads whole rows, so that product's split-K partials are summed first)")
        if cfg.sandwich_norms:
            path.append("each sandwich norm runs in the kernel of the residual add that takes its sublayer's output")
        if cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
            path.append(f"attention scores soft-capped at {cfg.attn_logit_softcapping} in the attention kernels, "
                        f"logits at {cfg.final_logit_softcapping} in float32")
        if cfg.rope_depends_on_length:
            path.append("dynamic NTK rope: each token's frequencies from its sequence's length")
        return f"{cfg.model_type}: {window}; " + "; ".join(path)

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
        """Final hidden states ``[..., hidden]`` (already normed) -> float32 logits ``[..., vocab]``
        (soft-capped in float32 with ``final_logit_softcapping``)."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def forward_dense(self, input_ids: Array) -> Array:
        """Reference forward without a cache: token ids int ``[B, S]`` -> float32 logits ``[B, S, vocab]``.

        Every row is one sequence starting at position 0, attended causally (and with each
        layer's sliding window, if any). Rows may be right-padded: logits at positions
        before a row's padding do not depend on it, except with dynamic rope, which
        rotates every row at the padded width ``S`` (transformers' rule for a batch: the
        longest position + 1).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {input_ids.shape}.")
        x = self.model.embed(input_ids)
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
