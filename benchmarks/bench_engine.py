#!/usr/bin/env python3
"""Decode throughput and `generate` wall clock of `LLMEngine` beside dense-cache JAX
decode loops and Hugging Face transformers on the same GPU.

    python benchmarks/bench_engine.py [--batches 1,32,64,128,256] [--prompt-len 128]
                                      [--new-tokens 128] [--num-scheduler-steps 16]
                                      [--implementation auto] [--dense-impl xla]
                                      [--engine-option FIELD=VALUE ...]
                                      [--decode-config FIELD=VALUE,...] [--warm-up engine|requests]
                                      [--hf] [--quick]

Model: a random-weight ~1B-parameter Llama (hidden 2048, 16 layers, 32 query heads,
8 KV heads, head_dim 64, intermediate 8192, vocab 32000), bfloat16. ``--quick`` runs a
tiny float32 config on whatever backend JAX has (a CPU smoke run, seconds). The mixed
serving workload is `bench_serving.py`.

For each batch size B, B random prompts of ``--prompt-len`` tokens, greedy decoding of
N = ``--new-tokens`` tokens each (EOS ignored). Every contender is timed by wall clock
with the same method as `bench_hf.py` times transformers: after a warm-up, the calls
generating N tokens and 1 token alternate twice; **generate ms** is the wall time of a
call generating N tokens (prefill included; the first of the two / the best), and
**decode tok/s** = ``B * (N - 1) / (best t(N) - best t(1))``: the prefill and the
call's fixed costs cancel.

* **engine**: `LLMEngine.generate` (scheduler, metadata builder, decode windows of
  ``--num-scheduler-steps`` steps on the device, host reads overlapped), warmed up by
  `LLMEngine.warmup()` where the engine has it (else, or with ``--warm-up requests``,
  by untimed `generate` calls of the same requests, which compile only the programs
  they reach: minutes less per batch on a GPU). Beside its wall-clock figures: decode
  tok/s by the engine's own counters (`EngineStats.decode_tokens_per_s` over the timed calls: decode steps only,
  host work included), the ms per step that makes, the floor (every weight and the
  batch's K/V read once per step at the GPU's measured copy rate, `timing.device_copy_rate`), and `compiles after start`: XLA
  compilations during the timed calls (JAX's monitoring events, `engine_common.py`),
  which should be 0.
* **one-jit dense**: what a JAX user writes without paging: the model's own layers over
  a dense per-sequence cache ``[B, prompt_len + N, Hk, D]`` per layer and
  `jax.nn.dot_product_attention` (``implementation=--dense-impl``), the prefill and all
  N - 1 decode steps inside one `jax.jit` (`lax.fori_loop`, caches carried and donated,
  greedy argmax); one program per N. Its tokens are compared with the engine's (the
  rows whose N tokens are identical; on the float32 ``--quick`` config every row).
* **per-step dense**: the same decode step jitted alone and dispatched once per token
  from Python (no prefill; tok/s = B * N / the wall time of N steps).
* **Hugging Face** (``--hf``): `bench_hf.py` in a subprocess (torch bf16, the same
  shape, static cache + torch.compile, plain generate, continuous batching); its best
  decode tok/s per batch.

``--engine-option FIELD=VALUE`` (repeatable) sets any `EngineConfig` field, e.g.
``--engine-option num_scheduler_steps=32 --engine-option batch_buckets=1,32,256``.

Prints a markdown table.
"""
from __future__ import annotations

import argparse
import functools
import gc
import pathlib
import sys
import time
from typing import Any, Callable, Sequence

# Run as a script from anywhere: make the working tree's jax_paged_attn and the
# benchmarks' shared module importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (_REPO, _REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from engine_common import (  # noqa: E402,F401  (parse_options: profile_engine imports it from here)
    CompileCounter, add_decode_run_arguments, engine_config, parse_engine_options, parse_options, warm_up)
from jax_paged_attn import matmul, tuning  # noqa: E402
from jax_paged_attn.engine import LLMEngine, SamplingParams  # noqa: E402
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from timing import device_copy_rate  # noqa: E402

Array = jax.Array

