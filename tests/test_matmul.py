"""The weight-streaming matmul (`jax_paged_attn.matmul`): the kernel in interpret mode
against a float32 product, its plan, auto's choice, errors, the CUDA lowering, and the
Llama model's serving forward through it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import count_in_calls, lower_for_cuda
from jax_paged_attn import matmul, plans, tuning
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM
from jax_paged_attn.tuning import MatmulConfig

TRITON_CALL = "__gpu$xla.gpu.triton"
IMPLEMENTATIONS = ["xla", "weight_streaming"]


def _operands(rows, depth, out, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*rows, depth)), dtype)
    w = jnp.asarray(rng.standard_normal((depth, *out)) * depth ** -0.5, dtype)
    return x, w


def _exact(x, w):
    """float32 ``[rows, prod(out)]`` product of the flattened operands."""
    return np.asarray(x, np.float32).reshape(-1, x.shape[-1]) @ np.asarray(w, np.float32).reshape(w.shape[0], -1)


CASES = {  # rows (leading axes of x), K, out axes of w, config
    "one_row": ((1,), 256, (128,), MatmulConfig(block_k=64)),
    "odd_rows_split_4": ((17,), 512, (192,), MatmulConfig(block_k=64, split_k=4)),
    "auto_split": ((32,), 1024, (64,), MatmulConfig(block_k=64, target_programs=8)),
    "linear_general_kernel": ((3, 5), 256, (2, 4, 16), MatmulConfig(block_n=32, block_k=128)),
    "max_rows": ((128,), 128, (64,), MatmulConfig()),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_linear_matches_a_float32_product(implementation, case, dtype):
    rows, depth, out, config = case
    x, w = _operands(rows, depth, out, dtype)
    if implementation == "weight_streaming":
        y = matmul.weight_streaming_matmul(x, w, config=config, interpret=True)
    else:
        y = matmul.linear(x, w, implementation="xla")
    assert y.shape == (*rows, *out) and y.dtype == dtype
    expected = _exact(x, w)
    got = np.asarray(y, np.float32).reshape(expected.shape)
    # float32 accumulation, one rounding to the output dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * np.abs(expected).max())


def test_split_k_partials_sum_to_the_unsplit_product():
    x, w = _operands((8,), 512, (64,))
    one = matmul.weight_streaming_matmul(x, w, config=MatmulConfig(block_k=64, split_k=1), interpret=True)
    eight = matmul.weight_streaming_matmul(x, w, config=MatmulConfig(block_k=64, split_k=8), interpret=True)
    np.testing.assert_allclose(np.asarray(one, np.float32), np.asarray(eight, np.float32), rtol=1e-2, atol=1e-2)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


GATE_ACTIVATIONS = {"silu": lambda g: g / (1 + np.exp(-g)), "gelu_pytorch_tanh": _gelu_tanh}


@pytest.mark.covering
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows, config", [((1,), MatmulConfig(block_n=32, block_k=64, split_k=4)),
                                          ((3, 7), MatmulConfig(block_n=64, block_k=128))])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("activation", list(GATE_ACTIVATIONS))
def test_gated_product_matches_activated_gate_times_up(implementation, rows, config, dtype, activation):
    """``act(x @ w[:, 0]) * (x @ w[:, 1])`` for ``w`` ``[K, 2, I]``, SwiGLU's SiLU and
    GeGLU's tanh GELU: the kernel's gated form (one split whatever the config asks: the
    activation needs whole sums) against float32 math rounded once; XLA's path rounds
    both products first, as the unfused model does."""
    x, w = _operands(rows, 256, (2, 128), dtype, seed=5)
    if implementation == "weight_streaming":
        y = matmul.gated_weight_streaming_matmul(x, w, activation=activation, config=config, interpret=True)
    else:
        y = matmul.gated_linear(x, w, activation=activation, implementation="xla")
    assert y.shape == (*rows, 128) and y.dtype == dtype
    products = _exact(x, w).reshape(-1, 2, 128)
    gate, up = products[:, 0], products[:, 1]
    expected = GATE_ACTIVATIONS[activation](gate) * up
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32).reshape(expected.shape), expected, rtol=tol,
                               atol=tol * np.abs(expected).max())
    assert plans.plan_matmul(16, 256, 128, config, gated=True).split_k == 1


def test_gated_product_refuses_a_weight_without_gate_and_up_and_an_unknown_activation():
    x, w = _operands((2,), 256, (128,))
    with pytest.raises(ValueError, match=r"w must be \[K, 2, I\]"):
        matmul.gated_weight_streaming_matmul(x, w, interpret=True)
    x, w = _operands((2,), 256, (2, 128))
    for fn in (matmul.gated_weight_streaming_matmul, matmul.gated_linear):
        with pytest.raises(ValueError, match=r"activation must be one of \('silu', 'gelu_pytorch_tanh'\), got 'relu'"):
            fn(x, w, activation="relu")


def test_gated_geglu_lowers_to_the_kernel_for_cuda():
    """GeGLU's tanh GELU inside the gated kernel lowers through Triton for CUDA."""
    x, w = _operands((4,), 256, (2, 128))
    text = lower_for_cuda(lambda a, b: matmul.gated_linear(a, b, activation="gelu_pytorch_tanh",
                                                           implementation="weight_streaming"), x, w)
    assert TRITON_CALL in text and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("split_k", [1, 4])
