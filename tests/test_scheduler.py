"""Scheduler: chunked prefill, continuous batching, prefix sharing, copy-on-write, swapping.

Most tests drive the scheduler with a simulated KV cache: a numpy array with one slot
per (block, offset) that stores the *token id* written there. Each step writes the
scheduled chunk's tokens into its slots, after applying the step's swap-outs, copies
and swap-ins exactly as the engine does. Before writing, every scheduled request's
cache must hold all of its earlier tokens at the positions its block table says: if
the scheduler ever lost, overwrote or mis-mapped a token, this check fails.
"""
import numpy as np
import pytest

from jax_paged_attn.engine import scheduler as scheduler_module
from jax_paged_attn.engine.sampling import SamplingParams
from jax_paged_attn.engine.request import FinishReason, RequestStatus, ScheduledRequest, SchedulerOutput
from jax_paged_attn.engine.scheduler import Scheduler, SchedulerConfig

EMPTY = -1


class SimulatedCache:
    """Token ids in place of K/V, with the engine's order of block operations."""

    def __init__(self, scheduler: Scheduler, num_host_blocks: int):
        bs = scheduler.block_size
        self.bs = bs
        self.device = np.full((scheduler.device_blocks.num_blocks, bs), EMPTY, np.int64)
        self.host = np.full((num_host_blocks, bs), EMPTY, np.int64)

    def apply(self, out) -> None:
        for dev, host in out.swap_out:
            self.host[host] = self.device[dev]
        srcs = [s for s, _ in out.copies]
        dsts = [d for _, d in out.copies]
        self.device[dsts] = self.device[srcs]  # all reads before writes, like one gather/scatter
        for host, dev in out.swap_in:
            self.device[dev] = self.host[host]

    def slot(self, table, position):
        return table[position // self.bs], position % self.bs

    def check_and_write(self, out) -> None:
        for item in out.scheduled:
            r = item.request
            tokens = r.token_ids()
            for p in range(item.start):
                assert self.device[self.slot(r.block_table, p)] == tokens[p], (r.request_id, p)
            for p in range(item.start, item.seq_len):
                self.device[self.slot(r.block_table, p)] = tokens[p]


def next_token(request) -> int:
    """A deterministic stand-in for the model: depends only on the request's tokens."""
    return (sum(request.token_ids()) * 31 + request.num_tokens) % 97


def run_step(scheduler, cache):
    out = scheduler.schedule()
    cache.apply(out)
    cache.check_and_write(out)
    sampled = {s.request.request_id: next_token(s.request) for s in out.scheduled if s.samples}
    finished = scheduler.update(out, sampled)
    return out, finished


def make_scheduler(num_blocks=64, num_host_blocks=64, block_size=16, **config):
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512, **config})
    return Scheduler(cfg, num_device_blocks=num_blocks, num_host_blocks=num_host_blocks, block_size=block_size,
                     vocab_size=100)


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def expected_output(prompt, max_tokens):
    """What the simulated model generates for a prompt when nothing goes wrong."""

    class R:
        def __init__(self):
            self.toks = list(prompt)

        def token_ids(self):
            return self.toks

        @property
        def num_tokens(self):
            return len(self.toks)

    r = R()
    for _ in range(max_tokens):
        r.toks.append(next_token(r))
    return r.toks[len(prompt):]


def drain(scheduler, cache, max_steps=10_000):
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outs
        outs.append(run_step(scheduler, cache))
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_splits_long_prompt_and_samples_once():
    s = make_scheduler(max_num_batched_tokens=16)
    cache = SimulatedCache(s, 64)
    r = s.add_request("a", list(range(40)), greedy(3), seed=0)
    chunks = []
    for _ in range(3):
        out, _ = run_step(s, cache)
        (item,) = out.scheduled
        chunks.append((item.num_new_tokens, item.is_prefill, item.samples))
    assert chunks == [(16, True, False), (16, True, False), (8, True, True)]
    assert len(r.output_token_ids) == 1 and r.num_computed_tokens == 40
    out, _ = run_step(s, cache)
    assert [(i.num_new_tokens, i.is_prefill) for i in out.scheduled] == [(1, False)]