LLAMA_1B = LlamaConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
)


QWEN3_8B = LlamaConfig.for_family(
    "qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960,
)
GEMMA2_9B = LlamaConfig.for_family(
    "gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=8192,
    tie_word_embeddings=True, sliding_window=4096,
    layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(42)),
    query_pre_attn_scalar=256.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
)
# Gemma 2's cost beside a plain decoder's: Gemma-2-9B's shapes (vocabulary, widths, layers, heads,
# head size 256, tied embeddings) with Llama's traits (no soft-caps, no windows, SwiGLU, two norms
# a layer), the same weight bytes.
LLAMA_GEMMA2_9B_SHAPES = LlamaConfig.for_family(
    "llama", **{field: getattr(GEMMA2_9B, field) for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")},
)
MODELS = {"llama-1b": LLAMA_1B, "qwen3-8b": QWEN3_8B, "gemma2-9b": GEMMA2_9B,
          "llama-gemma2-9b-shapes": LLAMA_GEMMA2_9B_SHAPES}
"""``--model`` choices: the shapes of Llama 1.1B, Qwen3-8B and Gemma-2-9B, and a Llama of
Gemma-2-9B's shapes (random weights)."""


def build_model(quick: bool, implementation: str | None = None, matmul_implementation: str | None = None,
                model_name: str = "llama-1b") -> tuple[LlamaForCausalLM, dict[str, Any] | None]:
    """The benchmarks' model and the XLA compiler options of their programs: ``model_name``'s
    shapes (`MODELS`) in bfloat16, or with ``quick`` a tiny float32 config of its family
    (context 4,096, enough for the serving workload's lengths) compiled at XLA's lowest
    optimization level on a CPU (faster compiles for a smoke run)."""
    family = MODELS[model_name]
    if quick:
        windows = None if family.layer_types is None else ("sliding_attention", "full_attention")
        config, dtype = LlamaConfig.tiny(
            max_position_embeddings=4096, model_type=family.model_type, layer_types=windows,
            sliding_window=None if windows is None else 64, query_pre_attn_scalar=family.query_pre_attn_scalar,
            attn_logit_softcapping=family.attn_logit_softcapping,
            final_logit_softcapping=family.final_logit_softcapping), jnp.float32
        compiler_options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    else:
        config, dtype, compiler_options = family, jnp.bfloat16, None
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                             implementation=implementation, matmul_implementation=matmul_implementation)
    return model, compiler_options


# --------------------------------------------------------------------------- dense loops

Attend = Callable[[Array, Array, Array, Array, Array, Any], tuple[Array, Array, Array]]


def _dense_forward(model: LlamaForCausalLM, tokens: Array, positions: Array, k_caches: list[Array],
                   v_caches: list[Array], attend: Attend) -> tuple[Array, list[Array], list[Array]]:
    """The model's layers over dense caches: ``tokens`` / ``positions`` i32[B, S] ->
    (greedy next token i32[B] after each row's last token, updated caches).
    ``attend(q [B, S, Hq, D], k, v [B, S, Hk, D], k_cache, v_cache, layer_attention)``
    writes the new keys / values and returns (attention output ``[B, S, Hq, D]``, the
    caches); the layer's attention gives its scale, window and soft-cap."""
    x = model.model.embed(tokens)  # [B, S, hidden]
    new_k, new_v = [], []
    for layer, k_cache, v_cache in zip(model.model.layers, k_caches, v_caches):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(x), positions)
        out, k_cache, v_cache = attend(q, k.astype(k_cache.dtype), v.astype(v_cache.dtype), k_cache, v_cache, attn)
        x = x + layer.attention_update(attn.o_proj(out.reshape(*x.shape[:2], -1)))
        x = x + layer.mlp_update(layer.mlp(layer.mlp_norm(x)))
        new_k.append(k_cache)
        new_v.append(v_cache)
    logits = model.compute_logits(model.model.norm(x[:, -1]))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), new_k, new_v


