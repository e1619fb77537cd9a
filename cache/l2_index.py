"""L2 bookkeeping: which chain blocks are on disk, in which extent file, and the disk bound.

Pure data (no I/O); ``cache/l2_store.py`` does the reads and writes and calls this from the
event loop thread only.

An *extent* is one file holding blocks ``first_block .. first_block+n-1`` of a chain. A save
writes only the blocks after the longest prefix already on disk, so a session spilled again
after two more turns adds one small extent after its old one, and sessions sharing a system
prompt share its extent. Each block hash is filed under one extent; an extent's *live* blocks
are ``hashes[first_live:]`` (the ones before were already filed elsewhere when it arrived) and its
*parent* is the extent holding the block just before them.

Invariants (``check``):

* Prefix-closed: a filed block's predecessor in its chain is filed (or it is block 0). So
  ``match`` is a binary search, as in L1. ``add`` files an extent only when its parent is
  filed; ``remove`` takes every descendant extent with it (they would be unreachable).
* ``used_bytes`` is the sum of the filed extents' file sizes; ``used_bytes + reserved_bytes``
  never exceeds ``max_bytes`` after ``make_room`` said yes (writes reserve before they start).
* Eviction is least recently used first (a restore or a save touches every extent of the
  chain's path, so a parent is never older than its children), leaves before parents on ties.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cache.hashing import BlockHash, filed_prefix_length


@dataclass(slots=True, eq=False)
class L2Extent:
    name: str  # file name inside the store's directory
    first_block: int  # chain position of hashes[0]
    parent_hash: BlockHash  # chain hash of position first_block-1 (root hash for block 0)
    hashes: list[BlockHash]
    checksums: list[int]
    payload_offset: int
    file_bytes: int
    last_used_s: float
    first_live: int = 0  # hashes[first_live:] are filed under this extent
    parent: L2Extent | None = None  # holds the block before hashes[first_live] (None at block 0)
    children: list[L2Extent] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True, slots=True)
class L2Run:
    """Blocks ``index .. index+count-1`` of ``extent`` (consecutive in the file and the chain)."""

    extent: L2Extent
    index: int
    count: int


class L2Index:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.extents: dict[str, L2Extent] = {}
        self._where: dict[BlockHash, tuple[L2Extent, int]] = {}
        self.used_bytes = 0
        self.reserved_bytes = 0

    @property
    def num_blocks(self) -> int:
        return len(self._where)

    # ----------------------------------------------------------------- lookups

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain ``hashes`` are on disk."""
        return filed_prefix_length(hashes, self._where)

    def runs(self, hashes: Sequence[BlockHash], first: int, count: int) -> list[L2Run]:
        """Where blocks ``first .. first+count-1`` of the chain are (all must be filed), grouped
        into runs that are consecutive within one extent."""
        out: list[L2Run] = []
        for h in hashes[first : first + count]:
            extent, index = self._where[h]
            last = out[-1] if out else None
            if last is not None and last.extent is extent and last.index + last.count == index:
                out[-1] = L2Run(extent, last.index, last.count + 1)
            else:
                out.append(L2Run(extent, index, 1))
        return out

    def path(self, hashes: Sequence[BlockHash], count: int) -> list[L2Extent]:
        """The distinct extents holding the chain's first ``count`` blocks."""
        seen: dict[int, L2Extent] = {}
        for h in hashes[:count]:
            extent = self._where[h][0]
            seen.setdefault(id(extent), extent)
        return list(seen.values())

    def touch(self, extents: Collection[L2Extent], now_s: float) -> None:
        for extent in extents:
            extent.last_used_s = now_s

    # ----------------------------------------------------------------- changes

    def add(self, extent: L2Extent) -> bool:
        """File an extent's blocks that are not on disk yet. False (nothing filed) when it adds
        nothing or its parent block is not filed (an orphan: its chain is unreachable)."""
        if extent.name in self.extents:
            raise ValueError(f"extent {extent.name} is already filed")
        k = 0
        while k < extent.num_blocks and extent.hashes[k] in self._where:
            k += 1
        if k == extent.num_blocks:
            return False
        parent: L2Extent | None = None
        if extent.first_block + k > 0:
            before = extent.hashes[k - 1] if k > 0 else extent.parent_hash
            found = self._where.get(before)
            if found is None:
                return False
            parent = found[0]
            parent.children.append(extent)
        extent.first_live, extent.parent = k, parent
        for i in range(k, extent.num_blocks):
            self._where[extent.hashes[i]] = (extent, i)
        self.extents[extent.name] = extent
        self.used_bytes += extent.file_bytes
        return True

    def remove(self, extent: L2Extent) -> list[L2Extent]:
        """Unfile an extent and every extent that depends on it; returns all removed."""
        if self.extents.get(extent.name) is not extent:
            return []
        if extent.parent is not None:
            extent.parent.children.remove(extent)
            extent.parent = None
        removed: list[L2Extent] = []
        stack = [extent]
        while stack:
            e = stack.pop()
            for h in e.hashes[e.first_live :]:
                if self._where.get(h, (None, 0))[0] is e:
                    del self._where[h]
            del self.extents[e.name]
            self.used_bytes -= e.file_bytes
            stack.extend(e.children)
            e.children, e.parent = [], None
            removed.append(e)
        return removed

    def clear(self) -> list[L2Extent]:
        removed = list(self.extents.values())
        self.extents.clear()
        self._where.clear()
        self.used_bytes = 0
        return removed

    # ----------------------------------------------------------------- the bound

    def make_room(self, nbytes: int, keep: Collection[L2Extent] = ()) -> list[L2Extent] | None:
        """Reserve ``nbytes`` for a write, evicting least recently used extents (never those in
        ``keep``, which must be closed under parents, as a chain's ``path`` is) as needed.
        Returns the evicted extents (the caller deletes their files), or None, with nothing
        changed, when even evicting everything else would not make room."""
        keep_ids = {id(e) for e in keep}
        kept_bytes = sum(e.file_bytes for e in keep if self.extents.get(e.name) is e)
        if kept_bytes + self.reserved_bytes + nbytes > self.max_bytes:
            return None
        evicted: list[L2Extent] = []
        while self.used_bytes + self.reserved_bytes + nbytes > self.max_bytes:
            victim = min((e for e in self.extents.values() if id(e) not in keep_ids),
                         key=lambda e: (e.last_used_s, bool(e.children)))
            evicted.extend(self.remove(victim))
        self.reserved_bytes += nbytes
        return evicted

    def release(self, nbytes: int) -> None:
        """A reserved write ended (filed or not): its reservation goes."""
        self.reserved_bytes -= nbytes
        assert self.reserved_bytes >= 0

    def set_bound(self, max_bytes: int) -> list[L2Extent]:
        """Move the bound (the disk filled up or freed space) and evict down to it; returns the
        evicted extents."""
        self.max_bytes = max(0, max_bytes)
        evicted: list[L2Extent] = []
        while self.extents and self.used_bytes + self.reserved_bytes > self.max_bytes:
            victim = min(self.extents.values(), key=lambda e: (e.last_used_s, bool(e.children)))
            evicted.extend(self.remove(victim))
        return evicted

    # ----------------------------------------------------------------- tests

    def check(self) -> None:
        assert self.used_bytes == sum(e.file_bytes for e in self.extents.values())
        assert 0 <= self.reserved_bytes
        for h, (e, i) in self._where.items():
            assert self.extents.get(e.name) is e and e.hashes[i] == h and i >= e.first_live
        for e in self.extents.values():
            if e.first_block + e.first_live == 0:
                assert e.parent is None
                continue
            before = e.hashes[e.first_live - 1] if e.first_live > 0 else e.parent_hash
            assert e.parent is not None and self._where[before][0] is e.parent, f"{e.name} not prefix-closed"
            assert e in e.parent.children