def test_partials_sum_to_the_product(split_k):
    """``keep_partials``: float32 split-K partials ``[S, ..., N]`` (the product itself as
    ``S = 1`` when the plan does not split); `linear_partials` through XLA is ``[1, ..., N]``."""
    x, w = _operands((3, 5), 512, (64,))
    config = MatmulConfig(block_k=64, split_k=split_k)
    parts = matmul.weight_streaming_matmul(x, w, config=config, interpret=True, keep_partials=True)
    assert parts.shape == (split_k, 3, 5, 64)
    assert parts.dtype == (jnp.float32 if split_k > 1 else jnp.bfloat16)
    whole = matmul.weight_streaming_matmul(x, w, config=config, interpret=True)
    np.testing.assert_allclose(np.asarray(parts.astype(jnp.float32).sum(0)), np.asarray(whole, np.float32),
                               rtol=1e-2, atol=1e-2)
    xla = matmul.linear_partials(x, w, implementation="xla")
    assert xla.shape == (1, 3, 5, 64)
    np.testing.assert_array_equal(np.asarray(xla[0], np.float32), np.asarray(matmul.xla_matmul(x, w), np.float32))


def test_products_of_more_rows_than_the_kernel_takes_run_through_xla():
    """"weight_streaming" is for decode-sized products: a prefill's (more than
    `tuning.MATMUL_MAX_ROWS` rows) is XLA's dot, in every entry point."""
    big, small = _operands((tuning.MATMUL_MAX_ROWS + 1,), 256, (2, 64)), _operands((4,), 256, (2, 64))
    assert not matmul.streams(big[0], "weight_streaming") and matmul.streams(small[0], "weight_streaming")
    assert not matmul.streams(small[0], None)
    for fn in (matmul.linear, matmul.linear_partials, matmul.gated_linear):
        text = lower_for_cuda(lambda a, b, f=fn: f(a, b, implementation="weight_streaming"), *big)
        assert TRITON_CALL not in text and "stablehlo.dot_general" in text
        assert TRITON_CALL in lower_for_cuda(lambda a, b, f=fn: f(a, b, implementation="weight_streaming"), *small)


