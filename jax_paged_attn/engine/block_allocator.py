"""Host-side bookkeeping of KV-cache blocks: free list, reference counts, prefix sharing.

The paged KV cache (`jax_paged_attn.cache`) is an array of ``num_blocks`` blocks of
``block_size`` token slots each. Which block holds which tokens is decided here, on the
host, in plain Python; the device only ever sees the resulting block tables, slot
mappings and (src, dst) block lists for `copy_blocks` / `swap_blocks`.

* `BlockAllocator` hands out block ids from a free list and counts references. A block
  is shared when several sequences point at it (same prompt prefix); it is returned to
  the free list when its last reference is dropped.
* Prefix sharing: a *full* block whose tokens (and every token before it) are known
  gets a content digest (`hash_block_tokens`, SHA-256 chained over the previous block's
  digest). `BlockAllocator.register` records it with the block's tokens and its parent
  block; `BlockAllocator.lookup` lets a new sequence with the same prefix take a
  reference instead of recomputing. A hit is exact, not just probable: the digest only
  finds a candidate, whose tokens and parent are then compared with the request's, so
  even colliding digests never share another prefix's keys and values (sharing them
  would let one user's crafted prompt attend over another user's cache). A cached
  block whose last reference is dropped is kept (still findable) until the free list
  runs dry and it is evicted, least recently used first.
* Copy-on-write: `BlockAllocator.cow` gives a sequence that is about to write into a
  shared block its own copy; the caller must run ``copy_blocks`` with the returned
  ``(src, dst)`` pair before the write.

Errors: freeing a block that is not in use (double free), an id outside the cache, or
allocating from an exhausted cache raise clear exceptions (`ValueError`,
`NoFreeBlocksError`).
"""
from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import itertools
from typing import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockAllocator.allocate` when every block is in use."""


_ROOT_DIGEST = bytes(32)  # the parent digest of an unsalted sequence's first block


def root_digest(cache_salt: str | None) -> bytes | None:
    """The parent digest of a sequence's first block: None (`_ROOT_DIGEST`) without a
    salt, else a digest of the salt, so that salted requests' blocks are found only by
    requests with the same salt (`SamplingParams.cache_salt`)."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"jax_paged_attn cache_salt\0" + cache_salt.encode()).digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 digest of one full block: its tokens and (through ``parent_hash``) all before it.

    ``parent_hash`` is the previous block's digest (for a sequence's first block
    `root_digest` of its salt: None without one);
    the tokens enter as little-endian int64s. The digest is what the prefix cache is
    keyed by; `BlockAllocator.lookup` still compares a candidate's tokens and parent, so
    correctness never rests on the digest being collision-free. Cost on the host: about
    2 us per 16-token block, 0.3 ms for a 2048-token prompt (128 blocks), the same as the
    64-bit tuple hash it replaces (CPython 3.11, one core).
    """
    parent = _ROOT_DIGEST if parent_hash is None else parent_hash
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


@dataclasses.dataclass(frozen=True)
class _CachedContent:
    """What a registered block holds. ``content_id`` is never reused, so a child that
    names its parent's content id names that exact content, not whatever block id or
    digest happens to match later."""

    digest: bytes
    token_ids: tuple[int, ...]
    parent_content_id: int | None
    content_id: int
    cache_salt: str | None = None  # a first block's salt (later blocks inherit it through their parent)


class BlockAllocator:
    """Free list and reference counts of ``num_blocks`` blocks, with prefix caching.

    Args:
      num_blocks: number of blocks this allocator manages (ids ``0 .. num_blocks-1``).
      block_size: token slots per block (used only to describe the cache in messages).
      name: "device" or "host", used in error messages.
      enable_prefix_caching: keep hashes of full blocks so they can be shared.
    """

    def __init__(self, num_blocks: int, block_size: int, *, name: str = "device",
                 enable_prefix_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}.")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.name = name
        self.enable_prefix_caching = enable_prefix_caching
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # Prefix cache: digest -> block id, and what each registered block holds, for
        # blocks whose KV is computed.
        self._block_by_hash: dict[bytes, int] = {}
        self._content_of_block: dict[int, _CachedContent] = {}
        # Blocks holding exactly a registered block's content that were not registered
        # themselves (computed twice at once): their children can still be registered.
        self._duplicate_content_id: dict[int, int] = {}
        self._content_ids = itertools.count()
        # Cached blocks with no reference left, evicted least recently used first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now (free plus evictable cached blocks)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_shared(self, block_id: int) -> bool:
        return self.ref_count(block_id) > 1

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds registered prefix-cache content (writing it needs a copy)."""
        self._check_id(block_id)
        return block_id in self._content_of_block

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free_blocks

    # ------------------------------------------------------------- allocation
    def allocate(self) -> int:
        """Takes one block (reference count 1). Raises `NoFreeBlocksError` when none is left."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_content(block_id)
        else:
            raise NoFreeBlocksError(
                f"no free {self.name} block: all {self.num_blocks} blocks of {self.block_size} "
                f"tokens are in use."
            )
        self._ref_counts[block_id] = 1
        return block_id

    def allocate_many(self, count: int) -> list[int]:
        """Takes ``count`` blocks at once, or none (raises `NoFreeBlocksError`) if they do not fit."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}.")
        if not self.can_allocate(count):
            raise NoFreeBlocksError(
                f"need {count} free {self.name} blocks, only {self.num_free_blocks} of "
                f"{self.num_blocks} are free."
            )
        return [self.allocate() for _ in range(count)]

    def incref(self, block_id: int) -> None:
        """Adds a reference to a block that is in use (sharing it)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot share {self.name} block {block_id}: it is not allocated.")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drops one reference; the block becomes free (or evictable, if cached) at zero."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"double free of {self.name} block {block_id}: it is not allocated.")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._duplicate_content_id.pop(block_id, None)
            if block_id in self._content_of_block:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def free_many(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.free(block_id)

    # ---------------------------------------------------------- prefix cache
    def lookup(self, block_hash: bytes, token_ids: Sequence[int], parent_block: int | None,
               cache_salt: str | None = None) -> int | None:
        """Returns a computed block holding these tokens after ``parent_block``, taking a
        reference, or None.

        ``parent_block`` is the block this lookup's sequence holds just before (the
        previous hit; None for a sequence's first block). The candidate found by
        ``block_hash`` counts only when its tokens equal ``token_ids`` and it was
        registered after that very parent content (a first block: with the same
        ``cache_salt``).
        """
        if not self.enable_prefix_caching:
            return None
        block_id = self._block_by_hash.get(block_hash)
        if block_id is None:
            return None
        content = self._content_of_block[block_id]
        parent_content_id = self._parent_content_id(parent_block)
        if parent_block is not None and parent_content_id is None:
            return None
        if content.token_ids != tuple(token_ids) or content.parent_content_id != parent_content_id:
            return None
        if parent_block is None and content.cache_salt != cache_salt:
            return None
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1
        return block_id

    def contains(self, block_hash: bytes) -> bool:
        return self.enable_prefix_caching and block_hash in self._block_by_hash

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int],
                 parent_block: int | None, cache_salt: str | None = None) -> bool:
        """Marks a full, computed block as holding ``token_ids`` (digest ``block_hash``)
        right after the content of ``parent_block`` (None: the sequence's first block,
        of a sequence salted with ``cache_salt``).

        Returns False (and changes nothing findable) when prefix caching is off, another
        block already holds that digest, this block already holds content, or the parent
        block holds no registered content (its children could never be checked).
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot register {self.name} block {block_id}: it is not allocated.")
        if not self.enable_prefix_caching or block_id in self._content_of_block:
            return False
        parent_content_id = self._parent_content_id(parent_block)
        if parent_block is not None and parent_content_id is None:
            return False
        token_ids = tuple(int(t) for t in token_ids)
        salt = cache_salt if parent_block is None else None
        holder = self._block_by_hash.get(block_hash)
        if holder is not None:
            held = self._content_of_block[holder]
            if held.token_ids == token_ids and held.parent_content_id == parent_content_id and held.cache_salt == salt:
                self._duplicate_content_id[block_id] = held.content_id
            return False
        self._block_by_hash[block_hash] = block_id
        self._content_of_block[block_id] = _CachedContent(
            block_hash, token_ids, parent_content_id, next(self._content_ids), salt)
        return True

    def _parent_content_id(self, parent_block: int | None) -> int | None:
        if parent_block is None:
            return None
        content = self._content_of_block.get(parent_block)
        if content is not None:
            return content.content_id
        return self._duplicate_content_id.get(parent_block)

    def cow(self, block_id: int) -> tuple[int, tuple[int, int] | None]:
        """Copy-on-write: makes ``block_id`` safe for one holder to write.

        Returns ``(writable_block, copy)``. When the block has one reference and no
        cached content it is returned as is with ``copy=None``. Otherwise a fresh block
        replaces the caller's reference and ``copy=(block_id, new_block)`` must be
        applied with ``copy_blocks`` before writing. A cached block (registered hash)
        is copied too, even with one reference: its content must stay what its hash
        says. Raises `NoFreeBlocksError` when no block is free for the copy.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot write {self.name} block {block_id}: it is not allocated.")
        if self._ref_counts[block_id] == 1 and block_id not in self._content_of_block:
            return block_id, None
        new_block = self.allocate()
        self.free(block_id)
        return new_block, (block_id, new_block)

    def _forget_content(self, block_id: int) -> None:
        content = self._content_of_block.pop(block_id, None)
        if content is not None:
            del self._block_by_hash[content.digest]

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"{self.name} block id {block_id!r} is outside [0, {self.num_blocks}).")