def _dot_product_attention(q: Array, k: Array, v: Array, attn: Any, implementation: str | None, *,
                           is_causal: bool = False, key_value_seq_lengths: Array | None = None) -> Array:
    """`jax.nn.dot_product_attention` with the layer's scale and window; what that function
    cannot express runs the same mask in plain einsums: a soft-capped layer (Gemma 2), and a
    window over queries that do not start at key 0 (a decode row: its window counts back
    from the row's own position, which `local_window_size` without `is_causal` does not)."""
    config, window = attn.config, attn.attn.sliding_window  # the layer's PagedAttention keeps its window
    if config.attn_logit_softcapping is None and (window is None or is_causal):
        return jax.nn.dot_product_attention(
            q, k, v, scale=config.softmax_scale, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=None if window is None else (window - 1, 0), implementation=implementation)
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(t, group, axis=2) for t in (k, v))
    cap = config.attn_logit_softcapping
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * config.softmax_scale
    if cap is not None:
        scores = cap * jnp.tanh(scores / cap)
    rows = jnp.arange(q.shape[1])[:, None] if is_causal else (key_value_seq_lengths - 1)[:, None, None, None]
    cols = jnp.arange(k.shape[1])
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _decode_attend(lengths: Array, implementation: str | None) -> Attend:
    """One token per row at position ``lengths`` i32[B]: written to cache row ``lengths``,
    attending to the row's first ``lengths + 1`` keys (its window's, in a windowed layer)."""

    def attend(q, k, v, k_cache, v_cache, attn):
        rows = jnp.arange(q.shape[0])
        k_cache = k_cache.at[rows, lengths].set(k[:, 0])
        v_cache = v_cache.at[rows, lengths].set(v[:, 0])
        out = _dot_product_attention(q, k_cache, v_cache, attn, implementation, key_value_seq_lengths=lengths + 1)
        return out, k_cache, v_cache

    return attend


def _prefill_attend(implementation: str | None) -> Attend:
    """Whole prompts from position 0: causal attention over their own keys, written to
    the caches' first rows."""

    def attend(q, k, v, k_cache, v_cache, attn):
        out = _dot_product_attention(q, k, v, attn, implementation, is_causal=True)
        return out, jax.lax.dynamic_update_slice_in_dim(k_cache, k, 0, axis=1), \
            jax.lax.dynamic_update_slice_in_dim(v_cache, v, 0, axis=1)

    return attend


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
        next_tokens, k_caches, v_caches = _dense_forward(
            model, tokens[:, None], lengths[:, None], k_caches, v_caches, _decode_attend(lengths, implementation))
        return next_tokens, lengths + 1, k_caches, v_caches

    return step


def make_dense_generate(graphdef: Any, implementation: str | None,
                        compiler_options: dict[str, Any] | None = None):
    """Greedy generation over dense caches in one jitted program (one per ``num_tokens``).

    ``generate(state, k_caches, v_caches, prompts, num_tokens) -> (tokens i32[B, num_tokens],
    k_caches, v_caches)``: ``prompts`` i32[B, P] (equal lengths) are prefilled in one
    forward, then ``num_tokens - 1`` decode steps run in a `lax.fori_loop`; each layer's
    caches ``[B, >= P + num_tokens - 1, Hk, D]`` are donated and carried through the loop.
    """

    @functools.partial(jax.jit, static_argnames="num_tokens", donate_argnums=(1, 2),
                       compiler_options=compiler_options)
    def generate(state: Any, k_caches: list[Array], v_caches: list[Array], prompts: Array,
                 num_tokens: int) -> tuple[Array, list[Array], list[Array]]:
        model = nnx.merge(graphdef, state)
        batch, prompt_len = prompts.shape
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
        first, k_caches, v_caches = _dense_forward(model, prompts, positions, k_caches, v_caches,
                                                   _prefill_attend(implementation))
        out = jnp.zeros((batch, num_tokens), jnp.int32).at[:, 0].set(first)

        def body(i: Array, carry: tuple[Array, list[Array], list[Array], Array]):
            tokens, k_caches, v_caches, out = carry
            lengths = jnp.full((batch,), prompt_len - 1, jnp.int32) + i  # the input token's position
            tokens, k_caches, v_caches = _dense_forward(
                model, tokens[:, None], lengths[:, None], k_caches, v_caches, _decode_attend(lengths, implementation))
            return tokens, k_caches, v_caches, out.at[:, i].set(tokens)

        _, k_caches, v_caches, out = jax.lax.fori_loop(1, num_tokens, body, (first, k_caches, v_caches, out))
        return out, k_caches, v_caches

    return generate


