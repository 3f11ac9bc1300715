"""Presence / frequency / repetition penalties, ``logit_bias``, ``min_tokens`` and
``min_p``: vLLM's definitions, applied on the device inside the engine's programs.

The oracle is `vllm_logits`, NumPy's transcription of vLLM V1's sampler (``logit_bias``,
``min_tokens``, then ``apply_penalties``: repetition over prompt and output, frequency
and presence over the output), applied to the dense, cache-free ``forward_dense`` logits
at every output position of what the engine produced: each greedy token must be the
argmax of the processed logits. Requests without these parameters, batched beside one
that has them, keep their tokens, and run the programs without penalties once the
penalized request has left.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ENGINE_GROUP, engine_base, random_prompts
from jax_paged_attn.engine import LLMEngine, SamplingParams, sample_tokens
from jax_paged_attn.engine.penalties import Penalties, PenaltyTokens, apply_penalties, with_token_counts
from jax_paged_attn.engine.sampling import MAX_LOGIT_BIAS
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, jit_forward_dense

pytestmark = ENGINE_GROUP  # one worker compiles the tiny Llama's programs once (conftest.py)

BASE = dataclasses.replace(engine_base(), num_scheduler_steps=4)
VOCAB = LlamaConfig.tiny().vocab_size
ATOL = 2e-4  # paged vs dense logits; a token within this of the best is a tie
PROMPTS = random_prompts(11, [9, 14, 6])
MAX_TOKENS = 14
DENSE_LENGTH = 160  # token ids the dense oracle runs on, right-padded


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def vllm_logits(raw: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams,
                stop_ids: tuple[int, ...] = ()) -> np.ndarray:
    """vLLM V1's processed logits of one position (NumPy): ``logit_bias``, ``min_tokens``
    (stop ids to -inf), then vllm.model_executor.layers.utils.apply_penalties."""
    x = np.array(raw, np.float32)
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        x[list(stop_ids)] = -np.inf
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))
    seen = counts > 0
    seen[prompt] = True
    penalty = np.where(seen, params.repetition_penalty, 1.0).astype(np.float32)
    x = np.where(x > 0, x / penalty, x * penalty)
    x -= params.frequency_penalty * counts
    x -= params.presence_penalty * (counts > 0)
    return x


_dense: dict[int, object] = {}


def dense_logits(model, prompt: list[int], output: list[int]) -> np.ndarray:
    """f32[len(output), V]: the dense logits that predicted each output token."""
    if id(model) not in _dense:
        _dense[id(model)] = jit_forward_dense(model)
    tokens = list(prompt) + list(output)
    assert len(tokens) <= DENSE_LENGTH, len(tokens)
    ids = jnp.asarray([tokens + [0] * (DENSE_LENGTH - len(tokens))], jnp.int32)  # one padded shape, one program
    return np.asarray(_dense[id(model)](ids)[0, len(prompt) - 1:len(tokens) - 1])


def assert_greedy_follows_reference(model, prompt, tokens, params, stop_ids=()):
    """Every token is the argmax (within `ATOL`) of vLLM's processed dense logits."""
    raw = dense_logits(model, prompt, tokens)
    for t, token in enumerate(tokens):
        row = vllm_logits(raw[t], prompt, tokens[:t], params, stop_ids)
        assert row[token] >= row.max() - ATOL, (t, token, int(row.argmax()), row[token], row.max())


def spy_penalties(engine, setattr=setattr) -> list[tuple[str, bool]]:
    """Records, for each program call, its kind and whether it applied `Penalties`
    (``setattr``: pytest's ``monkeypatch.setattr`` to undo it after the test)."""
    calls, runner = [], engine.runner
    window, mixed, step = runner._window, runner._mixed, runner._step

    def spied(kind, program, penalized_of):
        def call(*args, **kwargs):
            calls.append((kind, penalized_of(args)))
            return program(*args, **kwargs)
        return call

    setattr(runner, "_window", spied("window", window, lambda a: a[2].penalties is not None))
    setattr(runner, "_mixed", spied("mixed", mixed, lambda a: a[12] is not None))
    setattr(runner, "_step", spied("step", step, lambda a: a[6] is not None))
    return calls


