"""LLMEngine end to end on a tiny random Llama (float32, CPU), and the sampler.

The oracle is `dense_greedy_generate`: greedy argmax over the model's cache-free
``forward_dense``, re-run over the whole sequence for every token. The engine must
produce the same tokens, token for token, through the paged cache, continuous batching
(requests arriving at different steps), chunked prefill, prefix sharing with
copy-on-write, and preemption (swap to host, or recompute) forced by a tiny cache.

Engines here share one model structure and cache size where they can, so they share
compiled programs (`LLMEngine` keeps one jitted step per model structure).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import (ENGINE_GROUP, CompileCounter, assert_no_data_dependent_branch, cuda_lowering_target, engine_base,
                      random_prompts)
from jax_paged_attn.engine import (
    EngineConfig,
    LLMEngine,
    SamplingParams,
    sample_tokens,
)
from jax_paged_attn.engine.decode_batch import DecodeBatch
from jax_paged_attn.engine.model_runner import DecodeState, decode_batch_rows
from jax_paged_attn.builder import ScheduledSequence
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, dense_greedy_generate

pytestmark = ENGINE_GROUP  # one worker compiles the tiny Llama's programs once (conftest.py)

BASE = engine_base()


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run_with_arrivals(engine, prompts, params, arrivals):
    """Adds prompt i at step arrivals[i] and steps until all finish; returns outputs by index."""
    outputs, step = {}, 0
    while len(outputs) < len(prompts):
        for i, when in enumerate(arrivals):
            if when == step:
                engine.add_request(prompts[i], params, request_id=f"req{i}")
        for out in engine.step():
            outputs[int(out.request_id[3:])] = engine.pop_output(out.request_id)
        step += 1
        assert step < 2000, "engine did not finish"
    return [outputs[i] for i in range(len(prompts))]


def assert_all_blocks_free(engine):
    assert engine.scheduler.device_blocks.num_free_blocks == engine.config.num_blocks
    assert engine.scheduler.host_blocks.num_free_blocks == engine.config.num_host_blocks


# --------------------------------------------------------------------------- greedy vs dense


# Four long prompts outgrow the 24-block cache within 40 tokens (one preemption); the
# fifth arrives later and waits for a free row.
SWAP_PROMPTS, SWAP_MAX_TOKENS = random_prompts(0, [70, 60, 45, 50, 12]), 40


@pytest.fixture(scope="module")
def swap_expected(model):
    return dense_greedy_generate(model, SWAP_PROMPTS, SWAP_MAX_TOKENS)


@pytest.mark.parametrize("decode_during_prefill", [False, True])
def test_greedy_matches_dense_with_continuous_batching_chunked_prefill_and_swapping(model, swap_expected,
                                                                                    decode_during_prefill):
    prompts, max_tokens = SWAP_PROMPTS, SWAP_MAX_TOKENS
    engine = LLMEngine(model, dataclasses.replace(BASE, decode_during_prefill=decode_during_prefill))
    outs = run_with_arrivals(engine, prompts, greedy(max_tokens), arrivals=[0, 0, 1, 2, 5])
    expected = swap_expected
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ref, f"request {i} diverged from the dense reference"
        assert out.outputs[0].finish_reason == "length"
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks > 0  # the cache was too small
    assert stats.num_recomputed_requests == 0
    assert any(o.num_preemptions for o in outs)
    assert_all_blocks_free(engine)


def test_greedy_matches_dense_when_preemption_recomputes(model, swap_expected):
    engine = LLMEngine(model, dataclasses.replace(BASE, num_host_blocks=0))
    outs = run_with_arrivals(engine, SWAP_PROMPTS, greedy(SWAP_MAX_TOKENS), arrivals=[0, 0, 0, 1, 1])
    assert [o.outputs[0].token_ids for o in outs] == swap_expected
    assert engine.stats.num_recomputed_requests > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("decode_during_prefill", [True, False])
def test_recomputed_request_whose_blocks_stay_cached_refills_as_a_prompt_chunk(model, decode_during_prefill):
    """Issue #49 item 4. Two 16-token prompts in a 5-block cache each need a third block at
    their 33rd token; the younger is preempted by recomputation while its two full blocks
    stay in the prefix cache. Readmitted, the hit covers all its tokens but the last: that
    one token is the rest of its prefill, so it runs in the prompt section (a decode there
    broke the mixed step: "concatenate_sections takes a prefill-only and a decode-only
    batch"), and the tokens are the dense ones."""
    prompts = random_prompts(7, [16, 16])
    engine = LLMEngine(model, dataclasses.replace(BASE, num_blocks=5, num_host_blocks=0,
                                                  decode_during_prefill=decode_during_prefill))
    prompt_steps = []
    schedule_prefills = engine.scheduler.schedule_prefills

    def recording_prompt_steps():
        out = schedule_prefills()
        prompt_steps.append([(item.request.request_id, item.start, item.num_new_tokens, item.is_prefill)
                             for item in out.scheduled])
        return out

    engine.scheduler.schedule_prefills = recording_prompt_steps
    outs = run_with_arrivals(engine, prompts, greedy(20), arrivals=[0, 0])
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(model, prompts, 20)
    # Its readmission hit 32 tokens; num_cached_tokens is vLLM's count, its first admission's (prompt) hit.
    assert engine.stats.num_recomputed_requests == 1 and engine.stats.num_prefix_cache_hit_tokens >= 32
    assert outs[1].num_cached_tokens == 0
    assert ("req1", 32, 1, True) in [item for step in prompt_steps for item in step]
    assert all(is_prefill for step in prompt_steps for *_, is_prefill in step)
    assert_all_blocks_free(engine)


def test_prefix_sharing_and_copy_on_write_match_dense(model):
    (shared,) = random_prompts(2, [32])  # exactly two blocks
    prompts = [shared, shared + [5, 6, 7], shared[:20] + [1, 2], shared]
    engine = LLMEngine(model, BASE)
    first = engine.generate([shared], greedy(6), use_tqdm=False)[0]
    outs = engine.generate(prompts, greedy(6), use_tqdm=False)
    expected = dense_greedy_generate(model, prompts, 6)
    assert first.outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The repeated prompt reuses both cached blocks and recomputes only its last token,
    # which lies in a shared block: that write goes to a copy.
    assert outs[0].num_cached_tokens == 31 and outs[1].num_cached_tokens == 32
    assert engine.stats.num_copied_blocks >= 1
    assert_all_blocks_free(engine)


def test_colliding_block_hashes_share_nothing_wrong_and_match_dense(model, monkeypatch):
    # Every block hash collides (a deliberately bad hash): hits are still exact, because
    # the cache compares a hit's tokens and its parent block.
    from jax_paged_attn.engine import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "hash_block_tokens", lambda parent, tokens: b"collide")
    first, other = random_prompts(4, [32, 32])
    prompts = [other, first[:16] * 2, first, other[:16] + first[:16]]
    engine = LLMEngine(model, BASE)
    engine.generate([first], greedy(1), use_tqdm=False)
    outs = engine.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(model, prompts, 6)
    # Only first's block 0 is cached (its other blocks' hash is taken); only exact matches hit it.
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16, 0]
    assert_all_blocks_free(engine)


