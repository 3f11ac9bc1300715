"""The Llama model (`jax_paged_attn.models.llama`) and its checkpoint loader.

The serving forward (packed tokens, paged KV cache, builder metadata with padding) must
give the logits of the dense no-cache forward, token for token, through prefills,
chunked prefills and decode steps, in float32. Checkpoints round-trip through the
Hugging Face format, and every kind of mismatch is reported with the tensor and file.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_paged_attn.builder import (
    FlashAttentionMetadataBuilder,
    ScheduledSequence,
    input_positions,
    pack_per_token,
    sequence_rows,
)
from jax_paged_attn.models import (
    CheckpointError,
    LlamaConfig,
    LlamaForCausalLM,
    last_token_indices,
    load_checkpoint,
    load_llama,
    save_checkpoint,
)
from jax_paged_attn.models.checkpoint import checkpoint_dtype, hf_parameter_map
from jax_paged_attn.models.llama import apply_rope, jit_forward, jit_forward_dense, rope_inverse_frequencies
from conftest import count_in_calls, lower_for_cuda

BLOCK_SIZE = 16
NUM_BLOCKS = 32
ATOL = 1e-4  # float32 logits of O(1): paged and dense forwards differ only by summation order


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), implementation="xla")


@pytest.fixture(scope="module")
def forwards(model):
    return jit_forward(model), jit_forward_dense(model)


def dense_logits(dense, tokens: list[int]) -> np.ndarray:
    """Dense logits of one sequence, padded to a power of two so few programs compile."""
    width = 1 << (len(tokens) - 1).bit_length()
    return np.asarray(dense(jnp.asarray([tokens + [0] * (width - len(tokens))])))[0, :len(tokens)]


class Runner:
    """Drives the paged forward step by step with the real builder, checking every new token."""

    def __init__(self, model: LlamaForCausalLM, forward, dense, *, chunked_prefill: bool):
        self.forward, self.dense = forward, dense
        self.builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                                     chunked_prefill=chunked_prefill,
                                                     sliding_window=model.config.sliding_window)
        self.caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        self.free_blocks = list(np.random.default_rng(0).permutation(NUM_BLOCKS))
        self.tables: dict[int, list[int]] = {}

    def table(self, seq_id: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq_id, [])
        while len(table) * BLOCK_SIZE < length:
            table.append(int(self.free_blocks.pop()))
        return list(table)

    def step(self, work: list[tuple[int, list[int], int, int]]) -> list[np.ndarray]:
        """work: (seq_id, tokens, context_len, query_len); prompts are those with query_len > 1
        or context 0. Returns each sequence's logits rows and checks them against dense."""
        scheduled = []
        for seq_id, tokens, ctx, n in work:
            is_prompt = ctx == 0 or n > 1
            scheduled.append(ScheduledSequence(is_prompt=is_prompt, seq_len=ctx + n, context_len=ctx, query_len=n,
                                               block_table=self.table(seq_id, ctx + n)))
        md = self.builder.build(scheduled)
        ids = pack_per_token(md, scheduled, [tokens[ctx:ctx + n] for _, tokens, ctx, n in work])
        logits, self.caches = self.forward(jnp.asarray(ids), jnp.asarray(input_positions(md, scheduled)),
                                           self.caches, md)
        logits = np.asarray(logits)
        assert logits.shape == (md.num_tokens, 128)
        starts = np.asarray(md.query_start_loc)
        results = []
        for row, (seq_id, tokens, ctx, n) in zip(sequence_rows(md, scheduled), work):
            got = logits[starts[row]:starts[row] + n]
            want = dense_logits(self.dense, tokens[:ctx + n])[ctx:]
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"sequence {seq_id}, context {ctx}")
            results.append(got)
        return results


def greedy(logits_rows: np.ndarray) -> int:
    return int(np.argmax(logits_rows[-1]))


def test_prefill_then_decode_matches_dense(model, forwards):
    runner = Runner(model, *forwards, chunked_prefill=False)
    rng = np.random.default_rng(1)
    prompts = {0: rng.integers(0, 128, 5).tolist(), 1: rng.integers(0, 128, 19).tolist(),
               2: rng.integers(0, 128, 16).tolist()}
    rows = runner.step([(i, p, 0, len(p)) for i, p in prompts.items()])
    for _ in range(4):
        for (i, p), r in zip(prompts.items(), rows):
            p.append(greedy(r))
        rows = runner.step([(i, p, len(p) - 1, 1) for i, p in prompts.items()])