def test_mixed_batch_puts_prefills_first_and_respects_budget():
    s = make_scheduler(max_num_batched_tokens=20)
    cache = SimulatedCache(s, 64)
    s.add_request("old", list(range(5)), greedy(10), seed=0)
    run_step(s, cache)  # "old" prefilled, now decoding
    s.add_request("new", list(range(50)), greedy(10), seed=0)
    out, _ = run_step(s, cache)
    assert [(i.request.request_id, i.num_new_tokens, i.is_prefill) for i in out.scheduled] == [
        ("new", 19, True), ("old", 1, False)]
    assert out.num_prefills == 1 and out.num_batched_tokens == 20


def test_prefill_only_steps_when_decodes_wait_for_prefills():
    s = make_scheduler(max_num_batched_tokens=20, decode_during_prefill=False)
    cache = SimulatedCache(s, 64)
    s.add_request("old", list(range(5)), greedy(10), seed=0)
    run_step(s, cache)  # "old" prefilled, now decoding
    s.add_request("new", list(range(30)), greedy(10), seed=0)
    assert s.can_admit()
    chunks = [[(i.request.request_id, i.num_new_tokens) for i in run_step(s, cache)[0].scheduled] for _ in range(3)]
    assert chunks == [[("new", 20)], [("new", 10)], [("old", 1), ("new", 1)]]
    assert s.requests["old"].output_token_ids == expected_output(list(range(5)), 2)


def test_can_admit_needs_a_slot_and_blocks():
    s = make_scheduler(num_blocks=4, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    assert not s.can_admit()  # nobody waits
    s.add_request("a", [1] * 40, greedy(20), seed=0)  # 3 blocks
    assert s.can_admit()
    run_step(s, SimulatedCache(s, 64))
    s.add_request("b", [2] * 40, greedy(5), seed=0)
    assert not s.can_admit()  # a slot is free, but only 1 of 4 blocks
    s.add_request("c", [3] * 4, greedy(5), seed=0)
    assert not s.can_admit()  # FCFS: "b" is first


def test_continuous_batching_requests_join_and_leave():
    s = make_scheduler()
    cache = SimulatedCache(s, 64)
    prompts = {f"r{i}": [(7 * i + j) % 100 for j in range(3 + 5 * i)] for i in range(5)}
    max_tokens = {f"r{i}": 2 + 3 * i for i in range(5)}
    finished = {}
    step = 0
    while s.has_unfinished() or step < 5:
        if step < 5:  # one new request per step while others decode
            rid = f"r{step}"
            s.add_request(rid, prompts[rid], greedy(max_tokens[rid]), seed=0)
        out, done = run_step(s, cache)
        for r in done:
            finished[r.request_id] = r
        step += 1
    for rid, r in finished.items():
        assert r.finish_reason == FinishReason.LENGTH
        assert r.output_token_ids == expected_output(prompts[rid], max_tokens[rid])
    assert len(finished) == 5
    assert s.device_blocks.num_free_blocks == 64


def test_swap_preemption_preserves_every_token_and_is_fcfs():
    # 6 blocks of 4 tokens: three requests growing to 15 tokens cannot all fit.
    s = make_scheduler(num_blocks=6, num_host_blocks=16, block_size=4, enable_prefix_caching=False)
    cache = SimulatedCache(s, 16)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, greedy(12), seed=0)
    order = []
    saw_swap_out = saw_swap_in = False
    for out, done in drain(s, cache):
        saw_swap_out |= bool(out.swap_out)
        saw_swap_in |= bool(out.swap_in)
        # The youngest running request is the one preempted.
        for rid in out.preempted:
            assert all(r.arrival_index < s.requests[rid].arrival_index for r in s.running)
        order += [r.request_id for r in done]
    assert saw_swap_out and saw_swap_in and s.num_preemptions > 0
    assert order == ["r0", "r1", "r2"]  # first come, first served
    for i, p in enumerate(prompts):
        assert s.requests[f"r{i}"].output_token_ids == expected_output(p, 12)
    assert s.device_blocks.num_free_blocks == 6 and s.host_blocks.num_free_blocks == 16