def test_plan_splits_k_until_enough_programs():
    config = MatmulConfig(block_n=64, block_k=128, target_programs=256, min_k_steps=2)
    tiling = plans.plan_matmul(32, 2048, 2048, config)
    assert (tiling.rows, tiling.split_k) == (32, 8)  # 32 column blocks x 8 splits of 2 steps
    # each split keeps min_k_steps steps: 2048 / 128 = 16 steps allow at most split 4
    tiling = plans.plan_matmul(2, 2048, 64, MatmulConfig(block_k=128, target_programs=1024, min_k_steps=4))
    assert (tiling.rows, tiling.split_k) == (16, 4)
    assert plans.plan_matmul(2, 2048, 2048, MatmulConfig(split_k=2)).split_k == 2


def test_plan_drops_pipeline_stages_to_fit_shared_memory():
    config = MatmulConfig(block_n=64, block_k=128, num_stages=6)  # 48 KiB per stage at 128 rows
    assert plans.plan_matmul(128, 4096, 1024, config, itemsize=2, budget=200 * 1024).num_stages == 4
    assert plans.plan_matmul(16, 4096, 1024, config, itemsize=2, budget=200 * 1024).num_stages == 6


@pytest.mark.parametrize("config, message", [
    (MatmulConfig(block_n=48), "block_n"),
    (MatmulConfig(block_k=8), "block_k"),
    (MatmulConfig(split_k=3), "split_k"),
    (MatmulConfig(eviction_policy="keep"), "eviction_policy"),
])
def test_bad_configs_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        plans.plan_matmul(16, 256, 256, config)


@pytest.mark.parametrize("x_shape, w_shape, dtypes, message", [
    ((4, 256), (128, 64), (jnp.bfloat16, jnp.bfloat16), "x's last axis"),
    ((4, 256), (256,), (jnp.bfloat16, jnp.bfloat16), r"w \[K, \*out\]"),
    ((4, 256), (256, 64), (jnp.bfloat16, jnp.float16), "bfloat16, float16 or float32"),
    ((4, 256), (256, 64), (jnp.int8, jnp.int8), "bfloat16, float16 or float32"),
    ((129, 256), (256, 64), (jnp.bfloat16, jnp.bfloat16), "129 rows"),
    ((4, 256), (256, 40), (jnp.bfloat16, jnp.bfloat16), "block_n"),
    ((4, 200), (200, 64), (jnp.bfloat16, jnp.bfloat16), "block_k"),
])
def test_streaming_matmul_errors_name_the_argument(x_shape, w_shape, dtypes, message):
    x, w = jnp.zeros(x_shape, dtypes[0]), jnp.zeros(w_shape, dtypes[1])
    with pytest.raises(ValueError, match=message):
        matmul.weight_streaming_matmul(x, w, interpret=True)


def test_linear_rejects_unknown_implementation():
    x, w = _operands((2,), 128, (64,))
    with pytest.raises(ValueError, match="implementation"):
        matmul.linear(x, w, implementation="cublas")


def test_configs_come_from_the_h200_table_else_the_default():
    h200 = tuning.REFERENCE_DEVICE
    assert tuning.matmul_config(32, 2048, 3072, h200) == tuning.MATMUL_TABLE[(2048, 3072, 32)]
    assert tuning.matmul_config(2, 2048, 2048, h200) == tuning.MATMUL_TABLE[(2048, 2048, 16)]  # rows -> 16
    assert tuning.matmul_config(64, 1024, 1024, h200) == MatmulConfig()
    other = tuning.device_from_properties("NVIDIA A100-SXM4-80GB", "8.0")
    assert tuning.matmul_config(32, 2048, 3072, other) == MatmulConfig()  # not measured there