# --------------------------------------------------------------------------- device function


def test_apply_penalties_is_vllms_formula():
    rng = np.random.default_rng(0)
    num_rows, vocab = 4, 40
    logits = rng.normal(scale=3.0, size=(num_rows, vocab)).astype(np.float32)
    params = [SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.7, min_tokens=3,
                             logit_bias={2: 4.0, 39: -7.5}),
              SamplingParams(repetition_penalty=0.6, frequency_penalty=2.0),
              SamplingParams(logit_bias={0: 100.0}),
              SamplingParams()]
    prompts = [rng.integers(0, vocab, 6).tolist() for _ in range(num_rows)]
    outputs = [rng.integers(0, vocab, n).tolist() for n in (2, 5, 0, 4)]
    stops = (7, 11)
    rows = Penalties.neutral(num_rows, vocab, 8)
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        rows.presence[i], rows.frequency[i], rows.repetition[i] = (p.presence_penalty, p.frequency_penalty,
                                                                   p.repetition_penalty)
        rows.min_tokens[i], rows.stop_ids[i, :2] = p.min_tokens, stops
        for j, (token, bias) in enumerate((p.logit_bias or {}).items()):
            rows.bias_ids[i, j], rows.bias_values[i, j] = token, bias
        rows.output_counts[i] = np.bincount(output, minlength=vocab)
        rows.prompt_mask[i, prompt] = True
    num_generated = np.array([len(o) for o in outputs], np.int32)
    got = np.asarray(jax.jit(apply_penalties)(logits, rows, num_generated))
    for i in range(num_rows):
        want = vllm_logits(logits[i], prompts[i], outputs[i], params[i], stops)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[3], logits[3])  # a neutral row passes unchanged, bit for bit
    assert np.isneginf(got[0, list(stops)]).all() and np.isfinite(got[1, list(stops)]).all()


def test_a_steps_token_ids_count_as_the_host_counts():
    """A step sends its rows' token ids (`PenaltyTokens`); the program's counts equal
    NumPy's bincount of the output and the prompt's set, padding and empty rows aside."""
    rng = np.random.default_rng(1)
    vocab, width = 50, 24
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 9, 0)]
    outputs = [rng.integers(0, vocab, n).tolist() for n in (7, 0, 0)]
    tokens = PenaltyTokens.empty(3, width)
    tokens.token_ids[:] = 7  # junk past each row's tokens must not count
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        tokens.token_ids[i, :len(prompt) + len(output)] = prompt + output
        tokens.num_prompt_tokens[i], tokens.num_tokens[i] = len(prompt), len(prompt) + len(output)
    counted = jax.jit(with_token_counts, static_argnums=2)(Penalties.neutral(3, None, 8), tokens, vocab)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        np.testing.assert_array_equal(counted.output_counts[i], np.bincount(output, minlength=vocab).astype(int))
        np.testing.assert_array_equal(np.nonzero(counted.prompt_mask[i])[0], sorted(set(prompt)))


def test_min_p_keeps_tokens_at_least_min_p_of_the_most_likely():
    logits = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]] * 2, np.float32))
    draws = 400
    tile = lambda x: jnp.asarray(np.repeat(x, draws, axis=0))  # noqa: E731
    sample = jax.jit(sample_tokens)
    args = (tile(logits), jnp.ones(2 * draws), jnp.ones(2 * draws), jnp.full(2 * draws, -1),
            jnp.arange(2 * draws, dtype=jnp.uint32), jnp.zeros(2 * draws, jnp.int32))
    min_p = jnp.asarray(np.repeat([0.3, 0.0], draws), jnp.float32)
    tokens = np.asarray(sample(*args, min_p=min_p)).reshape(2, draws)
    # vLLM: keep p >= min_p * max p, i.e. p >= 0.12 here: tokens 0, 1, 2.
    assert set(tokens[0].tolist()) == {0, 1, 2}
    assert set(tokens[1].tolist()) > {0, 1, 2}  # without min_p the tail is drawn
    greedy = np.asarray(sample(args[0], jnp.zeros(2 * draws), *args[2:], min_p=min_p))
    assert (greedy == 0).all()  # min_p leaves greedy rows alone