def test_chunked_prefill_mixed_with_decodes_matches_dense(model, forwards):
    chunked_prefill_beside_decodes(Runner(model, *forwards, chunked_prefill=True), decode_steps=2)


def chunked_prefill_beside_decodes(runner: Runner, decode_steps: int) -> None:
    """A long prompt in two chunks (the second reading the first from the cache) beside a
    short prompt that then decodes, then ``decode_steps`` steps decoding both; the runner
    checks every step's logits against the dense forward."""
    rng = np.random.default_rng(2)
    long_prompt, short_prompt = rng.integers(0, 128, 35).tolist(), rng.integers(0, 128, 12).tolist()
    # Step 1: the short prompt whole, the first chunk of the long one.
    _, short_rows = runner.step([(0, long_prompt, 0, 20), (1, short_prompt, 0, 12)])
    short_prompt.append(greedy(short_rows))
    # Step 2: the second chunk (reads its first 20 tokens from the cache) next to a decode.
    long_rows, short_rows = runner.step([(0, long_prompt, 20, 15), (1, short_prompt, 12, 1)])
    long_prompt.append(greedy(long_rows))
    short_prompt.append(greedy(short_rows))
    for _ in range(decode_steps):
        long_rows, short_rows = runner.step([(0, long_prompt, len(long_prompt) - 1, 1),
                                             (1, short_prompt, len(short_prompt) - 1, 1)])
        long_prompt.append(greedy(long_rows))
        short_prompt.append(greedy(short_rows))


def test_sliding_window_model_matches_dense():
    config = LlamaConfig.tiny(sliding_window=8, tie_word_embeddings=True)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(3), implementation="xla")
    runner = Runner(model, jit_forward(model), jit_forward_dense(model), chunked_prefill=False)
    prompt = np.random.default_rng(3).integers(0, 128, 21).tolist()
    (rows,) = runner.step([(0, prompt, 0, len(prompt))])
    for _ in range(3):  # decodes read block tables truncated to the window
        prompt.append(greedy(rows))
        (rows,) = runner.step([(0, prompt, len(prompt) - 1, 1)])


def test_logits_indices_select_rows_and_profiling_run_needs_no_cache(model, forwards):
    _, dense = forwards
    prompts = [[5, 6, 7], list(range(20, 40))]
    scheduled = [ScheduledSequence.prompt(len(p), None) for p in prompts]
    md = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE).build(scheduled)  # profiling: no tables
    ids = jnp.asarray(pack_per_token(md, scheduled, prompts))
    empty = [jnp.zeros((0,), jnp.float32)] * model.config.num_hidden_layers
    forward = jax.jit(lambda ids, pos, caches, md, idx: model(ids, pos, caches, md, logits_indices=idx))
    logits, caches = forward(ids, jnp.asarray(input_positions(md, scheduled)), empty, md, last_token_indices(md))
    assert logits.shape == (md.num_seqs, 128) and logits.dtype == jnp.float32
    assert all(c.size == 0 for c in caches)
    rows = sequence_rows(md, scheduled)
    for row, p in zip(rows, prompts):
        np.testing.assert_allclose(np.asarray(logits[row]), dense_logits(dense, p)[-1], rtol=0, atol=ATOL)


def test_bfloat16_model_from_a_float32_checkpoint(tmp_path, model, forwards):
    save_checkpoint(model, model.config, tmp_path)
    model16 = load_llama(tmp_path, dtype=jnp.bfloat16, implementation="xla")
    assert model16.model.layers[0].mlp.gate_up_proj.kernel.get_value().dtype == jnp.bfloat16
    prompt = list(range(40, 57))
    scheduled = [ScheduledSequence.prompt(len(prompt), list(range(2)))]
    md = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, chunked_prefill=True).build(scheduled)
    caches = model16.allocate_kv_caches(4, BLOCK_SIZE)
    assert caches[0].dtype == jnp.bfloat16 and caches[0].shape == (2, 4, BLOCK_SIZE, 2, 32)
    logits, caches = jit_forward(model16)(jnp.asarray(pack_per_token(md, scheduled, [prompt])),
                                          jnp.asarray(input_positions(md, scheduled)), caches, md,
                                          last_token_indices(md))
    assert logits.dtype == jnp.float32 and caches[1].dtype == jnp.bfloat16
    reference = dense_logits(forwards[1], prompt)[-1]  # the float32 model
    assert np.abs(np.asarray(logits[0]) - reference).max() < 0.1 * np.abs(reference).max()