def dense_caches(model: LlamaForCausalLM, batch: int, max_len: int) -> tuple[list[Array], list[Array]]:
    """Zeroed dense K and V caches ``[batch, max_len, Hk, D]``, one of each per layer."""
    cfg = model.config
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return ([jnp.zeros(shape, model.dtype) for _ in range(cfg.num_hidden_layers)],
            [jnp.zeros(shape, model.dtype) for _ in range(cfg.num_hidden_layers)])


# --------------------------------------------------------------------------- timing


def wall_clock_decode(run: Callable[[int], Any], batch: int, new_tokens: int, repeats: int = 2) -> dict[str, Any]:
    """`bench_hf.py`'s method: ``run(n)`` generates ``n`` tokens per row and returns when
    they are on the host; calls of ``new_tokens`` and of 1 token alternate ``repeats``
    times. Returns the first and best wall ms of the ``new_tokens`` calls, the best of
    the 1-token calls, decode tok/s = ``batch * (new_tokens - 1) / (best - best_one)``,
    and the last ``new_tokens`` call's result (``outputs``)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding by difference, got {new_tokens}.")
    full, one, outputs = [], [], None
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run(new_tokens)
        full.append(time.perf_counter() - start)
        start = time.perf_counter()
        run(1)
        one.append(time.perf_counter() - start)
    decode_s = max(min(full) - min(one), 1e-9)
    return dict(first_ms=1e3 * full[0], best_ms=1e3 * min(full), one_token_ms=1e3 * min(one),
                decode_tok_s=batch * (new_tokens - 1) / decode_s, outputs=outputs)


def bench_dense_one_jit(model: LlamaForCausalLM, prompts: np.ndarray, new_tokens: int, implementation: str | None,
                        compiler_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one-jit dense loop (`make_dense_generate`) timed by `wall_clock_decode`;
    ``outputs``: its tokens i64[B, new_tokens]."""
    graphdef, state = nnx.split(model)
    generate = make_dense_generate(graphdef, implementation, compiler_options)
    batch, prompt_len = prompts.shape
    caches = dense_caches(model, batch, prompt_len + new_tokens)
    prompt_ids = jnp.asarray(prompts, jnp.int32)

    def run(num_tokens: int) -> np.ndarray:
        nonlocal caches
        tokens, *caches = generate(state, *caches, prompt_ids, num_tokens=num_tokens)
        return np.asarray(tokens)  # waits

    run(new_tokens)  # compile both programs
    run(1)
    return wall_clock_decode(run, batch, new_tokens)


def bench_dense_per_step(model: LlamaForCausalLM, batch: int, prompt_len: int, new_tokens: int,
                         implementation: str | None, compiler_options: dict[str, Any] | None = None) -> float:
    """Decode tokens/s of the per-step dense loop: one jitted step per token from
    Python (B tokens per step; no prefill)."""
    graphdef, state = nnx.split(model)
    step = make_dense_decode_step(graphdef, implementation, compiler_options)
    k_caches, v_caches = dense_caches(model, batch, prompt_len + new_tokens)
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