@pytest.mark.parametrize("kwargs, name, words", [
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens", "max_tokens=10"),
    (dict(min_tokens=-1), "min_tokens", "[0, "),
    (dict(logit_bias={-1: 1.0}), "logit_bias", ">= 0"),
    (dict(logit_bias={3: float("nan")}), "logit_bias", "finite"),
    (dict(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)), "logit_bias", "at most 300"),
])
def test_invalid_values_name_the_parameter(kwargs, name, words):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value).startswith(name) and words in str(error.value)


def test_wrong_types_name_the_parameter_and_neutral_values_process_nothing():
    with pytest.raises(TypeError, match="^logit_bias"):
        SamplingParams(logit_bias=[(1, 2.0)])
    with pytest.raises(TypeError, match="^presence_penalty"):
        SamplingParams(presence_penalty="1")
    neutral = SamplingParams(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, min_p=0, min_tokens=0,
                             logit_bias={})
    assert not neutral.processes_logits and neutral.logit_bias is None
    assert SamplingParams(logit_bias={np.int64(3): 1}).logit_bias == {3: 1.0}
    assert all(SamplingParams(**{k: v}).processes_logits for k, v in [
        ("presence_penalty", 0.1), ("frequency_penalty", -0.1), ("repetition_penalty", 1.1), ("min_p", 0.05),
        ("min_tokens", 1), ("logit_bias", {0: 0.5})])


def test_logit_bias_ids_are_checked_against_the_vocabulary(model):
    engine = LLMEngine(model, BASE)
    with pytest.raises(ValueError, match=rf"logit_bias token ids \[{VOCAB}\] lie outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={3: 1.0, VOCAB: 2.0}))
    assert not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def neutral_tokens(model):
    engine = LLMEngine(model, BASE)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kwargs, decode_during_prefill", [
    (dict(presence_penalty=2.0), True),
    (dict(frequency_penalty=1.0), True),
    (dict(repetition_penalty=1.8), True),
    (dict(logit_bias={5: 2.5, 30: -100.0}), True),
    (dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4, logit_bias={17: 1.5}), False),
], ids=["presence", "frequency", "repetition", "logit_bias", "all-scheduled-steps"])
def test_greedy_with_a_penalty_follows_vllms_formula_and_leaves_neutral_requests_alone(
        model, neutral_tokens, kwargs, decode_during_prefill):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kwargs)
    if "logit_bias" in kwargs:  # bias against what the neutral run picks first: the bias must change it
        params = dataclasses.replace(params, logit_bias={**kwargs["logit_bias"], neutral_tokens[0][0]: -3.0})
    engine = LLMEngine(model, dataclasses.replace(BASE, decode_during_prefill=decode_during_prefill))
    calls = spy_penalties(engine)
    neutral = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS, [params, neutral, neutral], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] != neutral_tokens[0]  # the penalty changed the greedy tokens ...
    assert_greedy_follows_reference(model, PROMPTS[0], tokens[0], params)  # ... as vLLM's formula says
    assert tokens[1:] == neutral_tokens[1:]  # the neutral requests beside it are untouched
    assert any(penalized for _, penalized in calls)


def test_penalties_follow_a_request_through_windows_and_the_batch_sheds_them(model, neutral_tokens):
    """A penalized request whose output outlives several decode windows keeps its counts
    on the device; once it finishes, the batch is rebuilt without penalties."""
    engine = LLMEngine(model, BASE)
    calls = spy_penalties(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, frequency_penalty=1.5, repetition_penalty=1.2)
    neutral = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS, [params, neutral, neutral], use_tqdm=False)
    assert_greedy_follows_reference(model, PROMPTS[0], outs[0].outputs[0].token_ids, params)
    assert [o.outputs[0].token_ids for o in outs[1:]] == neutral_tokens[1:]
    windows = [penalized for kind, penalized in calls if kind == "window"]
    assert windows[0] and not windows[-1], calls