def test_forward_rejects_bad_inputs(model):
    md = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE).build([ScheduledSequence.prompt(3, None)])
    ids = jnp.zeros((md.num_tokens,), jnp.int32)
    empty = [jnp.zeros((0,))] * 2
    with pytest.raises(ValueError, match="one cache per layer"):
        model(ids, ids, empty[:1], md)
    with pytest.raises(ValueError, match="input_ids must be"):
        model(ids[None], ids[None], empty, md)
    with pytest.raises(ValueError, match="positions must have"):
        model(ids, ids[:-1], empty, md)
    with pytest.raises(ValueError, match="batch, seq_len"):
        model.forward_dense(ids)


# --------------------------------------------------------------------------- config


LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_config_from_hf_config_round_trips():
    config = LlamaConfig.from_hf_config(LLAMA3_CONFIG)
    assert config.head_dim == 128 and config.num_key_value_heads == 8 and config.sliding_window is None
    assert config.rope_scaling_dict()["rope_type"] == "llama3"
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config
    hash(config)  # static attribute of the NNX graph: must be hashable
    mistral = LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "model_type": "mistral", "sliding_window": 4096,
                                          "rope_scaling": None, "head_dim": None, "num_key_value_heads": None})
    assert mistral.sliding_window == 4096 and mistral.num_key_value_heads == 32 and mistral.head_dim == 128
    legacy = LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_scaling_dict() == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("change, message", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
])
def test_config_rejects_unsupported_features(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config({**LLAMA3_CONFIG, **change})


# transformers 5's spelling: one rope_parameters dict, no top-level rope_theta / rope_scaling.
LLAMA3_ROPE_PARAMETERS = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
LLAMA3_CONFIG_V5 = {**{k: v for k, v in LLAMA3_CONFIG.items() if k not in ("rope_theta", "rope_scaling")},
                    "rope_parameters": LLAMA3_ROPE_PARAMETERS}


def test_config_reads_transformers_5_rope_parameters():
    legacy = LlamaConfig.from_hf_config(LLAMA3_CONFIG)
    v5 = LlamaConfig.from_hf_config(LLAMA3_CONFIG_V5)
    assert v5 == legacy and v5.rope_theta == 500000.0 and v5.rope_scaling_dict()["rope_type"] == "llama3"
    np.testing.assert_array_equal(rope_inverse_frequencies(v5), rope_inverse_frequencies(legacy))
    plain = LlamaConfig.from_hf_config(
        {**LLAMA3_CONFIG_V5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert plain.rope_theta == 500000.0 and plain.rope_scaling is None
    # Both spellings present and agreeing (a file written for both transformers 4 and 5).
    both = LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "rope_parameters": LLAMA3_ROPE_PARAMETERS})
    assert both == legacy
    # rope_parameters without a rope_theta keeps the top-level one, then Hugging Face's default.
    no_theta = {k: v for k, v in LLAMA3_ROPE_PARAMETERS.items() if k != "rope_theta"}
    assert LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "rope_scaling": None, "rope_parameters": no_theta}) == legacy
    assert LlamaConfig.from_hf_config({**LLAMA3_CONFIG_V5, "rope_parameters": no_theta}).rope_theta == 10000.0


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}},
     r"rope_parameters\['rope_type'\] = 'longrope' is not supported"),
    ({"rope_parameters": {"type": "dynamic"}}, r"rope_parameters\['factor'\] must be a positive number"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, r"rope_scaling\['rope_type'\] = 'longrope'"),
    ({"rope_parameters": {**LLAMA3_ROPE_PARAMETERS, "low_freq_factor": None}},
     r"rope_parameters\['low_freq_factor'\] must be a positive number"),
    ({"rope_parameters": LLAMA3_ROPE_PARAMETERS, "rope_theta": 10000.0},
     r"rope_theta = 10000.0 and rope_parameters\['rope_theta'\] = 500000.0"),
    ({"rope_parameters": LLAMA3_ROPE_PARAMETERS, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     "rope_scaling = .* and rope_parameters = .*same rope"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "one dict per layer type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_config_rejects_bad_rope_settings_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config({**LLAMA3_CONFIG_V5, **change})


def test_config_carries_eos_token_id():
    assert LlamaConfig.from_hf_config(LLAMA3_CONFIG).eos_token_id is None
    single = LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "eos_token_id": 128001})
    assert single.eos_token_id == 128001
    several = LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "eos_token_id": [128001, 128008, 128009]})
    assert several.eos_token_id == (128001, 128008, 128009)
    hash(several)  # a list would make the config unhashable
    assert LlamaConfig.from_hf_config(several.to_hf_config()) == several
    assert several.to_hf_config()["eos_token_id"] == [128001, 128008, 128009]
    assert LlamaConfig.tiny(eos_token_id=[3, 4]).eos_token_id == (3, 4)
    with pytest.raises(ValueError, match="eos_token_id"):
        LlamaConfig.from_hf_config({**LLAMA3_CONFIG, "eos_token_id": "</s>"})
    with pytest.raises(ValueError, match="LlamaConfig.eos_token_id"):
        LlamaConfig.tiny(eos_token_id=-1)


