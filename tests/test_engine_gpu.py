"""The engine with the compiled Pallas kernels on an NVIDIA GPU (``gpu`` marker).

Greedy generation through decode windows, continuous batching and preemption must equal
cache-free dense generation token for token, and the compiled decode window must hold
no copy of a KV cache and no conditional (both would cost every step). On a host of two
GPUs or more, the model tensor-parallel over two of them must give the one-GPU model's
tokens (skipped, saying so, on fewer).
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import CompileCounter
from jax_paged_attn import parallel
from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence, input_positions, pack_per_token
from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, dense_greedy_generate, last_token_indices
from jax_paged_attn.models.llama import jit_forward

pytestmark = pytest.mark.gpu

BASE = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                    num_host_blocks=64, num_scheduler_steps=4)


@pytest.fixture(scope="module")
def model():
    assert jax.default_backend() == "gpu", "the gpu suite needs a GPU"
    return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), implementation="triton")


def _num_gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend on this host
        return 0


NUM_GPUS = _num_gpus()


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, size=n).tolist() for n in lengths]


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_engine_greedy_matches_dense_with_compiled_kernels(model):
    prompts = _prompts(0, [5, 45, 17, 70, 3, 30])
    with jax.default_matmul_precision("highest"):
        engine = LLMEngine(model, BASE)
        outs = engine.generate(prompts, _greedy(40), use_tqdm=False)
        expected = dense_greedy_generate(model, prompts, 40)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.scheduler.device_blocks.num_free_blocks == engine.config.num_blocks


@pytest.mark.parametrize("num_host_blocks", [0, 32])  # recompute, swap
def test_engine_preemption_is_token_exact_with_compiled_kernels(model, num_host_blocks):
    prompts = _prompts(1, [20, 33, 9, 41, 14])
    with jax.default_matmul_precision("highest"):
        engine = LLMEngine(model, dataclasses.replace(BASE, num_blocks=14, num_host_blocks=num_host_blocks))
        outs = engine.generate(prompts, _greedy(60), use_tqdm=False)
        expected = dense_greedy_generate(model, prompts, 60)
    assert engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_no_compilation_after_warmup_with_compiled_kernels(model):
    """After `LLMEngine.warmup`, generate calls of other batch sizes, prompt lengths
    (chunked, mixed with decodes), sampling and prefix-cache hits compile nothing
    (JAX's compilation events), and greedy outputs stay the dense ones."""
    batches = [_prompts(10 + i, lens) for i, lens in enumerate([[5], [3, 40, 17], [70, 2, 9, 33, 12, 6, 50, 8, 21, 4]])]
    batches.append([batches[2][0], batches[2][0][:40] + [1, 2]])  # prefix-cache hits, a copy-on-write
    with jax.default_matmul_precision("highest"):
        expected = [dense_greedy_generate(model, prompts, 12) for prompts in batches]
        engine = LLMEngine(model, dataclasses.replace(BASE, num_blocks=128, compilation_cache=False))
        engine.warmup(use_tqdm=False)
        with CompileCounter() as compiles:
            outs = [engine.generate(prompts, _greedy(12), use_tqdm=False) for prompts in batches]
            engine.generate(batches[1], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=2),
                            use_tqdm=False)
    assert compiles.count == 0
    assert [[o.outputs[0].token_ids for o in batch] for batch in outs] == expected
    assert outs[3][0].num_cached_tokens > 0 and engine.stats.num_mixed_steps > 0


def test_compiled_decode_window_copies_no_cache_and_branches_on_nothing(model):
    engine = LLMEngine(model, BASE)
    engine.add_request([1, 2, 3, 4], _greedy(32))
    engine.step()  # prefill
    engine.step()  # the persistent batch exists
    runner = engine.runner
    state = runner._decode_state
    rows, width = state.block_tables.shape
    hlo = runner.window_program.lower(
        runner.params, runner.kv_caches, state, np.ones(rows, bool), np.full(rows, rows, np.int32),
        np.zeros((rows, width), np.int32), num_steps=4, greedy=True, block_size=16,
        max_model_len=512).compile().as_text()
    cache = runner.kv_caches[0]
    dims = ",".join(map(str, cache.shape))
    half = ",".join(map(str, cache.shape[1:]))
    rows_shape = f"{cache.shape[1] * cache.shape[2]},{cache.shape[3]},{cache.shape[4]}"
    copies = [line for line in hlo.splitlines() if re.search(r"= \w+\[[^\]]*\]\S* copy\(", line)
              and any(f"[{s}]" in line for s in (dims, half, rows_shape))]
    assert not copies, copies[:3]
    assert " conditional(" not in hlo


