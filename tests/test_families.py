"""The model families (Qwen2/2.5, Qwen3, Gemma 2) and rope scalings against transformers.

Each case is a tiny random checkpoint that transformers writes in the test
(``save_pretrained``, safetensors, no download), with weights redrawn large enough that
greedy tokens are not near-ties. `jax_paged_attn.models.load_llama` reads it through the
checkpoint reader, and:

* the dense forward's float32 logits equal transformers' (eager attention) on prompts of
  several lengths, past the windows of windowed layers, and the feature under test
  matters (the same weights without the window / the rope scaling give other logits);
* 32 greedy tokens through `LLM` equal transformers' (`Case.hf_greedy`), for three prompts in
  a cache too small for them (preemption), two sharing a block (a prefix-cache hit in
  families whose layers are not all windowed), with each token's logprob equal to
  transformers' log-softmax;
* `save_checkpoint` writes files transformers reads back to the same model;
* each family's decode step lowers for CUDA with the fused rotary + cache write, plain
  and with the fused decoder layers (the weight-streaming matmul), and the fused layers
  give the unfused logits (Pallas interpret mode on the CPU).

Dynamic NTK rope is compared with preemption by swapping: a sequence recomputed after
preemption is rotated at its new length (`jax_paged_attn.models.rope`), transformers'
result for that forward, not ``generate``'s cache.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence
from jax_paged_attn.engine import LLM, SamplingParams
from jax_paged_attn.models.rope import config_cos_sin
from jax_paged_attn.models import (
    LlamaConfig,
    LlamaForCausalLM,
    jit_forward_dense,
    last_token_indices,
    load_llama,
    save_checkpoint,
)
from conftest import count_in_calls, engine_base, lower_for_cuda



class _OnFirstUse:
    """A module imported when one of its attributes is first read: torch and transformers
    take seconds of CPU to import, which only the one pytest-xdist worker that runs this
    module (its group, below) spends, not every worker that collects it."""

    def __init__(self, name: str, on_import=lambda module: None) -> None:
        self._name, self._on_import, self._module = name, on_import, None

    def __getattr__(self, attribute: str):
        if attribute.startswith("__") and attribute.endswith("__"):
            # pytest's collection asks every module global for ``__test__`` (and other
            # dunders): answering would import the module in every worker that collects.
            raise AttributeError(attribute)
        if self._module is None:
            self._module = importlib.import_module(self._name)
            self._on_import(self._module)
        return getattr(self._module, attribute)


# One intra-op thread: the references are tiny models, and torch's thread pool spinning
# beside JAX's on two cores took 20x the CPU time of a single thread.
torch = _OnFirstUse("torch", on_import=lambda torch: torch.set_num_threads(1))
transformers = _OnFirstUse("transformers")

# One pytest-xdist worker runs the module: each case's checkpoint (`case`, a module
# fixture) is written and loaded once, and the tests of a family share its compiled programs.
pytestmark = pytest.mark.xdist_group("families")

VOCAB = 128
WINDOW = 8
MAX_TOKENS = 32
ATOL = 1e-4  # float32 logits of O(5): the two implementations differ by summation order
LENGTHS = (5, 13, 29)  # past the 8-token window; 29 > dynamic rope's 16-token original context

_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)


CASES = ("qwen2-yarn", "qwen3-linear", "gemma2-dynamic", "llama-llama3")  # `_hf_configs`' names


def _hf_configs() -> dict[str, transformers.PretrainedConfig]:
    """Each case's transformers config: every family, every rope scaling, 2 layers each."""
    family = dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    configs = {
        # Qwen2.5's long-context rope (yarn); a window on layer 1 (max_window_layers), tied
        # embeddings, biased q / k / v.
        "qwen2-yarn": transformers.Qwen2Config(
            **_SMALL, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=100.0)),
        # head_dim 32 apart from hidden / heads (16); per-head q / k norms; untied embeddings;
        # attention_bias: q / k / v and o biases (Qwen3's option; Llama's spelling too).
        "qwen3-linear": transformers.Qwen3Config(
            **family, tie_word_embeddings=False, attention_bias=True,
            rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=100.0)),
        # A window on layer 0, soft-caps small enough to bind, a softmax scale not D's; the
        # dynamic rope scales past max_position_embeddings (16): the engine serves 4 x 16 tokens.
        "gemma2-dynamic": transformers.Gemma2Config(
            **{**family, "max_position_embeddings": 16}, sliding_window=WINDOW, query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=100.0)),
        "llama-llama3": transformers.LlamaConfig(
            **_SMALL, rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8, rope_theta=100.0)),
    }
    assert tuple(configs) == CASES
    return configs