def test_rope_frequencies():
    base = LlamaConfig.tiny(head_dim=64, rope_theta=10000.0)
    inv = rope_inverse_frequencies(base)
    np.testing.assert_allclose(inv, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    linear = LlamaConfig.tiny(head_dim=64, rope_scaling=(("factor", 4.0), ("rope_type", "linear")))
    np.testing.assert_allclose(rope_inverse_frequencies(linear), inv / 4, rtol=1e-6)
    llama3 = LlamaConfig.from_hf_config(LLAMA3_CONFIG)
    inv3, inv_plain = rope_inverse_frequencies(llama3), 500000.0 ** (-np.arange(0, 128, 2) / 128)
    wavelen = 2 * math.pi / inv_plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    np.testing.assert_allclose(inv3[high], inv_plain[high], rtol=1e-6)  # short wavelengths kept
    np.testing.assert_allclose(inv3[low], inv_plain[low] / 8, rtol=1e-6)  # long ones divided by factor
    mid = ~high & ~low
    assert np.all((inv3[mid] <= inv_plain[mid]) & (inv3[mid] >= inv_plain[mid] / 8))


# --------------------------------------------------------------------------- checkpoints


def params_of(model: LlamaForCausalLM) -> dict:
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_round_trip(tmp_path, model, sharded):
    files = save_checkpoint(model, model.config, tmp_path, max_shard_bytes=60_000 if sharded else None)
    names = sorted(os.listdir(tmp_path))
    if sharded:
        assert "model.safetensors.index.json" in names and len([n for n in names if n.startswith("model-")]) > 2
    else:
        assert names == ["config.json", "model.safetensors"]
    assert all(os.path.exists(f) for f in files)
    loaded = load_llama(tmp_path, dtype=jnp.float32, implementation="xla")
    assert loaded.config == model.config
    want, got = params_of(model), params_of(loaded)
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8]])
    np.testing.assert_array_equal(np.asarray(jit_forward_dense(loaded)(ids)),
                                  np.asarray(jit_forward_dense(model)(ids)))


def test_a_loaded_model_keeps_its_weights_when_the_file_is_rewritten_in_place(tmp_path, model):
    """The loader reads the mapped file's bytes (`checkpoint._MappedTensors`); what it
    gives the device is its own copy, so writing other weights into the same file (same
    inode) afterwards changes nothing loaded, transposed weights or not."""
    save_checkpoint(model, model.config, tmp_path)
    loaded = load_llama(tmp_path, dtype=jnp.float32, implementation="xla")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    other = {name: (value + 1).astype(value.dtype) for name, value in tensors.items()}
    save_file(other, tmp_path / "other.safetensors")
    with open(tmp_path / "other.safetensors", "rb") as src, open(path, "r+b") as dst:  # same file, rewritten
        dst.write(src.read())
        dst.truncate()
    assert load_file(path)["model.norm.weight"][0] == tensors["model.norm.weight"][0] + 1
    want = params_of(model)
    for name, got in params_of(loaded).items():
        np.testing.assert_array_equal(got, want[name], err_msg=str(name))