def bench_engine(model: LlamaForCausalLM, prompts: np.ndarray, new_tokens: int, *, block_size: int,
                 max_num_batched_tokens: int, num_scheduler_steps: int, compiler_options: dict[str, Any] | None,
                 engine_options: dict[str, Any] | None = None, seed: int = 0,
                 whole_engine_warm_up: bool = True) -> dict[str, Any]:
    """`LLMEngine.generate` of ``prompts`` i32[B, P], timed by `wall_clock_decode` after
    a warm-up, with the engine's own decode counters over the timed calls and the XLA
    compilations they made (``compiles_after_start``); ``outputs``: the tokens of the last
    ``new_tokens`` call, i64[B, new_tokens]."""
    batch, prompt_len = prompts.shape
    blocks_per_seq = -(-(prompt_len + new_tokens) // block_size)
    config = engine_config(
        dict(num_blocks=batch * blocks_per_seq + 8, block_size=block_size, num_host_blocks=0,
             max_num_seqs=batch, max_num_batched_tokens=max(max_num_batched_tokens, batch),
             max_model_len=prompt_len + new_tokens, enable_prefix_caching=False,
             num_scheduler_steps=num_scheduler_steps, compiler_options=compiler_options, seed=seed),
        engine_options or {})
    engine = LLMEngine(model, config)
    prompt_lists = prompts.tolist()

    def run(num_tokens: int) -> np.ndarray:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        outputs = engine.generate(prompt_lists, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == num_tokens for o in outputs)
        return np.array([o.outputs[0].token_ids for o in outputs])

    warm = warm_up(engine, lambda: (run(new_tokens), run(1)), "untimed generate calls of the timed requests",
                   whole_engine=whole_engine_warm_up)
    programs = engine.num_compiled_programs
    engine.reset_stats()
    counter = CompileCounter()
    result = wall_clock_decode(run, batch, new_tokens)
    stats = engine.stats
    result.update(counter_tok_s=stats.decode_tokens_per_s, compiles_after_start=counter.count,
                  compile_s_after_start=counter.seconds, programs=programs, warm_up=warm)
    del engine
    gc.collect()
    return result


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
    # The engine's program store keys programs by source, not by a patched function: a
    # stored program would keep the tables' config.
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"decode kernel config for this run: {decode_config} (compilation cache and program store off)")


def weight_read_floor_ms(model: LlamaForCausalLM, batch: int, context: int, copy_rate: float) -> float:
    """ms per decode step to read every weight once plus the batch's K/V, at ``copy_rate``
    bytes/s (`timing.device_copy_rate`: the GPU's own measured copy rate)."""
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