def test_multi_step_decoding_matches_dense_and_stops_on_time(model):
    prompts = random_prompts(8, [6, 33, 12, 20])
    expected = dense_greedy_generate(model, prompts, 24)
    eos = expected[1][9]  # request 1 stops at its 10th token (or earlier, if eos came before)
    cut = [ref[:ref.index(eos) + 1] if eos in ref else ref for ref in expected]
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4, eos_token_id=eos))
    events, run_mixed, dispatch = [], engine.runner.run_mixed, engine.runner.run_decode_window

    def watching_mixed(*args, **kwargs):
        events.append("mixed")
        return run_mixed(*args, **kwargs)

    def watching_dispatch(*args, **kwargs):  # steps counted without a prompt, before this window
        events.append(engine._loop.batch.steps_since_prompts)
        return dispatch(*args, **kwargs)

    engine.runner.run_mixed, engine.runner.run_decode_window = watching_mixed, watching_dispatch
    outs = run_with_arrivals(engine, prompts, greedy(24), arrivals=[0, 0, 3, 9])
    assert [o.outputs[0].token_ids for o in outs] == cut
    # The prompts arriving at steps 3 and 9 joined in mixed steps, each starting the
    # batch's count of steps without a prompt (its shrink delay) again; windows add theirs.
    after_mixed = [events[i + 1] for i, e in enumerate(events[:-1]) if e == "mixed" and events[i + 1] != "mixed"]
    assert events.count("mixed") >= 2 and after_mixed and set(after_mixed) == {0}, events
    assert any(e == 4 for e in events), events
    assert [o.outputs[0].finish_reason for o in outs] == ["stop" if eos in ref else "length" for ref in expected]
    # Decode-only stretches ran four model steps per scheduling step.
    assert engine.stats.num_steps < engine.stats.num_generated_tokens * 0.6
    assert engine.stats.num_generated_tokens == sum(len(c) for c in cut)
    assert_all_blocks_free(engine)


# --------------------------------------------------------------------------- compilation, donation


def test_256_step_decode_compiles_few_programs_and_matches_dense():
    # A model structure no other test uses, so its jitted step starts with no program.
    small = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1), rngs=nnx.Rngs(3))
    prompts = random_prompts(3, [8, 5])
    engine = LLMEngine(small, dataclasses.replace(
        BASE, num_blocks=40, max_num_batched_tokens=64, batch_buckets=None, token_buckets=None,
        block_table_width_buckets=None, coarse_length_bounds=False))
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [256, 256]
    # 1 mixed prompt + decode program and 2 decode-window programs: the mixed batch's
    # rows (4) for its first two windows, then the batch shrunk to the 2 live rows, whose
    # block tables are sized for the requests' last positions, so growing sequences
    # compile nothing.
    assert engine.num_compiled_programs == 3, engine.num_compiled_programs
    programs = (engine.runner.mixed_program, engine.runner.window_program)
    if all(hasattr(p, "_cache_size") for p in programs):
        assert sum(p._cache_size() for p in programs) == engine.num_compiled_programs
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(small, prompts, 256)


def test_decode_step_updates_the_donated_cache_in_place(model):
    engine = LLMEngine(model, BASE)
    engine.add_request([1, 2, 3], greedy(64))
    engine.step()  # prefill
    engine.step()  # dispatches two decode windows, reads the first
    before = list(engine.kv_caches)
    pointers = [c.unsafe_buffer_pointer() for c in before]
    engine.step()
    assert all(c.is_deleted() for c in before), "the step did not consume (donate) the old caches"
    assert [c.unsafe_buffer_pointer() for c in engine.kv_caches] == pointers, "the cache was copied"


