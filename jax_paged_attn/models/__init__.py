"""Models that run on the paged attention layer (`jax_paged_attn.layer.PagedAttention`).

* `LlamaForCausalLM` / `LlamaConfig`: the decoder of every supported family (Llama 2 / 3,
  Mistral, Qwen2 / 2.5, Qwen3, Gemma 2; `jax_paged_attn.models.config` says where they
  differ, `jax_paged_attn.models.rope` computes the rope types);
  `jit_forward` / `jit_forward_dense` compile the serving and the reference forwards;
  `last_token_indices` selects one logits row per sequence; `dense_greedy_generate` is
  cache-free greedy generation, the engine's oracle.
* `load_llama` / `load_checkpoint` / `save_checkpoint`: Hugging Face checkpoints of any
  supported family (config.json + safetensors) from and to a local directory; `checkpoint_dtype` is
  the dtype a checkpoint names (what ``load_llama(dtype="auto")`` computes in).
"""
from jax_paged_attn.models.checkpoint import (
    CheckpointError,
    checkpoint_dtype,
    load_checkpoint,
    load_llama,
    save_checkpoint,
)
from jax_paged_attn.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    dense_greedy_generate,
    jit_forward,
    jit_forward_dense,
    last_token_indices,
)

__all__ = [
    "CheckpointError",
    "LlamaConfig",
    "LlamaForCausalLM",
    "checkpoint_dtype",
    "dense_greedy_generate",
    "jit_forward",
    "jit_forward_dense",
    "last_token_indices",
    "load_checkpoint",
    "load_llama",
    "save_checkpoint",
]