def test_auto_takes_the_kernel_for_16_bit_decode_products_on_measured_gpus_only(monkeypatch):
    from jax_paged_attn import dispatch

    x, w = _operands((32,), 2048, (3072,))
    assert not matmul.auto_takes_kernel()  # this CPU host: XLA's dot
    assert matmul.auto_choice() == "XLA's dot: the weight-streaming kernel runs through CUDA only"
    assert not matmul.streams(x, None, w)
    monkeypatch.setattr(dispatch, "default_platform", lambda: "cuda")
    monkeypatch.setattr(tuning, "target_device", lambda: tuning.REFERENCE_DEVICE)
    assert matmul.auto_takes_kernel()
    choice = matmul.auto_choice()
    assert choice.startswith("on the NVIDIA H200, products of at most 128 rows") and "0.88 / 1.01 ms" in choice
    assert matmul.streams(x, None, w) and matmul.streams(x, "auto", w)
    assert not matmul.streams(x.astype(jnp.float32), None, w)  # float32: not measured
    assert not matmul.streams(x[:, :2000], None, w[:2000])  # does not tile: XLA's, no error
    assert not matmul.streams(jnp.zeros((129, 2048), jnp.bfloat16), None, w)
    assert not matmul.streams(x, "xla", w)
    other = tuning.device_from_properties("NVIDIA A100-SXM4-80GB", "8.0")
    monkeypatch.setattr(tuning, "target_device", lambda: other)
    assert not matmul.auto_takes_kernel()
    choice = matmul.auto_choice()  # the start report names the reason and the measurement that would change it
    assert choice.startswith("XLA's dot: ") and ("on the NVIDIA H200 and the NVIDIA H100 80GB HBM3 only, not on the NVIDIA A100-SXM4-80GB"
                                              in choice)
    assert "--matmul-implementation weight_streaming" in choice
    h100 = tuning.device_from_properties(tuning.H100_DEVICE_KIND, "9.0")  # measured too (2026-12-07)
    monkeypatch.setattr(tuning, "target_device", lambda: h100)
    assert matmul.auto_takes_kernel() and "1.05 / 1.29 ms" in matmul.auto_choice()
    monkeypatch.setattr(tuning, "target_device", lambda: other)
    monkeypatch.setitem(tuning.MATMUL_KERNEL_MEASURED, other.kind, "measured here")  # a GPU measured later
    assert matmul.auto_takes_kernel() and matmul.auto_choice().endswith("measured here; XLA's dot for larger "
                                                                          "products, float32 and with a mesh")


def test_auto_with_a_mesh_keeps_xlas_dot():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), mesh=mesh)
    assert model.matmul_implementation is None
    assert {layer.mlp.matmul_implementation for layer in model.model.layers} == {"xla"}


@pytest.mark.parametrize("implementation", [None, "auto", "xla"])
def test_auto_and_xla_lower_to_xlas_dot_and_the_forced_kernel_to_triton(implementation):
    x, w = _operands((32,), 2048, (3072,))
    text = lower_for_cuda(lambda a, b: matmul.linear(a, b, implementation=implementation), x, w)
    assert TRITON_CALL not in text and "stablehlo.dot_general" in text
    forced = lower_for_cuda(lambda a, b: matmul.linear(a, b, implementation="weight_streaming"), x, w)
    assert TRITON_CALL in forced and "stablehlo.dot_general" not in forced
    y = jax.jit(lambda a, b: matmul.linear(a, b, implementation=implementation))(x, w)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(matmul.xla_matmul(x, w), np.float32))


def test_the_kernel_lowers_for_cuda_with_split_k():
    x, w = _operands((2,), 8192, (2048,))
    text = lower_for_cuda(lambda a, b: matmul.weight_streaming_matmul(a, b, config=MatmulConfig(split_k=8)), x, w)
    assert TRITON_CALL in text


def _streaming_llama(matmul_implementation, implementation="xla", **overrides):
    config = LlamaConfig.tiny(hidden_size=128, intermediate_size=256, **overrides)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                            implementation=implementation, interpret=True,
                            matmul_implementation=matmul_implementation)