def test_recompute_when_host_swap_space_is_full_keeps_tokens():
    s = make_scheduler(num_blocks=6, num_host_blocks=0, block_size=4, enable_prefix_caching=False)
    cache = SimulatedCache(s, 0)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, greedy(12), seed=0)
    outs = drain(s, cache)
    assert s.num_recomputed_requests > 0
    assert not any(out.swap_out for out, _ in outs)
    for i, p in enumerate(prompts):
        assert s.requests[f"r{i}"].output_token_ids == expected_output(p, 12)


def test_recompute_readmitted_through_a_prefix_hit_of_all_but_its_last_token_is_a_prefill():
    """Issue #49 item 4. "b" is preempted by recomputation at its 9th token (its two full
    blocks stay cached) and, readmitted, finds all its tokens but the last in the prefix
    cache. That token finishes its prefill: a prompt-only step holds it as a prefill chunk."""
    s = make_scheduler(num_blocks=5, num_host_blocks=0, block_size=4, decode_during_prefill=False)
    cache = SimulatedCache(s, 0)
    s.add_request("a", [1, 2, 3, 4], greedy(6), seed=0)
    s.add_request("b", [5, 6, 7, 8], greedy(6), seed=0)
    steps = drain(s, cache)
    assert s.num_recomputed_requests == 1
    readmission = [item for out, _ in steps for item in out.scheduled
                   if item.request.request_id == "b" and item.start == 8 and item.num_new_tokens == 1]
    assert len(readmission) == 1 and readmission[0].is_prefill
    assert all(out.num_prefills in (0, len(out.scheduled)) for out, _ in steps)
    assert s.requests["b"].output_token_ids == expected_output([5, 6, 7, 8], 6)


def test_waiting_requests_do_not_overtake_swapped_ones():
    s = make_scheduler(num_blocks=4, num_host_blocks=16, block_size=4, enable_prefix_caching=False)
    cache = SimulatedCache(s, 16)
    s.add_request("a", [1] * 3, greedy(10), seed=0)
    s.add_request("b", [2] * 3, greedy(10), seed=0)
    while not s.swapped:
        run_step(s, cache)
    (swapped_id,) = [r.request_id for r in s.swapped]
    s.add_request("c", [3], greedy(1), seed=0)
    steps = drain(s, cache)
    back = min(i for i, (out, _) in enumerate(steps) if swapped_id in [x.request.request_id for x in out.scheduled])
    c_first = min(i for i, (out, _) in enumerate(steps) if "c" in [x.request.request_id for x in out.scheduled])
    assert back > 0 and c_first >= back


def test_prefix_sharing_refcounts_and_copy_on_write():
    s = make_scheduler(block_size=4)
    cache = SimulatedCache(s, 64)
    prompt = list(range(10, 22))  # three full blocks
    a = s.add_request("a", prompt, greedy(1), seed=0)
    run_step(s, cache)  # prefill a: registers its 3 full blocks, finishes
    assert a.is_finished
    b = s.add_request("b", prompt + [50, 51], greedy(4), seed=0)
    c = s.add_request("c", prompt + [60], greedy(4), seed=0)
    out, _ = run_step(s, cache)
    # Both reuse a's three blocks; only their own tails are computed.
    assert b.num_cached_prompt_tokens == 12 and c.num_cached_prompt_tokens == 12
    assert b.block_table[:3] == c.block_table[:3]
    assert all(s.device_blocks.ref_count(blk) == 2 for blk in b.block_table[:3])
    assert [i.num_new_tokens for i in out.scheduled] == [2, 1]
    assert not out.copies
    # A fully cached prompt still feeds its last token: that write copies the shared block.
    d = s.add_request("d", prompt, greedy(2), seed=0)
    out, _ = run_step(s, cache)
    (d_item,) = [i for i in out.scheduled if i.request is d]
    assert d_item.start == 11 and d_item.num_new_tokens == 1
    assert len(out.copies) == 1 and out.copies[0][0] == b.block_table[2]
    assert d.block_table[:2] == b.block_table[:2] and d.block_table[2] != b.block_table[2]
    drain(s, cache)
    assert d.output_token_ids == expected_output(prompt, 2)
    assert b.output_token_ids == expected_output(prompt + [50, 51], 4)
    assert s.device_blocks.num_free_blocks == 64


