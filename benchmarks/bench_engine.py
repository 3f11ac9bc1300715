#!/usr/bin/env python3
"""End-to-end decode throughput of `LLMEngine` against a dense-cache XLA decode loop.

    python benchmarks/bench_engine.py [--batches 1,32,256] [--prompt-len 128]
                                      [--new-tokens 128] [--implementation auto]
                                      [--dense-impl xla] [--quick]

Model: a random-weight ~1B-parameter Llama (hidden 2048, 16 layers, 32 query heads,
8 KV heads, head_dim 64, intermediate 8192, vocab 32000), bfloat16. ``--quick`` runs a
tiny float32 config on whatever backend JAX has (a CPU smoke run, seconds).

For each batch size B, with B random prompts of ``--prompt-len`` tokens and greedy
decoding of ``--new-tokens`` tokens each (EOS ignored):

* **engine**: `LLMEngine.generate` through the paged KV cache, the metadata builder,
  the jitted forward + sampling step (caches donated) and the host-side scheduler,
  once with one model step per scheduling step and once with
  ``--num-scheduler-steps`` (multi-step decoding: host work amortized over several
  device steps). One untimed run compiles every program; the timed run reports decode
  tokens/s over decode-only steps (`EngineStats.decode_tokens_per_s`, scheduler and
  host work included) and end-to-end generated tokens/s (prefill included).
* **dense XLA**: the same model parameters with a dense per-sequence cache
  ``[B, prompt_len + new_tokens, Hk, D]`` per layer and `jax.nn.dot_product_attention`
  (``implementation=--dense-impl``, masked by ``key_value_seq_lengths``), one jitted
  step per token (caches donated, greedy argmax), no host-side scheduling. Its tokens/s
  counts B tokens per step over ``--new-tokens`` steps.

Prints a markdown table; the run is sized to finish in well under 5 minutes on one H200.
"""
from __future__ import annotations

import argparse
import functools
import gc
import pathlib
import sys
import time
from typing import Any, Sequence

# Run as a script from anywhere: make the working tree's jax_paged_attn importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM  # noqa: E402

Array = jax.Array

LLAMA_1B = LlamaConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
)