def test_mapped_tensors_refuse_byte_ranges_their_shapes_do_not_fit(tmp_path):
    """The loader's own header reading (`checkpoint._MappedTensors`, used after
    ``safe_open`` accepted the file): a tensor whose header entry does not fit the file
    (changed since, or written by a faulty tool) is a CheckpointError naming the file and
    the tensor, never a view of other bytes."""
    import struct

    from jax_paged_attn.models.checkpoint import _MappedTensors

    def write(entries: dict, data: bytes) -> str:
        header = json.dumps(entries).encode()
        path = tmp_path / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + data)
        return str(path)

    values = np.arange(6, dtype=np.float32)
    path = write({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, values.tobytes())
    np.testing.assert_array_equal(_MappedTensors(path).view("w"), values.reshape(2, 3))
    for entry, problem in [
        ({"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 24]}, "do not hold a F32 tensor of shape \\[2, 4\\]"),
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}, "within the file's 24 data bytes"),
        ({"dtype": "F32", "shape": [2, 3]}, "no valid header entry for tensor 'w'"),
    ]:
        path = write({"w": entry}, values.tobytes())
        with pytest.raises(CheckpointError, match=rf"{re.escape(path)} is not a readable safetensors file.*{problem}"):
            _MappedTensors(path).view("w")


@pytest.mark.parametrize("shape, dtype, strides", [
    ((1100, 520), "bfloat16", "c"),  # over a MiB: tiles of 256 with ragged edges, on the threads
    ((520, 600), "float32", "f"),
    ((600, 1200), "float16", "every-other-column"),
    ((40, 30), "float32", "c"),  # under a MiB: NumPy's own copy
])
def test_contiguous_transpose_equals_numpys(shape, dtype, strides):
    from jax_paged_attn.models.checkpoint import contiguous_transpose

    matrix = np.random.default_rng(0).standard_normal(shape).astype(jnp.dtype(dtype))
    if strides == "f":
        matrix = np.asfortranarray(matrix)
    elif strides == "every-other-column":
        matrix = np.concatenate([matrix, matrix], axis=1)[:, ::2]
    got = contiguous_transpose(matrix)
    assert got.dtype == matrix.dtype and got.flags.c_contiguous and got.shape == shape[::-1]
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(matrix.T).view(np.uint8))