def test_device_decode_metadata_equals_the_builder():
    """The decode window builds each step's metadata on the device; for the same rows it
    must be what the host builder makes (slots, lengths, tables), across a block edge."""
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder
    from jax_paged_attn.engine.model_runner import decode_metadata

    block_size, width = 16, 4
    tables = [[3, 9], [5], [7, 2, 11, 4]]
    seq_lens = [17, 16, 50]  # 17: the new token opens block 1; 16: the last slot of block 0
    builder = FlashAttentionMetadataBuilder(block_size=block_size, num_blocks=12, pad=False)
    built = builder.build_host([ScheduledSequence(is_prompt=False, seq_len=n, context_len=n - 1, query_len=1,
                                                  block_table=t) for n, t in zip(seq_lens, tables)])
    padded = np.zeros((4, width), np.int32)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    positions = np.array([n - 1 for n in seq_lens] + [0], np.int32)
    active = np.array([True, True, True, False])
    md = decode_metadata(jnp.asarray(positions), jnp.asarray(active), jnp.asarray(padded), block_size)
    np.testing.assert_array_equal(np.asarray(md.slot_mapping)[:3], built.slot_mapping)
    np.testing.assert_array_equal(np.asarray(md.seq_lens)[:3], built.seq_lens)
    np.testing.assert_array_equal(np.asarray(md.context_lens)[:3], built.context_lens)
    assert np.asarray(md.slot_mapping)[3] == -1 and np.asarray(md.seq_lens)[3] == 0  # a stopped row


def test_decode_windows_overlap_and_read_once_per_window(model, monkeypatch):
    """The host dispatches window n + 1 before it reads window n, and reads each window's
    tokens once (not once per token); the outputs are still the dense ones."""
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4))
    events = []
    dispatch, read = engine.runner.run_decode_window, DecodeBatch.read_window

    def counting_dispatch(*args, **kwargs):
        events.append("dispatch")
        return dispatch(*args, **kwargs)

    def counting_read(batch):
        events.append("read")
        return read(batch)

    run_mixed = engine.runner.run_mixed

    def counting_mixed(*args, **kwargs):  # a mixed step's rows are read as a window of one step
        events.append("mixed")
        return run_mixed(*args, **kwargs)

    engine.runner.run_decode_window = counting_dispatch
    monkeypatch.setattr(DecodeBatch, "read_window", counting_read)
    engine.runner.run_mixed = counting_mixed
    prompts = random_prompts(11, [9, 20, 4])
    traces = engine.runner.num_traces
    outs = engine.generate(prompts, greedy(30), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(model, prompts, 30)
    windows = events.count("dispatch")
    assert events.count("read") == windows + events.count("mixed")
    assert 29 // 4 - 1 <= windows <= 29 // 4 + 2  # 29 decoded tokens each, some in mixed steps
    # Before every read but the last, the next program (a window or a mixed step, whose
    # rows are read like a window's) is already queued behind the one read.
    in_flight, reads_left = 0, events.count("read")
    for event in events:
        if event == "read":
            reads_left -= 1
            assert in_flight >= (2 if reads_left else 1), events
            in_flight -= 1
        else:
            in_flight += 1
    assert engine.runner.num_traces - traces <= 2  # the mixed step and one window program


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_steps_are_dispatched_before_the_last_one_is_read(model, swap_expected, async_scheduling, monkeypatch):
    """With ``async_scheduling`` the host dispatches mixed step n + 1 before it reads step
    n (so the device never waits for the host's bookkeeping between them); without it,
    each mixed step is read before the next is scheduled. Chunked prompts, admissions
    and a tiny cache (preemption) give the same tokens as the dense reference either way."""
    engine = LLMEngine(model, dataclasses.replace(BASE, async_scheduling=async_scheduling))
    events = []
    run_mixed, read_prompt_tokens = engine.runner.run_mixed, DecodeBatch.read_prompt_tokens

    def counting_mixed(*args, **kwargs):
        events.append("dispatch")
        return run_mixed(*args, **kwargs)

    def counting_read(*args, **kwargs):
        events.append("read")
        return read_prompt_tokens(*args, **kwargs)

    engine.runner.run_mixed = counting_mixed
    monkeypatch.setattr(DecodeBatch, "read_prompt_tokens", counting_read)
    engine.runner.insert_decode_rows = None  # prompts join the batch inside the mixed step
    outs = run_with_arrivals(engine, SWAP_PROMPTS, greedy(SWAP_MAX_TOKENS), arrivals=[0, 0, 1, 2, 5])
    assert [o.outputs[0].token_ids for o in outs] == swap_expected
    assert events.count("dispatch") == events.count("read") == engine.stats.num_mixed_steps >= 6
    unread_at_dispatch = [events[:i].count("dispatch") - events[:i].count("read")
                          for i, e in enumerate(events) if e == "dispatch"]
    if async_scheduling:
        assert sum(n == 1 for n in unread_at_dispatch) >= 4, events  # steps back to back
    else:
        assert set(unread_at_dispatch) == {0}, events
    assert engine.stats.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_a_request_whose_first_token_ends_it_stops_in_its_mixed_step(model):
    """A prompt that ends in a mixed step joins the batch on the device with the token
    the step sampled, so the device decides whether that token ends it (EOS, a stop id,
    ``max_tokens=1``) before the next step: such a row decodes nothing more."""
    prompts = random_prompts(17, [12, 30, 7, 21, 9])
    expected = dense_greedy_generate(model, prompts, 12)
    eos = expected[1][0]  # request 1's first token is EOS
    params = [greedy(12), greedy(12), greedy(1), SamplingParams(temperature=0.0, max_tokens=12,
                                                                  stop_token_ids=[expected[3][0]]), greedy(12)]
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4, eos_token_id=eos))
    outs = engine.generate(prompts, params, use_tqdm=False)
    cut = [ref[:ref.index(eos) + 1] if eos in ref else ref for ref in expected]
    assert outs[1].outputs[0].token_ids == [eos] and outs[1].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].token_ids == expected[2][:1] and outs[2].outputs[0].finish_reason == "length"
    assert outs[3].outputs[0].token_ids == expected[3][:1] and outs[3].outputs[0].stop_reason == expected[3][0]
    for i in (0, 4):
        assert outs[i].outputs[0].token_ids == cut[i][:12]
    assert engine.stats.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in outs)
    assert_all_blocks_free(engine)