def test_engine_greedy_matches_dense_with_the_weight_streaming_matmul():
    """Decode steps' projections through the compiled weight-streaming kernel (prefill
    steps of more than 128 tokens keep XLA's dot): tokens equal the dense forward's."""
    config = LlamaConfig.tiny(hidden_size=128, intermediate_size=256)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="triton",
                             matmul_implementation="weight_streaming")
    prompts = _prompts(7, [5, 45, 17, 70])
    with jax.default_matmul_precision("highest"):
        engine = LLMEngine(model, BASE)
        outputs = engine.generate(prompts, _greedy(40), use_tqdm=False)
        expected = dense_greedy_generate(model, prompts, 40)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_second_engine_loads_its_compiled_kernels_from_the_program_store(model, monkeypatch, tmp_path):
    """The engine's programs, Pallas kernels inside, serialized on the GPU and loaded by
    a second engine untraced, generate the same tokens as the dense forward."""
    from jax_paged_attn.engine import startup

    monkeypatch.setattr(startup, "program_store_dir", lambda config: str(tmp_path))
    # Pages of 32: programs no earlier test of this module ran.
    config = dataclasses.replace(BASE, block_size=32, num_blocks=32, num_host_blocks=32)
    prompts = _prompts(4, [7, 40, 19])
    with jax.default_matmul_precision("highest"):
        expected = dense_greedy_generate(model, prompts, 12)
        runs = []
        for _ in range(2):
            engine = LLMEngine(model, config)
            engine.warmup(use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, _greedy(12), use_tqdm=False)]
            runs.append((engine.runner.program_store, engine.runner.num_traces, tokens))
    (first, traces, tokens), (second, traces_after, again) = runs
    assert tokens == expected and again == expected
    assert first.num_stored > 0 and first.num_unserializable == 0
    assert second.num_loaded == first.num_stored and traces_after == traces


_STORED_MOSAIC_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, implementation="mosaic_gpu")
engine = LLMEngine(model, EngineConfig(num_blocks=32, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                                       batch_buckets=(2,), token_buckets=(64,), block_table_width_buckets=(4,),
                                       max_model_len=64, compilation_cache_dir=sys.argv[1]))
outs = engine.generate([[1, 2, 3, 4, 5], [7, 8, 9] * 9], SamplingParams(temperature=0.0, max_tokens=12),
                       use_tqdm=False)
store = engine.runner.program_store
print(json.dumps(dict(tokens=[o.outputs[0].token_ids for o in outs], loaded=store.num_loaded,
                      stored=store.num_stored, traces=engine.runner.num_traces)))
"""


def test_a_fresh_process_runs_stored_mosaic_gpu_programs(tmp_path):
    """A start that reads the Mosaic GPU kernels' programs an earlier process stored, in a
    process that traces no kernel: XLA links their host code against JAX's Mosaic GPU
    runtime (`dispatch.prepare_lowering_runtimes`), so each loads, none is traced again,
    and the tokens are the first start's."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # beside this process's pool
    env.pop("MOSAIC_GPU_RUNTIME_LIB_PATH", None)  # what a fresh process starts without
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _STORED_MOSAIC_SCRIPT, str(tmp_path / "cache")], env=env,
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "JIT session error" not in done.stderr and "not used" not in done.stderr, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["stored"] > 0 and second["loaded"] == first["stored"] and second["traces"] == 0
    assert second["tokens"] == first["tokens"] and len(first["tokens"][1]) == 12


def _prefill_then_decode_logits(model):
    """float32 logits ``[2, vocab]`` of a prefill of prompts of 21 and 7 tokens (their
    last tokens), then of one decode step of each, through `jit_forward`."""
    builder = FlashAttentionMetadataBuilder(block_size=16, num_blocks=16, chunked_prefill=True)
    forward, caches = jit_forward(model), model.allocate_kv_caches(16, 16)
    prompts, tables = _prompts(3, [21, 7]), [[5, 2], [11]]
    logits = []
    for seqs, tokens in (
        ([ScheduledSequence.prompt(len(p), t) for p, t in zip(prompts, tables)], prompts),
        ([ScheduledSequence.decode(len(p) + 1, t) for p, t in zip(prompts, tables)], [[1], [2]]),
    ):
        md = builder.build(seqs)
        out, caches = forward(jnp.asarray(pack_per_token(md, seqs, tokens)), jnp.asarray(input_positions(md, seqs)),
                              caches, md, last_token_indices(md))
        logits.append(np.asarray(out))
    return logits


@pytest.mark.skipif(NUM_GPUS < 2, reason=f"tensor parallelism over 2 GPUs; this host has {NUM_GPUS}")
def test_two_way_tensor_parallel_matches_one_gpu_with_compiled_kernels():
    """The model on a 2-GPU mesh (its attention kernels, implementation auto, compiled
    under `jax.shard_map` on each GPU's heads) against the same model on one GPU, in
    float32: the same weights (created sharded), logits within 1e-4 (the all-reduces sum
    the partial products in another order), greedy tokens through the engine equal."""
    config = LlamaConfig.tiny()  # 4 query / 2 KV heads: one KV head per GPU
    one_gpu = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    two_gpus = LlamaForCausalLM(config, rngs=nnx.Rngs(0), mesh=parallel.tensor_parallel_mesh(2))
    for (path, want), (_, got) in zip(nnx.to_flat_state(nnx.state(one_gpu)), nnx.to_flat_state(nnx.state(two_gpus))):
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()), err_msg=str(path))
    prompts = _prompts(5, [5, 45, 17, 70, 3, 30])
    with jax.default_matmul_precision("highest"):
        for step, (got, want) in enumerate(zip(_prefill_then_decode_logits(two_gpus),
                                               _prefill_then_decode_logits(one_gpu))):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"step {step}")
        tokens = [[o.outputs[0].token_ids for o in LLMEngine(model, BASE).generate(prompts, _greedy(40),
                                                                                    use_tqdm=False)]
                  for model in (one_gpu, two_gpus)]
    assert tokens[1] == tokens[0]