FAMILIES = ("qwen2", "qwen3", "gemma2")
FAMILY_CASES = dict(zip(FAMILIES, CASES))


def _reset_dynamic_rope(model: torch.nn.Module) -> None:
    """transformers' dynamic rope keeps the frequencies of the longest sequence it has seen
    (until one shorter than the original context): start each reference from a fresh state."""
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", None) == "dynamic":
        rotary.inv_freq = rotary.original_inv_freq.clone()
        rotary.max_seq_len_cached = rotary.original_max_seq_len


def _prompts() -> list[list[int]]:
    """Three prompts: 32 tokens (the first step's whole token budget), 29 sharing its first
    block (read from the prefix cache), and 9."""
    rng = np.random.default_rng(0)
    first = rng.integers(0, VOCAB, 32).tolist()
    return [first, first[:16] + rng.integers(0, VOCAB, 13).tolist(), rng.integers(0, VOCAB, 9).tolist()]


@dataclasses.dataclass
class Case:
    """One checkpoint: its directory, transformers' model and references, ours loaded."""
    name: str
    directory: str
    hf_model: torch.nn.Module
    ours: LlamaForCausalLM

    def hf_logits(self, ids: np.ndarray) -> np.ndarray:
        _reset_dynamic_rope(self.hf_model)
        with torch.no_grad():
            return self.hf_model(torch.tensor(ids)).logits.numpy()

    def hf_greedy(self, prompt: list[int]) -> tuple[list[int], np.ndarray]:
        """32 greedy tokens of transformers' model (no end token: the engine runs with
        ignore_eos) and their logprobs: the prompt's forward, then one token a forward over
        transformers' cache (``generate``'s numbers; dynamic rope's keys rotated when
        written). The loop is written out: ``generate`` would infer an attention mask from
        a pad token id, and these prompts hold every token id."""
        _reset_dynamic_rope(self.hf_model)
        tokens, logprobs, cache, new = list(prompt), [], transformers.DynamicCache(config=self.hf_model.config), prompt
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                out = self.hf_model(torch.tensor([new]), past_key_values=cache, use_cache=True)
                step = torch.log_softmax(out.logits[0, -1], -1)
                token = int(step.argmax())
                tokens.append(token)
                logprobs.append(step[token].item())
                new = [token]
        return tokens[len(prompt):], np.asarray(logprobs)


def _write_case(name: str, directory: str) -> Case:
    """Case ``name``'s random checkpoint, written by transformers into ``directory``."""
    torch.manual_seed(CASES.index(name))
    hf_model = transformers.AutoModelForCausalLM.from_config(_hf_configs()[name], attn_implementation="eager")
    hf_model = hf_model.float().eval()
    with torch.no_grad():  # transformers draws N(0, 0.02): logits too flat for stable greedy tokens
        for param_name, param in hf_model.named_parameters():
            centre = 0.0 if "norm" not in param_name or name.startswith("gemma2") else 1.0  # Gemma scales by 1 + weight
            param.copy_(centre + (0.1 if "norm" in param_name else 0.15) * torch.randn_like(param))
    hf_model.save_pretrained(directory)
    return Case(name, directory, hf_model, load_llama(directory, dtype=jnp.float32))


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    return _write_case(request.param, str(tmp_path_factory.mktemp(request.param)))


def _ablated_logits(ours: LlamaForCausalLM, ids: np.ndarray, **changes) -> np.ndarray:
    """Our dense logits with the same weights under a config changed by ``changes``."""
    other = LlamaForCausalLM(dataclasses.replace(ours.config, **changes), rngs=nnx.Rngs(0))
    nnx.update(other, nnx.state(ours, nnx.Param))
    return np.asarray(jit_forward_dense(other)(jnp.asarray(ids)))


