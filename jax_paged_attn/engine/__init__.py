"""Serving engine on the paged KV cache: block allocator, scheduler, sampler, `LLMEngine`.

* `BlockAllocator`: host-side free list, reference counts, prefix cache, copy-on-write.
* `Scheduler`: continuous batching, chunked prefill, swap / recompute preemption (FCFS).
* `SamplingParams` / `sample_tokens`: greedy, temperature, top-p, top-k, seeded per request.
* `LLMEngine`: runs the jitted model step (KV caches donated) and the loop around it.
* `LLM`: text in, text out: a checkpoint's model and ``tokenizer.json`` (Hugging Face
  ``tokenizers``) around an `LLMEngine`.
"""
from jax_paged_attn.engine.block_allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens
from jax_paged_attn.engine.engine import (
    EngineConfig,
    EngineStats,
    LLMEngine,
    RequestOutput,
    dense_greedy_generate,
)
from jax_paged_attn.engine.llm import LLM, LLMOutput, load_tokenizer
from jax_paged_attn.engine.sampling import SamplingParams, sample_tokens
from jax_paged_attn.engine.scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "BlockAllocator",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLM",
    "LLMEngine",
    "LLMOutput",
    "NoFreeBlocksError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "dense_greedy_generate",
    "hash_block_tokens",
    "load_tokenizer",
    "sample_tokens",
]
