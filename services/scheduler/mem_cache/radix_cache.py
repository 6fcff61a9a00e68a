"""Radix-tree prefix cache over the token-granular KV pool (SGLang's RadixCache).

Each edge holds a run of token ids and the pool slots that hold their K/V, so a
new request reuses the KV of the longest cached prefix of its tokens. Nodes on a
running request's path are locked (reference counted) and never evicted;
unlocked leaves are evicted least-recently-used first when the pool runs short.

The tree owns the slots stored in it: ``evict`` and ``reset`` return them to the
pool. Callers that insert slots already present in the tree keep ownership of
their duplicates (``insert`` tells how many leading tokens were present).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from services.scheduler.mem_cache.kv_pool import KVPool


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int]  # token ids on the edge from the parent to this node
    value: list[int]  # pool slots of those tokens, same length as key
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0  # running requests whose matched prefix ends at or below this node
    last_access: int = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


@dataclass(slots=True)
class PrefixMatch:
    slots: list[int]  # pool slots of the matched tokens, in order
    node: TreeNode  # the node the match ends at; lock it to keep the slots alive


def common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[start:]``."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start : start + n]:  # the common case, a whole edge, at C speed
        return n
    i = 0
    while edge[i] == key[start + i]:
        i += 1
    return i


class RadixCache:
    """Prefix tree of cached KV; the scheduler's KVCacheManager is its only caller."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._clock = itertools.count(1)
        self.root = TreeNode(key=[], value=[], lock_ref=1)  # the root is never evicted
        self.num_evictable = 0  # tokens in unlocked nodes
        self.num_locked = 0  # tokens in nodes some running request depends on

    @property
    def num_cached(self) -> int:
        return self.num_evictable + self.num_locked

    # ---- lookups ---------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> PrefixMatch:
        """Longest cached prefix of ``key``; splits an edge so the match ends on a node."""
        node, slots, i = self.root, [], 0
        now = next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            child.last_access = now
            matched = common_prefix_len(child.key, key, i)
            is_partial = matched < len(child.key)
            if is_partial:
                child = self._split(child, matched)
            slots.extend(child.value)
            node, i = child, i + matched
            if is_partial:
                break
        return PrefixMatch(slots, node)

    def insert(self, key: list[int], value: list[int]) -> int:
        """Cache ``value`` (slots) for ``key``; returns how many leading tokens were cached.

        The tree takes ownership of ``value[returned:]``; the caller keeps
        ``value[:returned]``, whose tokens the tree already held in other slots.
        """
        if len(key) != len(value):
            raise ValueError(f"{len(key)} tokens but {len(value)} slots")
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                self._add_leaf(node, key[i:], value[i:], now)
                break
            child.last_access = now
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split(child, matched)
            node, i = child, i + matched
        return min(i, len(key))

    # ---- locks -----------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (one reference)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_evictable -= len(node.key)
                self.num_locked += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Drop one reference taken by ``lock``."""
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable += len(node.key)
                self.num_locked -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ---- freeing ---------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, oldest first.

        Returns the number freed (less only when nothing else is evictable).
        """
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            self.pool.free(leaf.value)
            freed += len(leaf.value)
            self.num_evictable -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def reset(self) -> bool:
        """Free every cached slot; refused (False) while any request holds a lock."""
        if self.num_locked:
            return False
        self.evict(self.num_evictable)
        return True

    # ---- internals -------------------------------------------------------------

    def _add_leaf(self, parent: TreeNode, key: list[int], value: list[int], now: int) -> None:
        leaf = TreeNode(key=list(key), value=list(value), parent=parent, last_access=now)
        parent.children[key[0]] = leaf
        self.num_evictable += len(key)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child``'s edge after ``at`` tokens; returns the new upper node.

        Both halves keep the lock count, so the evictable/locked totals are unchanged.
        """
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            key=child.key[:at],
            value=child.value[:at],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        child.key, child.value, child.parent = child.key[at:], child.value[at:], upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