def test_logits_match_transformers(case):
    rng = np.random.default_rng(1)
    dense = jit_forward_dense(case.ours)
    prompts = [rng.integers(0, VOCAB, (1, length)) for length in LENGTHS]
    if case.ours.config.rope_depends_on_length:  # a row's rotation follows its length: one call each
        ours = [np.asarray(dense(jnp.asarray(ids)))[0] for ids in prompts]
    else:  # one right-padded batch (logits before a row's padding do not depend on it)
        padded = np.zeros((len(prompts), max(LENGTHS)), np.int32)
        for row, ids in enumerate(prompts):
            padded[row, :ids.shape[1]] = ids[0]
        ours = np.asarray(dense(jnp.asarray(padded)))
    for row, ids in enumerate(prompts):
        np.testing.assert_allclose(ours[row][:ids.shape[1]], case.hf_logits(ids)[0], rtol=0, atol=ATOL,
                                   err_msg=f"{case.name}, {ids.shape[1]} tokens")
    ids = prompts[-1]
    # The window and the rope scaling change these logits: the comparison does not pass without them.
    config = case.ours.config
    ablations = [dict(rope_scaling=None)]
    if config.sliding_window is not None:
        ablations.append(dict(sliding_window=None, layer_types=None))
    for ablation in ablations:
        assert np.abs(_ablated_logits(case.ours, ids, **ablation) - case.hf_logits(ids)).max() > 1e-2, ablation


def test_config_declares_the_family(case):
    config = case.ours.config
    expected = {
        "qwen2-yarn": dict(attention_bias=True, o_proj_bias=False, tie_word_embeddings=True, kv_cache_window=None,
                           layer_windows=(None, WINDOW)),
        "qwen3-linear": dict(qk_norm=True, attention_bias=True, o_proj_bias=True, tie_word_embeddings=False,
                             head_dim=32,
                             layer_windows=(None, None)),
        "gemma2-dynamic": dict(sandwich_norms=True, norm_unit_offset=True, scale_embeddings=True,
                               hidden_act="gelu_pytorch_tanh", attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0, softmax_scale=24 ** -0.5, layer_windows=(WINDOW, None),
                               kv_cache_window=None, max_sequence_length=64),
        "llama-llama3": dict(model_type="llama", layer_windows=(None, None)),
    }[case.name]
    assert config.rope_scaling_dict()["rope_type"] == case.name.split("-")[1]
    for field, value in expected.items():
        if field == "layer_windows":
            assert tuple(config.layer_window(i) for i in range(config.num_hidden_layers)) == value
        else:
            assert getattr(config, field) == value, field


def test_engine_greedy_tokens_and_logprobs_match_transformers_through_preemption(case):
    prompts = _prompts()
    expected = [case.hf_greedy(p) for p in prompts]
    dynamic = case.ours.config.rope_scaling_dict().get("rope_type") == "dynamic"
    # 7 blocks of 16 tokens hold two of the three sequences (52, 61, 41 tokens): preemption,
    # by recomputation (swapping for dynamic rope, see the module docstring).
    options = dataclasses.asdict(dataclasses.replace(engine_base(), num_blocks=7, num_host_blocks=16 if dynamic else 0))
    llm = LLM(case.directory, tokenizer=None, dtype="float32", **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"{case.name}: request {i} diverged from transformers"
        got = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
        np.testing.assert_allclose(got, logprobs, rtol=0, atol=ATOL, err_msg=f"{case.name}: request {i}")
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and any(o.num_preemptions for o in outs), stats
    assert (stats.num_recomputed_requests > 0) != dynamic, stats
    assert f"model: {case.ours.config.model_type}:" in llm.engine.start_report
    # Not every layer is windowed: the cache keeps every block (the builder has no window).
    assert case.ours.config.kv_cache_window is None and llm.engine.builder.sliding_window is None
    # Prefix caching stays on, but for dynamic rope, whose keys depend on the sequence's length.
    assert llm.engine.config.enable_prefix_caching != dynamic
    assert (stats.num_prefix_cache_hit_tokens >= 16) != dynamic, stats
    if case.name.startswith("gemma2"):  # soft-caps and windows over an fp8 cache, once (a compile more)
        _check_fp8_cache(case, prompts, expected)


@pytest.mark.gpu
def test_engine_on_the_gpu_matches_transformers(case):
    """The engine check above on a GPU, through the kernels auto picks there (float32
    queries: the Triton tier), at full float32 matmul precision (JAX's default on a GPU
    multiplies float32 in reduced precision)."""
    with jax.default_matmul_precision("highest"):
        test_engine_greedy_tokens_and_logprobs_match_transformers_through_preemption(case)
    assert jax.default_backend() == "gpu"


# The real long-context ropes (head size 128): Qwen2.5's yarn over 32,768 positions to
# 131,072, Llama 3.1's llama3 over 8,192 to 131,072, linear and dynamic NTK at 4x.
LONG_ROPES = {
    "qwen2.5-yarn": ("Qwen2Config", dict(
        max_position_embeddings=131072, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6,
                                                             original_max_position_embeddings=32768))),
    "llama3.1-llama3": ("LlamaConfig", dict(
        max_position_embeddings=131072, rope_parameters=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=5e5,
            original_max_position_embeddings=8192))),
    "qwen3-linear": ("Qwen3Config", dict(
        max_position_embeddings=32768, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e6))),
    "gemma2-dynamic": ("Gemma2Config", dict(
        max_position_embeddings=8192, rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=1e4))),
}
# Around the original context's end and the scaled one's, where the scalings part ways.
LONG_POSITIONS = (0, 1, 4095, 8191, 8192, 16383, 32767, 32768, 65535, 131071)


