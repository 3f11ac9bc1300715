#!/usr/bin/env python3
"""End-to-end decode throughput of `LLMEngine` beside a dense-cache XLA decode loop and
Hugging Face transformers on the same GPU.

    python benchmarks/bench_engine.py [--batches 1,32,64,128,256] [--prompt-len 128]
                                      [--new-tokens 128] [--num-scheduler-steps 16]
                                      [--implementation auto] [--dense-impl xla]
                                      [--decode-config FIELD=VALUE,...]
                                      [--hf] [--serving 1000] [--quick]

Model: a random-weight ~1B-parameter Llama (hidden 2048, 16 layers, 32 query heads,
8 KV heads, head_dim 64, intermediate 8192, vocab 32000), bfloat16. ``--quick`` runs a
tiny float32 config on whatever backend JAX has (a CPU smoke run, seconds).

For each batch size B, with B random prompts of ``--prompt-len`` tokens and greedy
decoding of ``--new-tokens`` tokens each (EOS ignored):

* **engine**: `LLMEngine.generate` (scheduler, metadata builder, decode windows of
  ``--num-scheduler-steps`` steps on the device, host reads overlapped). One untimed run
  compiles every program; the timed run reports decode tokens/s over decode steps
  (`EngineStats.decode_tokens_per_s`, host work included), the ms per step that makes,
  the floor (every weight and the batch's K/V read once per step at 4.2 TB/s), and
  end-to-end generated tokens/s (prefill included).
* **dense XLA**: the same parameters with a dense per-sequence cache
  ``[B, prompt_len + new_tokens, Hk, D]`` per layer and `jax.nn.dot_product_attention`
  (``implementation=--dense-impl``, masked by ``key_value_seq_lengths``), one jitted
  step per token (caches donated, greedy argmax), no host-side scheduling: what a JAX
  user writes without paging. Its tokens/s counts B tokens per step.
* **Hugging Face** (``--hf``): `bench_hf.py` in a subprocess (torch bf16, the same shape,
  static cache + torch.compile, plain generate, continuous batching); its best decode
  tok/s per batch.

``--serving N`` adds a serving run: N requests with prompts of 32-2,048 and outputs of
16-512 tokens submitted at once (the KV cache sized from the device's memory): total
tok/s and time-to-first-token / time-per-output-token percentiles.

Prints markdown tables.
"""
from __future__ import annotations

import argparse
import dataclasses
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

