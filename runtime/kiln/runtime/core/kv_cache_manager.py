"""Per-request view of the paged KV cache: block tables, prefix-cache lookups, allocation.

The middle layer (Scheduler -> **KVCacheManager** -> BlockPool), shaped after vLLM V1's
``vllm/v1/core/kv_cache_manager.py``: ``get_computed_blocks`` finds the cached prefix,
``allocate_slots`` returns new blocks or ``None`` (and then changes nothing), ``free``
returns all of a request's blocks.  nano-vllm's ``BlockManager`` does the same with
``can_allocate``/``allocate``/``may_append``/``deallocate``; TensorRT-LLM calls prefix
caching "KV cache block reuse".

Only full blocks are ever shared, and only through a matching chained hash (see
:mod:`kiln.runtime.core.block_pool`).  Plain Python, no torch import.
"""

from __future__ import annotations

from .block_pool import ROOT_HASH, BlockHash, BlockPool, hash_block_tokens, root_hash  # noqa: F401
from .request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints (tokens -> blocks)."""
    return -(-a // b)


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without building the whole list."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n : end - n]
    return prompt[start:] + request.output_token_ids[: end - n]


class KVCacheManager:
    """Owns the block tables of all requests over one :class:`BlockPool`.

    Units: ``block_size`` in tokens; block ids index the model runner's KV pool; stats in
    tokens.  A request's block table covers its first ``len(table) * block_size`` token
    positions; block ``i`` holds tokens ``[i*block_size, (i+1)*block_size)``.

    Protocol (what the scheduler does):
      1. On admission: ``blocks, n = get_computed_blocks(req)``, then
         ``allocate_slots(req, num_new_tokens, blocks)`` with ``req.num_computed_tokens``
         still at 0; on success the caller sets ``req.num_computed_tokens = n``.
      2. For a running request: ``allocate_slots(req, num_new_tokens)``.
      3. After the step: ``req.num_computed_tokens += num_new_tokens`` then
         ``cache_blocks(req, req.num_computed_tokens)``.
      4. On finish/abort/preemption: ``free(req)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        """Create the manager and its pool.

        Args:
            num_blocks: pool size (blocks).
            block_size: tokens per block.
            enable_prefix_caching: reuse full blocks across requests through their hashes.

        Raises:
            ValueError: if ``num_blocks`` or ``block_size`` is below 1.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # request id -> block table (block ids, in token order).
        self._tables: dict[str, list[int]] = {}
        # request id -> chained hashes of its full blocks computed so far (a memo).
        self._hashes: dict[str, list[BlockHash]] = {}
        # request id -> number of leading table blocks already offered to the prefix cache.
        self._num_cached: dict[str, int] = {}
        # request ids whose prefix-cache lookup was counted since their last free()
        # (a request blocked at the head of the queue is counted once, not every step).
        self._counted: set[str] = set()
        # Cumulative prefix-cache statistics (tokens): tokens looked up / tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- counts ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Pool size (blocks)."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocations (free + evictable cached), in blocks."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request (blocks)."""
        return self.pool.num_used_blocks

    @property
    def num_allocated_uncached_blocks(self) -> int:
        """Blocks held by requests, i.e. neither free nor evictable-cached (blocks).

        Zero whenever no request holds blocks: the "no leaked blocks" check.  (Same number
        as ``num_used_blocks``; evictable cached blocks are not counted.)
        """
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable (blocks)."""
        return self.pool.num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks still holding reusable cached KV (blocks; part of
        ``num_free_blocks``)."""
        return self.pool.num_evictable_blocks

    @property
    def usage(self) -> float:
        """Fraction (0..1) of the pool referenced by requests; evictable cached blocks
        count as unused."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def num_requests(self) -> int:
        """Requests currently holding a block table."""
        return len(self._tables)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (block ids in token order); ``[]`` if the
        request holds no blocks."""
        return list(self._tables.get(request_id, ()))

    def num_blocks_held(self, request_id: str) -> int:
        """Length of the request's block table (blocks), without copying it."""
        table = self._tables.get(request_id)
        return len(table) if table else 0

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return cdiv(num_tokens, self.block_size)

    # ---- hashing --------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_full_blocks`` blocks (memoized per
        request; tokens of a full block never change)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(request.lora_id)
            hashes.append(hash_block_tokens(parent, _token_slice(request, i * bs, (i + 1) * bs)))
        return hashes[:num_full_blocks]

    # ---- the protocol ---------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Find the longest cached prefix of ``request.all_token_ids`` in full blocks.

        Never covers the request's last token: at least one token must be computed to
        produce logits, so at most ``(num_tokens - 1) // block_size`` blocks are returned.
        Does not take references (``allocate_slots`` does).  Counts
        ``prefix_cache_queries += num_tokens`` and ``prefix_cache_hits += hit tokens`` once
        per admission attempt (until the request's next ``free``).

        Returns:
            ``(block_ids, num_tokens)``: the cached blocks in order and the tokens they
            cover (``len(block_ids) * block_size``).  ``([], 0)`` when caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        num_tokens = request.num_tokens
        max_blocks = (num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in self._block_hashes(request, max_blocks):
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        num_hit_tokens = len(blocks) * self.block_size
        if request.request_id not in self._counted:
            self._counted.add(request.request_id)
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        """Fresh blocks ``allocate_slots`` would take for this call (not counting hits)."""
        table = self._tables.get(request.request_id, ())
        total = request.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(table) - num_computed_blocks)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make the block table cover ``num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` must not yet include the
                prefix-cache hit passed in ``new_computed_blocks``.
            num_new_tokens: tokens to compute this step (tokens, >= 0).
            new_computed_blocks: prefix-cache hit from ``get_computed_blocks`` (only when
                the request holds no blocks yet, i.e. on admission).

        Returns:
            The block ids appended to the table by this call (cache hits first, then fresh
            blocks; ``[]`` — not None — when the table already covers the tokens), or
            ``None`` if the pool lacks free blocks: then nothing changed.

        Raises:
            ValueError: on a negative ``num_new_tokens`` or ``new_computed_blocks`` given
                to a request that already holds blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"allocate_slots: num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        table = self._tables.get(rid)
        if table and not new_computed_blocks \
                and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return []  # the common decode step: the last block still has room
        hits = list(new_computed_blocks or ())
        if hits and table:
            raise ValueError(
                f"allocate_slots: request {rid} already holds {len(table)} blocks; "
                "prefix-cache hits are only accepted on admission"
            )
        num_fresh = self.num_new_blocks_needed(request, num_new_tokens, len(hits))
        # Hits on evictable blocks leave the free pool when touched.
        num_hit_evictable = sum(1 for b in hits if self.pool.is_evictable(b))
        if num_fresh + num_hit_evictable > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._tables[rid] = []
        if hits:
            self.pool.touch(hits)
            table.extend(hits)
            self._num_cached[rid] = len(hits)
        fresh = self.pool.allocate(num_fresh)
        table.extend(fresh)
        return hits + fresh

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full (all ``block_size`` tokens
        computed) under their chained hashes, so later requests can share them.

        Args:
            num_computed_tokens: tokens of the request now in the KV cache (tokens).

        A block whose prefix is already cached in another block stays private.  No-op
        when prefix caching is off or the request holds no blocks.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Return the blocks of the request's table past the first ``cdiv(num_tokens,
        block_size)`` (speculative decoding: slots allocated for drafts that were rejected).
        Those blocks are never cached (they hold no fully computed block), so they go back to
        the free list.  Returns the blocks freed (blocks)."""
        table = self._tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self.pool.free(reversed(tail))
        return len(tail)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (one reference each).  Cached blocks become
        evictable (LRU; the table's tail is evicted first), others go back to the free
        list.  Idempotent: a request without blocks is a no-op."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._counted.discard(rid)
        if table:
            self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes (e.g. after a weight reload).

        Returns:
            True on success; False (nothing changed) while any block is in use.
        """
        if not self.pool.reset_cache():
            return False
        self._num_cached.clear()
        return True

    # ---- checking -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Verify that reference counts equal the number of block tables holding each
        block, that no block is both free and held, and the pool's own invariants.

        Raises:
            AssertionError: describing the first broken invariant.
        """
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid}'s table holds a block twice: {table}"
            for block_id in table:
                expected[block_id] += 1
        for block_id, (want, got) in enumerate(zip(expected, self.pool.ref_cnt)):
            assert want == got, f"block {block_id}: ref_cnt {got} but held by {want} block tables"