@pytest.mark.parametrize("name", LONG_ROPES)
def test_long_context_rope_angles_match_transformers(name):
    """Each family's rotary cos / sin at the long positions of the real configs, against
    transformers' rotary embedding, to the float32 rounding of each angle (both compute
    position x frequency in float32; the frequencies may differ in their last bit)."""
    config_class, fields = LONG_ROPES[name]
    hf_config = getattr(transformers, config_class)(vocab_size=32, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=128, **fields)
    config = LlamaConfig.from_hf_config(hf_config.to_dict())
    positions = np.asarray(LONG_POSITIONS)
    if config.rope_scaling_dict()["rope_type"] != "dynamic":
        positions = positions[positions < hf_config.max_position_embeddings]
    rotary = transformers.AutoModelForCausalLM.from_config(hf_config).model.rotary_emb
    with torch.no_grad():
        hf_cos, hf_sin = (t[0].numpy() for t in rotary(torch.zeros(1, dtype=torch.float32),
                                                        torch.as_tensor(positions)[None]))
    # A dense forward's sequence length: the last position + 1 (dynamic rope reads it).
    cos, sin = config_cos_sin(config, jnp.asarray(positions)[None], jnp.float32,
                              seq_lens=jnp.full((1, positions.size), positions[-1] + 1, jnp.int32))
    # An angle of p radians or less is float32 to spacing(p): two such roundings apart at most.
    allowed = 2 * np.spacing(np.maximum(positions, 1).astype(np.float32))[:, None]
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        excess = np.abs(np.asarray(ours[0]) - theirs) - allowed
        assert excess.max() <= 0, (name, positions[np.unravel_index(excess.argmax(), excess.shape)[0]])
    plain = LlamaConfig.from_hf_config({**hf_config.to_dict(), "rope_parameters": dict(
        rope_type="default", rope_theta=fields["rope_parameters"]["rope_theta"])})
    plain_cos, _ = config_cos_sin(plain, jnp.asarray(positions)[None], jnp.float32)
    assert np.abs(np.asarray(plain_cos[0]) - hf_cos).max() > 0.1, "the scaling changes nothing here"