@pytest.mark.parametrize("decode_during_prefill", [True, False], ids=["mixed-step-join", "insert-join"])
def test_requests_joining_a_penalized_batch_bring_their_counts(model, neutral_tokens, decode_during_prefill):
    """Requests arriving while a penalized batch decodes take free rows: inside the mixed
    step (their penalties from their prompt's, counting the token it sampled, on the
    device) or by a row insert after a prefill beside the batch (built on the host)."""
    engine = LLMEngine(model, dataclasses.replace(BASE, decode_during_prefill=decode_during_prefill))
    first = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, frequency_penalty=1.1, presence_penalty=0.5)
    later = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.6, logit_bias={9: 1.5})
    neutral = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    arrivals = {0: [(0, first)], 2: [(1, later), (2, neutral)]}
    outputs, step = {}, 0
    while len(outputs) < 3:
        for i, params in arrivals.get(step, []):
            engine.add_request(PROMPTS[i], params, request_id=f"r{i}")
        for out in engine.step():
            outputs[int(out.request_id[1:])] = engine.pop_output(out.request_id).outputs[0].token_ids
        step += 1
    assert engine.stats.num_inserted_rows > 0  # they joined the running batch
    assert_greedy_follows_reference(model, PROMPTS[0], outputs[0], first)
    assert_greedy_follows_reference(model, PROMPTS[1], outputs[1], later)
    assert outputs[2] == neutral_tokens[2] and outputs[1] != neutral_tokens[1]


@pytest.mark.parametrize("num_host_blocks", [32, 0], ids=["swap", "recompute"])
def test_penalties_survive_preemption(model, num_host_blocks):
    """Preempted requests come back through scheduled steps (swap-in, or recomputation of
    prompt and output): their counts are rebuilt from the host's tokens, the prompt's
    apart from the output's."""
    prompts = random_prompts(2, [80, 18, 100, 42])  # 27 blocks at the end in BASE's 24
    engine = LLMEngine(model, dataclasses.replace(BASE, num_host_blocks=num_host_blocks))
    params = SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.8, presence_penalty=0.3,
                            repetition_penalty=1.2)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats.num_preemptions > 0
    assert (engine.stats.num_recomputed_requests > 0) == (num_host_blocks == 0)
    for prompt, out in zip(prompts, outs):
        assert_greedy_follows_reference(model, prompt, out.outputs[0].token_ids, params)


def test_min_tokens_holds_eos_and_stop_ids_back(model, neutral_tokens):
    eos, stop_id = neutral_tokens[0][0], neutral_tokens[0][1]  # the first tokens greedy picks
    engine = LLMEngine(model, dataclasses.replace(BASE, eos_token_id=eos))
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    held = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=8, stop_token_ids=[stop_id])
    outs = engine.generate([PROMPTS[0]] * 2, [plain, held], use_tqdm=False)
    first, second = (o.outputs[0] for o in outs)
    assert first.token_ids == [eos] and first.finish_reason == "stop"  # EOS ends it at once ...
    assert len(second.token_ids) >= 8 and not {eos, stop_id} & set(second.token_ids[:8])  # ... not before 8
    assert_greedy_follows_reference(model, PROMPTS[0], second.token_ids, held, stop_ids=(stop_id, eos))
    if len(second.token_ids) < MAX_TOKENS:
        assert second.finish_reason == "stop" and second.token_ids[-1] in (eos, stop_id)


def test_min_p_sampling_keeps_to_the_tokens_vllm_keeps(model):
    engine = LLMEngine(model, BASE)
    temperature, min_p = 1.3, 0.5
    params = [SamplingParams(temperature=temperature, min_p=min_p, max_tokens=MAX_TOKENS, seed=s) for s in range(3)]
    unrestricted = [dataclasses.replace(p, min_p=0.0) for p in params]
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    free = engine.generate(PROMPTS, unrestricted, use_tqdm=False)

    def ratios(prompt, tokens):  # each token's probability over the most likely one's
        probs = jax.nn.softmax(dense_logits(model, prompt, tokens) / temperature, axis=-1)
        return np.asarray(probs[np.arange(len(tokens)), tokens] / probs.max(axis=-1))

    for prompt, out in zip(PROMPTS, outs):
        assert (ratios(prompt, out.outputs[0].token_ids) >= min_p - 1e-4).all()
    # Without min_p the same seeds draw tokens it would have dropped: the bound is not vacuous.
    assert any((ratios(p, o.outputs[0].token_ids) < min_p).any() for p, o in zip(PROMPTS, free))
