"""FlashAttentionMetadata: pytree behaviour under jit, the prefill/decode views, advance_step."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence
from jax_paged_attn.metadata import (
    ARRAY_FIELDS,
    PAD_SLOT_ID,
    STATIC_FIELDS,
    FlashAttentionMetadata,
    advance_step,
    decode_metadata,
    prefill_metadata,
    validate_metadata,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 256


def assert_metadata_equal(got: FlashAttentionMetadata, want: FlashAttentionMetadata) -> None:
    for name in STATIC_FIELDS:
        assert getattr(got, name) == getattr(want, name), name
    for name in ARRAY_FIELDS:
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert g.shape == w.shape, (name, g.shape, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)


def mixed_batch() -> list[ScheduledSequence]:
    """Two prefills (one a chunk with cached context) and three decodes."""
    return [
        ScheduledSequence.prompt(20, [1, 2]),
        ScheduledSequence.prompt(40, [3, 4, 5], context_len=16),
        ScheduledSequence.decode(17, [6, 7]),
        ScheduledSequence.decode(5, [8]),
        ScheduledSequence.decode(33, [9, 10, 11]),
    ]


def mixed_metadata(pad: bool = True) -> FlashAttentionMetadata:
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                            chunked_prefill=True, pad=pad)
    return builder.build(mixed_batch())


# --------------------------------------------------------------------------- pytree


def test_tree_flatten_unflatten_round_trip():
    md = mixed_metadata()
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert len(leaves) == len(ARRAY_FIELDS)
    for leaf, name in zip(leaves, ARRAY_FIELDS):
        assert leaf is getattr(md, name)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt, FlashAttentionMetadata)
    assert_metadata_equal(rebuilt, md)
    # Static fields live in the treedef: same counts, same structure.
    assert jax.tree_util.tree_structure(mixed_metadata()) == treedef
    other = dataclasses.replace(md, max_query_len=md.max_query_len * 2)
    assert jax.tree_util.tree_structure(other) != treedef
    doubled = jax.tree_util.tree_map(lambda x: x * 2, md)
    np.testing.assert_array_equal(doubled.seq_lens, np.asarray(md.seq_lens) * 2)
    assert doubled.num_prefills == md.num_prefills


def test_jit_argument_and_output_and_trace_count():
    traces = []

    @jax.jit
    def shift(md: FlashAttentionMetadata, delta: jax.Array) -> FlashAttentionMetadata:
        traces.append(md.num_prefills)
        return dataclasses.replace(md, seq_lens=md.seq_lens + delta)

    md = mixed_metadata()
    out = shift(md, jnp.int32(1))
    assert isinstance(out, FlashAttentionMetadata)
    np.testing.assert_array_equal(out.seq_lens, np.asarray(md.seq_lens) + 1)
    for name in STATIC_FIELDS:
        assert getattr(out, name) == getattr(md, name)
    # New values with the same static fields reuse the compiled program ...
    shift(jax.tree_util.tree_map(lambda x: x + 3, md), jnp.int32(2))
    assert len(traces) == 1
    # ... a different static field compiles again.
    shift(dataclasses.replace(md, max_prefill_seq_len=md.max_prefill_seq_len * 2), jnp.int32(1))
    assert len(traces) == 2


def test_views_under_jit_match_eager_views():
    md = mixed_metadata()

    @jax.jit
    def views(m):
        return m.prefill_metadata, m.decode_metadata

    jit_prefill, jit_decode = views(md)
    assert_metadata_equal(jit_prefill, prefill_metadata(md))
    assert_metadata_equal(jit_decode, decode_metadata(md))


def test_static_fields_are_normalized_and_checked():
    md = mixed_metadata()
    same = dataclasses.replace(md, num_prefills=np.int64(md.num_prefills))
    assert type(same.num_prefills) is int
    assert jax.tree_util.tree_structure(same) == jax.tree_util.tree_structure(md)
    with pytest.raises(TypeError, match="metadata.max_query_len"):
        dataclasses.replace(md, max_query_len=2.0)
    with pytest.raises(TypeError, match="metadata.num_prefills"):
        dataclasses.replace(md, num_prefills=True)
    with pytest.raises(ValueError, match="metadata.num_decode_tokens"):
        dataclasses.replace(md, num_decode_tokens=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_prefills = 0  # type: ignore[misc]


# --------------------------------------------------------------------------- views


def test_views_equal_vllms_slicing():
    md = mixed_metadata()
    p, tp = md.num_prefills, md.num_prefill_tokens
    host = {name: np.asarray(getattr(md, name)) for name in ARRAY_FIELDS}

    prefill = md.prefill_metadata
    assert (prefill.num_prefills, prefill.num_prefill_tokens, prefill.num_decode_tokens) == (p, tp, 0)
    assert (prefill.max_query_len, prefill.max_prefill_seq_len) == (md.max_query_len, md.max_prefill_seq_len)
    assert (prefill.max_decode_query_len, prefill.max_decode_seq_len) == (0, 0)
    np.testing.assert_array_equal(prefill.slot_mapping, host["slot_mapping"][:tp])
    np.testing.assert_array_equal(prefill.seq_lens, host["seq_lens"][:p])
    np.testing.assert_array_equal(prefill.query_start_loc, host["query_start_loc"][:p + 1])
    np.testing.assert_array_equal(prefill.seq_start_loc, host["seq_start_loc"][:p + 1])
    np.testing.assert_array_equal(prefill.context_lens, host["context_lens"][:p])
    np.testing.assert_array_equal(prefill.block_tables, host["block_tables"][:p])

    decode = md.decode_metadata
    assert (decode.num_prefills, decode.num_prefill_tokens) == (0, 0)
    assert decode.num_decode_tokens == md.num_decode_tokens
    assert (decode.max_decode_query_len, decode.max_decode_seq_len) == (md.max_decode_query_len,
                                                                          md.max_decode_seq_len)
    assert decode.max_prefill_seq_len == 0
    np.testing.assert_array_equal(decode.slot_mapping, host["slot_mapping"][tp:])
    np.testing.assert_array_equal(decode.seq_lens, host["seq_lens"][p:])
    np.testing.assert_array_equal(decode.block_tables, host["block_tables"][p:])
    np.testing.assert_array_equal(decode.context_lens, host["context_lens"][p:])
    # vLLM's slices, rebased to start at 0 (documented difference).
    qsl, ssl = host["query_start_loc"][p:], host["seq_start_loc"][p:]
    np.testing.assert_array_equal(decode.query_start_loc, qsl - qsl[0])
    np.testing.assert_array_equal(decode.seq_start_loc, ssl - ssl[0])
    assert qsl[0] == tp  # decode rows start right after the prefill rows
    validate_metadata(prefill, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    validate_metadata(decode, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


def test_views_are_none_without_prefills_or_decodes():
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE)
    decode_only = builder.build([ScheduledSequence.decode(9, [0]), ScheduledSequence.decode(3, [1])])
    assert decode_only.prefill_metadata is None
    assert_metadata_equal(decode_only.decode_metadata, decode_only)
    prompts_only = builder.build([ScheduledSequence.prompt(9, [0])])
    assert prompts_only.decode_metadata is None
    assert_metadata_equal(prompts_only.prefill_metadata, prompts_only)


def test_validate_metadata_reports_inconsistencies():
    md = mixed_metadata()
    validate_metadata(md, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    host = jax.tree_util.tree_map(np.asarray, md)
    bad_ssl = host.seq_start_loc.copy()
    bad_ssl[-1] += 1
    with pytest.raises(ValueError, match="seq_start_loc"):
        validate_metadata(dataclasses.replace(host, seq_start_loc=bad_ssl))
    with pytest.raises(ValueError, match="max_decode_seq_len"):
        validate_metadata(dataclasses.replace(host, max_decode_seq_len=20))
    with pytest.raises(ValueError, match="slot_mapping"):
        validate_metadata(host, block_size=BLOCK_SIZE, num_blocks=8)
    with pytest.raises(ValueError, match="metadata.slot_mapping must have shape"):
        validate_metadata(dataclasses.replace(host, slot_mapping=host.slot_mapping[:-1]))
    with pytest.raises(TypeError, match="metadata.block_tables must be an integer array"):
        validate_metadata(dataclasses.replace(host, block_tables=host.block_tables.astype(np.float32)))
    with pytest.raises(ValueError, match="block_size=8 disagrees with metadata.block_size=16"):
        validate_metadata(host, block_size=8)
    with pytest.raises(ValueError, match="only 4 columns"):  # metadata of unknown block size
        validate_metadata(dataclasses.replace(host, block_size=None), block_size=8)
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\]"):
        qsl = host.query_start_loc.copy()
        qsl[-1] -= 1
        validate_metadata(dataclasses.replace(host, query_start_loc=qsl))


def test_validate_metadata_refuses_a_slot_outside_its_sequences_block_table():
    host = jax.tree_util.tree_map(np.asarray, mixed_metadata())
    qsl = host.query_start_loc
    # Token 0 of prefill 1 (a chunk at position 16), the decode of 17 tokens, and a padding token.
    chunk_row, decode_row, padding_row = int(qsl[1]), int(qsl[2]), int(qsl[-1]) - 1
    assert host.slot_mapping[chunk_row] == 4 * 16 and host.slot_mapping[padding_row] == PAD_SLOT_ID
    cases = {
        chunk_row: 200 * 16,  # in range, in nobody's block table
        decode_row: 1 * 16 + 3,  # prefill 0's block
        chunk_row + 1: 3 * 16 + 1,  # its own table's block for another position
    }
    for row, slot in cases.items():
        slots = host.slot_mapping.copy()
        slots[row] = slot
        with pytest.raises(ValueError, match=rf"metadata.slot_mapping\[{row}\] = {slot}"):
            validate_metadata(dataclasses.replace(host, slot_mapping=slots), num_blocks=NUM_BLOCKS)
    # Padding slots stay allowed anywhere, and so does a token the window skips.
    slots = host.slot_mapping.copy()
    slots[chunk_row] = PAD_SLOT_ID
    validate_metadata(dataclasses.replace(host, slot_mapping=slots))


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_builder_metadata_passes_the_slot_and_block_table_check(sliding_window):
    sequences = [
        ScheduledSequence.prompt(50, [1, 2, 3, 4], context_len=20),
        ScheduledSequence.prompt(30, [5, 6]),
        ScheduledSequence.decode(70, [10, 11, 12, 13, 14, 15, 16]),  # truncated by a window
        ScheduledSequence.decode(33, [17, 18, 19], query_len=3),
        ScheduledSequence.decode(16, [20]),
    ]
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, chunked_prefill=True,
                                            sliding_window=sliding_window)
    md = builder.build_host(sequences)
    validate_metadata(md, num_blocks=NUM_BLOCKS)
    hit = [ScheduledSequence.prompt(40, [1, 2, 3], context_len=32, prefix_cache_hit=True),
           ScheduledSequence.prompt(20, [6, 7])]
    validate_metadata(FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE).build_host(hit))


# --------------------------------------------------------------------------- advance_step


def decode_batch(seq_lens, lookahead_tokens: int, rng: np.random.Generator):
    """Decode sequences whose block tables already hold the blocks of the steps ahead."""
    free = list(rng.permutation(NUM_BLOCKS))
    tables = []
    for n in seq_lens:
        needed = -(-(n + lookahead_tokens) // BLOCK_SIZE)
        tables.append([int(free.pop()) for _ in range(needed)])
    return tables


def test_advance_step_matches_rebuilding_every_step_and_compiles_once():
    rng = np.random.default_rng(0)
    seq_lens = [1, 15, 16, 17, 40]  # crosses block boundaries at different steps
    steps = 40
    tables = decode_batch(seq_lens, steps + 1, rng)
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    md = builder.build([ScheduledSequence.decode(n, t) for n, t in zip(seq_lens, tables)])
    assert md.num_seqs == 8  # 5 real sequences padded to the batch bucket

    traces = []

    def step(m, sampled):
        traces.append(1)
        return advance_step(m, sampled, block_size=BLOCK_SIZE, num_queries=len(seq_lens))

    step = jax.jit(step)
    lens = list(seq_lens)
    for s in range(steps):
        sampled = jnp.asarray(rng.integers(0, 1000, size=len(seq_lens)), jnp.int32)
        md, tokens, positions = step(md, sampled)
        want_positions = np.array(lens + [0] * 3)
        lens = [n + 1 for n in lens]
        rebuilt = builder.build_host([ScheduledSequence.decode(n, t) for n, t in zip(lens, tables)])
        assert_metadata_equal(md, rebuilt)
        np.testing.assert_array_equal(tokens, np.concatenate([np.asarray(sampled), [0, 0, 0]]))
        np.testing.assert_array_equal(positions, want_positions)
    assert len(traces) == 1
    validate_metadata(md, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


def test_advance_step_unpadded_metadata_grows_max_decode_seq_len():
    rng = np.random.default_rng(1)
    seq_lens = [3, 30]
    tables = decode_batch(seq_lens, 5, rng)
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, pad=False)
    md = builder.build([ScheduledSequence.decode(n, t) for n, t in zip(seq_lens, tables)])
    for step in range(1, 4):
        md, _, _ = advance_step(md, jnp.arange(2, dtype=jnp.int32), block_size=BLOCK_SIZE, num_queries=2)
        rebuilt = builder.build_host([ScheduledSequence.decode(n + step, t) for n, t in zip(seq_lens, tables)])
        assert_metadata_equal(md, rebuilt)
        assert md.max_decode_seq_len == 30 + step


def test_advance_step_padding_and_finished_sequences():
    """Rows at or past num_queries keep their lengths, get PAD slots, token 0, position 0."""
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE)
    md = builder.build([ScheduledSequence.decode(5, [3]), ScheduledSequence.decode(16, [4, 7]),
                        ScheduledSequence.decode(9, [2])])
    new, tokens, positions = advance_step(md, jnp.asarray([[11], [12]], jnp.int32),
                                          block_size=BLOCK_SIZE, num_queries=2)
    np.testing.assert_array_equal(new.seq_lens, [6, 17, 9, 0])
    np.testing.assert_array_equal(new.context_lens, [5, 16, 8, 0])
    np.testing.assert_array_equal(new.slot_mapping, [3 * 16 + 5, 7 * 16 + 0, PAD_SLOT_ID, PAD_SLOT_ID])
    np.testing.assert_array_equal(new.seq_start_loc, [0, 6, 23, 32, 32])
    np.testing.assert_array_equal(new.query_start_loc, md.query_start_loc)
    np.testing.assert_array_equal(tokens, [11, 12, 0, 0])
    np.testing.assert_array_equal(positions, [5, 16, 0, 0])


def test_advance_step_traced_num_queries_compiles_once():
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE)
    md = builder.build([ScheduledSequence.decode(n, [n % 7, 8]) for n in (4, 10, 2)])
    traces = []

    @jax.jit
    def step(m, sampled, n):
        traces.append(1)
        return advance_step(m, sampled, block_size=BLOCK_SIZE, num_queries=n)

    sampled = jnp.asarray([7, 8, 9, 10], jnp.int32)  # one row per padded sequence
    for n in (3, 2, 0):
        new, tokens, _ = step(md, sampled, jnp.int32(n))
        want = advance_step(md, sampled, block_size=BLOCK_SIZE, num_queries=n)
        assert_metadata_equal(new, want[0])
        np.testing.assert_array_equal(tokens, want[1])
    assert len(traces) == 1


def test_advance_step_block_overflow():
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE)
    md = builder.build([ScheduledSequence.decode(16, [5])])  # the next token needs a 2nd block
    with pytest.raises(ValueError, match="only 1 columns"):
        advance_step(md, jnp.asarray([1]), block_size=BLOCK_SIZE, num_queries=1)
    # Under jit values cannot be checked: the token is not written anywhere.
    new, _, _ = jax.jit(lambda m: advance_step(m, jnp.asarray([1]), block_size=BLOCK_SIZE,
                                               num_queries=1))(md)
    assert int(new.slot_mapping[0]) == PAD_SLOT_ID


def test_advance_step_refuses_a_block_size_that_disagrees_with_the_metadata():
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    md = builder.build([ScheduledSequence.decode(20, [3, 9, 4]), ScheduledSequence.decode(5, [6, 7])])
    assert md.block_size == BLOCK_SIZE and decode_metadata(md).block_size == BLOCK_SIZE
    ids = jnp.asarray([1, 2], jnp.int32)
    # The builder records the block size statically: checked eagerly and under jit.
    with pytest.raises(ValueError, match="block_size=32 disagrees with metadata.block_size=16"):
        advance_step(md, ids, block_size=32, num_queries=2)
    with pytest.raises(ValueError, match="block_size=32 disagrees"):
        jax.jit(lambda m: advance_step(m, ids, block_size=32, num_queries=2))(md)
    # Without the static field, the slots of concrete metadata tell: with block size 32,
    # position 19 of sequence 0 would be slot 3 * 32 + 19, not the 9 * 16 + 3 it holds.
    unknown = dataclasses.replace(md, block_size=None)
    with pytest.raises(ValueError, match=r"block_size=32 does not match the metadata: "
                                         r"metadata.slot_mapping\[0\] = 147"):
        advance_step(unknown, ids, block_size=32, num_queries=2)
    with pytest.raises(ValueError, match="block_size is required"):
        advance_step(unknown, ids, num_queries=2)
    # The right size, given or taken from the metadata, advances alike.
    by_field = advance_step(md, ids, num_queries=2)
    by_argument = advance_step(unknown, ids, block_size=BLOCK_SIZE, num_queries=2)
    np.testing.assert_array_equal(by_field[0].slot_mapping, by_argument[0].slot_mapping)
    np.testing.assert_array_equal(by_field[0].slot_mapping[:2], [9 * 16 + 4, 6 * 16 + 5])


def test_advance_step_rejects_bad_inputs():
    builder = FlashAttentionMetadataBuilder(block_size=BLOCK_SIZE, chunked_prefill=True)
    decode = builder.build([ScheduledSequence.decode(5, [1]), ScheduledSequence.decode(6, [2])])
    mixed = builder.build([ScheduledSequence.prompt(5, [0]), ScheduledSequence.decode(6, [2])])
    ids = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="decode-only"):
        advance_step(mixed, ids, block_size=BLOCK_SIZE, num_queries=1)
    spec_decode = builder.build([ScheduledSequence.decode(5, [1], query_len=2)])
    with pytest.raises(ValueError, match="one query token"):
        advance_step(spec_decode, ids[:1], block_size=BLOCK_SIZE, num_queries=1)
    with pytest.raises(ValueError, match="num_queries=3 exceeds"):
        advance_step(decode, ids, block_size=BLOCK_SIZE, num_queries=3)
    with pytest.raises(ValueError, match="rows of sampled_token_ids"):
        advance_step(decode, ids[:1], block_size=BLOCK_SIZE, num_queries=2)
    with pytest.raises(ValueError, match=r"num_queries=5 must be in \[0, 2\]"):
        advance_step(decode, ids, block_size=BLOCK_SIZE, num_queries=jnp.int32(5))
    with pytest.raises(TypeError, match="sampled_token_ids must be an integer array"):
        advance_step(decode, ids.astype(jnp.float32), block_size=BLOCK_SIZE, num_queries=2)
    with pytest.raises(ValueError, match="sampled_token_ids must have shape"):
        advance_step(decode, jnp.zeros((2, 2), jnp.int32), block_size=BLOCK_SIZE, num_queries=2)
    with pytest.raises(TypeError, match="num_queries must be"):
        advance_step(decode, ids, block_size=BLOCK_SIZE, num_queries=2.0)
    with pytest.raises(TypeError, match="block_size"):
        advance_step(decode, ids, block_size=16.0, num_queries=2)
    with pytest.raises(TypeError, match="metadata must be a FlashAttentionMetadata"):
        advance_step({"seq_lens": ids}, ids, block_size=BLOCK_SIZE, num_queries=2)
