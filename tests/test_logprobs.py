"""``SamplingParams(logprobs=k)``: per-token logprobs with the top-k alternatives.

The oracle is ``log_softmax`` of the dense, cache-free ``forward_dense`` logits over the
prompt and the tokens the engine produced: the engine's logprobs (scheduled steps, decode
windows, after preemption) must be those at every output position. The device programs
compute them only when a request in the batch asks (a static ``num_logprobs``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ENGINE_GROUP, assert_no_data_dependent_branch, cuda_lowering_target, engine_base, random_prompts
from jax_paged_attn.engine import LLM, LLMEngine, Logprob, SamplingParams
from jax_paged_attn.engine.sampling import MAX_LOGPROBS, logprob_dicts, logprobs_bucket, token_logprobs
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, jit_forward_dense

from test_llm import ENGINE, checkpoint  # noqa: F401  (fixture: tiny checkpoint + tokenizer.json)

pytestmark = ENGINE_GROUP  # one worker compiles the tiny Llama's programs once (conftest.py)

BASE = engine_base()
ATOL = 2e-4


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


DENSE_LENGTH = 256
"""Token ids the dense oracle runs on, right-padded (the logits before the padding do not
depend on it): one compiled forward per model serves every check."""

_dense_forwards: dict[int, tuple] = {}


def dense_logprobs(model, prompt, output):
    """f32[len(output), V]: log_softmax of the dense logits that predicted each output token."""
    if id(model) not in _dense_forwards:
        _dense_forwards[id(model)] = (model, jit_forward_dense(model))
    tokens = list(prompt) + list(output)
    assert len(tokens) <= DENSE_LENGTH, len(tokens)
    ids = jnp.asarray([tokens + [0] * (DENSE_LENGTH - len(tokens))], jnp.int32)
    logits = _dense_forwards[id(model)][1](ids)[0]  # [DENSE_LENGTH, V]
    return np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], axis=-1))


def check_against_dense(model, out, k):
    """The output's logprobs are the dense distribution's at every position."""
    (seq,) = out.outputs
    ref = dense_logprobs(model, out.prompt_token_ids, seq.token_ids)
    assert len(seq.logprobs) == len(seq.token_ids)
    total = 0.0
    for t, (token, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
        row = ref[t]
        order = np.argsort(-row, kind="stable")
        assert list(entry)[:k] == order[:k].tolist(), f"position {t}: top-{k} ids"
        assert token in entry and len(entry) == k + (token not in order[:k].tolist())
        values = [lp.logprob for lp in entry.values()]
        assert values == sorted(values, reverse=True)  # decreasing logprob
        for tid, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.decoded_token is None
            np.testing.assert_allclose(lp.logprob, row[tid], atol=ATOL)
            # 1 + tokens with a greater logprob (the window allows for float noise near ties)
            assert 1 + np.sum(row > row[tid] + ATOL) <= lp.rank <= 1 + np.sum(row > row[tid] - ATOL)
        total += row[token]
    np.testing.assert_allclose(seq.cumulative_logprob, total, rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------- device helpers


def test_token_logprobs_rank_and_top_k_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    logits[2, [5, 9]] = 7.0  # a tie for the top: both rank 1
    tokens = np.array([int(np.argmax(logits[0])), 17, 9], np.int32)
    got = jax.jit(token_logprobs, static_argnums=2)(jnp.asarray(logits), jnp.asarray(tokens), 4)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(got.sampled_logprob, ref[np.arange(3), tokens], atol=1e-6)
    np.testing.assert_array_equal(got.sampled_rank, [1 + int(np.sum(ref[i] > ref[i, t])) for i, t in enumerate(tokens)])
    assert got.sampled_rank[0] == 1 and got.sampled_rank[2] == 1
    np.testing.assert_allclose(got.top_logprobs, -np.sort(-ref, axis=-1)[:, :4], atol=1e-6)
    host = jax.tree_util.tree_map(np.asarray, got)
    dicts = logprob_dicts(tokens.astype(np.int64), host, 2)
    assert [d[5].rank for d in dicts[2:]] == [1] and dicts[2][9].rank == 1  # tied tokens share rank 1
    assert len(dicts[0]) == 2 and len(dicts[1]) == 3  # token 17 is not in row 1's top 2: added
    assert logprob_dicts(tokens.astype(np.int64), host, 0)[1] == {17: Logprob(float(host.sampled_logprob[1]),
                                                                             int(host.sampled_rank[1]))}


def test_logprobs_bucket_keeps_few_programs():
    assert [logprobs_bucket(k, 128) for k in (0, 1, 2, 3, 5, 8, 9, 17, MAX_LOGPROBS)] == [0, 1, 2, 4, 8, 8, 16, 20, 20]
    assert logprobs_bucket(20, 10) == 10  # never more than the vocabulary


@pytest.mark.parametrize("value, error", [(-1, ValueError), (MAX_LOGPROBS + 1, ValueError), (1.5, TypeError),
                                          (True, TypeError), ("3", TypeError)])
def test_invalid_logprobs_name_the_parameter(value, error):
    with pytest.raises(error, match="logprobs"):
        SamplingParams(logprobs=value)


def test_valid_logprobs():
    assert SamplingParams().logprobs is None
    assert SamplingParams(logprobs=np.int64(0)).logprobs == 0 and SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20


# --------------------------------------------------------------------------- engine


def spy_logprobs_args(engine):
    """Records the ``num_logprobs`` every runner call gets."""
    calls = []
    step, window, mixed = engine.runner.run_step, engine.runner.run_decode_window, engine.runner.run_mixed

    def run_step(*args, **kwargs):
        calls.append(("step", kwargs.get("num_logprobs")))
        return step(*args, **kwargs)

    def run_decode_window(*args, **kwargs):
        calls.append(("window", kwargs.get("num_logprobs")))
        return window(*args, **kwargs)

    def run_mixed(*args, **kwargs):
        calls.append(("mixed", kwargs.get("num_logprobs")))
        return mixed(*args, **kwargs)

    engine.runner.run_step, engine.runner.run_decode_window = run_step, run_decode_window
    engine.runner.run_mixed = run_mixed
    return calls


@pytest.mark.parametrize("windows", [True, False], ids=["decode_windows", "scheduled_steps"])
def test_logprobs_match_dense_log_softmax(model, windows):
    prompts = random_prompts(0, [5, 21, 9, 14])
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4))
    if not windows:  # every decode then runs as a scheduled step
        engine._loop.decode_window_ready = lambda: False
    calls = spy_logprobs_args(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=10, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=1.0, max_tokens=10, logprobs=5, seed=3)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    check_against_dense(model, outs[0], 3)
    check_against_dense(model, outs[1], 0)
    check_against_dense(model, outs[3], 5)  # sampled tokens: any rank, the model's raw logprob
    assert outs[2].outputs[0].logprobs is None and outs[2].outputs[0].cumulative_logprob is None
    for out in outs[:2]:  # greedy: the sampled token ranks first
        assert all(entry[t].rank == 1 for t, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))
    assert all(len(entry) == 1 for entry in outs[1].outputs[0].logprobs)  # logprobs=0: the sampled token only
    kinds = {kind for kind, _ in calls}
    # Prompts run in mixed steps (with the batch's decode rows), the rest in windows, or
    # in scheduled steps when windows are off.
    assert kinds == ({"mixed", "window"} if windows else {"mixed", "step"})
    # Each program's num_logprobs: the largest ask in its batch rounded up to a power of
    # two (8 while the logprobs=5 request samples), None for a batch where nobody asks.
    sizes = {n for _, n in calls}
    assert 8 in sizes and sizes <= {None, 1, 4, 8}, sizes


def test_no_logprobs_runs_the_programs_without_them(model):
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4))
    calls = spy_logprobs_args(engine)
    outs = engine.generate(random_prompts(1, [6, 11]), SamplingParams(temperature=0.0, max_tokens=9),
                           use_tqdm=False)
    assert {kind for kind, _ in calls} == {"mixed", "window"} and {n for _, n in calls} == {None}
    assert all(o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None for o in outs)


@pytest.mark.parametrize("num_host_blocks", [32, 0], ids=["swap", "recompute"])
def test_logprobs_survive_preemption(model, num_host_blocks):
    # 400 tokens at the end (27 blocks) in BASE's cache of 24 blocks; logprobs=3 like the
    # test above: the same cache shape and logprobs width, the same compiled programs.
    prompts = random_prompts(2, [80, 18, 100, 42])
    engine = LLMEngine(model, dataclasses.replace(BASE, num_host_blocks=num_host_blocks, num_scheduler_steps=4))
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    assert (engine.stats.num_recomputed_requests > 0) == (num_host_blocks == 0)
    for out in outs:
        check_against_dense(model, out, 3)


def test_window_program_with_logprobs_has_no_conditional():
    small = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1), rngs=nnx.Rngs(5))
    engine = LLMEngine(small, dataclasses.replace(BASE, num_scheduler_steps=2))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.7, max_tokens=8, logprobs=3))
    engine.step()  # prefill
    engine.step()  # starts the persistent batch
    runner = engine.runner
    state = runner._decode_state
    rows, width = state.block_tables.shape
    with cuda_lowering_target():
        text = runner.window_program.trace(
            runner.params, runner.kv_caches, state, np.ones(rows, bool), np.full(rows, rows, np.int32),
            np.zeros((rows, width), np.int32), num_steps=2, greedy=False, block_size=16, max_model_len=512,
            num_logprobs=4).lower(lowering_platforms=("cuda",)).as_text()
    assert_no_data_dependent_branch(text)


# --------------------------------------------------------------------------- LLM


def test_llm_fills_decoded_tokens(checkpoint):  # noqa: F811
    _, tokenizer, model = checkpoint
    llm = LLM.from_model(model, tokenizer=tokenizer, **ENGINE)
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), SamplingParams(temperature=0.0, max_tokens=4)]
    out, plain = (o.outputs[0] for o in llm.generate(["the cat sat", "a dog"], params, use_tqdm=False))
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert len(out.logprobs) == len(out.token_ids) == 4
    engine_out = llm.engine.generate([llm.encode("the cat sat")], params[0], use_tqdm=False)[0].outputs[0]
    for token, entry, raw in zip(out.token_ids, out.logprobs, engine_out.logprobs):
        assert entry[token].rank == 1 and len(entry) == 2 and list(entry) == list(raw)
        for tid, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([tid], skip_special_tokens=False) and lp.decoded_token
            assert (lp.logprob, lp.rank) == (raw[tid].logprob, raw[tid].rank) and raw[tid].decoded_token is None
    assert out.cumulative_logprob == engine_out.cumulative_logprob


# --------------------------------------------------------------------------- examples/generate.py


def load_generate_example():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("example_generate_logprobs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_generate_example_prints_logprobs(checkpoint, capsys):  # noqa: F811
    generate = load_generate_example()
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--logprobs", "21"])
    assert exit_.value.code == 2 and "logprobs must be None or an int in [0, 20]" in capsys.readouterr().err
    _, outputs = generate.main(["--checkpoint", str(checkpoint[0]), "--prompts", "the cat sat", "--temperature", "0",
                                "--max-tokens", "3", "--logprobs", "2", "--num-blocks", "24", "--max-num-seqs", "4",
                                "--max-num-batched-tokens", "32"])
    out = capsys.readouterr().out
    (o,) = outputs[0].outputs
    assert len(o.logprobs) == 3 and f"cumulative logprob {o.cumulative_logprob:.3f}; per token: " in out
    first = o.logprobs[0][o.token_ids[0]]
    assert f"{first.decoded_token!r} {first.logprob:.2f} (rank 1) [top: " in out