def test_llama_serving_forward_through_the_kernel_matches_xla():
    from jax_paged_attn.models import jit_forward_dense

    ours, xla = _streaming_llama("weight_streaming"), _streaming_llama("xla")
    tokens = jnp.array([[3, 17, 9, 100, 5]], jnp.int32)
    # the dense forward is XLA's in both; the serving forward's projections differ (all
    # jitted: eagerly, every op compiles apart, 2.4 s for the dense forwards alone)
    np.testing.assert_array_equal(np.asarray(jit_forward_dense(ours)(tokens)),
                                  np.asarray(jit_forward_dense(xla)(tokens)))
    layer_ours, layer_xla = ours.model.layers[0], xla.model.layers[0]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 128)), jnp.bfloat16)
    got, want = (jax.jit(lambda x: layer.mlp(x, serving=True))(x) for layer in (layer_ours, layer_xla))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    positions = jnp.arange(4, dtype=jnp.int32)
    qkv = [jax.jit(lambda x, p: layer.self_attn.project_qkv(x, p, serving=True))(x, positions)
           for layer in (layer_ours, layer_xla)]
    for a, b in zip(*qkv):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


# attention="xla" runs the same fused layers with the norm's reference (checked against
# the kernel in test_norm.py): a ``--full`` case, the "triton" one covers the fusion.
@pytest.mark.parametrize("attention", [pytest.param("xla", marks=pytest.mark.full), "triton"])
def test_llama_fused_decoder_layers_match_dense(attention):
    """With the kernel, a serving forward of decode-sized batches fuses each residual add
    into the next RMSNorm (`jax_paged_attn.norm`) and the SwiGLU into the gate/up product
    (float32 model, kernels interpreted; attention="triton": the norm kernel too): chunked
    prefill beside decodes, every step's logits equal the dense forward's within 1e-4."""
    from test_llama import Runner, chunked_prefill_beside_decodes
    from jax_paged_attn.models import jit_forward, jit_forward_dense

    config = LlamaConfig.tiny(hidden_size=128, intermediate_size=256)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation=attention, interpret=True,
                             matmul_implementation="weight_streaming")
    assert model._norm_implementation() == attention
    assert model.fuses_residual_norms(jnp.zeros((tuning.MATMUL_MAX_ROWS, 128)))
    assert not model.fuses_residual_norms(jnp.zeros((tuning.MATMUL_MAX_ROWS + 1, 128)))
    runner = Runner(model, jit_forward(model), jit_forward_dense(model), chunked_prefill=True)
    chunked_prefill_beside_decodes(runner, decode_steps=1)


def test_fused_decode_step_lowers_to_norm_and_gated_kernels():
    """The fused decode step for CUDA: per layer two residual add + norm kernels, four
    kernel products (q/k/v, o, gated gate/up, down) and the rotary + cache write summing
    q/k/v's partials, one more norm for the final one; no XLA dot but the LM head's, no
    XLA reduction per layer."""
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence
    from jax_paged_attn.models import last_token_indices

    def lowered(num_layers):
        # hidden 1024: the q/k/v and down products split K in two (float32 partials)
        config = LlamaConfig.tiny(num_hidden_layers=num_layers, head_dim=64, hidden_size=1024,
                                  intermediate_size=1024)
        model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                        param_dtype=jnp.bfloat16,
                                                        matmul_implementation="weight_streaming"))
        graphdef, state = nnx.split(model)
        scheduled = [ScheduledSequence(is_prompt=False, seq_len=9, context_len=8, query_len=1, block_table=[i])
                     for i in range(2)]
        md = FlashAttentionMetadataBuilder(block_size=16, num_blocks=4).build(scheduled)
        caches = [jax.ShapeDtypeStruct(model.kv_cache_shape(4, 16), jnp.bfloat16)] * num_layers
        ids = jax.ShapeDtypeStruct((md.num_tokens,), jnp.int32)

        def step(state, ids, positions, caches, md):
            return nnx.merge(graphdef, state)(ids, positions, caches, md, logits_indices=last_token_indices(md))

        return lower_for_cuda(step, state, ids, ids, caches, md)

    one, two = lowered(1), lowered(2)

    def count(text: str, needle: str) -> int:
        return count_in_calls(text, needle)

    assert count(one, '"add_rms_norm"') == 2  # the first layer's input norm adds nothing: XLA's
    assert count(two, '"add_rms_norm"') - count(one, '"add_rms_norm"') == 2
    assert count(two, '"weight_streaming_matmul"') - count(one, '"weight_streaming_matmul"') == 4
    assert count(one, "stablehlo.dot_general") == count(two, "stablehlo.dot_general") == 1  # the LM head
    # No XLA reduction per layer: every split-K sum is inside a kernel (the norm's, or
    # the fused rotary + cache write's for q/k/v).
    assert count(two, "stablehlo.reduce") == count(one, "stablehlo.reduce")
    assert count(two, '"rotary_and_cache_flash"') - count(one, '"rotary_and_cache_flash"') == 1