def test_persistent_batch_rows():
    # Never one row: XLA's GPU simplifier would turn every projection into a multiply
    # writing a weight-sized product (3x the weight traffic).
    assert [decode_batch_rows(n) for n in (1, 2, 3, 5, 256)] == [2, 2, 4, 8, 256]
    assert [decode_batch_rows(n, (4, 16)) for n in (1, 4, 5, 17)] == [4, 4, 16, 32]


def test_decode_windows_run_while_requests_wait_for_blocks(model):
    """A request that waits for cache blocks (not for a sequence slot) does not stop the
    running ones from decoding in windows; admissions are prefill-only steps."""
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4, num_host_blocks=0))
    windows, steps = [], []
    dispatch, run_step = engine.runner.run_decode_window, engine.runner.run_step

    def counting_dispatch(*args, **kwargs):
        windows.append(kwargs["num_steps"])
        return dispatch(*args, **kwargs)

    def counting_step(token_ids, positions, metadata, *args, **kwargs):
        steps.append((metadata.num_prefills, metadata.num_decode_tokens))
        return run_step(token_ids, positions, metadata, *args, **kwargs)

    engine.runner.run_decode_window, engine.runner.run_step = counting_dispatch, counting_step
    # 24 blocks of 16 tokens; each prompt takes 7 and grows to 8: three run, the others
    # wait for blocks with a sequence slot free.
    prompts = random_prompts(12, [100, 97, 104, 99, 101])
    outs = engine.generate(prompts, greedy(20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(model, prompts, 20)
    steps_decoding = sum(1 for _, num_decodes in steps if num_decodes)
    assert len(windows) >= 10 and steps_decoding <= 2, (steps, windows)
    assert_all_blocks_free(engine)


def test_windows_shorten_while_no_request_waits(model):
    """With ``latency_scheduler_steps``, windows dispatched while requests wait (for
    blocks here) run ``num_scheduler_steps`` steps, and those dispatched while none waits
    run the short length; the tokens stay the dense ones."""
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4, latency_scheduler_steps=1,
                                                  num_host_blocks=0))
    windows = []
    dispatch = engine.runner.run_decode_window

    def counting_dispatch(*args, **kwargs):
        windows.append((kwargs["num_steps"], bool(engine.scheduler.waiting)))
        return dispatch(*args, **kwargs)

    engine.runner.run_decode_window = counting_dispatch
    prompts = random_prompts(12, [100, 97, 104, 99, 101])  # three run, two wait for blocks (as above)
    outs = engine.generate(prompts, greedy(20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(model, prompts, 20)
    assert {steps for steps, waiting in windows if waiting} == {4}, windows
    assert {steps for steps, waiting in windows if not waiting} == {1}, windows
    assert_all_blocks_free(engine)


def test_short_windows_only_below_the_row_cap(model):
    """With ``latency_max_rows``, a window dispatched while none waits is short only
    while at most that many requests run (the host's work per window grows with its
    rows); above the cap it runs ``num_scheduler_steps``. Tokens stay the dense ones."""
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4, latency_scheduler_steps=1,
                                                  latency_max_rows=2))
    windows = []
    dispatch = engine.runner.run_decode_window

    def counting_dispatch(*args, **kwargs):
        sched = engine.scheduler
        windows.append((kwargs["num_steps"], bool(sched.waiting), len(sched.running)))
        return dispatch(*args, **kwargs)

    engine.runner.run_decode_window = counting_dispatch
    prompts = random_prompts(13, [20, 21, 22, 23])
    lengths = [6, 10, 30, 40]  # the batch drains from four rows to one
    outs = engine.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        dense_greedy_generate(model, [p], n)[0] for p, n in zip(prompts, lengths)]
    assert {steps for steps, waiting, running in windows if running > 2} == {4}, windows
    assert {steps for steps, waiting, running in windows if running <= 2 and not waiting} == {1}, windows
    assert_all_blocks_free(engine)