def make_dense_decode_step(graphdef: Any, implementation: str | None,
                           compiler_options: dict[str, Any] | None = None):
    """A jitted greedy decode step over dense caches, reusing the model's own layers.

    ``step(state, k_caches, v_caches, tokens, lengths) -> (next_tokens, lengths + 1,
    k_caches, v_caches)``: ``tokens`` i32[B] sits at position ``lengths`` i32[B]; each
    layer's caches are ``[B, max_len, Hk, D]`` (donated) and the new key / value goes to
    row ``lengths``.
    """

    @functools.partial(jax.jit, donate_argnums=(1, 2), compiler_options=compiler_options)
    def step(state: Any, k_caches: list[Array], v_caches: list[Array], tokens: Array,
             lengths: Array) -> tuple[Array, Array, list[Array], list[Array]]:
        model = nnx.merge(graphdef, state)
        batch = tokens.shape[0]
        rows = jnp.arange(batch)
        x = model.model.embed_tokens(tokens)  # [B, hidden]
        new_k, new_v = [], []
        for layer, k_cache, v_cache in zip(model.model.layers, k_caches, v_caches):
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(x), lengths)  # [B, Hq, D], [B, Hk, D]
            k_cache = k_cache.at[rows, lengths].set(k.astype(k_cache.dtype))
            v_cache = v_cache.at[rows, lengths].set(v.astype(v_cache.dtype))
            out = jax.nn.dot_product_attention(
                q[:, None], k_cache, v_cache, key_value_seq_lengths=lengths + 1,
                implementation=implementation)  # [B, 1, Hq, D]
            x = x + attn.o_proj(out.reshape(batch, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_k.append(k_cache)
            new_v.append(v_cache)
        logits = model.compute_logits(model.model.norm(x))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), lengths + 1, new_k, new_v

    return step


def bench_dense(model: LlamaForCausalLM, batch: int, prompt_len: int, new_tokens: int,
                implementation: str | None, compiler_options: dict[str, Any] | None = None) -> float:
    """Decode tokens/s of the dense-cache XLA loop (B tokens per step)."""
    cfg = model.config
    graphdef, state = nnx.split(model)
    step = make_dense_decode_step(graphdef, implementation, compiler_options)
    shape = (batch, prompt_len + new_tokens, cfg.num_key_value_heads, cfg.head_dim)
    k_caches = [jnp.zeros(shape, model.dtype) for _ in range(cfg.num_hidden_layers)]
    v_caches = [jnp.zeros(shape, model.dtype) for _ in range(cfg.num_hidden_layers)]
    tokens = jnp.ones((batch,), jnp.int32)
    start_lengths = jnp.full((batch,), prompt_len, jnp.int32)
    tokens, _, k_caches, v_caches = step(state, k_caches, v_caches, tokens, start_lengths)  # compile
    tokens.block_until_ready()
    start = time.perf_counter()
    lengths = start_lengths
    for _ in range(new_tokens):
        tokens, lengths, k_caches, v_caches = step(state, k_caches, v_caches, tokens, lengths)
    tokens.block_until_ready()
    return batch * new_tokens / (time.perf_counter() - start)


def bench_engine(model: LlamaForCausalLM, batch: int, prompt_len: int, new_tokens: int, *,
                 block_size: int, batch_buckets: tuple[int, ...], max_num_batched_tokens: int,
                 num_scheduler_steps: int, lookahead_room: int, compiler_options: dict[str, Any] | None,
                 seed: int = 0) -> dict[str, Any]:
    """Engine decode and end-to-end tokens/s for one batch size (second of two identical runs).

    ``lookahead_room`` extra token slots per sequence size the cache (and max_model_len)
    for multi-step lookahead; pass the same value to runs that should share programs.
    """
    # Room for every sequence, plus multi-step lookahead slots (up to one more block each).
    blocks_per_seq = -(-(prompt_len + new_tokens + lookahead_room) // block_size)
    config = EngineConfig(
        num_blocks=batch * blocks_per_seq + 8, block_size=block_size, num_host_blocks=0,
        max_num_seqs=batch, max_num_batched_tokens=max(max_num_batched_tokens, batch),
        max_model_len=prompt_len + new_tokens + lookahead_room, enable_prefix_caching=False,
        batch_buckets=batch_buckets, num_scheduler_steps=num_scheduler_steps,
        compiler_options=compiler_options, seed=seed,
    )
    engine = LLMEngine(model, config)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model.config.vocab_size, size=prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # compiles every program of the run
    compiled = engine.num_compiled_programs
    engine.reset_stats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(len(o.output_token_ids) == new_tokens for o in outputs)
    stats = engine.stats
    result = dict(engine_tok_s=stats.decode_tokens_per_s, engine_e2e_tok_s=batch * new_tokens / wall,
                  engine_prefill_tok_s=stats.prefill_tokens_per_s, programs=compiled,
                  recompiled=stats.num_compiled_programs - compiled)
    del engine, outputs
    gc.collect()
    return result


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32,256)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="multi-step decoding of the second engine column (model steps per schedule)")
    parser.add_argument("--implementation", default=None,
                        help="paged attention implementation of the model: auto (default), xla, triton")
    parser.add_argument("--dense-impl", default="xla", choices=("xla", "cudnn", "auto"),
                        help="jax.nn.dot_product_attention implementation of the dense baseline")
    parser.add_argument("--quick", action="store_true", help="tiny float32 model: a CPU smoke run")
    args = parser.parse_args(argv)

    if args.quick:
        config, dtype = LlamaConfig.tiny(), jnp.float32
        batches = [1, 4]
        prompt_len, new_tokens = args.prompt_len or 8, args.new_tokens or 8
        compiler_options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    else:
        config, dtype = LLAMA_1B, jnp.bfloat16
        batches = [1, 32, 256]
        prompt_len, new_tokens = args.prompt_len or 128, args.new_tokens or 128
        compiler_options = None
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    dense_impl = None if args.dense_impl == "auto" else args.dense_impl

    start = time.perf_counter()
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                             implementation=args.implementation)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    print(f"# LLMEngine decode throughput: {num_params / 1e6:,.1f} M params, {jnp.dtype(dtype).name}, "
          f"prompt {prompt_len}, {new_tokens} new tokens, block size {args.block_size}, "
          f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print()
    steps = args.num_scheduler_steps
    print(f"| batch | engine decode tok/s | engine {steps}-step decode tok/s | engine {steps}-step end-to-end "
          f"tok/s | engine prefill tok/s | dense {args.dense_impl} decode tok/s | best engine / dense | "
          f"programs compiled |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    buckets = tuple(sorted(set(batches)))
    common = dict(block_size=args.block_size, batch_buckets=buckets, lookahead_room=steps,
                  max_num_batched_tokens=args.max_num_batched_tokens, compiler_options=compiler_options)
    for batch in batches:
        single = bench_engine(model, batch, prompt_len, new_tokens, num_scheduler_steps=1, **common)
        multi = bench_engine(model, batch, prompt_len, new_tokens, num_scheduler_steps=steps, **common)
        dense = bench_dense(model, batch, prompt_len, new_tokens, dense_impl, compiler_options)
        row = dict(batch=batch, engine_tok_s=single["engine_tok_s"], engine_multistep_tok_s=multi["engine_tok_s"],
                   engine_e2e_tok_s=multi["engine_e2e_tok_s"], engine_prefill_tok_s=single["engine_prefill_tok_s"],
                   dense_tok_s=dense, programs=single["programs"] + multi["programs"])
        rows.append(row)
        ratio = max(row["engine_tok_s"], row["engine_multistep_tok_s"]) / dense
        print(f"| {batch} | {row['engine_tok_s']:,.0f} | {row['engine_multistep_tok_s']:,.0f} | "
              f"{row['engine_e2e_tok_s']:,.0f} | {row['engine_prefill_tok_s']:,.0f} | {dense:,.0f} | {ratio:.2f} | "
              f"{row['programs']} |", flush=True)
    print()
    print(f"total time {time.perf_counter() - start:.1f} s (compilation included)")
    return rows


if __name__ == "__main__":
    main()
