"""Serving engine on the paged KV cache: block allocator, scheduler, sampler, `LLMEngine`.

* `BlockAllocator`: host-side free list, reference counts, prefix cache, copy-on-write.
* `Scheduler`: continuous batching, chunked prefill, swap / recompute preemption (FCFS).
* `SamplingParams` / `sample_tokens`: greedy, temperature, top-p, top-k, min-p, seeded per
  request; vLLM's presence / frequency / repetition penalties, ``min_tokens`` and
  ``logit_bias`` on the device (`jax_paged_attn.engine.penalties`); per-token logprobs
  (`Logprob`) on request.
* `ModelRunner`: the device side (parameters, caches, persistent decode batch, jitted programs).
* `LLMEngine`: the host loop: scheduled steps and overlapped decode windows; outputs in
  vLLM's shape (`RequestOutput` holding one `CompletionOutput` per sampled sequence).
* `LLM`: text in, text out: a checkpoint's model and tokenizer (``tokenizer.json`` through
  Hugging Face ``tokenizers``, the special tokens its configs name) around an
  `LLMEngine`; stop strings.
"""
from jax_paged_attn.engine.block_allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens
from jax_paged_attn.engine.config import EngineConfig
from jax_paged_attn.engine.engine import LLMEngine
from jax_paged_attn.engine.llm import LLM, load_tokenizer
from jax_paged_attn.engine.model_runner import CausalLM, ModelConfig, ModelRunner
from jax_paged_attn.engine.outputs import CompletionOutput, EngineLoad, RequestOutput
from jax_paged_attn.engine.request import FinishReason, Request, RequestStatus, ScheduledRequest, SchedulerOutput
from jax_paged_attn.engine.sampling import Logprob, SamplingParams, greedy_tokens, sample_tokens
from jax_paged_attn.engine.scheduler import Scheduler, SchedulerConfig
from jax_paged_attn.engine.stats import EngineStats

__all__ = [
    "BlockAllocator",
    "CausalLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLM",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "ModelRunner",
    "NoFreeBlocksError",
    "Request",
    "RequestOutput",
    "EngineLoad",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "greedy_tokens",
    "hash_block_tokens",
    "load_tokenizer",
    "sample_tokens",
]