def test_admissions_join_the_running_batch_without_draining_it(model):
    """Without mixed steps (``decode_during_prefill=False``), a prompt admitted while the
    persistent batch decodes is prefilled beside it, with the batch's windows still in
    flight, and takes a free row on the device: no drain, no new batch. Tokens equal the
    dense ones."""
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4, decode_during_prefill=False))
    in_flight_at_prefill, events = [], []
    run_step, dispatch = engine.runner.run_step, engine.runner.run_decode_window

    def watching_step(*args, **kwargs):
        batch = engine._loop.batch
        in_flight_at_prefill.append(len(batch.inflight) if batch is not None else 0)
        events.append("prefill" if batch is not None else "prefill without a batch")
        return run_step(*args, **kwargs)

    def watching_dispatch(*args, **kwargs):
        events.append("window")
        return dispatch(*args, **kwargs)

    engine.runner.run_step, engine.runner.run_decode_window = watching_step, watching_dispatch
    prompts = random_prompts(13, [9, 20, 4, 15, 7, 11])
    max_tokens = [6, 30, 10, 12, 25, 8]  # 4 sequence slots: the last two wait for short ones to end
    outs = engine.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    expected = dense_greedy_generate(model, prompts, max(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == [ref[:n] for ref, n in zip(expected, max_tokens)]
    assert engine.stats.num_inserted_rows == 2 and engine.stats.num_decode_batches == 1
    assert max(in_flight_at_prefill) > 0  # a prefill ran behind windows the host had not read
    # and the running rows got a window behind each such prefill, before the newcomer joined
    assert all(events[i + 1] == "window" for i, e in enumerate(events) if e == "prefill"), events
    assert_all_blocks_free(engine)


def test_a_batch_shrinks_only_after_two_windows_without_a_prompt():
    """A batch whose live rows fit a smaller bucket keeps its rows while prompts keep
    joining (each shrink would drain it, and the next prompt's mixed step would need the
    largest bucket back): it shrinks once ``2 * num_scheduler_steps`` steps passed with
    no prompt; a prompt joining starts the count again."""
    from types import SimpleNamespace

    from jax_paged_attn.engine.shapes import ProgramShapes

    shapes = ProgramShapes(block_table_width=16, window_widths=(16,), decode_rows=(2, 4, 8), mixed_rows=(8,),
                           prompt_shapes=((32, 4),))
    requests = [SimpleNamespace(is_finished=i >= 3) for i in range(8)]  # 3 live rows of 8: a 4-row bucket fits
    batch = DecodeBatch(scheduler=None, runner=None, config=dataclasses.replace(BASE, num_scheduler_steps=4),
                        vocab_size=64, requests=requests, num_rows=8, width=16, num_stop_ids=1,
                        next_position=np.zeros(8, np.int64), table_len=np.zeros(8, np.int64),
                        last_input=np.zeros(8, np.int64), greedy=True)
    assert batch.shrink_after_steps() == 8
    for steps, rebuild in [(0, False), (4, False), (7, False), (8, True), (40, True)]:
        batch.steps_since_prompts = steps
        assert batch.needs_rebuild(shapes) == rebuild, steps
    batch.requests = [SimpleNamespace(is_finished=i >= 5) for i in range(8)]  # 5 live: the 8-row bucket
    assert not batch.needs_rebuild(shapes)
    batch.missing_rows = True  # a request that could not join rebuilds at once, as before
    batch.steps_since_prompts = 0
    assert batch.needs_rebuild(shapes)


def test_a_request_that_cannot_join_the_batch_rebuilds_it(model):
    """A sampled request arriving while a greedy batch runs (whose window program is the
    greedy one) cannot take a row: the batch is rebuilt with it. Its tokens are those it
    samples alone, the greedy ones the dense ones."""
    sampled = SamplingParams(temperature=0.9, top_k=40, max_tokens=10, seed=3)
    prompts = random_prompts(14, [9, 20, 4, 15, 7])
    alone = LLMEngine(model, BASE).generate([prompts[4]], sampled, use_tqdm=False)[0]
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4))
    params = [greedy(5), greedy(20), greedy(12), greedy(16), sampled]
    outs = engine.generate(prompts, params, use_tqdm=False)
    expected = dense_greedy_generate(model, prompts[:4], 20)
    assert [o.outputs[0].token_ids for o in outs[:4]] == [ref[:p.max_tokens] for ref, p in zip(expected, params)]
    assert outs[4].outputs[0].token_ids == alone.outputs[0].token_ids
    # The greedy requests joined the greedy batch beside their prompts; the sampled one
    # could not (the batch's programs are the greedy ones), so the batch was rebuilt.
    assert engine.stats.num_inserted_rows == 4 and engine.stats.num_decode_batches >= 2
    assert_all_blocks_free(engine)


def test_aborted_row_is_reused_after_the_windows_in_flight(model):
    """Aborting a request in the running batch frees its row for the next admission; the
    windows already dispatched still carry the aborted request's row, and their tokens
    are not given to the newcomer."""
    engine = LLMEngine(model, dataclasses.replace(BASE, num_scheduler_steps=4))
    prompts = random_prompts(15, [9, 20, 4, 15, 7])
    ids = [engine.add_request(p, greedy(24), request_id=f"r{i}") for i, p in enumerate(prompts)]
    outputs, aborted = {}, False
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id] = engine.pop_output(out.request_id)
        batch = engine._loop.batch
        if not aborted and batch is not None and batch.inflight and engine.scheduler.requests["r1"] in batch.requests:
            engine.abort_request("r1")  # in the batch, with a window in flight
            aborted = True
    # Every request joined the batch from its mixed prompt step; the last took r1's row.
    assert aborted and engine.stats.num_inserted_rows == len(prompts)
    expected = dense_greedy_generate(model, prompts, 24)
    for i, request_id in enumerate(ids):
        if request_id != "r1":
            assert outputs[request_id].outputs[0].token_ids == expected[i], request_id
    assert_all_blocks_free(engine)


def test_decode_window_program_has_no_conditional():
    """No data-dependent branch in the decode window or the mixed step lowered for CUDA
    (XLA would copy its predicate to the host, and the call would wait for the whole
    step), greedy, sampled, or sampled with penalties."""
    small = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1), rngs=nnx.Rngs(5))
    engine = LLMEngine(small, dataclasses.replace(BASE, num_scheduler_steps=2))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.7, max_tokens=8))
    engine.step()  # prefill
    engine.step()  # starts the persistent batch
    runner = engine.runner
    state = runner._decode_state
    rows, width = state.block_tables.shape
    assert rows == 4 and state.active.tolist() == [True, False, False, False]  # BASE's batch bucket
    num_stop_ids, vocab = state.stop_ids.shape[1], small.config.vocab_size
    variants = [(True, None), (False, None), (False, vocab)]  # (greedy, vocabulary of the Penalties or none)
    for greedy_batch, penalties_vocab in variants:
        window_state = state if penalties_vocab is None else jax.device_put(
            DecodeState.empty(rows, width, num_stop_ids, penalties_vocab))
        with cuda_lowering_target():
            text = runner.window_program.trace(
                runner.params, runner.kv_caches, window_state, np.ones(rows, bool), np.full(rows, rows, np.int32),
                np.zeros((rows, width), np.int32), num_steps=2, greedy=greedy_batch, block_size=16,
                max_model_len=512).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text  # the kernels, as on a GPU
        assert_no_data_dependent_branch(text)
    # The mixed step too, with the prompts joining the batch inside it.
    num_tokens, num_seqs = engine.shapes.prompt_shapes[0]
    width = engine.shapes.block_table_width
    join = (np.arange(num_seqs, dtype=np.int32) % (rows + 1), DecodeState.empty(num_seqs, width, num_stop_ids))
    for greedy_batch, penalties_vocab in variants:
        mixed_state = jax.device_put(DecodeState.empty(rows, width, num_stop_ids, penalties_vocab))
        prompt_penalties = None if penalties_vocab is None else engine._inputs.neutral_penalties(num_seqs)
        with cuda_lowering_target():
            text = runner.mixed_program.trace(
                runner.params, runner.kv_caches, mixed_state, np.ones(rows, bool), np.full(rows, rows, np.int32),
                np.zeros((rows, width), np.int32), *engine._inputs.padding_prompt_inputs(num_tokens, num_seqs), *join,
                prompt_penalties, greedy=greedy_batch, block_size=16,
                max_model_len=512).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
        assert_no_data_dependent_branch(text)