def test_prefix_sharing_under_preemption_keeps_tokens():
    s = make_scheduler(num_blocks=10, num_host_blocks=40, block_size=4, max_num_batched_tokens=8)
    cache = SimulatedCache(s, 40)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    prompts = [shared + [i] * (1 + i % 3) for i in range(6)]
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, greedy(9), seed=0)
    drain(s, cache)
    assert s.num_preemptions > 0 and s.num_prefix_cache_hit_tokens > 0
    for i, p in enumerate(prompts):
        assert s.requests[f"r{i}"].output_token_ids == expected_output(p, 9)


def test_prefix_cache_hits_are_exact_even_when_every_block_hash_collides(monkeypatch):
    # A deliberately bad hash: every block of every request collides. A hit must still
    # compare the block's tokens and its parent chain, so nobody reads another's K/V
    # (the simulated cache checks every earlier token a request reads).
    monkeypatch.setattr(scheduler_module, "hash_block_tokens", lambda parent, tokens: b"collide")
    s = make_scheduler(block_size=4)
    cache = SimulatedCache(s, 64)
    first = list(range(10, 22))  # three full blocks
    s.add_request("first", first, greedy(2), seed=0)
    drain(s, cache)
    prompts = {
        "other": list(range(40, 52)),  # same length, no token in common
        "repeats": first[:4] * 3,  # blocks 1 and 2 hold block 0's tokens at later positions
        "same": first,  # only block 0 is cached: every later block's hash is already taken
        "shifted": [90, 91, 92, 93] + first[:8],  # first's blocks one block later
    }
    for rid, prompt in prompts.items():
        s.add_request(rid, prompt, greedy(6), seed=0)
    drain(s, cache)
    for rid, prompt in prompts.items():
        assert s.requests[rid].output_token_ids == expected_output(prompt, 6), rid
    cached = {rid: s.requests[rid].num_cached_prompt_tokens for rid in prompts}
    assert cached == {"other": 0, "repeats": 4, "same": 4, "shifted": 0}
    assert s.device_blocks.num_free_blocks == 64


def test_stop_tokens_eos_and_abort():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    s = Scheduler(cfg, num_device_blocks=8, num_host_blocks=8, block_size=4, eos_token_id=next_token_for([1, 2]))
    cache = SimulatedCache(s, 8)
    eos = s.add_request("eos", [1, 2], greedy(5), seed=0)
    ignore = s.add_request("ignore", [1, 2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), seed=0)
    ctx = s.add_request("ctx", [3, 3, 3, 3, 3, 3], greedy(5), seed=0)
    gone = s.add_request("gone", [4], greedy(5), seed=0)
    s.abort("gone")
    assert gone.finish_reason == FinishReason.ABORTED and gone.status == RequestStatus.FINISHED
    drain(s, cache)
    assert eos.finish_reason == FinishReason.STOP and len(eos.output_token_ids) == 1
    assert ignore.finish_reason == FinishReason.LENGTH and len(ignore.output_token_ids) == 5
    assert ctx.finish_reason == FinishReason.LENGTH and ctx.num_tokens == 8
    with pytest.raises(KeyError, match="unknown request_id"):
        s.abort("nope")


def next_token_for(prompt):
    return expected_output(prompt, 1)[0]


