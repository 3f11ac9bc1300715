"""Host-side block allocator: free list, reference counts, prefix cache, copy-on-write."""
import pytest

from jax_paged_attn.engine.block_allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens


def test_allocate_and_free_round_trip():
    alloc = BlockAllocator(4, 16)
    blocks = alloc.allocate_many(4)
    assert sorted(blocks) == [0, 1, 2, 3]
    assert alloc.num_free_blocks == 0
    assert all(alloc.ref_count(b) == 1 for b in blocks)
    with pytest.raises(NoFreeBlocksError, match="no free device block"):
        alloc.allocate()
    alloc.free(blocks[2])
    assert alloc.num_free_blocks == 1
    assert alloc.allocate() == blocks[2]


def test_allocate_many_is_all_or_nothing():
    alloc = BlockAllocator(3, 16)
    alloc.allocate()
    with pytest.raises(NoFreeBlocksError, match="need 3 free device blocks, only 2"):
        alloc.allocate_many(3)
    assert alloc.num_free_blocks == 2


def test_double_free_and_bad_ids_raise():
    alloc = BlockAllocator(2, 16, name="host")
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(ValueError, match="double free of host block 0"):
        alloc.free(block)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        alloc.free(5)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        alloc.ref_count(-1)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.incref(1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)


def test_refcounts_share_and_release():
    alloc = BlockAllocator(2, 16)
    block = alloc.allocate()
    alloc.incref(block)
    alloc.incref(block)
    assert alloc.ref_count(block) == 3 and alloc.is_shared(block)
    alloc.free(block)
    alloc.free(block)
    assert alloc.ref_count(block) == 1 and not alloc.is_shared(block)
    assert alloc.num_free_blocks == 1
    alloc.free(block)
    assert alloc.num_free_blocks == 2


def test_prefix_cache_lookup_shares_and_survives_free_until_evicted():
    alloc = BlockAllocator(2, 4)
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1  # the parent chains the prefix in
    block = alloc.allocate()
    assert alloc.register(block, h0, [1, 2, 3, 4], parent_block=None)
    assert not alloc.register(alloc.allocate(), h0, [1, 2, 3, 4], parent_block=None)  # cached elsewhere
    assert alloc.lookup(h0, [1, 2, 3, 4], parent_block=None) == block and alloc.ref_count(block) == 2
    assert alloc.lookup(h1, [5, 6, 7, 8], parent_block=block) is None
    alloc.free(block)
    alloc.free(block)
    # Unreferenced but cached: counted free, still found by hash.
    assert alloc.num_free_blocks == 1 and alloc.contains(h0)
    assert alloc.lookup(h0, [1, 2, 3, 4], parent_block=None) == block and alloc.ref_count(block) == 1
    alloc.free(block)
    # Allocating with no plain free block evicts it and forgets its hash.
    assert alloc.allocate() == block
    assert not alloc.contains(h0) and alloc.lookup(h0, [1, 2, 3, 4], parent_block=None) is None


def test_prefix_cache_hit_needs_equal_tokens_and_the_same_parent_content():
    alloc = BlockAllocator(6, 2)
    digest = b"every block collides"
    first, second = alloc.allocate(), alloc.allocate()
    assert alloc.register(first, digest, [1, 2], parent_block=None)
    # Other tokens, or the same tokens at another place in the sequence: a miss, no reference.
    assert alloc.lookup(digest, [3, 4], parent_block=None) is None
    assert alloc.lookup(digest, [1, 2], parent_block=second) is None
    assert alloc.lookup(digest, [1, 2], parent_block=first) is None
    assert alloc.ref_count(first) == 1
    # A child is found only after the very content it was registered after.
    child = alloc.allocate()
    assert alloc.register(child, b"child", [5, 6], parent_block=first)
    assert alloc.lookup(b"child", [5, 6], parent_block=first) == child
    assert not alloc.register(alloc.allocate(), b"orphan", [7, 8], parent_block=second)  # uncached parent
    # Once the parent's block is evicted and reused, its old children no longer match it.
    alloc.free_many([first, child, child])
    refilled = [alloc.allocate() for _ in range(3)]
    assert first in refilled and not alloc.contains(digest)
    assert alloc.register(first, digest, [1, 2], parent_block=None)
    assert alloc.lookup(b"child", [5, 6], parent_block=first) is None


def test_children_of_a_block_computed_twice_are_still_registered():
    alloc = BlockAllocator(4, 2)
    cached, twin = alloc.allocate(), alloc.allocate()
    d0 = hash_block_tokens(None, [1, 2])
    assert alloc.register(cached, d0, [1, 2], parent_block=None)
    assert not alloc.register(twin, d0, [1, 2], parent_block=None)  # same content, already cached
    child = alloc.allocate()
    d1 = hash_block_tokens(d0, [3, 4])
    assert alloc.register(child, d1, [3, 4], parent_block=twin)
    assert alloc.lookup(d1, [3, 4], parent_block=cached) == child


def test_prefix_caching_disabled_never_shares():
    alloc = BlockAllocator(2, 4, enable_prefix_caching=False)
    block = alloc.allocate()
    digest = hash_block_tokens(None, [1, 2, 3, 4])
    assert not alloc.register(block, digest, [1, 2, 3, 4], parent_block=None)
    assert alloc.lookup(digest, [1, 2, 3, 4], parent_block=None) is None


def test_copy_on_write():
    alloc = BlockAllocator(3, 16)
    block = alloc.allocate()
    # Private and uncached: written in place.
    assert alloc.cow(block) == (block, None)
    # Shared: the writer gets a fresh block and must copy.
    alloc.incref(block)
    new_block, copy = alloc.cow(block)
    assert new_block != block and copy == (block, new_block)
    assert alloc.ref_count(block) == 1 and alloc.ref_count(new_block) == 1
    # Cached content is copied even with one holder, so the hash stays truthful.
    digest = hash_block_tokens(None, range(16))
    assert alloc.register(block, digest, range(16), parent_block=None)
    newer, copy = alloc.cow(block)
    assert copy == (block, newer) and alloc.contains(digest) and alloc.ref_count(block) == 0
    # No room for the copy.
    full = BlockAllocator(1, 16)
    b = full.allocate()
    full.incref(b)
    with pytest.raises(NoFreeBlocksError):
        full.cow(b)
    assert full.ref_count(b) == 2