from jax_paged_attn import matmul, tuning  # noqa: E402
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
                 block_size: int, max_num_batched_tokens: int, num_scheduler_steps: int,
                 compiler_options: dict[str, Any] | None, seed: int = 0) -> dict[str, Any]:
    """Engine decode and end-to-end tokens/s for one batch size (second of two identical runs)."""
    blocks_per_seq = -(-(prompt_len + new_tokens) // block_size)
    config = EngineConfig(
        num_blocks=batch * blocks_per_seq + 8, block_size=block_size, num_host_blocks=0,
        max_num_seqs=batch, max_num_batched_tokens=max(max_num_batched_tokens, batch),
        max_model_len=prompt_len + new_tokens, enable_prefix_caching=False,
        num_scheduler_steps=num_scheduler_steps, compiler_options=compiler_options, seed=seed,
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
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    stats = engine.stats
    result = dict(engine_tok_s=stats.decode_tokens_per_s, engine_e2e_tok_s=batch * new_tokens / wall,
                  engine_prefill_tok_s=stats.prefill_tokens_per_s, programs=compiled,
                  recompiled=stats.num_compiled_programs - compiled)
    del engine, outputs
    gc.collect()
    return result


def bench_serving(model: LlamaForCausalLM, num_requests: int, *, block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int, num_scheduler_steps: int, compiler_options: dict[str, Any] | None,
                  seed: int = 0, prompt_lens: tuple[int, int] = (32, 2048),
                  output_lens: tuple[int, int] = (16, 512)) -> dict[str, Any]:
    """``num_requests`` requests with prompts of 32-2,048 and outputs of 16-512 tokens
    (uniform; ``prompt_lens`` / ``output_lens`` change the ranges), all submitted at once: total generated tok/s, time to first token and time
    per output token percentiles. A first run compiles the programs: ``max_num_seqs + 16``
    of the prompts with outputs of at most 48 tokens, enough to fill every batch bucket's
    rows and to make later prompts join a running batch (the timed run reports how many
    more programs it compiled)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_lens[0], prompt_lens[1] + 1, size=num_requests)
    output_lens = rng.integers(output_lens[0], output_lens[1] + 1, size=num_requests)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in prompt_lens]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for n in output_lens]
    max_model_len = 4096
    # Few shapes, so few programs: batches of 16 / 64 / max_num_seqs rows, prefill steps
    # of 256 or max_num_batched_tokens tokens, one block-table width.
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          num_scheduler_steps=num_scheduler_steps, compiler_options=compiler_options, seed=seed,
                          enable_prefix_caching=False, coarse_length_bounds=True,
                          batch_buckets=tuple(sorted({min(16, max_num_seqs), min(64, max_num_seqs), max_num_seqs})),
                          token_buckets=tuple(sorted({min(256, max_num_batched_tokens), max_num_batched_tokens})),
                          block_table_width_buckets=(-(-max_model_len // block_size),))
    engine = LLMEngine(model, config)
    warm = min(num_requests, max_num_seqs + 16)
    engine.generate(prompts[:warm], [dataclasses.replace(p, max_tokens=min(p.max_tokens, 48)) for p in params[:warm]],
                    use_tqdm=False)
    compiled = engine.num_compiled_programs
    engine.reset_stats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = np.array([o.time_to_first_token_s for o in outputs]) * 1e3
    tpot = np.array([(o.latency_s - o.time_to_first_token_s) / max(len(o.outputs[0].token_ids) - 1, 1)
                     for o in outputs]) * 1e3
    result = dict(requests=num_requests, wall_s=wall, generated_tok_s=generated / wall,
                  total_tok_s=(generated + int(prompt_lens.sum())) / wall,
                  ttft_ms=np.percentile(ttft, [50, 90, 99]).tolist(), tpot_ms=np.percentile(tpot, [50, 90, 99]).tolist(),
                  programs=compiled, recompiled=engine.num_compiled_programs - compiled,
                  kv_cache=next(line for line in engine.start_report.splitlines() if line.startswith("KV cache")),
                  decode_batches=engine.stats.num_decode_batches, joined_rows=engine.stats.num_inserted_rows)
    del engine, outputs
    gc.collect()
    return result


def parse_options(text: str) -> dict[str, Any]:
    """``"NAME=VALUE,..."`` -> a dict: ints, true / false as bools, anything else a string."""
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
        else:
            options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options


def parse_decode_config(text: str) -> tuning.DecodeConfig:
    """``"FIELD=VALUE,..."`` -> a `tuning.DecodeConfig` (`parse_options`)."""
    return tuning.DecodeConfig(**parse_options(text))


def use_decode_config(text: str | None) -> None:
    """``--decode-config``: every Triton decode call of this process takes the parsed
    config (the tables are looked up at trace time), said on stdout; None: nothing."""
    if not text:
        return
    decode_config = parse_decode_config(text)
    tuning.decode_config = lambda *_, **__: decode_config
    print(f"decode kernel config for this run: {decode_config}")


def weight_read_floor_ms(model: LlamaForCausalLM, batch: int, context: int, copy_rate: float = 4.2e12) -> float:
    """ms per decode step to read every weight once plus the batch's K/V, at ``copy_rate``
    bytes/s (the H200's measured device-copy rate)."""
    cfg = model.config
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    kv = 2 * cfg.num_hidden_layers * batch * context * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    return 1e3 * (weights + kv) / copy_rate


def _run_hf(batches: Sequence[int], prompt_len: int, new_tokens: int) -> dict[int, float]:
    """Best Hugging Face decode tok/s per batch (bench_hf.py in a subprocess), or {}."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "hf.json"
        cmd = [sys.executable, str(pathlib.Path(__file__).with_name("bench_hf.py")), "--batches",
               ",".join(map(str, batches)), "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens),
               "--json", str(out)]
        done = subprocess.run(cmd, text=True)
        if done.returncode or not out.exists():
            print(f"bench_hf.py failed (exit {done.returncode}); no Hugging Face column")
            return {}
        rows = json.loads(out.read_text())["rows"]
    best: dict[int, float] = {}
    for row in rows:
        rate = row.get("decode_tok_s") or row.get("e2e_tok_s")
        if rate:
            best[row["batch"]] = max(best.get(row["batch"], 0.0), rate)
    return best


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32,64,128,256)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-scheduler-steps", type=int, default=16, help="decode steps per decode window")
    parser.add_argument("--implementation", default=None,
                        help="paged attention implementation of the model: auto (default), xla, triton")
    parser.add_argument("--matmul-implementation", default=None, choices=matmul.IMPLEMENTATION_CHOICES,
                        help="the engine model's projections (jax_paged_attn.matmul.linear; default auto); the "
                             "dense loop always uses XLA's dot")
    parser.add_argument("--dense-impl", default="xla", choices=("xla", "cudnn", "auto"),
                        help="jax.nn.dot_product_attention implementation of the dense baseline")
    parser.add_argument("--decode-config", default=None, metavar="FIELD=VALUE,...",
                        help="replace the Triton decode kernel's tile config (tuning.DecodeConfig fields) for "
                             "this run, e.g. pages_per_step=16,num_splits=1,num_warps=8")
    parser.add_argument("--hf", action="store_true", help="also run bench_hf.py (torch) in a subprocess first")
    parser.add_argument("--serving", type=int, default=0, help="requests of the mixed-length serving run (0: none)")
    parser.add_argument("--quick", action="store_true", help="tiny float32 model: a CPU smoke run")
    args = parser.parse_args(argv)
    use_decode_config(args.decode_config)

    if args.quick:
        config, dtype = LlamaConfig.tiny(max_position_embeddings=4096), jnp.float32  # the serving run's lengths
        batches = [1, 4]
        prompt_len, new_tokens = args.prompt_len or 8, args.new_tokens or 8
        compiler_options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    else:
        config, dtype = LLAMA_1B, jnp.bfloat16
        batches = [1, 32, 64, 128, 256]
        prompt_len, new_tokens = args.prompt_len or 128, args.new_tokens or 128
        compiler_options = None
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    dense_impl = None if args.dense_impl == "auto" else args.dense_impl
    hf = _run_hf(batches, prompt_len, new_tokens) if args.hf else {}

    start = time.perf_counter()
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                             implementation=args.implementation, matmul_implementation=args.matmul_implementation)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    steps = args.num_scheduler_steps
    print(f"# LLMEngine decode throughput: {num_params / 1e6:,.1f} M params, {jnp.dtype(dtype).name}, "
          f"prompt {prompt_len}, {new_tokens} new tokens, block size {args.block_size}, {steps}-step decode "
          f"windows, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"engine projections: matmul_implementation={args.matmul_implementation or 'auto'}")
    print()
    print("| batch | engine decode tok/s | engine ms/step | floor ms/step | engine end-to-end tok/s | "
          "engine prefill tok/s | dense xla decode tok/s | dense ms/step | best engine / dense | "
          "HF best decode tok/s | engine / HF | programs compiled |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for batch in batches:
        engine = bench_engine(model, batch, prompt_len, new_tokens, num_scheduler_steps=steps,
                              block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                              compiler_options=compiler_options)
        dense = bench_dense(model, batch, prompt_len, new_tokens, dense_impl, compiler_options)
        floor = weight_read_floor_ms(model, batch, prompt_len + new_tokens // 2)
        row = dict(batch=batch, dense_tok_s=dense, floor_ms=floor, hf_tok_s=hf.get(batch), **engine)
        rows.append(row)
        hf_rate = hf.get(batch)
        hf_text = "n/a" if hf_rate is None else f"{hf_rate:,.0f}"
        hf_ratio = "n/a" if hf_rate is None else f"{engine['engine_tok_s'] / hf_rate:.2f}"
        print(f"| {batch} | {engine['engine_tok_s']:,.0f} | {1e3 * batch / max(engine['engine_tok_s'], 1e-9):.2f} | "
              f"{floor:.2f} | {engine['engine_e2e_tok_s']:,.0f} | {engine['engine_prefill_tok_s']:,.0f} | "
              f"{dense:,.0f} | {1e3 * batch / dense:.2f} | {engine['engine_tok_s'] / dense:.2f} | "
              f"{hf_text} | {hf_ratio} | "
              f"{engine['programs']} (+{engine['recompiled']} in the timed run) |", flush=True)
    if args.serving:
        serving = bench_serving(model, args.serving, block_size=args.block_size, max_num_seqs=256,
                                max_num_batched_tokens=max(args.max_num_batched_tokens, 2048),
                                num_scheduler_steps=steps, compiler_options=compiler_options)
        print()
        print(f"serving: {serving['requests']} requests (prompts 32-2048, outputs 16-512, all at once): "
              f"{serving['generated_tok_s']:,.0f} generated tok/s, {serving['total_tok_s']:,.0f} total tok/s "
              f"(prompt + generated) in {serving['wall_s']:.1f} s; TTFT p50/p90/p99 "
              f"{'/'.join(f'{x:,.0f}' for x in serving['ttft_ms'])} ms; TPOT p50/p90/p99 "
              f"{'/'.join(f'{x:.2f}' for x in serving['tpot_ms'])} ms; {serving['programs']} programs "
              f"(+{serving['recompiled']} in the timed run); {serving['decode_batches']} decode batches built, "
              f"{serving['joined_rows']} requests joined a running one; {serving['kv_cache']}", flush=True)
        rows.append(dict(serving=serving))
    print()
    print(f"total time {time.perf_counter() - start:.1f} s (compilation included)")
    return rows


if __name__ == "__main__":
    main()