# --------------------------------------------------------------------------- bad requests


def test_bad_requests_are_rejected_and_others_continue(model):
    prompts = random_prompts(4, [7, 20])
    engine = LLMEngine(model, BASE)
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="max context"):
        engine.add_request([1] * 512, greedy(4))
    with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
        engine.add_request([1, 128], greedy(4))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], SamplingParams(temperature=-0.5))
    with pytest.raises(ValueError, match="prompts\\[1\\]: .*empty"):
        engine.generate([[1, 2], []], greedy(4), use_tqdm=False)
    assert sorted(engine.scheduler.requests) == sorted(ids)  # nothing of the bad ones remains
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = engine.pop_output(out.request_id).outputs[0].token_ids
    assert [outputs[i] for i in ids] == dense_greedy_generate(model, prompts, 10)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-3), "top_k"),
    (dict(seed=-1), "seed"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_engine_config_errors():
    with pytest.raises(ValueError, match="block_size must be a multiple of 16"):
        EngineConfig(block_size=8)
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=0)
    with pytest.raises(ValueError, match=r"latency_scheduler_steps must be at most num_scheduler_steps \(4\), got 8"):
        EngineConfig(num_scheduler_steps=4, latency_scheduler_steps=8)
    with pytest.raises(ValueError, match="latency_scheduler_steps must be an int >= 1, got 0"):
        EngineConfig(latency_scheduler_steps=0)
    with pytest.raises(ValueError, match="latency_max_rows must be an int >= 1, got 0"):
        EngineConfig(latency_scheduler_steps=1, latency_max_rows=0)


# --------------------------------------------------------------------------- sampling


def test_sampler_greedy_top_k_and_top_p_limits():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((6, 50)).astype(np.float32))
    argmax = np.argmax(np.asarray(logits), axis=-1)
    ones, seeds, counters = jnp.ones(6), jnp.arange(6, dtype=jnp.uint32), jnp.zeros(6, jnp.int32)
    sample = jax.jit(sample_tokens)
    greedy_tokens = sample(logits, jnp.zeros(6), ones, jnp.full(6, -1), seeds, counters)
    np.testing.assert_array_equal(greedy_tokens, argmax)
    top1 = sample(logits, jnp.full(6, 5.0), ones, jnp.ones(6, jnp.int32), seeds, counters)
    np.testing.assert_array_equal(top1, argmax)
    tiny_p = sample(logits, jnp.full(6, 5.0), jnp.full(6, 1e-6), jnp.full(6, -1), seeds, counters)
    np.testing.assert_array_equal(tiny_p, argmax)


def test_sampler_distribution_top_p_and_seeds():
    n = 4000
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.tile(np.log(probs), (n, 1)).astype(np.float32))
    seeds = jnp.full(n, 11, jnp.uint32)
    counters = jnp.arange(n, dtype=jnp.int32)  # one stream, n draws
    sample = jax.jit(sample_tokens)
    tokens = np.asarray(sample(logits, jnp.ones(n), jnp.ones(n), jnp.full(n, -1), seeds, counters))
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # top_p=0.7 keeps tokens 0 and 1 (0.5 before token 1 < 0.7; 0.8 before token 2 is not).
    nucleus = np.asarray(sample(logits, jnp.ones(n), jnp.full(n, 0.7), jnp.full(n, -1), seeds, counters))
    assert set(nucleus.tolist()) == {0, 1}
    np.testing.assert_allclose(np.mean(nucleus == 0), 0.5 / 0.8, atol=0.03)
    top2 = np.asarray(sample(logits, jnp.ones(n), jnp.ones(n), jnp.full(n, 2), seeds, counters))
    assert set(top2.tolist()) == {0, 1}
    # The same (seed, counter) always draws the same token; another seed draws others.
    again = np.asarray(sample(logits, jnp.ones(n), jnp.ones(n), jnp.full(n, -1), seeds, counters))
    np.testing.assert_array_equal(again, tokens)
    other = np.asarray(sample(logits, jnp.ones(n), jnp.ones(n), jnp.full(n, -1), seeds + 1, counters))
    assert np.mean(other != tokens) > 0.3


def test_seeded_sampling_does_not_depend_on_the_batch(model, capsys):
    prompts = random_prompts(6, [9, 14, 4, 25])
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=7)
    alone = LLMEngine(model, BASE).generate([prompts[0]], params, use_tqdm=False)[0]
    engine = LLMEngine(model, BASE)
    others = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in (1, 2, 3)]
    together = engine.generate(prompts, [params] + others, use_tqdm=True)
    assert together[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in together}) == 4
    err = capsys.readouterr().err
    assert ("generate: 4/4 requests" in err) or ("100%" in err)  # the stderr line, or a tqdm bar
    summary = engine.stats.summary()
    assert "prefill:" in summary and "decode:" in summary and "tok/s" in summary
    assert engine.stats.num_generated_tokens == 4 * 12


def test_the_start_report_names_the_attention_code_and_its_tile_configs(monkeypatch):
    from jax_paged_attn import tuning
    from jax_paged_attn.engine import startup

    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0), implementation="triton", interpret=True)
    monkeypatch.setattr(startup.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "target_device", lambda: tuning.TuningDevice("NVIDIA L4", 99 * 1024))
    assert startup.implementation_report(model) == (
        "triton (chosen by the model's implementation argument); no tile configs measured on the NVIDIA L4: "
        "defaults fitted to its 99 KiB of shared memory per block; `python3 -m jax_paged_attn.tune` measures a "
        "table for it")


@pytest.mark.parametrize("head_dim, mosaic", [(128, True), (64, False)])
def test_the_start_report_says_when_auto_prefills_through_the_mosaic_gpu_kernel(monkeypatch, head_dim, mosaic):
    from jax_paged_attn import tuning
    from jax_paged_attn.engine import startup

    config = LlamaConfig.tiny(head_dim=head_dim)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    monkeypatch.setattr(startup.jax, "default_backend", lambda: "gpu")
    report = startup.implementation_report(model)
    assert report.startswith("auto: Pallas Triton kernels")
    assert ("rows per sequence) through the Mosaic GPU kernel" in report) == mosaic
    assert (f"head size {head_dim} on this GPU" in report) == mosaic
    assert tuning.target_device().kind == "NVIDIA H200"  # a CPU host plans for the H200


def test_the_engine_keeps_the_process_choice_of_compilation_cache(tmp_path):
    from jax_paged_attn.engine import startup

    options = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
               "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in options}
    try:
        # conftest turned JAX's cache off for the run: an engine leaves it off and says so
        assert startup.use_compilation_cache(EngineConfig()) == (
            "compilation cache: off (the process set jax_enable_compilation_cache=False)")
        assert jax.config.jax_compilation_cache_dir == saved["jax_compilation_cache_dir"]
        jax.config.update("jax_enable_compilation_cache", True)
        line = startup.use_compilation_cache(EngineConfig(compilation_cache_dir=str(tmp_path)))
        assert line.startswith(f"compilation cache: {tmp_path} ")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        # the directory in use is kept; another named by a second engine is an error, not ignored
        assert startup.use_compilation_cache(EngineConfig()) == (
            f"compilation cache: {tmp_path} (set by an engine)")
        with pytest.raises(ValueError, match="compilation_cache_dir='/elsewhere', but JAX's persistent compilation"):
            startup.use_compilation_cache(EngineConfig(compilation_cache_dir="/elsewhere"))
        assert startup.use_compilation_cache(EngineConfig(compilation_cache=False)).startswith(
            "compilation cache: off (EngineConfig.compilation_cache=False)")
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def test_kv_cache_sized_from_memory_does_not_depend_on_the_allocators_history(model, monkeypatch):
    """The block count is in every cache program's shape. A cold start's allocator peak
    (XLA's autotuner allocates while it compiles) is higher than a warm start's, so a
    count from the peak gave a second start other programs than the persistent
    compilation cache held: the count comes from what is alive and XLA's buffer
    assignment, a multiple of KV_CACHE_BLOCK_QUANTUM."""
    from jax_paged_attn.engine import startup

    config = dataclasses.replace(BASE, num_blocks=None, gpu_memory_utilization=0.5)
    bytes_per_block = sum(int(c.nbytes) for c in model.allocate_kv_caches(1, config.block_size))
    activations = startup.largest_step_activation_bytes(model, config, model.config.max_position_embeddings)
    penalties = startup.penalty_state_bytes(model, config)  # the penalized batch's token counts
    assert activations > 0 and penalties == config.max_num_seqs * model.config.vocab_size * 5
    activations += penalties
    limit, in_use = 128 << 20, 16 << 20  # a few thousand blocks of the tiny model

    def blocks(peak: int, alive: int = in_use) -> tuple[int, str]:
        stats = dict(bytes_limit=limit, bytes_in_use=alive, peak_bytes_in_use=peak)
        monkeypatch.setattr(startup, "device_memory_stats", lambda device: stats)
        return startup.kv_cache_blocks_for_memory(model, config, model.config.max_position_embeddings)

    cold, line = blocks(peak=96 << 20)
    warm, _ = blocks(peak=in_use)
    assert cold == warm
    quantum = startup.KV_CACHE_BLOCK_QUANTUM
    assert cold % quantum == 0
    assert cold * bytes_per_block + in_use + activations <= limit * 0.5
    assert (cold + quantum) * bytes_per_block + in_use + activations > limit * 0.5
    assert f"{cold} blocks fit" in line
    # more arrays alive (the weights of another model): fewer blocks
    assert blocks(peak=in_use, alive=in_use + (8 << 20))[0] < cold
    # no room: a clear error naming the option
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        blocks(peak=limit, alive=limit // 2)
    # the engine uses it
    monkeypatch.setattr(startup, "device_memory_stats",
                        lambda device: dict(bytes_limit=limit, bytes_in_use=in_use, peak_bytes_in_use=limit))
    engine = LLMEngine(model, config)
    assert engine.config.num_blocks == cold


def test_the_sizing_figure_is_measured_once_per_key(model, monkeypatch, tmp_path, caplog):
    """The largest step's activation bytes (the KV-cache sizing's one traced and compiled
    program) are kept in the program store under the programs' key and the sizes: a
    second start reads the figure and traces nothing; other sizes, or a file that is not
    the figure, are measured again (the latter said in the log)."""
    from jax_paged_attn.engine import startup
    from jax_paged_attn.engine.program_store import FIGURE_SUFFIX

    measured = []
    measure = startup.largest_step_activation_bytes
    monkeypatch.setattr(startup, "largest_step_activation_bytes",
                        lambda *args: measured.append(args[1].max_num_batched_tokens) or measure(*args))
    config, length, store = dataclasses.replace(BASE, num_blocks=None), model.config.max_position_embeddings, str(tmp_path)
    first = startup.stored_activation_bytes(model, config, length, store)
    assert first == measure(model, config, length) > 0 and measured == [config.max_num_batched_tokens]
    files = list(tmp_path.glob(f"*{FIGURE_SUFFIX}"))
    assert len(files) == 1 and files[0].name.startswith("activation_bytes-")
    assert startup.stored_activation_bytes(model, config, length, store) == first and len(measured) == 1
    larger = dataclasses.replace(config, max_num_batched_tokens=2 * config.max_num_batched_tokens)
    assert startup.stored_activation_bytes(model, larger, length, store) > first and len(measured) == 2
    files[0].write_bytes(files[0].read_bytes()[:-3])  # torn
    with caplog.at_level("WARNING"):
        assert startup.stored_activation_bytes(model, config, length, store) == first and len(measured) == 3
    assert "not used" in caplog.text and "torn file" in caplog.text
    assert startup.stored_activation_bytes(model, config, length, store) == first and len(measured) == 3
    assert startup.stored_activation_bytes(model, config, length, None) == first and len(measured) == 4


def test_a_second_engine_loads_its_programs_from_the_program_store(model, monkeypatch, tmp_path, caplog):
    """Compiled programs kept by source, model, JAX and device: a second start loads them
    (no tracing of the model; their compilation is JAX's persistent cache's, off in this
    process: tests/test_program_store.py starts processes with it) and generates the same
    tokens; an unreadable file is compiled again and replaced; another model or other
    XLA options get programs of their own."""
    from jax_paged_attn.engine import startup
    from jax_paged_attn.engine.program_store import FILE_SUFFIX

    monkeypatch.setattr(startup, "program_store_dir", lambda config: str(tmp_path))
    # The warm-up's greedy and sampled programs; the penalized ones the middle request
    # runs are stored and loaded as it reaches them.
    config = dataclasses.replace(BASE, max_model_len=64, warmup_penalties=False)
    prompts = random_prompts(11, (5, 20, 9))

    # The middle request runs the programs with penalties (their Penalties trees stored
    # too), biased away from the token greedy picks first.
    dense = dense_greedy_generate(model, prompts, 6)
    params = [greedy(6), dataclasses.replace(greedy(6), repetition_penalty=1.5, logit_bias={dense[1][0]: -5.0}),
              greedy(6)]

    def start() -> tuple[LLMEngine, list[list[int]]]:
        engine = LLMEngine(model, config)
        assert str(tmp_path) in engine.start_report
        engine.warmup(use_tqdm=False)
        return engine, [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    first, tokens = start()
    stored = first.runner.program_store.num_stored
    assert stored > 0 and first.runner.program_store.num_loaded == 0
    assert first.runner.program_store.num_unserializable == 0
    assert [tokens[0], tokens[2]] == [dense[0], dense[2]] and tokens[1] != dense[1]
    traces = first.runner.num_traces
    # The second start finds one file torn (one start, not two: each start compiles every
    # program in this process, loaded or not). A whole second start loading every program
    # untraced, in processes of its own: tests/test_program_store.py's
    # test_starts_after_an_upgrade_load_what_they_stored.
    files = sorted(tmp_path.glob(f"*{FILE_SUFFIX}"))
    files[0].write_bytes(files[0].read_bytes()[:100])  # a torn file
    with caplog.at_level("WARNING"):
        second, again = start()
    assert again == tokens and "torn file" in caplog.text
    # The first warm-up's programs were read ahead, in its order (the penalized ones,
    # which the warm-up left out, loaded as the request reached them).
    assert "those this configuration's last warm-up used, in its order" in second.start_report
    # Every other program loaded; the torn one compiled again and replaced.
    assert second.runner.program_store.num_loaded == stored - 1 and second.runner.program_store.num_stored == 1
    assert second.runner.num_traces - traces <= 1  # nothing but the torn one traced anew
    cache = second.runner.kv_caches[0]
    second.generate(prompts[:1], greedy(2), use_tqdm=False)
    assert cache.is_deleted()  # a loaded program still takes the caches donated: in place
    # Another option beside the same optimization level (compiles as fast as the others):
    # the programs a request runs are its own, compiled and stored beside the base's.
    options = {**config.compiler_options, "xla_llvm_disable_expensive_passes": True}
    other = LLMEngine(model, dataclasses.replace(config, compiler_options=options))
    assert other.generate(prompts[:1], greedy(6), use_tqdm=False)[0].outputs[0].token_ids == dense[0]
    assert other.runner.program_store.num_loaded == 0 and other.runner.program_store.num_stored > 0
    assert len(list(tmp_path.glob(f"*{FILE_SUFFIX}"))) == len(files) + other.runner.program_store.num_stored


def test_the_program_store_keys_programs_by_the_jax_options_in_effect(model, tmp_path):
    """A program traced under ``jax.default_matmul_precision("highest")`` is another
    program: the store must not hand the default one out under the context (jit itself
    retraces there)."""
    from jax_paged_attn.engine import program_store

    calls = []

    @jax.jit
    def matmul(w, x):
        calls.append(jax.config.jax_default_matmul_precision)
        return x @ w

    store = program_store.ProgramStore(tmp_path, ["test"])
    stored = program_store.StoredProgram(matmul, "matmul", store, params_first=True)
    w, x = jnp.ones((8, 8)), jnp.ones((2, 8))
    stored(w, x)
    with jax.default_matmul_precision("highest"):
        stored(w, x)
    stored(w, x)
    assert calls == [None, "highest"] and store.num_stored == 2
    again = program_store.StoredProgram(matmul, "matmul", program_store.ProgramStore(tmp_path, ["test"]),
                                        params_first=True)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_array_equal(again(w, x), x @ w)
    assert again.store.num_loaded == 1 and len(calls) == 2