def test_checkpoint_uses_hugging_face_names_and_layouts(tmp_path):
    config = LlamaConfig.tiny(tie_word_embeddings=True, num_hidden_layers=1)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(4))
    save_checkpoint(model, config, tmp_path, dtype=jnp.bfloat16)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == sorted([
        "model.embed_tokens.weight", "model.norm.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ])  # tied: no lm_head.weight
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (4 * 32, 64) and q.dtype == jnp.bfloat16  # [out, in]
    # Row h * D + c of q_proj is query head h, channel c: qkv_proj.kernel[:, h // group, h % group, c].
    qkv = np.asarray(model.model.layers[0].self_attn.qkv_proj.kernel.get_value())  # [hidden, Hk, group + 2, D]
    group = 4 // 2
    for h in range(4):
        np.testing.assert_array_equal(
            q[h * 32:(h + 1) * 32].astype(np.float32),
            qkv[:, h // group, h % group, :].T.astype(jnp.bfloat16).astype(np.float32), err_msg=f"query head {h}")
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["torch_dtype"] == "bfloat16" and hf_config["tie_word_embeddings"] is True
    # A bf16 checkpoint loads into a float32 model (cast), but not with strict_dtype.
    loaded = load_llama(tmp_path, dtype=jnp.float32)
    assert loaded.model.embed_tokens.embedding.get_value().dtype == jnp.float32
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*has dtype bfloat16, expected float32"):
        load_llama(tmp_path, dtype=jnp.float32, strict_dtype=True)


def _rewrite(path: str, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_checkpoint_errors_name_tensor_and_file(tmp_path, model):
    save_checkpoint(model, model.config, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    v_file = str(tmp_path / index["model.layers.1.self_attn.v_proj.weight"])
    norm_file = str(tmp_path / index["model.norm.weight"])

    fresh = lambda: LlamaForCausalLM(model.config, rngs=nnx.Rngs(9), implementation="xla")  # noqa: E731
    target = fresh()
    before = params_of(target)

    _rewrite(v_file, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(CheckpointError) as error:  # the index still lists it
        load_checkpoint(target, tmp_path)
    assert f"missing tensor 'model.layers.1.self_attn.v_proj.weight': model.safetensors.index.json lists it in " \
        f"{v_file}" in str(error.value)
    index_path = tmp_path / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())
    del weight_map["weight_map"]["model.layers.1.self_attn.v_proj.weight"]
    index_path.write_text(json.dumps(weight_map))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['model\.layers\.1\.self_attn\.v_proj\.weight'\] "
                                              r"\(not in model\.safetensors\.index\.json"):
        load_checkpoint(target, tmp_path)

    save_checkpoint(model, model.config, tmp_path, max_shard_bytes=60_000)
    _rewrite(norm_file, lambda t: t.update({"model.norm.weight": np.ones(63, np.float32)}))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(target, tmp_path)
    assert "'model.norm.weight'" in str(error.value) and norm_file in str(error.value)
    assert "shape [63], expected [64]" in str(error.value)

    save_checkpoint(model, model.config, tmp_path)  # one file: every tensor in it is seen
    _rewrite(str(tmp_path / "model.safetensors"), lambda t: t.update({
        "model.layers.0.mlp.extra.weight": np.ones(3, np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(3, np.float32)}))  # this one is ignored
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \[\('model\.layers\.0\.mlp\.extra\.weight'"):
        load_checkpoint(target, tmp_path)
    for path, value in params_of(target).items():  # a failed load changes nothing
        np.testing.assert_array_equal(value, before[path])

    save_checkpoint(model, model.config, tmp_path)
    other = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        load_checkpoint(other, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"checkpoint directory '.*nowhere' does not exist"):
        load_llama(tmp_path / "nowhere")


def test_unreadable_safetensors_files_are_checkpoint_errors_naming_the_file(tmp_path, model):
    save_checkpoint(model, model.config, tmp_path)
    path = tmp_path / "model.safetensors"
    whole = path.read_bytes()
    target = LlamaForCausalLM(model.config, rngs=nnx.Rngs(9), implementation="xla")
    for content in (b"", whole[:5], whole[:20], whole[:-40]):  # empty, cut in the header, cut in the data
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is not a readable safetensors file"):
            load_checkpoint(target, tmp_path)
    _edit_config(tmp_path, torch_dtype=None, dtype=None)  # the dtype is then read from the tensors
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is not a readable safetensors file"):
        checkpoint_dtype(tmp_path)


@pytest.mark.parametrize("index, problem", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"metadata": {}}', "has no 'weight_map'"),
    ('{"weight_map": ["model.norm.weight"]}', "'weight_map' must map tensor names to file names, got list"),
    ('{"weight_map": {"model.norm.weight": 3}}', r"'weight_map'\['model.norm.weight'\] must be a file name"),
    ('{"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}',
     r"lists file\(s\) that do not exist: \['model-00009-of-00009.safetensors'\]"),
    ('{"weight_map": {"model.norm.weight": "../model.safetensors"}}', "must be a file name in the checkpoint"),
])
def test_malformed_index_is_a_checkpoint_error_naming_the_file(tmp_path, model, index, problem):
    save_checkpoint(model, model.config, tmp_path, max_shard_bytes=60_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index_path.write_text(index)
    target = LlamaForCausalLM(model.config, rngs=nnx.Rngs(9), implementation="xla")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(index_path))}.*{problem}"):
        load_checkpoint(target, tmp_path)


def _edit_config(directory, **changes) -> None:
    """Sets (or, with value None, removes) keys of directory/config.json."""
    path = directory / "config.json"
    hf_config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            hf_config.pop(key, None)
        else:
            hf_config[key] = value
    path.write_text(json.dumps(hf_config))


def test_load_llama_computes_in_the_dtype_the_checkpoint_names(tmp_path, model, caplog):
    def loaded_dtypes():
        loaded = load_llama(tmp_path, implementation="xla")
        return loaded.dtype, loaded.model.layers[0].mlp.gate_up_proj.kernel.get_value().dtype

    caplog.set_level("WARNING", logger="jax_paged_attn")
    save_checkpoint(model, model.config, tmp_path)  # float32 parameters: a float32 checkpoint
    assert loaded_dtypes() == (jnp.float32, jnp.float32)
    save_checkpoint(model, model.config, tmp_path, dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"  # transformers 5's key
    assert loaded_dtypes() == (jnp.bfloat16, jnp.bfloat16)
    _edit_config(tmp_path, torch_dtype=None, dtype="float16")  # transformers 5 writes only "dtype"
    assert loaded_dtypes() == (jnp.float16, jnp.float16)
    _edit_config(tmp_path, dtype=None, torch_dtype="float32")  # transformers 4 writes only "torch_dtype"
    assert loaded_dtypes() == (jnp.float32, jnp.float32)
    assert caplog.records == []  # the checkpoint chose: nothing to say
    assert load_llama(tmp_path, dtype=jnp.bfloat16).dtype == jnp.bfloat16  # an explicit dtype wins

    _edit_config(tmp_path, torch_dtype=None)  # names none: the tensors' dtype, said once
    assert loaded_dtypes() == (jnp.bfloat16, jnp.bfloat16)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "names no dtype" in message and "bfloat16" in message and "dtype of its tensors" in message

    _edit_config(tmp_path, torch_dtype="bfloat16", dtype="float32")
    with pytest.raises(CheckpointError, match="dtype = 'float32' and torch_dtype = 'bfloat16'"):
        load_llama(tmp_path)
    _edit_config(tmp_path, torch_dtype=None, dtype="int8")
    with pytest.raises(CheckpointError, match="dtype = 'int8' is not a compute dtype"):
        load_llama(tmp_path)
    with pytest.raises(TypeError, match="dtype must be 'auto' or one of"):
        load_llama(tmp_path, dtype="float")


def test_load_llama_reads_eos_token_id_generation_config_first(tmp_path, model):
    save_checkpoint(model, model.config, tmp_path)
    assert load_llama(tmp_path).config.eos_token_id is None
    _edit_config(tmp_path, eos_token_id=[5, 6])
    assert load_llama(tmp_path).config.eos_token_id == (5, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "do_sample": True}))
    assert load_llama(tmp_path).config.eos_token_id == (5, 6)  # sets no eos: config.json's stays
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 7}))
    loaded = load_llama(tmp_path)
    assert loaded.config.eos_token_id == 7
    assert dataclasses.replace(loaded.config, eos_token_id=None) == model.config
    load_checkpoint(model, tmp_path)  # the eos id is not architecture: a model without one loads it
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CheckpointError, match="generation_config.json.*eos_token_id"):
        load_llama(tmp_path)


