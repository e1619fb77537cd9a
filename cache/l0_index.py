"""L0: the index of KV blocks resident on each rank's GPU, by chain hash.

One ``RankIndex`` per rank maps ``BlockHash -> Node(block id, parent, use count, owner)``. The
index holds exactly one engine *cache ref* on every block it files (handed to it in a finished
request's ``kept_blocks`` or by ``import_blocks``); dropping a node means ``release``-ing that ref.

Invariants (``check`` asserts them; tests call it after every scenario):

* Prefix-closed: a node's parent is in the index. Insertion goes parent first, eviction only
  takes leaves (nodes with no children), so a parent is never evicted before its children.
  Hence the present blocks of any chain form a prefix of it and ``match`` is a binary search.
* ``use_count`` counts admitted requests (and exports in progress) whose prefix *ends* at the
  node. A node with ``use_count > 0`` is never evicted, and neither are its ancestors (they have
  a child, so they are not leaves), so one use on the deepest block pins a whole prefix in O(1).
* ``_leaves[owner]`` holds exactly the nodes with ``num_children == 0`` owned by ``owner``.
  The owner is the session that last used the block; eviction weighs blocks by their owner.
* One hash, one block: a finished request's kept block whose hash is already filed is a
  duplicate (always true for the replayed last prefix block and for the prefix blocks the
  request started from); the caller releases its ref instead of filing it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.hashing import BlockHash, filed_prefix_length
from cache.sessions import SessionId
from rank.ids import BlockId


@dataclass(slots=True, eq=False)
class Node:
    block_hash: BlockHash
    block_id: BlockId
    parent: Node | None
    depth: int  # index of the block in its chain (0 = first block of the prompt)
    owner: SessionId | None  # session that last used it; decides its eviction value
    last_used_s: float
    num_children: int = 0  # children filed in the index
    use_count: int = 0  # admitted requests (and exports) using it; > 0 pins it

    def chain(self) -> list[Node]:
        """The nodes of this block's chain, block 0 first, ending with this one."""
        out: list[Node] = []
        walk: Node | None = self
        while walk is not None:
            out.append(walk)
            walk = walk.parent
        out.reverse()
        return out