def test_llama_rejects_bad_matmul_implementation_and_kernel_with_a_mesh():
    with pytest.raises(ValueError, match="matmul_implementation"):
        LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), matmul_implementation="cublas")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="matmul_implementation='weight_streaming'"):
        LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), mesh=mesh, matmul_implementation="weight_streaming")


GPU_PRODUCTS = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 32, 100, 128])
@pytest.mark.parametrize("depth, cols", GPU_PRODUCTS)
def test_compiled_kernel_matches_xla_on_the_gpu(rows, depth, cols):
    assert jax.default_backend() == "gpu", "the gpu suite needs a GPU"
    x, w = _operands((rows,), depth, (cols,), seed=rows)
    got = jax.jit(lambda a, b: matmul.linear(a, b, implementation="weight_streaming"))(x, w)
    want = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                    precision=jax.lax.Precision.HIGHEST,
                                                    preferred_element_type=jnp.float32))(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2,
                               atol=1e-2 * float(jnp.abs(want).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 128])
@pytest.mark.parametrize("activation", list(GATE_ACTIVATIONS))
def test_compiled_gated_kernel_matches_float32_on_the_gpu(rows, activation):
    """The gated gate/up product of the benchmark model's MLP (2048 x 2 x 8192), compiled."""
    assert jax.default_backend() == "gpu", "the gpu suite needs a GPU"
    x, w = _operands((rows,), 2048, (2, 8192), seed=rows)
    gated = functools.partial(matmul.gated_linear, activation=activation, implementation="weight_streaming")
    got = jax.jit(gated)(x, w)
    products = jax.jit(lambda a, b: jnp.einsum("mk,kgn->mgn", a, b, precision=jax.lax.Precision.HIGHEST,
                                               preferred_element_type=jnp.float32))(x, w)
    want = GATE_ACTIVATIONS[activation](np.asarray(products[:, 0])) * np.asarray(products[:, 1])
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=1e-2 * np.abs(want).max())


def test_engine_greedy_through_the_kernel_in_interpret_mode_matches_dense():
    """The engine's decode windows and prefill steps with every decoder projection
    through the kernel (float32, interpreted): the same tokens as the dense forward."""
    from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams
    from jax_paged_attn.models import dense_greedy_generate

    config = LlamaConfig.tiny(hidden_size=128, intermediate_size=256)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="xla", interpret=True,
                             matmul_implementation="weight_streaming")
    prompts = [[5, 9, 33, 2], [7, 1, 120, 64, 3, 3, 8]]
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
                                           num_host_blocks=0, num_scheduler_steps=4))
    assert "weight_streaming (chosen by the model's matmul_implementation argument)" in engine.start_report
    with jax.default_matmul_precision("highest"):
        outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
        expected = dense_greedy_generate(model, prompts, 10)
    assert [o.outputs[0].token_ids for o in outputs] == expected
