"""Request-level KV bookkeeping: the KV pool plus the radix prefix cache.

Every slot is in exactly one of three places: the pool's free list, the radix
tree (locked while a running request uses it, evictable otherwise), or a
running request's own tail (``req.kv_slots[req.num_tree_tokens:]``). So
``free + cached + owned-by-requests == total`` at all times, and once nothing
runs, ``free + evictable == total``.
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.mem_cache.radix_cache import RadixCache, TreeNode


class CachedSequence(Protocol):
    """What the manager reads and keeps of a sequence (the scheduler's ``Req`` is one): its
    slots, the tree node and token count its cached prefix is locked at, and its tokens."""

    kv_slots: list[int]
    cache_node: TreeNode | None
    num_tree_tokens: int

    @property
    def num_computed(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...

    def max_prefix_len(self) -> int: ...


class KVCacheManager:
    """Owns the pairing of sequences with slots; the scheduler is its only caller.

    With ``enable_prefix_cache=False`` nothing is shared: matches are empty and a
    released request's slots go straight back to the pool.
    """

    def __init__(self, pool: KVPool, enable_prefix_cache: bool = True) -> None:
        self.pool = pool
        self.tree = RadixCache(pool) if enable_prefix_cache else None

    # ---- capacity --------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_evictable(self) -> int:
        return self.tree.num_evictable if self.tree else 0

    @property
    def num_cached(self) -> int:
        return self.tree.num_cached if self.tree else 0

    def can_allocate(self, num: int) -> bool:
        return num <= self.pool.num_free + self.num_evictable

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` slots, evicting cold cache leaves first if the free list is short."""
        short = num - self.pool.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.pool.allocate(num)

    # ---- request lifecycle -----------------------------------------------------

    def match(self, req: CachedSequence) -> int:
        """Attach the longest cached prefix of the request's tokens, locked; returns its length.

        At most ``req.max_prefix_len()`` tokens: at least one is left uncomputed (the
        step that computes it yields the logits the next token is sampled from), more
        while the request still needs the logits of prompt positions.
        """
        if self.tree is None:
            return 0
        match = self.tree.match_prefix(req.token_slice(0, req.max_prefix_len()))
        self.tree.lock(match.node)
        req.kv_slots = match.slots
        req.cache_node = match.node
        req.num_tree_tokens = len(match.slots)
        return len(match.slots)

    def unmatch(self, req: CachedSequence) -> None:
        """Undo ``match`` for a request that could not be admitted after all."""
        if self.tree is not None and req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        self._detach(req)

    def cache_prefix(self, req: CachedSequence) -> None:
        """Insert the request's computed KV into the tree while it keeps running.

        Duplicates of tokens the tree already held are freed and the request
        switches to the tree's slots, so later requests can share this prefix.
        """
        if self.tree is None or req.num_computed <= req.num_tree_tokens:
            return
        key = req.token_slice(0, req.num_computed)
        self._insert(req, key)
        match = self.tree.match_prefix(key)
        self.tree.lock(match.node)
        self._unlock(req)
        req.kv_slots = match.slots
        req.cache_node = match.node
        req.num_tree_tokens = len(match.slots)

    def release(self, req: CachedSequence) -> None:
        """Give up the request's KV: computed tokens stay cached (evictable), the rest is freed.

        Called when a request finishes, is aborted or is retracted; a retracted
        request re-matches its own tokens when it is admitted again.
        """
        if self.tree is None:
            self.pool.free(req.kv_slots)
        else:
            self._insert(req, req.token_slice(0, req.num_computed))
            self._unlock(req)
        self._detach(req)

    def pin(self, req: CachedSequence) -> TreeNode | None:
        """Cache every computed token of ``req`` and lock them once more, for a holder that
        outlives the request (a session): they stay cached after ``release`` until
        ``unpin``. None without a prefix cache (nothing can be kept)."""
        if self.tree is None:
            return None
        self.cache_prefix(req)
        node = req.cache_node
        if node is not None:
            self.tree.lock(node)
        return node

    def unpin(self, node: TreeNode) -> None:
        """Give back the lock ``pin`` took; the tokens become an evictable prefix."""
        if self.tree is not None:
            self.tree.unlock(node)

    def flush(self) -> bool:
        """Drop every cached prefix; refused (False) while a request holds a lock."""
        return self.tree.reset() if self.tree else True

    # ---- internals -------------------------------------------------------------

    def _insert(self, req: CachedSequence, key: list[int]) -> None:
        assert self.tree is not None
        num_present = self.tree.insert(key, req.kv_slots[: len(key)])
        # Tokens the tree already held in other slots: our copies are duplicates.
        self.pool.free(req.kv_slots[req.num_tree_tokens : num_present])

    def _unlock(self, req: CachedSequence) -> None:
        if self.tree is not None and req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = None

    @staticmethod
    def _detach(req: CachedSequence) -> None:
        req.kv_slots = []
        req.cache_node = None
        req.num_tree_tokens = 0