class RankIndex:
    """The blocks one rank holds for the cache (see the module docstring for invariants)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.nodes: dict[BlockHash, Node] = {}
        self._leaves: dict[SessionId | None, set[Node]] = {}
        self._seq = itertools.count()  # heap tie-breaker; keeps eviction deterministic

    def __len__(self) -> int:
        return len(self.nodes)

    # ----------------------------------------------------------------- lookups

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of ``hashes`` filed here (binary search: prefix-closed)."""
        return filed_prefix_length(hashes, self.nodes)

    def block_ids(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        nodes = self.nodes
        return [nodes[h].block_id for h in hashes]

    def owners(self) -> set[SessionId | None]:
        return {owner for owner, leaves in self._leaves.items() if leaves}

    def num_blocks_owned(self, owner: SessionId | None) -> int:
        """Blocks on the chains ending at ``owner``'s leaves that ``owner`` owns (O(its blocks))."""
        seen: set[int] = set()
        for leaf in self._leaves.get(owner, ()):
            node: Node | None = leaf
            while node is not None and node.owner == owner and id(node) not in seen:
                seen.add(id(node))
                node = node.parent
        return len(seen)

    # ----------------------------------------------------------------- uses

    def acquire(self, hashes: Sequence[BlockHash], owner: SessionId | None, now_s: float) -> None:
        """Pin the chain prefix ``hashes`` (all filed) for a request and make ``owner`` the owner
        of its deepest block. One use on the deepest node protects the whole prefix: its
        ancestors have a child, so they are never leaves while it is filed. O(1)."""
        if not hashes:
            return
        node = self.nodes[hashes[-1]]
        node.use_count += 1
        node.last_used_s = now_s
        if node.owner != owner:
            self._set_owner(node, owner)

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Like ``acquire`` without touching recency or owner (exports: copying a block to L1
        is not a sign that anyone wants it)."""
        if hashes:
            self.nodes[hashes[-1]].use_count += 1

    def release_uses(self, hashes: Sequence[BlockHash]) -> None:
        """Undo one ``acquire``/``pin`` of the same prefix."""
        if not hashes:
            return
        node = self.nodes[hashes[-1]]
        assert node.use_count > 0, f"use count underflow on block {node.block_id}"
        node.use_count -= 1

    def disown(self, tail: BlockHash, owner: SessionId, keep: set[BlockHash]) -> int:
        """The chain ending at ``tail`` is dead for ``owner`` (its prefix was replaced, e.g. by a
        compaction): its blocks that ``owner`` owns and ``keep`` lacks lose their owner, so they
        are evicted first (``cache/eviction.py``: no owner, score infinity). Returns how many."""
        node = self.nodes.get(tail)
        n = 0
        while node is not None and node.block_hash not in keep:
            if node.owner == owner:
                self._set_owner(node, None)
                n += 1
            node = node.parent
        return n

    # ----------------------------------------------------------------- insert

    def insert(
        self,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[BlockId],
        owner: SessionId | None,
        now_s: float,
        num_known: int = 0,
    ) -> list[BlockId]:
        """File the blocks of a chain (``block_ids[i]`` holds the block named ``hashes[i]``).

        Each ``block_ids[i]`` carries one cache ref the caller hands over. Returns the block ids
        whose ref must be released because their hash was already filed (duplicates). Already
        filed blocks are touched (recency, owner), except the first ``num_known``, which the
        caller knows are filed (a request's pinned prefix): they are duplicates by definition,
        and skipping them keeps a 1M-token turn's insert proportional to its new blocks."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        nodes = self.nodes
        duplicates: list[BlockId] = list(block_ids[:num_known])
        parent: Node | None = nodes[hashes[num_known - 1]] if num_known else None
        last_new: Node | None = None
        for depth in range(num_known, len(hashes)):
            h = hashes[depth]
            node = nodes.get(h)
            if node is not None:
                duplicates.append(block_ids[depth])
                node.last_used_s = now_s
                if node.owner != owner:
                    self._set_owner(node, owner)
            else:
                node = Node(h, block_ids[depth], parent, depth, owner, now_s)
                nodes[h] = node
                if parent is not None:
                    if parent.num_children == 0 and parent is not last_new:
                        self._leaves[parent.owner].discard(parent)
                    parent.num_children += 1
                last_new = node
            parent = node
        if last_new is not None and last_new.num_children == 0:
            self._leaves.setdefault(owner, set()).add(last_new)
        return duplicates

    # ----------------------------------------------------------------- eviction

    def evict(
        self,
        num_blocks: int,
        score: Callable[[SessionId | None], float],
        may_evict: Callable[[SessionId | None], bool],
    ) -> list[Node]:
        """Remove up to ``num_blocks`` unused blocks, leaf first, and return them in eviction order.

        Leaves are taken by owner ``score`` (higher first), then least recently used, then
        deepest, so a session's tail goes block by block from its end towards the shared prefix
        before the next session is touched. Owners for which ``may_evict`` is false are skipped.
        The caller must release the returned blocks' cache refs."""
        scores: dict[SessionId | None, float] = {}
        allowed: dict[SessionId | None, bool] = {}

        def key(node: Node) -> tuple[float, float, int, int] | None:
            if node.use_count or node.num_children:
                return None
            owner = node.owner
            if owner not in allowed:
                allowed[owner] = may_evict(owner)
                scores[owner] = score(owner)
            if not allowed[owner]:
                return None
            return (-scores[owner], node.last_used_s, -node.depth, next(self._seq))

        heap: list[tuple[tuple[float, float, int, int], Node]] = []
        for leaves in self._leaves.values():
            for leaf in leaves:
                k = key(leaf)
                if k is not None:
                    heap.append((k, leaf))
        heapq.heapify(heap)
        victims: list[Node] = []
        while heap and len(victims) < num_blocks:
            _, node = heapq.heappop(heap)
            if self.nodes.get(node.block_hash) is not node or key(node) is None:
                continue
            self._remove_leaf(node)
            victims.append(node)
            parent = node.parent
            if parent is not None and parent.num_children == 0:
                k = key(parent)
                if k is not None:
                    heapq.heappush(heap, (k, parent))
        return victims

    def num_evictable(self, may_evict: Callable[[SessionId | None], bool]) -> int:
        """How many blocks ``evict`` could free with this ``may_evict`` (nodes not in use whose
        whole subtree is unused and evictable)."""
        blocked: set[int] = set()  # ids of nodes that must stay (in use, or under a kept node)
        allowed: dict[SessionId | None, bool] = {}
        for node in self.nodes.values():
            if node.owner not in allowed:
                allowed[node.owner] = may_evict(node.owner)
            if node.use_count or not allowed[node.owner]:
                walk: Node | None = node
                while walk is not None and id(walk) not in blocked:
                    blocked.add(id(walk))
                    walk = walk.parent
        return len(self.nodes) - len(blocked)

    def remove_all(self) -> list[Node]:
        """Forget every block (after a rank restart the ids mean nothing; nothing to release)."""
        out = list(self.nodes.values())
        self.nodes.clear()
        self._leaves.clear()
        return out

    # ----------------------------------------------------------------- internals

    def _remove_leaf(self, node: Node) -> None:
        assert node.num_children == 0 and node.use_count == 0
        del self.nodes[node.block_hash]
        self._leaves[node.owner].discard(node)
        parent = node.parent
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0:
                self._leaves.setdefault(parent.owner, set()).add(parent)

    def _set_owner(self, node: Node, owner: SessionId | None) -> None:
        if node.num_children == 0:
            self._leaves[node.owner].discard(node)
            self._leaves.setdefault(owner, set()).add(node)
        node.owner = owner

    def check(self) -> None:
        """Assert the invariants in the module docstring (O(n); tests only)."""
        children: dict[int, int] = {}
        for h, node in self.nodes.items():
            assert node.block_hash == h
            assert node.block_id > 0, f"scratch block filed for hash {h}"
            if node.parent is not None:
                assert self.nodes.get(node.parent.block_hash) is node.parent, "parent not filed"
                assert node.depth == node.parent.depth + 1
                children[id(node.parent)] = children.get(id(node.parent), 0) + 1
            else:
                assert node.depth == 0
        ids = [n.block_id for n in self.nodes.values()]
        assert len(set(ids)) == len(ids), "one block filed under two hashes"
        for node in self.nodes.values():
            assert node.num_children == children.get(id(node), 0)
        leaves = {id(n) for s in self._leaves.values() for n in s}
        assert leaves == {id(n) for n in self.nodes.values() if n.num_children == 0}
        for owner, s in self._leaves.items():
            assert all(n.owner == owner for n in s)


class L0Index:
    """The per-rank indexes together (a session lives on one rank, but a shared prefix such
    as the system prompt and tools is usually filed on every rank)."""

    def __init__(self, num_ranks: int) -> None:
        self.ranks = [RankIndex(r) for r in range(num_ranks)]

    def __getitem__(self, rank: int) -> RankIndex:
        return self.ranks[rank]

    def match_all(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Matched blocks per rank."""
        return [r.match(hashes) for r in self.ranks]

    def best_rank(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """(rank, matched blocks) with the longest match; ties go to the lowest rank."""
        best = (0, -1)
        for r in self.ranks:
            m = r.match(hashes)
            if m > best[1]:
                best = (r.rank, m)
        return best

    def num_blocks(self) -> int:
        return sum(len(r) for r in self.ranks)
