"""The engine after something goes wrong, and what a caller may not learn or pass.

* A `generate` that raises (a stop checker, an interrupt, a failed step) leaves none of
  its requests, and none of their KV blocks, in the engine.
* A program that fails after it consumed the donated KV caches leaves the engine usable:
  the caches are allocated anew, the requests that held blocks are aborted or recomputed
  (`EngineConfig.on_step_failure`), and later requests get the dense reference's tokens.
* `SamplingParams.cache_salt` scopes prefix-cache hits: a caller who knows all but one
  token of another tenant's cached block cannot find the last one from
  ``num_cached_tokens`` (without salts the test shows that it can).
* Strict types where truthiness would mislead (``ignore_eos="false"``), vLLM's finish
  reasons, and one rule for prompts given as arrays.

Tiny random Llama, float32, CPU; the oracle is `dense_greedy_generate`.
"""
from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ENGINE_GROUP, engine_base, random_prompts
from jax_paged_attn.engine import EngineConfig, EngineLoad, LLMEngine, SamplingParams
from jax_paged_attn.engine.block_allocator import BlockAllocator
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, dense_greedy_generate

pytestmark = ENGINE_GROUP  # one worker compiles the tiny Llama's programs once (conftest.py)

BASE = engine_base()
PROMPTS = random_prompts(11, [40, 23, 33])
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def expected(model):
    return dense_greedy_generate(model, PROMPTS, MAX_TOKENS)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def assert_empty(engine: LLMEngine) -> None:
    """No request and no block left: every device and host block free, no cache dead.
    Decode windows still in flight (of aborted rows only) are read first: they yield
    nothing."""
    assert not engine.scheduler.requests
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert engine.scheduler.device_blocks.num_free_blocks == engine.config.num_blocks
    assert engine.scheduler.host_blocks.num_free_blocks == engine.config.num_host_blocks
    assert not any(cache.is_deleted() for cache in engine.kv_caches)


# --------------------------------------------------------------------------- a generate that raises


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_generate_that_raises_leaves_none_of_its_requests_behind(model, expected, error):
    engine = LLMEngine(model, BASE)
    calls = []

    def failing_checker(prompt_index, sample_index, completion):
        calls.append(prompt_index)
        if len(calls) == 3:  # mid-generation: some tokens out, blocks held, windows in flight
            raise error("from the stop checker")

    with pytest.raises(error, match="from the stop checker"):
        engine.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False, stop_checker=failing_checker)
    assert_empty(engine)
    # The next call starts clean and is exact (nothing of the failed call is scheduled).
    outs = engine.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_empty(engine)


def test_a_failed_generate_leaves_other_callers_requests_running(model, expected):
    engine = LLMEngine(model, BASE)
    other = engine.add_request(PROMPTS[0], greedy(MAX_TOKENS), request_id="other")

    def failing_checker(prompt_index, sample_index, completion):
        raise ValueError("stop")

    with pytest.raises(ValueError, match="stop"):
        engine.generate(PROMPTS[1:], greedy(MAX_TOKENS), use_tqdm=False, stop_checker=failing_checker)
    assert set(engine.scheduler.requests) == {other}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pop_output(other).outputs[0].token_ids == expected[0]
    assert_empty(engine)


# --------------------------------------------------------------------------- a program that fails


class FailsOnce:
    """Wraps a runner program: its ``fail_at``-th call runs (consuming the donated KV
    caches), then raises, as a program that fails on the device does for its caller."""

    def __init__(self, program, fail_at: int) -> None:
        self.program, self.fail_at, self.calls = program, fail_at, 0

    def __call__(self, *args, **kwargs):
        result = self.program(*args, **kwargs)
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected device failure")
        return result


def break_a_program(engine: LLMEngine, name: str, fail_at: int) -> FailsOnce:
    wrapper = FailsOnce(getattr(engine.runner, name), fail_at)
    setattr(engine.runner, name, wrapper)
    return wrapper


@pytest.mark.parametrize("program", ["_mixed", "_window"])
def test_a_failed_program_aborts_its_requests_and_the_engine_serves_on(model, expected, program, caplog):
    engine = LLMEngine(model, BASE)
    engine.generate([PROMPTS[0]], greedy(MAX_TOKENS), use_tqdm=False)  # its blocks enter the prefix cache
    wrapper = break_a_program(engine, program, fail_at=1)
    with caplog.at_level(logging.WARNING, logger="jax_paged_attn.engine.engine"):
        with pytest.raises(RuntimeError, match="injected device failure"):
            engine.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert wrapper.calls == 1
    warnings = [r.getMessage() for r in caplog.records if "LLMEngine.step failed" in r.getMessage()]
    assert len(warnings) == 1 and "allocated anew" in warnings[0] and "aborted" in warnings[0]
    assert_empty(engine)  # the consumed caches were replaced
    outs = engine.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The failed program may have half-written cached blocks: the prefix cache was emptied.
    assert outs[0].num_cached_tokens == 0


def test_with_recompute_the_requests_of_a_failed_program_finish_exactly(model, expected):
    engine = LLMEngine(model, dataclasses.replace(BASE, on_step_failure="recompute"))
    break_a_program(engine, "_window", fail_at=2)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(MAX_TOKENS), request_id=f"r{i}")
    failures, outputs = 0, {}
    while engine.has_unfinished_requests():
        try:
            finished = engine.step()
        except RuntimeError as error:
            assert "injected device failure" in str(error)
            failures += 1
            continue
        for out in finished:
            outputs[out.request_id] = engine.pop_output(out.request_id)
    assert failures == 1
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs.values())
    assert_empty(engine)


def test_on_step_failure_is_checked():
    with pytest.raises(ValueError, match="on_step_failure must be 'abort' or 'recompute'"):
        EngineConfig(on_step_failure="retry")


def test_peek_output_and_load_show_running_requests_without_removing_them(model, expected):
    engine = LLMEngine(model, BASE)
    assert engine.load() == EngineLoad(num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(MAX_TOKENS), request_id=f"r{i}")
    assert engine.load().num_waiting == len(PROMPTS)
    seen = {f"r{i}": 0 for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        engine.step()
        load = engine.load()
        assert load.num_running + load.num_waiting + load.num_swapped <= len(PROMPTS)
        assert 0.0 <= load.kv_cache_usage <= 1.0
        for rid in seen:
            tokens = engine.peek_output(rid).outputs[0].token_ids  # grows, never shrinks, stays in the engine
            assert len(tokens) >= seen[rid] and tokens == expected[int(rid[1:])][:len(tokens)]
            seen[rid] = len(tokens)
    assert [engine.pop_output(f"r{i}").outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    with pytest.raises(KeyError, match="unknown request_id 'r0'"):
        engine.peek_output("r0")
    assert engine.load().kv_cache_usage == 0.0


# --------------------------------------------------------------------------- cache_salt


def test_cache_salt_closes_the_prefix_cache_side_channel(model):
    """The attack of issue #49: a 16-token block of a victim's prompt is cached; the
    attacker knows its first 15 tokens and tries each candidate for the 16th with
    ``max_tokens=1``, reading ``num_cached_tokens``."""
    (secret_prompt,) = random_prompts(21, [20])
    candidates = sorted({secret_prompt[15], *range(8)})

    def attack(victim_salt, attacker_salt):
        engine = LLMEngine(model, BASE)
        engine.generate([secret_prompt], greedy(1, cache_salt=victim_salt), use_tqdm=False)
        hits = {}
        for token in candidates:
            guess = secret_prompt[:15] + [token, 0]  # a 17th token: the guessed block is full
            out = engine.generate([guess], greedy(1, cache_salt=attacker_salt), use_tqdm=False)[0]
            hits[token] = out.num_cached_tokens
        return hits

    shared = attack(None, None)  # no salts: the channel is real
    assert shared[secret_prompt[15]] == 16 and all(hits == 0 for t, hits in shared.items() if t != secret_prompt[15])
    assert set(attack("alice", "mallory").values()) == {0}
    assert set(attack("alice", None).values()) == {0}
    assert attack("alice", "alice")[secret_prompt[15]] == 16  # a tenant still hits its own cache


def test_salted_requests_share_only_within_their_salt_and_stay_exact(model):
    (shared,) = random_prompts(22, [32])
    engine = LLMEngine(model, BASE)
    expected = dense_greedy_generate(model, [shared], 4)
    cached = []
    for salt in ("a", "b", "a", None, None):
        out = engine.generate([shared], greedy(4, cache_salt=salt), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected[0]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 31, 0, 31]


def test_a_digest_collision_across_salts_shares_nothing():
    allocator = BlockAllocator(4, 2)
    block = allocator.allocate()
    assert allocator.register(block, b"digest", [1, 2], parent_block=None, cache_salt="a")
    assert allocator.lookup(b"digest", [1, 2], parent_block=None, cache_salt="b") is None
    assert allocator.lookup(b"digest", [1, 2], parent_block=None) is None
    assert allocator.lookup(b"digest", [1, 2], parent_block=None, cache_salt="a") == block


@pytest.mark.parametrize("salt, error, match", [("", ValueError, "cache_salt must not be empty"),
                                                (5, TypeError, "cache_salt must be None or a str")])
def test_bad_cache_salts_are_named(salt, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(cache_salt=salt)


# --------------------------------------------------------------------------- types, reasons, prompts


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens"])
def test_sampling_flags_take_bools_only(name):
    with pytest.raises(TypeError, match=f"{name} must be a bool, got str 'false'"):
        SamplingParams(**{name: "false"})
    assert getattr(SamplingParams(**{name: np.bool_(True)}), name) is True


@pytest.mark.parametrize("name", ["enable_prefix_caching", "coarse_length_bounds", "decode_during_prefill",
                                  "async_scheduling", "compilation_cache"])
def test_engine_flags_take_bools_only(name):
    with pytest.raises(TypeError, match=f"{name} must be a bool, got str 'no'"):
        EngineConfig(**{name: "no"})


def test_finish_reasons_are_vllms(model):
    engine = LLMEngine(model, dataclasses.replace(BASE, max_model_len=40))
    (prompt,) = random_prompts(23, [35])
    out = engine.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5  # the context is full
    rid = engine.add_request(prompt, greedy(3))
    engine.abort_request(rid)
    assert engine.pop_output(rid).outputs[0].finish_reason == "abort"


def test_prompts_as_numpy_or_jax_arrays_follow_one_rule(model, expected):
    engine = LLMEngine(model, BASE)
    arrays = [np.asarray(PROMPTS[0], np.int32), jnp.asarray(PROMPTS[1], jnp.int32), tuple(PROMPTS[2])]
    outs = engine.generate(arrays, greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(type(t) is int for o in outs for t in o.prompt_token_ids)
    for bad, match in [(np.asarray([[1, 2]]), "1-D integer array, got 2-D"),
                       (jnp.asarray([1.0, 2.0]), "1-D integer array, got 1-D float32")]:
        with pytest.raises(TypeError, match=rf"prompts\[0\]: prompt_token_ids must be a {match}"):
            engine.generate([bad], greedy(2), use_tqdm=False)
    assert_empty(engine)