# --------------------------------------------------------------------------- fused projections

# Query heads per KV head 2, 3, 4 (MQA) and 1 (MHA); the MQA one ties its embeddings.
FUSED_CONFIGS = {
    "group2": LlamaConfig.tiny(num_hidden_layers=1),
    "group3": LlamaConfig.tiny(num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2),
    "mqa_tied": LlamaConfig.tiny(num_hidden_layers=2, num_key_value_heads=1, tie_word_embeddings=True),
    "mha": LlamaConfig.tiny(num_hidden_layers=1, num_key_value_heads=4),
}


@pytest.mark.parametrize("config", FUSED_CONFIGS.values(), ids=FUSED_CONFIGS.keys())
def test_fused_projections_equal_separate_matmuls(config):
    """project_qkv and the MLP compute what the unfused layers would, with the weights each
    part of the fused kernels holds by the documented layout."""
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(5), implementation="xla")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden, hq, hk, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = hq // hk
    qkv = np.asarray(attn.qkv_proj.kernel.get_value(), np.float64)
    assert qkv.shape == (hidden, hk, group + 2, d)
    w_q = qkv[:, :, :group].reshape(hidden, hq * d)  # column h * D + c: query head h = j * group + i
    w_k = qkv[:, :, group].reshape(hidden, hk * d)
    w_v = qkv[:, :, group + 1].reshape(hidden, hk * d)
    x = np.random.default_rng(6).standard_normal((5, hidden)).astype(np.float32)
    positions = np.arange(3, 8, dtype=np.int32)
    q, k, v = attn.project_qkv(jnp.asarray(x), jnp.asarray(positions))
    assert q.shape == (5, hq, d) and k.shape == v.shape == (5, hk, d)
    inv_freq = rope_inverse_frequencies(config)
    separate = {
        "q": apply_rope(jnp.asarray((x @ w_q).reshape(5, hq, d), jnp.float32), positions, inv_freq),
        "k": apply_rope(jnp.asarray((x @ w_k).reshape(5, hk, d), jnp.float32), positions, inv_freq),
        "v": (x @ w_v).reshape(5, hk, d),
    }
    for name, got in zip("qkv", (q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(separate[name]), rtol=1e-5, atol=1e-5, err_msg=name)

    gate_up = np.asarray(mlp.gate_up_proj.kernel.get_value(), np.float64)
    assert gate_up.shape == (hidden, 2, config.intermediate_size)
    gate, up = x @ gate_up[:, 0], x @ gate_up[:, 1]
    want = (gate / (1 + np.exp(-gate)) * up) @ np.asarray(mlp.down_proj.kernel.get_value(), np.float64)
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", FUSED_CONFIGS.values(), ids=FUSED_CONFIGS.keys())
def test_hf_parameter_map_fills_every_parameter_element_once(config):
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    counts = {path: np.zeros(var.get_value().shape, np.int32)
              for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for placement in hf_parameter_map(config).values():
        counts[placement.param_path][placement.index] += 1
    for path, count in counts.items():
        assert (count == 1).all(), path


def hf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face LlamaForCausalLM's tensors and shapes, written out from its modeling code."""
    hidden, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (config.num_attention_heads * d, hidden),
            p + "self_attn.k_proj.weight": (config.num_key_value_heads * d, hidden),
            p + "self_attn.v_proj.weight": (config.num_key_value_heads * d, hidden),
            p + "self_attn.o_proj.weight": (hidden, config.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def hf_reference_logits(tensors: dict[str, np.ndarray], config: LlamaConfig, ids: np.ndarray) -> np.ndarray:
    """Float64 NumPy forward of Hugging Face's LlamaForCausalLM (eager attention, default
    rope) on its own separate q / k / v / gate / up tensors: shares no code with the model."""
    w = {name: t.astype(np.float64) for name, t in tensors.items()}
    hq, hk, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    batch, seq = ids.shape

    def rms_norm(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)

    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(seq)[:, None] * inv_freq
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]  # [S, 1, D]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]

    def rope(x):  # [B, S, H, D], rotate-half
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def heads(x, name, n):
        return (x @ w[name].T).reshape(batch, seq, n, d)

    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = rope(heads(h, p + "self_attn.q_proj.weight", hq))
        # repeat_kv: KV head j serves query heads j * group ... (j + 1) * group - 1.
        k = np.repeat(rope(heads(h, p + "self_attn.k_proj.weight", hk)), hq // hk, axis=2)
        v = np.repeat(heads(h, p + "self_attn.v_proj.weight", hk), hq // hk, axis=2)
        scores = np.where(causal, np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, hq * d)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return rms_norm(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("config", FUSED_CONFIGS.values(), ids=FUSED_CONFIGS.keys())
def test_hugging_face_checkpoint_loads_into_fused_model_and_exports_identically(tmp_path, config):
    """Separate Hugging Face tensors -> the fused model: logits match a NumPy forward of
    Hugging Face's math on those tensors, and saving gives back the identical tensors."""
    rng = np.random.default_rng(12)
    tensors = {}
    for name, shape in hf_tensor_shapes(config).items():
        noise = rng.standard_normal(shape)
        tensors[name] = (1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise).astype(np.float32)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    model = load_llama(tmp_path, dtype=jnp.float32, implementation="xla")
    ids = rng.integers(0, config.vocab_size, (2, 11))
    got = np.asarray(jit_forward_dense(model)(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, hf_reference_logits(tensors, config, ids), rtol=0, atol=ATOL)

    save_checkpoint(model, model.config, tmp_path / "exported")
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert sorted(exported) == sorted(tensors)
    for name, tensor in tensors.items():
        assert exported[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)


def test_decode_step_lowers_to_four_matmuls_per_layer():
    """The fused projections make a layer's decode step 4 dot_generals (qkv, o, gate_up,
    down) instead of 7. Lowered for CUDA, where attention is a Triton call (no dot in the
    StableHLO), so the count is the projections' alone, plus one for the LM head."""
    def dot_count(num_layers: int) -> int:
        config = LlamaConfig.tiny(num_hidden_layers=num_layers, head_dim=64)
        model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                        param_dtype=jnp.bfloat16))
        graphdef, state = nnx.split(model)
        scheduled = [ScheduledSequence(is_prompt=False, seq_len=9, context_len=8, query_len=1, block_table=[i])
                     for i in range(2)]
        md = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=4).build(scheduled)
        caches = [jax.ShapeDtypeStruct(model.kv_cache_shape(4, BLOCK_SIZE), jnp.bfloat16)] * num_layers
        ids = jax.ShapeDtypeStruct((md.num_tokens,), jnp.int32)

        def step(state, ids, positions, caches, md):
            return nnx.merge(graphdef, state)(ids, positions, caches, md, logits_indices=last_token_indices(md))

        text = lower_for_cuda(step, state, ids, ids, caches, md)
        # The rotation of q / k and the cache write are one fused kernel per layer
        # (cache.rotary_and_cache_flash_kv), not XLA rotations and a separate write.
        assert count_in_calls(text, '"rotary_and_cache_flash"') == num_layers
        assert '"reshape_and_cache_flash"' not in text
        return count_in_calls(text, "stablehlo.dot_general")

    one_layer, two_layers = dot_count(1), dot_count(2)
    assert two_layers - one_layer == 4
    assert one_layer == 4 + 1