def _check_fp8_cache(case: Case, prompts: list[list[int]], expected: list[tuple[list[int], np.ndarray]]) -> None:
    """An fp8 (e4m3) KV cache keeps transformers' first 8 greedy tokens, logprobs within
    fp8's error (measured up to 0.01 for this model), and is really fp8 (not exact)."""
    options = dataclasses.asdict(dataclasses.replace(engine_base(), num_blocks=24))
    llm = LLM(case.directory, tokenizer=None, dtype="float32", kv_cache_dtype="fp8", **options)
    assert llm.engine.kv_caches[0].dtype == jnp.float8_e4m3fn
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    errors = []
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens[:8]
        errors += [abs(entry[t].logprob - want) for entry, t, want in zip(out.outputs[0].logprobs, tokens, logprobs)]
    assert 1e-4 < max(errors) < 0.05, errors


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_transformers(family, tmp_path):
    hf_config = _hf_configs()[FAMILY_CASES[family]]
    torch.manual_seed(7)
    source = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    source.save_pretrained(tmp_path / "source")
    ours = load_llama(tmp_path / "source", dtype=jnp.float32)
    save_checkpoint(ours, ours.config, tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
    ids = torch.tensor(np.random.default_rng(2).integers(0, VOCAB, (1, 13)))
    with torch.no_grad():
        np.testing.assert_allclose(reloaded.float()(ids).logits.numpy(), source(ids).logits.numpy(), rtol=0,
                                   atol=1e-6)
    assert reloaded.config.layer_types == source.config.layer_types


def _family_config(family: str, **changes) -> LlamaConfig:
    """A tiny config of ``family`` with its windows (head size 64: the CUDA kernels' tile;
    hidden 128: the weight-streaming matmul's K tile)."""
    windows = {"qwen2": ("full_attention", "sliding_attention"), "gemma2": ("sliding_attention", "full_attention")}
    fields = dict(head_dim=64, hidden_size=128, intermediate_size=256,
                  sliding_window=WINDOW if family in windows else None,
                  layer_types=windows.get(family))
    if family == "qwen3":
        fields.update(attention_bias=True, o_proj_bias=True)
    if family == "gemma2":
        fields.update(query_pre_attn_scalar=24.0, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    return LlamaConfig.tiny(model_type=family, **{**fields, **changes})


def _decode_metadata():
    scheduled = [ScheduledSequence(is_prompt=False, seq_len=9 + i, context_len=8 + i, query_len=1, block_table=[i])
                 for i in range(2)]
    return FlashAttentionMetadataBuilder(block_size=16, num_blocks=4).build(scheduled)


@pytest.mark.parametrize("matmul_implementation", ["xla", "weight_streaming"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_lowers_for_cuda(family, matmul_implementation):
    """Each family's bf16 decode step lowers for CUDA with one fused rotary + cache write a
    layer; with the weight-streaming matmul, through the fused decoder layers: per layer
    four kernel products (the gate's activation, SiLU or GeGLU, inside the gate/up one) and
    two residual add + norm kernels (Gemma 2's sandwich norms inside them), whatever the
    family."""
    config = _family_config(family)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                    param_dtype=jnp.bfloat16,
                                                    matmul_implementation=matmul_implementation))
    graphdef, state = nnx.split(model)
    md = _decode_metadata()
    caches = [jax.ShapeDtypeStruct(model.kv_cache_shape(4, 16), jnp.bfloat16)] * config.num_hidden_layers
    ids = jax.ShapeDtypeStruct((md.num_tokens,), jnp.int32)

    def step(state, ids, positions, caches, md):
        return nnx.merge(graphdef, state)(ids, positions, caches, md, logits_indices=last_token_indices(md))

    text = lower_for_cuda(step, state, ids, ids, caches, md)
    assert count_in_calls(text, '"rotary_and_cache_flash"') == config.num_hidden_layers
    assert '"reshape_and_cache_flash"' not in text
    if matmul_implementation == "weight_streaming":
        assert model.fuses_residual_norms(jax.ShapeDtypeStruct((md.num_tokens, config.hidden_size), jnp.bfloat16))
        layers = config.num_hidden_layers  # the first layer's input norm adds nothing (XLA's); the final one adds
        assert count_in_calls(text, '"add_rms_norm"') == 2 * layers
        assert count_in_calls(text, '"weight_streaming_matmul"') == 4 * layers


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decoder_layers_match_unfused(family):
    """The fused layers (split-K partials, biases on the first partial, q / k norms after the
    sum, sandwich norms in the add + norm kernels, GeGLU inside the gated product) give the unfused
    logits for a decode step (kernels in interpret mode)."""
    config = _family_config(family, head_dim=32, num_hidden_layers=1,
                            layer_types=("sliding_attention",) if family == "gemma2" else None)
    kwargs = dict(rngs=nnx.Rngs(3), implementation="xla", interpret=True)
    plain = LlamaForCausalLM(config, matmul_implementation="xla", **kwargs)
    fused = LlamaForCausalLM(config, matmul_implementation="weight_streaming", **kwargs)
    # Non-trivial biases and norm weights (they start at 0 and 1).
    state = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(5), x.shape, x.dtype),
                         nnx.state(plain, nnx.Param))
    nnx.update(plain, state)
    nnx.update(fused, state)
    md = _decode_metadata()
    ids = jnp.asarray([5, 9] + [0] * (md.num_tokens - 2), jnp.int32)
    positions = jnp.asarray([8, 9] + [0] * (md.num_tokens - 2), jnp.int32)
    caches = [jax.random.normal(jax.random.key(i), plain.kv_cache_shape(4, 16))
              for i in range(config.num_hidden_layers)]
    assert fused.fuses_residual_norms(jnp.zeros((md.num_tokens, config.hidden_size)))
    want, _ = plain(ids, positions, caches, md, logits_indices=last_token_indices(md))
    got, _ = fused(ids, positions, caches, md, logits_indices=last_token_indices(md))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=128, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              sliding_window=8, query_pre_attn_scalar=32)