@pytest.mark.parametrize("prompt, params, match", [
    ([], greedy(4), "prompt_token_ids is empty"),
    ([5] * 512, greedy(4), "max context"),
    ([1, 200], greedy(4), r"outside \[0, 100\)"),
    ([1, 2], greedy(64 * 16), "num_blocks=8"),
])
def test_bad_requests_are_rejected_without_disturbing_others(prompt, params, match):
    s = make_scheduler(num_blocks=8)
    cache = SimulatedCache(s, 64)
    s.add_request("good", [1, 2, 3], greedy(3), seed=0)
    run_step(s, cache)
    with pytest.raises(ValueError, match=match):
        s.add_request("bad", prompt, params, seed=0)
    assert "bad" not in s.requests
    drain(s, cache)
    assert s.requests["good"].output_token_ids == expected_output([1, 2, 3], 3)


def test_request_validation_errors():
    s = make_scheduler()
    s.add_request("x", [1], greedy(1), seed=0)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request("x", [1], greedy(1), seed=0)
    with pytest.raises(TypeError, match="got a string"):
        s.add_request("y", "hello", greedy(1), seed=0)
    with pytest.raises(TypeError, match="must hold ints"):
        s.add_request("y", [1.5], greedy(1), seed=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        s.add_request("y", [1], {"temperature": 0}, seed=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_max_num_seqs_bounds_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    cache = SimulatedCache(s, 64)
    for i in range(5):
        s.add_request(f"r{i}", [i + 1] * 3, greedy(4), seed=0)
    for out, _ in drain(s, cache):
        assert len(out.scheduled) <= 2 and len(s.running) <= 2


def test_random_workloads_never_lose_a_token():
    """Random arrivals, prompt prefixes, budgets, cache and swap sizes, with multi-step
    lookahead now and then: every request's cache always holds its tokens, outputs are
    what an undisturbed run produces, and every block comes back."""
    import random

    for seed in range(60):
        rnd = random.Random(seed)
        num_blocks, num_host = rnd.randint(6, 16), rnd.choice([0, 4, 16, 64])
        s = make_scheduler(num_blocks=num_blocks, num_host_blocks=num_host, block_size=4,
                           max_num_batched_tokens=rnd.randint(1, 12), max_num_seqs=rnd.randint(1, 5),
                           enable_prefix_caching=rnd.random() < 0.7, decode_during_prefill=rnd.random() < 0.5)
        cache = SimulatedCache(s, num_host)
        shared = [rnd.randint(0, 99) for _ in range(12)]
        arrivals = sorted(rnd.randint(0, 30) for _ in range(rnd.randint(1, 8)))
        wanted, step, added = {}, 0, 0
        while added < len(arrivals) or s.has_unfinished():
            while added < len(arrivals) and arrivals[added] <= step:
                prompt = (shared[:rnd.randint(0, 12)] + [rnd.randint(0, 99) for _ in range(rnd.randint(1, 14))])[:20]
                max_tokens = rnd.randint(1, 12)
                try:
                    s.add_request(f"r{added}", prompt, greedy(max_tokens), seed=0)
                    wanted[f"r{added}"] = expected_output(prompt, max_tokens)
                except ValueError as e:  # too big for this cache: rejected up front
                    assert "num_blocks" in str(e)
                added += 1
            out = s.schedule()
            assert out.scheduled or not s.has_unfinished(), f"seed {seed}: no progress"
            cache.apply(out)
            num_steps = 1
            if (out.num_prefills == 0 and not (out.swap_out or out.swap_in or out.copies)
                    and not s.waiting and not s.swapped and rnd.random() < 0.5 and s.reserve_lookahead(out, 3)):
                num_steps = 4
            for k in range(num_steps):
                if k:  # what the engine does between the model steps of a multi-step window
                    live = [i.request for i in out.scheduled if not i.request.is_finished]
                    out = SchedulerOutput([ScheduledRequest.of(r, 1) for r in live], [], [], [], [], 0, len(live))
                cache.check_and_write(out)
                s.update(out, {i.request.request_id: next_token(i.request) for i in out.scheduled if i.samples})
            step += 1
            assert step < 3000, f"seed {seed}: did not finish"
        for rid, tokens in wanted.items():
            assert s.requests[rid].output_token_ids == tokens, f"seed {seed}, {rid}"
        assert s.device_blocks.num_free_blocks == num_blocks and s.host_blocks.num_free_blocks == num_host
