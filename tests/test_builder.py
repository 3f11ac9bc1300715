"""Host-side metadata builder: slot mapping, block tables, bucketed padding, input checks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged_attn import reference
from jax_paged_attn.builder import (
    FlashAttentionMetadataBuilder,
    ScheduledSequence,
    input_positions,
    pack_per_token,
    pad_to_bucket,
    sequence_rows,
)
from jax_paged_attn.metadata import ARRAY_FIELDS, PAD_SLOT_ID, STATIC_FIELDS, validate_metadata
from jax_paged_attn.spec import AttentionSpec

BS = 16
NUM_BLOCKS = 512


def hand_slots(seq: ScheduledSequence, block_size: int, sliding_window: int | None,
               prompt_reads_cache: bool) -> list[int]:
    """vLLM's slot mapping, one token at a time; a prompt that attends through the cache
    (chunked prefill) must cache every token, so only packed prompts skip window-dead ones."""
    skip = seq.is_prompt and sliding_window and not prompt_reads_cache
    start = max(0, seq.query_len - sliding_window) if skip else 0
    slots = []
    for pos in range(seq.context_len, seq.seq_len):
        if pos < start:
            slots.append(PAD_SLOT_ID)
        else:
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
    return slots


def random_batch(rng: np.random.Generator, num_prompts: int, num_decodes: int, *, chunked: bool = True,
                 extra_blocks: int = 0, max_len: int = 150) -> list[ScheduledSequence]:
    free = list(rng.permutation(NUM_BLOCKS))

    def table(seq_len: int) -> list[int]:
        return [int(free.pop()) for _ in range(-(-seq_len // BS) + extra_blocks)]

    seqs = []
    for _ in range(num_prompts):
        seq_len = int(rng.integers(1, max_len))
        context = int(rng.integers(0, seq_len)) if chunked else 0
        seqs.append(ScheduledSequence.prompt(seq_len, table(seq_len), context_len=context))
    for _ in range(num_decodes):
        seq_len = int(rng.integers(1, max_len))
        seqs.append(ScheduledSequence.decode(seq_len, table(seq_len)))
    return seqs


# --------------------------------------------------------------------------- slot mapping


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 24, 40])
def test_slot_mapping_matches_hand_computation(sliding_window, pad):
    rng = np.random.default_rng(0)
    builder = FlashAttentionMetadataBuilder(block_size=BS, num_blocks=NUM_BLOCKS, chunked_prefill=True,
                                            sliding_window=sliding_window, pad=pad)
    for trial in range(10):
        seqs = random_batch(rng, int(rng.integers(0, 4)), int(rng.integers(0, 5)) + 1, extra_blocks=trial % 2)
        md = builder.build_host(seqs)
        validate_metadata(md, block_size=BS, num_blocks=NUM_BLOCKS)
        want = pack_per_token(md, seqs, [hand_slots(s, BS, sliding_window, prompt_reads_cache=True) for s in seqs],
                              pad_value=PAD_SLOT_ID)
        np.testing.assert_array_equal(md.slot_mapping, want)


def test_sliding_window_prompt_example_from_vllm():
    # vLLM's comment (prompt 10, window 8, block size 4 -> [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1])
    # scaled to block size 16: prompt 40, window 32, the cyclic block table [0, 1, 0].
    builder = FlashAttentionMetadataBuilder(block_size=16, sliding_window=32, pad=False)
    md = builder.build_host([ScheduledSequence.prompt(40, [0, 1, 0])])
    want = [PAD_SLOT_ID] * 8 + list(range(8, 16)) + list(range(16, 32)) + list(range(0, 8))
    np.testing.assert_array_equal(md.slot_mapping, want)


def test_profile_run_has_only_pad_slots_and_no_block_table():
    builder = FlashAttentionMetadataBuilder(block_size=BS, num_blocks=4)
    md = builder.build_host([ScheduledSequence.prompt(100, None), ScheduledSequence.prompt(7, None)])
    assert np.all(md.slot_mapping == PAD_SLOT_ID)
    assert md.slot_mapping.shape == (128,)
    assert md.block_tables.shape == (4, 0) and not md.has_block_tables
    np.testing.assert_array_equal(md.seq_lens, [100, 7, 0, 0])
    validate_metadata(md, block_size=BS, num_blocks=4)


# --------------------------------------------------------------------------- block tables


def test_block_tables_follow_vllms_rules():
    prompts = [ScheduledSequence.prompt(20, [4, 5]), ScheduledSequence.prompt(3, [6])]
    # Without chunked prefill prompts attend to their own keys: no block table at all.
    plain = FlashAttentionMetadataBuilder(block_size=BS).build_host(prompts)
    assert plain.block_tables.shape[1] == 0 and not plain.has_block_tables
    # Chunked prefill or a prefix-cache hit (anywhere in the batch) gives full tables.
    chunked = FlashAttentionMetadataBuilder(block_size=BS, chunked_prefill=True, pad=False).build_host(prompts)
    np.testing.assert_array_equal(chunked.block_tables, [[4, 5], [6, 0]])
    hit = [ScheduledSequence.prompt(40, [1, 2, 3], context_len=32, prefix_cache_hit=True), prompts[1]]
    md = FlashAttentionMetadataBuilder(block_size=BS, pad=False).build_host(hit)
    np.testing.assert_array_equal(md.block_tables, [[1, 2, 3], [6, 0, 0]])
    np.testing.assert_array_equal(md.context_lens, [32, 0])
    np.testing.assert_array_equal(md.slot_mapping[:8], 3 * 16 + np.arange(8))


def test_sliding_window_truncates_decode_block_tables():
    builder = FlashAttentionMetadataBuilder(block_size=16, sliding_window=32, pad=False)
    table = [10, 11, 12, 13, 14, 15, 16]  # 5 used blocks for 70 tokens, 2 preallocated
    md = builder.build_host([ScheduledSequence.decode(70, table), ScheduledSequence.decode(64, [20, 21, 22, 23]),
                             ScheduledSequence.decode(20, [30, 31])])
    # 70 = 4 full blocks + 6: the window's 2 blocks plus the partial one, 32 + 6 keys.
    np.testing.assert_array_equal(md.seq_lens, [38, 32, 20])
    np.testing.assert_array_equal(md.block_tables, [[12, 13, 14], [22, 23, 0], [30, 31, 0]])
    # Slots use the untruncated position.
    np.testing.assert_array_equal(md.slot_mapping, [14 * 16 + 5, 23 * 16 + 15, 31 * 16 + 3])
    np.testing.assert_array_equal(md.context_lens, [69, 63, 19])
    assert md.max_decode_seq_len == 38


# --------------------------------------------------------------------------- padding / buckets


def test_padding_layout():
    seqs = [ScheduledSequence.prompt(20, [1, 2]), ScheduledSequence.prompt(44, [3, 4, 5], context_len=16),
            ScheduledSequence.decode(17, [6, 7]), ScheduledSequence.decode(5, [8]),
            ScheduledSequence.decode(33, [9, 10, 11])]
    md = FlashAttentionMetadataBuilder(block_size=BS, chunked_prefill=True).build_host(seqs)
    # Prefills: 2 real + 2 padding sequences own 48 -> 64 token rows; decodes: 3 -> 4.
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens, md.num_seqs) == (4, 64, 4, 8)
    np.testing.assert_array_equal(md.query_start_loc, [0, 20, 48, 56, 64, 65, 66, 67, 68])
    np.testing.assert_array_equal(md.seq_lens, [20, 44, 0, 0, 17, 5, 33, 0])
    np.testing.assert_array_equal(md.context_lens, [0, 16, 0, 0, 16, 4, 32, 0])
    assert np.all(md.slot_mapping[48:64] == PAD_SLOT_ID) and md.slot_mapping[-1] == PAD_SLOT_ID
    assert np.all(md.block_tables[[2, 3, 7]] == 0) and md.block_tables.shape == (8, 4)
    assert (md.max_query_len, md.max_decode_query_len) == (32, 1)
    assert (md.max_prefill_seq_len, md.max_decode_seq_len) == (64, 64)
    np.testing.assert_array_equal(sequence_rows(md, seqs), [0, 1, 4, 5, 6])
    positions = input_positions(md, seqs)
    np.testing.assert_array_equal(positions[20:48], np.arange(16, 44))
    np.testing.assert_array_equal(positions[64:], [16, 4, 32, 0])
    validate_metadata(md, block_size=BS)


def test_unpadded_metadata_has_vllms_values():
    seqs = [ScheduledSequence.prompt(20, [1, 2]), ScheduledSequence.prompt(40, [3, 4, 5], context_len=16),
            ScheduledSequence.decode(17, [6, 7]), ScheduledSequence.decode(5, [8])]
    md = FlashAttentionMetadataBuilder(block_size=BS, chunked_prefill=True, pad=False).build_host(seqs)
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 44, 2)
    assert (md.max_query_len, md.max_decode_query_len, md.max_prefill_seq_len, md.max_decode_seq_len) \
        == (24, 1, 40, 17)
    np.testing.assert_array_equal(md.query_start_loc, [0, 20, 44, 45, 46])
    np.testing.assert_array_equal(md.seq_start_loc, [0, 20, 60, 77, 82])
    np.testing.assert_array_equal(md.block_tables, [[1, 2, 0], [3, 4, 5], [6, 7, 0], [8, 0, 0]])


def test_bucketing_gives_few_shapes():
    rng = np.random.default_rng(1)
    builder = FlashAttentionMetadataBuilder(block_size=BS, chunked_prefill=True)

    def signature(md):
        return (tuple(getattr(md, n) for n in STATIC_FIELDS),
                tuple(getattr(md, n).shape for n in ARRAY_FIELDS))

    decode_signatures = {signature(builder.build_host(random_batch(rng, 0, n, max_len=120)))
                         for n in range(1, 65)}
    # 64 batch sizes -> 7 batch buckets, times at most 2 table widths (<= 8 blocks) for 120 tokens.
    assert len(decode_signatures) <= 14, len(decode_signatures)
    shapes = {tuple(s[1]) for s in decode_signatures}
    assert {shape[0][0] for shape in shapes} == {1, 2, 4, 8, 16, 32, 64}

    mixed = [builder.build_host(random_batch(rng, int(rng.integers(1, 5)), int(rng.integers(1, 9))))
             for _ in range(60)]
    token_counts = {md.num_prefill_tokens for md in mixed}
    assert token_counts <= {2 ** i for i in range(11)}
    assert {md.num_seqs - md.num_prefills for md in mixed} <= {1, 2, 4, 8}
    for md in mixed:
        validate_metadata(md, block_size=BS, num_blocks=NUM_BLOCKS)


def test_configurable_buckets():
    builder = FlashAttentionMetadataBuilder(block_size=BS, batch_buckets=(4, 12, 6),
                                            block_table_width_buckets=[16])
    assert builder.batch_buckets == (4, 6, 12)
    for n, want in ((1, 4), (5, 6), (7, 12), (12, 12), (13, 16), (40, 64)):
        md = builder.build_host([ScheduledSequence.decode(3, [i]) for i in range(n)])
        assert md.num_seqs == want and md.num_decode_tokens == want
        assert md.block_tables.shape[1] == 16 and md.max_decode_seq_len == 16 * BS
    assert [pad_to_bucket(n, (8, 24)) for n in (0, 1, 9, 24, 25)] == [0, 8, 24, 24, 32]
    assert [pad_to_bucket(n) for n in (0, 1, 3, 4, 5)] == [0, 1, 4, 4, 8]
    multi = FlashAttentionMetadataBuilder(block_size=BS, token_buckets=(10, 20)).build_host(
        [ScheduledSequence.decode(9, [0], query_len=3), ScheduledSequence.decode(9, [1], query_len=3)])
    # 6 speculative tokens -> 10 rows; 2 sequences fill their batch bucket, so a padding one is added.
    assert (multi.num_decode_tokens, multi.num_seqs, multi.max_decode_query_len) == (10, 4, 4)
    np.testing.assert_array_equal(multi.query_start_loc, [0, 3, 6, 8, 10])


def test_padding_does_not_change_attention():
    """Real rows of prefill and decode attention are the same with and without padding."""
    varlen_attention = jax.jit(reference.varlen_attention,
                               static_argnames=("spec", "max_seqlen_q", "max_seqlen_k"))
    paged_decode_attention = jax.jit(reference.paged_decode_attention, static_argnames=("spec",))
    rng = np.random.default_rng(2)
    heads, head_size = 2, 32
    seqs = random_batch(rng, 3, 5, max_len=70)
    k_cache = jnp.asarray(rng.standard_normal((NUM_BLOCKS, BS, heads, head_size)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((NUM_BLOCKS, BS, heads, head_size)), jnp.float32)
    spec = AttentionSpec.create(head_size, causal=True)
    queries = [rng.standard_normal((s.query_len, heads, head_size)).astype(np.float32) for s in seqs]

    def attend(pad: bool) -> np.ndarray:
        builder = FlashAttentionMetadataBuilder(block_size=BS, chunked_prefill=True, pad=pad)
        md = builder.build(seqs)
        q = np.zeros((md.num_tokens, heads, head_size), np.float32)
        starts = np.asarray(md.query_start_loc)
        for row, seq, values in zip(sequence_rows(md, seqs), seqs, queries):
            q[starts[row]:starts[row] + seq.query_len] = values
        q = jnp.asarray(q)
        pre, dec = md.prefill_metadata, md.decode_metadata
        out_prefill = varlen_attention(
            q[:md.num_prefill_tokens], k_cache, v_cache, pre.query_start_loc, pre.seq_start_loc,
            pre.block_tables, None, None, 1.0, 1.0, spec=spec, max_seqlen_q=pre.max_query_len,
            max_seqlen_k=pre.max_prefill_seq_len)
        out_decode = paged_decode_attention(
            q[md.num_prefill_tokens:][:, None], k_cache, v_cache, dec.seq_lens, dec.block_tables,
            None, 1.0, 1.0, spec=spec)[:, 0]
        out = np.concatenate([np.asarray(out_prefill), np.asarray(out_decode)])
        assert np.all(np.isfinite(out))
        return np.concatenate([out[starts[row]:starts[row] + seq.query_len]
                               for row, seq in zip(sequence_rows(md, seqs), seqs)])

    np.testing.assert_allclose(attend(True), attend(False), rtol=1e-5, atol=1e-5)


def test_build_puts_arrays_on_device():
    builder = FlashAttentionMetadataBuilder(block_size=BS)
    seqs = [ScheduledSequence.decode(4, [2])]
    md = builder.build(seqs, jax.devices()[0])
    host = builder.build_host(seqs)
    for name in ARRAY_FIELDS:
        assert isinstance(getattr(md, name), jax.Array)
        np.testing.assert_array_equal(getattr(md, name), getattr(host, name))
        assert getattr(md, name).dtype == jnp.int32


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("seqs, config, error, match", [
    ([], {}, ValueError, "sequences must not be empty"),
    ([ScheduledSequence.decode(5, [7], query_len=1)], {"num_blocks": 4}, ValueError,
     r"sequences\[0\].block_table holds block ids \[7\] outside \[0, 4\)"),
    ([ScheduledSequence.decode(5, [-1])], {}, ValueError, r"block ids \[-1\] outside \[0\)"),
    ([ScheduledSequence.decode(40, [1, 2])], {}, ValueError,
     r"sequences\[0\].block_table has 2 blocks but seq_len=40 needs 3"),
    ([ScheduledSequence(is_prompt=True, seq_len=4, context_len=0, query_len=5, block_table=[0])], {},
     ValueError, r"sequences\[0\].query_len=5 exceeds sequences\[0\].seq_len=4"),
    ([ScheduledSequence(is_prompt=False, seq_len=9, context_len=3, query_len=1, block_table=[0])], {},
     ValueError, r"context_len \+ query_len = 3 \+ 1 must equal seq_len = 9"),
    ([ScheduledSequence.decode(5, [0]), ScheduledSequence.prompt(5, [1])], {"chunked_prefill": True},
     ValueError, r"sequences\[1\] is a prompt after a decode"),
    ([ScheduledSequence.prompt(5, [0]), ScheduledSequence.decode(5, [1])], {}, ValueError,
     "needs chunked_prefill=True"),
    ([ScheduledSequence.prompt(5, [0], context_len=2)], {}, ValueError, "context_len=2 > 0"),
    ([ScheduledSequence.prompt(5, None), ScheduledSequence.prompt(5, [1])], {}, ValueError,
     r"sequences\[0\].block_table is None"),
    ([ScheduledSequence(is_prompt=False, seq_len=5, context_len=4, query_len=1)], {}, ValueError,
     "profiling run"),
    ([ScheduledSequence.prompt(5, [0], context_len=1, prefix_cache_hit=True)], {"sliding_window": 8},
     ValueError, "prefix_cache_hit is not supported with sliding_window"),
    ([ScheduledSequence(is_prompt=1, seq_len=5, context_len=0, query_len=5, block_table=[0])], {},
     TypeError, r"sequences\[0\].is_prompt must be a bool"),
    ([ScheduledSequence.decode(5, [[0]])], {}, ValueError, "must be a 1-D sequence"),
    ([ScheduledSequence.decode(0, [0])], {}, ValueError, r"sequences\[0\].seq_len must be >= 1"),
    ([ScheduledSequence.decode(5, [2 ** 28])], {}, ValueError, "beyond the int32 slot range"),
])
def test_bad_sequences_raise(seqs, config, error, match):
    builder = FlashAttentionMetadataBuilder(block_size=BS, **config)
    with pytest.raises(error, match=match):
        builder.build_host(seqs)


def test_bad_builder_config_raises():
    with pytest.raises(ValueError, match="block_size=24 must be a positive multiple of 16"):
        FlashAttentionMetadataBuilder(block_size=24)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        FlashAttentionMetadataBuilder(block_size=16, num_blocks=0)
    with pytest.raises(ValueError, match="do not fit the int32 slot mapping"):
        FlashAttentionMetadataBuilder(block_size=16, num_blocks=2 ** 28)
    with pytest.raises(TypeError, match="sliding_window must be a Python int"):
        FlashAttentionMetadataBuilder(block_size=16, sliding_window=8.5)
    with pytest.raises(ValueError, match="batch_buckets entry must be >= 1"):
        FlashAttentionMetadataBuilder(block_size=16, batch_buckets=(0, 4))
    with pytest.raises(ValueError, match="token_buckets must not be empty"):
        FlashAttentionMetadataBuilder(block_size=16, token_buckets=())
    with pytest.raises(TypeError, match="chunked_prefill must be a bool"):
        FlashAttentionMetadataBuilder(block_size=16, chunked_prefill=1)
    with pytest.raises(TypeError, match="sequences must be a sequence of ScheduledSequence"):
        FlashAttentionMetadataBuilder(block_size=16).build_host(ScheduledSequence.decode(3, [0]))
    md = FlashAttentionMetadataBuilder(block_size=16).build_host([ScheduledSequence.decode(3, [0])])
    with pytest.raises(ValueError, match=r"values\[0\] must have query_len = 1 entries"):
        pack_per_token(md, [ScheduledSequence.decode(3, [0])], [[1, 2]])


# --------------------------------------------------------------------------- block ownership


def test_sequences_may_share_blocks_they_only_read():
    # Prefix caching: two prompts share their two full, cached prompt blocks (7, 8) and
    # write their own third block; a decode shares them too.
    builder = FlashAttentionMetadataBuilder(block_size=BS, num_blocks=NUM_BLOCKS, chunked_prefill=True)
    shared = [7, 8]
    md = builder.build_host([
        ScheduledSequence.prompt(40, shared + [9], context_len=32, prefix_cache_hit=True),
        ScheduledSequence.prompt(36, shared + [10], context_len=32, prefix_cache_hit=True),
        ScheduledSequence.decode(33, shared + [11]),
    ])
    validate_metadata(md, num_blocks=NUM_BLOCKS)
    written = md.slot_mapping[md.slot_mapping >= 0] // BS
    assert set(written.tolist()) == {9, 10, 11}


@pytest.mark.parametrize("seqs,match", [
    # The same block given to two sequences that both write it (even in different rows).
    ([ScheduledSequence.decode(20, [3, 5]), ScheduledSequence.decode(18, [4, 5])],
     r"sequences\[0\] and sequences\[1\] both write block 5 in this step \(slots 83 and 81\)"),
    ([ScheduledSequence.decode(20, [3, 5]), ScheduledSequence.decode(20, [4, 5])],
     r"sequences\[0\] and sequences\[1\] both write block 5 in this step \(slot 83\)"),
    # A block one sequence writes while another reads it (a shared block not copied first).
    ([ScheduledSequence.decode(20, [3, 5]), ScheduledSequence.decode(40, [5, 6, 7])],
     r"block 5 is written by sequences\[0\] in this step \(slot 83\) and is also entry 0 of "
     r"sequences\[1\]\.block_table"),
    # One block twice in one sequence's table (even past what the step touches).
    ([ScheduledSequence.decode(20, [3, 4, 3])],
     r"sequences\[0\]\.block_table holds block 3 more than once \(entries \[0, 2\]\)"),
])
def test_a_block_given_to_two_owners_is_rejected(seqs, match):
    builder = FlashAttentionMetadataBuilder(block_size=BS, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match=match):
        builder.build_host(seqs)


def test_sliding_window_tables_may_repeat_blocks_but_not_write_a_slot_twice():
    builder = FlashAttentionMetadataBuilder(block_size=16, sliding_window=32, pad=False)
    # vLLM's cyclic table [0, 1, 0] (see above) and one null block (0) for the blocks
    # that left the window: both legitimate.
    builder.build_host([ScheduledSequence.prompt(40, [0, 1, 0])])
    builder.build_host([ScheduledSequence.decode(70, [0, 0, 12, 13, 14])])
    # A prompt read through the cache (chunked prefill) caches all its 64 tokens: through
    # a cyclic table of 2 blocks, positions 0 and 32 would land in the same slot.
    chunked = FlashAttentionMetadataBuilder(block_size=16, sliding_window=32, pad=False, chunked_prefill=True)
    with pytest.raises(ValueError, match=r"sequences\[0\] writes slot 0 more than once in this step "
                                         r"\(its block_table repeats block 0\)"):
        chunked.build_host([ScheduledSequence.prompt(64, [0, 1, 0, 1])])
