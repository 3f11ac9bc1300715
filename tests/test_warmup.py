"""`LLMEngine.warmup` compiles every program a configuration reaches: afterwards no
`generate` whose requests fit the configuration compiles anything, counted with JAX's
own compilation events (not the engine's counters). Mixed prompt + decode steps stay
token-identical to the dense no-cache forward."""
from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from conftest import CompileCounter, random_prompts
from test_penalties import spy_penalties
from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, dense_greedy_generate

# One pytest-xdist worker runs the module (README's `--dist loadgroup`): one warm-up.
pytestmark = pytest.mark.xdist_group("warmup")

# One token bucket (the prompt chunk's 32): the warm-up still spans two decode-row buckets, both window lengths,
# greedy and sampled, with a third of the programs of the default token buckets gone.
CONFIG = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      num_scheduler_steps=4, latency_scheduler_steps=2, token_buckets=(32,), compilation_cache=False,
                      compiler_options={"xla_backend_optimization_level": 0})


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(max_position_embeddings=128), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def warm_engine(model):
    engine = LLMEngine(model, CONFIG)
    report = engine.warmup(use_tqdm=False)
    shapes = engine.shapes
    # Windows of both lengths and mixed steps of every row count, greedy, sampled and
    # sampled with penalties, plus copy-on-write sizes.
    expected = 3 * (2 * len(shapes.decode_rows) * len(shapes.window_widths)
                    + len(shapes.mixed_rows) * len(shapes.prompt_shapes))
    assert expected <= report.num_programs <= expected + 4, (report, shapes)
    return engine


def test_no_compilation_after_warmup_across_batches_lengths_and_sampling(model, warm_engine):
    engine = warm_engine
    lengths = [[5], [3, 40, 17], [70, 2, 9, 33, 12, 6], [100, 1]]  # 6 > max_num_seqs: some wait
    batches = [random_prompts(40 + i, lens) for i, lens in enumerate(lengths)]
    shared = batches[2][3]
    batches.append([shared, shared[:20] + [1, 2, 3]])  # prefix-cache hits and a copy-on-write
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=7, seed=1)
    expected = [dense_greedy_generate(model, prompts, 9) for prompts in batches]
    with CompileCounter() as compiles:
        outputs = []
        for i, prompts in enumerate(batches):
            params = [SamplingParams(temperature=0.0, max_tokens=9 - (j % 3)) for j in range(len(prompts))]
            if i == 1:
                params[1] = sampled  # a sampled request among greedy ones
            outputs.append(engine.generate(prompts, params, use_tqdm=False))
        rid = engine.add_request(batches[0][0], SamplingParams(temperature=0.0, max_tokens=30))
        engine.step()
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    assert compiles.count == 0
    for i, (outs, refs) in enumerate(zip(outputs, expected)):
        for j, (out, ref) in enumerate(zip(outs, refs)):
            if i == 1 and j == 1:
                assert len(out.outputs[0].token_ids) == 7
                continue
            assert out.outputs[0].token_ids == ref[:9 - (j % 3)], (i, j)
    assert outputs[4][0].num_cached_tokens > 0
    assert engine.stats.num_mixed_steps > 0


def test_penalized_requests_compile_nothing_after_warmup_and_neutral_batches_skip_them(warm_engine, monkeypatch):
    """The penalties' program variant is part of the warm-up (a server compiles nothing
    for them after its port opens), whatever the values and the ``logit_bias`` size; a
    batch of neutral requests runs only the programs without it."""
    calls = spy_penalties(warm_engine, setattr=monkeypatch.setattr)
    prompts = random_prompts(60, [5, 30, 12])
    neutral = SamplingParams(temperature=0.0, max_tokens=9)
    penalized = [SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.4, logit_bias={3: 2.0}),
                 SamplingParams(temperature=0.7, seed=2, max_tokens=9, min_p=0.2, min_tokens=3,
                                logit_bias=dict.fromkeys(range(40), -1.0)),
                 neutral]
    with CompileCounter() as compiles:
        warm_engine.generate(prompts, neutral, use_tqdm=False)
        num_neutral_calls = len(calls)
        warm_engine.generate(prompts, penalized, use_tqdm=False)
    assert compiles.count == 0
    assert num_neutral_calls and not any(penalized for _, penalized in calls[:num_neutral_calls])
    assert any(penalized for _, penalized in calls[num_neutral_calls:])


def test_warmup_refuses_while_requests_run(model, warm_engine):
    rid = warm_engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="unfinished requests"):
        warm_engine.warmup(use_tqdm=False)
    warm_engine.abort_request(rid)
    warm_engine.pop_output(rid)


def test_mixed_steps_decode_while_prompts_prefill_and_match_dense(model):
    """Prompts admitted while others decode run in mixed steps: every such step also
    decodes the batch's rows (one token each), and the batch is built once."""
    engine = LLMEngine(model, dataclasses.replace(CONFIG, num_blocks=40))
    prompts = random_prompts(50, [9, 60, 4, 50, 7, 30])
    max_tokens = [6, 12, 20, 8, 25, 10]
    mixed_rows_decoded = []
    run_mixed = engine.runner.run_mixed

    def watching(*args, **kwargs):
        mixed_rows_decoded.append(int(args[0].sum()))  # live rows decoded beside the prompts
        return run_mixed(*args, **kwargs)

    engine.runner.run_mixed = watching
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                           use_tqdm=False)
    expected = dense_greedy_generate(model, prompts, max(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == [ref[:n] for ref, n in zip(expected, max_tokens)]
    assert engine.stats.num_mixed_steps == len(mixed_rows_decoded) > 0
    assert max(mixed_rows_decoded) > 0  # decodes rode along with prompt chunks
    assert engine.scheduler.device_blocks.num_free_blocks == engine.config.num_blocks


def test_llm_warms_up_on_accelerators_or_when_asked(model, monkeypatch):
    from jax_paged_attn.engine import LLM

    calls = []
    monkeypatch.setattr(LLMEngine, "warmup", lambda self, **kwargs: calls.append(self))
    options = dict(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16, compilation_cache=False)
    LLM.from_model(model, **options)  # the cpu backend: no warm-up unless asked
    assert calls == []
    llm = LLM.from_model(model, warmup=True, **options)
    assert calls == [llm.engine]
    with pytest.raises(TypeError, match="warmup must be a bool"):
        LLM.from_model(model, warmup="yes", **options)


def test_warmup_can_leave_the_penalized_programs_to_first_use(model, warm_engine):
    """``EngineConfig.warmup_penalties=False``: the warm-up plans the greedy and sampled
    programs alone (a third fewer), and the start report says a penalized request
    compiles its programs on first use."""
    from jax_paged_attn.engine.warmup import warmup_tasks

    lean = LLMEngine(model, dataclasses.replace(CONFIG, warmup_penalties=False))
    shapes = lean.shapes
    per_variant = (2 * len(shapes.decode_rows) * len(shapes.window_widths)  # windows of 4 and 2 steps
                   + len(shapes.mixed_rows) * len(shapes.prompt_shapes))
    full = warmup_tasks(warm_engine.shapes, warm_engine.config, warm_engine.runner, warm_engine._inputs,
                        warm_engine.vocab_size)
    planned = warmup_tasks(shapes, lean.config, lean.runner, lean._inputs, lean.vocab_size)
    assert len(full) - len(planned) == per_variant
    assert "warmup compiles it" in warm_engine.start_report
    assert "EngineConfig.warmup_penalties=False" in lean.start_report and "first use" in lean.start_report
    with pytest.raises(TypeError, match="warmup_penalties must be a bool"):
        EngineConfig(warmup_penalties="no")
