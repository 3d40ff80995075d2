"""The pool of KV cache blocks: free list, reference counts and the prefix-cache hash map.

This is the lowest of the three layers (Scheduler -> KVCacheManager -> BlockPool, as in
vLLM V1's ``vllm/v1/core/block_pool.py``).  It knows block ids, reference counts and block
hashes; it knows nothing about requests.

Block states (every block is in exactly one):
  * **free**: ``ref_cnt == 0`` and no hash; kept in a FIFO list.
  * **evictable**: ``ref_cnt == 0`` and a hash; its KV is still valid and can be reused by a
    request whose prefix hashes to it.  Kept in LRU order; evicted (hash dropped) only when
    the free list is empty (TensorRT-LLM's "KV cache block reuse" keeps reusable blocks
    over plain free ones the same way).
  * **in use**: ``ref_cnt > 0`` (one reference per block table holding it), with or
    without a hash.

Block hashes are chained: ``hash(parent_hash, token ids of the block)`` with sha256, so a
hash identifies the whole token prefix up to the end of the block (nano-vllm's
``BlockManager.compute_hash``, vLLM's ``hash_block_tokens``).  sha256 makes an accidental
collision (two different prefixes sharing KV) practically impossible.

Plain Python, no torch import.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

#: A block hash: 32 bytes of sha256 over the parent hash and the block's token ids.
BlockHash = bytes

#: Parent hash of a request's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"kiln-prefix-cache-v1").digest()


def root_hash(lora_id: int = 0) -> BlockHash:
    """Parent hash of a request's first block: ``ROOT_HASH`` for the base model, a hash of
    its own per LoRA adapter (``lora_id``, never reused), so a block computed under one
    adapter is never found for another adapter or for the base."""
    if not lora_id:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"lora" + lora_id.to_bytes(8, "little")).digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained over all earlier blocks.

    Args:
        parent_hash: hash of the previous block of the same sequence, or ``ROOT_HASH`` for
            the first block.
        token_ids: the block's token ids (exactly ``block_size`` of them; each must fit
            a signed 64-bit integer).

    Returns:
        32 bytes: sha256 of ``parent_hash`` + the token ids as native-endian int64
        (stable within a process and across runs on one architecture).
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks with ids ``0 .. num_blocks-1``.

    Units: counts are blocks.  The pool owns reference counts (one per block table holding
    a block), the free list, the LRU list of evictable cached blocks and the map from block
    hash to block id (at most one block per hash).

    Sources: vLLM V1 ``BlockPool`` (free queue + ``cached_block_hash_to_block``), nano-vllm
    ``BlockManager`` (``ref_count``, ``hash_to_block_id``), TensorRT-LLM KV block reuse
    (reusable blocks outlive their requests until evicted).
    """

    def __init__(self, num_blocks: int) -> None:
        """Create the pool with every block free.

        Raises:
            ValueError: if ``num_blocks < 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Per block: number of block tables holding it.
        self.ref_cnt: list[int] = [0] * num_blocks
        # Per block: its hash once it is full and registered in the prefix cache, else None.
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks without a hash, allocated first (FIFO).
        self._free: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks with a hash, least recently freed first (LRU eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Prefix cache: hash -> the block holding that prefix's KV.
        self._cached: dict[BlockHash, int] = {}

    # ---- counts ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now (free + evictable cached), in blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks that still hold reusable cached KV, in blocks."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one block table, in blocks."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable), in blocks."""
        return len(self._cached)

    # ---- prefix cache ---------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Block id holding the prefix with this hash, or None.  Does not touch it."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, in-use block under ``block_hash``.

        Returns:
            True if the block now maps from the hash; False if another block already holds
            that prefix (the block then stays uncached and is freed normally; never two
            blocks per hash).

        Raises:
            ValueError: if the block is not in use or already carries a different hash.
        """
        if self.ref_cnt[block_id] <= 0:
            raise ValueError(f"cache_block: block {block_id} is not in use (ref_cnt {self.ref_cnt[block_id]})")
        current = self.block_hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"cache_block: block {block_id} already cached under another hash")
            return True
        holder = self._cached.get(block_hash)
        if holder is not None:
            return False
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def reset_cache(self) -> bool:
        """Drop every cached hash.  Only allowed when no block is in use.

        Returns:
            True if the cache was reset; False (nothing changed) if some block is in use.
        """
        if self.num_used_blocks:
            return False
        for block_id in self._evictable:
            self.block_hash[block_id] = None
            self._free.append(block_id)
        self._evictable.clear()
        self._cached.clear()
        return True

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (free ones first, then evict LRU cached ones).

        Each returned block has ``ref_cnt == 1`` and no hash.

        Raises:
            ValueError: if fewer than ``num_blocks`` blocks are free (nothing changes).
        """
        if num_blocks < 0:
            raise ValueError(f"allocate: num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"allocate: need {num_blocks} blocks, only {self.num_free_blocks} free")
        out: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self.block_hash[block_id]
                del self._cached[block_hash]  # type: ignore[arg-type]
                self.block_hash[block_id] = None
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit); an evictable block leaves
        the LRU list.

        Raises:
            ValueError: if a block is neither in use nor evictable (a free, hash-less block
                cannot be shared).
        """
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                if block_id not in self._evictable:
                    raise ValueError(f"touch: block {block_id} is free and uncached; it cannot be shared")
                del self._evictable[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.  A block reaching zero
        goes to the LRU tail if it has a hash (so blocks freed first are evicted first),
        else back to the free list.

        Raises:
            RuntimeError: on a double free (``ref_cnt`` already 0).
        """
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def is_evictable(self, block_id: int) -> bool:
        """True if the block is unreferenced but cached (counted in ``num_free_blocks``)."""
        return block_id in self._evictable

    # ---- checking -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Verify the pool's internal consistency (for tests and debug builds).

        Raises:
            AssertionError: describing the first broken invariant.
        """
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), "a block appears twice in the free list"
        evictable = set(self._evictable)
        assert not (free_set & evictable), f"blocks both free and evictable: {sorted(free_set & evictable)}"
        for block_id in range(self.num_blocks):
            ref = self.ref_cnt[block_id]
            assert ref >= 0, f"block {block_id} has negative ref_cnt {ref}"
            in_free = block_id in free_set or block_id in evictable
            assert in_free == (ref == 0), f"block {block_id}: ref_cnt {ref} but in free structures: {in_free}"
            if block_id in free_set:
                assert self.block_hash[block_id] is None, f"free block {block_id} still has a hash"
            if block_id in evictable:
                assert self.block_hash[block_id] is not None, f"evictable block {block_id} has no hash"
            h = self.block_hash[block_id]
            if h is not None:
                assert self._cached.get(h) == block_id, f"block {block_id}'s hash maps to {self._cached.get(h)}"
        for h, block_id in self._cached.items():
            assert self.block_hash[block_id] == h, f"hash map points to block {block_id} with another hash"