TABLE_COLUMNS = (
    "batch", "engine generate ms (first / best)", "engine decode tok/s (wall clock)",
    "engine decode tok/s (counters)", "engine ms/step (counters)", "floor ms/step",
    "one-jit dense generate ms (best)", "one-jit dense decode tok/s", "per-step dense decode tok/s",
    "engine / one-jit (wall clock)", "engine / one-jit (counters)", "HF best decode tok/s", "engine / HF",
    "rows with the one-jit tokens", "programs compiled", "compiles after start",
)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32,64,128,256)")
    add_decode_run_arguments(parser, quick_prompt_len=8, quick_new_tokens=8)
    parser.add_argument("--implementation", default=None,
                        help="paged attention implementation of the model: auto (default), xla, triton")
    parser.add_argument("--matmul-implementation", default=None, choices=matmul.IMPLEMENTATION_CHOICES,
                        help="the engine model's projections (jax_paged_attn.matmul.linear; default auto); the "
                             "dense loops always use XLA's dot")
    parser.add_argument("--dense-impl", default="xla", choices=("xla", "cudnn", "auto"),
                        help="jax.nn.dot_product_attention implementation of the dense baselines")
    parser.add_argument("--decode-config", default=None, metavar="FIELD=VALUE,...",
                        help="replace the Triton decode kernel's tile config (tuning.DecodeConfig fields) for "
                             "this run, e.g. pages_per_step=16,num_splits=1,num_warps=8")
    parser.add_argument("--hf", action="store_true", help="also run bench_hf.py (torch) in a subprocess first")
    parser.add_argument("--warm-up", default="engine", choices=("engine", "requests"),
                        help="engine: engine.warmup() compiles every program of the configuration (what LLM "
                             "does); requests: untimed generate calls of the timed requests compile only the "
                             "programs they reach (minutes less on a GPU; the timed calls' compiles are "
                             "counted either way)")
    parser.add_argument("--quick", action="store_true", help="tiny float32 model: a CPU smoke run")
    parser.add_argument("--model", default="llama-1b", choices=tuple(MODELS),
                        help="the model's shapes, random bf16 weights (--quick: a tiny config of its family)")
    args = parser.parse_args(argv)
    engine_options = parse_engine_options(args.engine_option)
    use_decode_config(args.decode_config)

    batches = [1, 4] if args.quick else [1, 32, 64, 128, 256]
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    prompt_len = args.prompt_len or (8 if args.quick else 128)
    new_tokens = args.new_tokens or (8 if args.quick else 128)
    if new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (decode is timed as t(N) - t(1)), got {new_tokens}")
    dense_impl = None if args.dense_impl == "auto" else args.dense_impl
    hf = _run_hf(batches, prompt_len, new_tokens) if args.hf else {}

    start = time.perf_counter()
    model, compiler_options = build_model(args.quick, args.implementation, args.matmul_implementation, args.model)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    copy_rate = device_copy_rate()
    steps = args.num_scheduler_steps
    print(f"# LLMEngine generate and decode: {num_params / 1e6:,.1f} M params, {jnp.dtype(model.dtype).name}, "
          f"prompt {prompt_len}, {new_tokens} new tokens, block size {args.block_size}, {steps}-step decode "
          f"windows, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"engine projections: matmul_implementation={args.matmul_implementation or 'auto'}"
          + (f", engine options {engine_options}" if engine_options else ""))
    print(f"# wall clock as bench_hf.py: N = {new_tokens} and 1 new tokens alternate twice; decode tok/s = "
          f"B * (N - 1) / (best t(N) - best t(1))")
    print()
    print("| " + " | ".join(TABLE_COLUMNS) + " |")
    print("| " + " | ".join("---" for _ in TABLE_COLUMNS) + " |")
    rows = []
    warm_ups = []
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(0, model.config.vocab_size, size=(batch, prompt_len))
        engine = bench_engine(model, prompts, new_tokens, num_scheduler_steps=steps, block_size=args.block_size,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              compiler_options=compiler_options, engine_options=engine_options,
                              whole_engine_warm_up=args.warm_up == "engine")
        one_jit = bench_dense_one_jit(model, prompts, new_tokens, dense_impl, compiler_options)
        per_step = bench_dense_per_step(model, batch, prompt_len, new_tokens, dense_impl, compiler_options)
        floor = weight_read_floor_ms(model, batch, prompt_len + new_tokens // 2, copy_rate)
        same_rows = int(np.sum(np.all(engine["outputs"] == one_jit["outputs"], axis=1)))
        hf_rate = hf.get(batch)
        row = dict(batch=batch, engine_generate_first_ms=engine["first_ms"], engine_generate_ms=engine["best_ms"],
                   engine_wall_tok_s=engine["decode_tok_s"], engine_counter_tok_s=engine["counter_tok_s"],
                   floor_ms=floor, one_jit_generate_ms=one_jit["best_ms"], one_jit_tok_s=one_jit["decode_tok_s"],
                   per_step_tok_s=per_step, hf_tok_s=hf_rate, rows_matching_one_jit=same_rows,
                   programs=engine["programs"], compiles_after_start=engine["compiles_after_start"])
        rows.append(row)
        warm_ups.append(f"batch {batch}: {engine['warm_up'].describe()}")
        cells = (
            batch, f"{engine['first_ms']:,.1f} / {engine['best_ms']:,.1f}", f"{engine['decode_tok_s']:,.0f}",
            f"{engine['counter_tok_s']:,.0f}", f"{1e3 * batch / max(engine['counter_tok_s'], 1e-9):.2f}",
            f"{floor:.2f}", f"{one_jit['best_ms']:,.1f}", f"{one_jit['decode_tok_s']:,.0f}", f"{per_step:,.0f}",
            f"{engine['decode_tok_s'] / one_jit['decode_tok_s']:.2f}",
            f"{engine['counter_tok_s'] / one_jit['decode_tok_s']:.2f}",
            "n/a" if hf_rate is None else f"{hf_rate:,.0f}",
            "n/a" if hf_rate is None else f"{engine['decode_tok_s'] / hf_rate:.2f}",
            f"{same_rows}/{batch}", engine["programs"], engine["compiles_after_start"],
        )
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    print()
    print("\n".join(warm_ups))
    print(f"total time {time.perf_counter() - start:.1f} s (compilation included)")
    return rows


if __name__ == "__main__":
    main()