@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'; gemma2 runs 'gelu_pytorch_tanh'"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must list one of"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must list one of"),
    ({"sliding_window": None}, "layer_types names sliding_attention layers but sliding_window is null"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": None, "architectures": ["Gemma3ForCausalLM"]}, "architectures .* name no supported model"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 8, "beta_fast": -1}}, r"\['beta_fast'\]"),
])
def test_bad_family_configs_name_the_field(change, message):
    hf_config = {k: v for k, v in {**GEMMA2, **change}.items() if v is not None or k == "sliding_window"}
    if change.get("sliding_window", 0) is None:
        hf_config["layer_types"] = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config(hf_config)


def test_windows_of_every_layer_free_blocks_and_mixed_windows_keep_them():
    every = LlamaConfig.from_hf_config({**GEMMA2, "layer_types": ["sliding_attention"] * 2})
    assert every.kv_cache_window == 8 and every.layer_types is None  # the plain (Mistral) form
    mixed = LlamaConfig.from_hf_config(GEMMA2)
    assert mixed.kv_cache_window is None and mixed.layer_types == ("sliding_attention", "full_attention")
    qwen = {**GEMMA2, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": 1}
    assert LlamaConfig.from_hf_config(qwen).sliding_window is None  # use_sliding_window defaults to false
    windowed = LlamaConfig.from_hf_config({**qwen, "use_sliding_window": True})
    assert [windowed.layer_window(i) for i in range(2)] == [None, 8]
    assert LlamaConfig.from_hf_config(windowed.to_hf_config()) == windowed
    assert LlamaConfig.from_hf_config(mixed.to_hf_config()) == mixed


_TENSOR_PARALLEL_RUN = """
import json, sys
import jax
jax.config.update("jax_enable_compilation_cache", False)
from conftest import engine_base
from jax_paged_attn.engine import LLM, SamplingParams
tokens = {}
for directory in sys.argv[1:]:
    llm = LLM(directory, tokenizer=None, dtype="float32", tensor_parallel_size=2, num_blocks=24, num_host_blocks=0,
              **{k: v for k, v in vars(engine_base()).items() if k not in ("num_blocks", "num_host_blocks")})
    qkv = llm.model.model.layers[0].self_attn.qkv_proj.kernel[...]
    assert len({s.device for s in qkv.addressable_shards}) == 2 and qkv.addressable_shards[0].data.shape[1] == 1
    outs = llm.generate(json.loads(sys.stdin.read() or "null") or PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=%d, ignore_eos=True), use_tqdm=False)
    tokens[directory] = [o.outputs[0].token_ids for o in outs]
print(json.dumps(tokens))
"""


def test_tensor_parallel_engine_matches_transformers(tmp_path):
    """`LLM(tensor_parallel_size=2)` (two forced CPU devices, in a subprocess: the flag is
    read when JAX starts) with Qwen2's head counts: its one KV head stored twice, with its
    q / k / v biases (the other families' sharded layouts are Llama's, which
    tests/test_parallel.py checks)."""
    import json
    import subprocess
    import sys

    prompts = _prompts()[:2]
    cases = [_write_case(name, str(tmp_path / name)) for name in ("qwen2-yarn",)]
    expected = {case.directory: [case.hf_greedy(p)[0] for p in prompts] for case in cases}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip(),
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")]))
    code = _TENSOR_PARALLEL_RUN.replace("%d", str(MAX_TOKENS)).replace("PROMPTS", repr(prompts))
    result = subprocess.run([sys.executable, "-c", code, *expected], env=env, capture_output=True, text=True,
                            timeout=600, input="")
    assert result.returncode == 0, result.stderr[-6000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected
