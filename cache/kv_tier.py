"""The seam below L1, and the link that moves sessions between L1 and a tier below it.

``KVTier``: a tier that keeps chain blocks outside the host's RAM. ``cache/l2_store.py`` (local
disk) implements it, and so does ``cache/l3_stack.py``: L2 with L3, the store shared by every
node (``cache/l3_store.py``, docs/cache.md "Beyond one node") below it, so L1 spills to and
restores from either without knowing which. Blocks move between the tier and consecutive slots of the shared
L1 host pool; block ``i`` of a chain is named by its chain hash ``hashes[i]``
(``cache/hashing.py``), which also fixes its position and everything before it.

``TierLink``: the two moves the cache makes through the seam, on the L1 index's terms.

* **Spill** (write-behind): after a session's chain is committed to L1, the blocks the tier
  lacks are saved from the entry's slots, holding the entry meanwhile (a held entry is neither
  evicted nor cut back, so its slots stay put). An L1 eviction therefore drops nothing the tier
  does not have, and a backend that stops finds every L1-written session on disk at the next
  start. Only new blocks are written (the tier matches by chain hash), so a session spilled
  after each of its turns costs O(its blocks) of disk writes, not O(turns x blocks).
* **Fill**: when the tier holds more of a prompt than L0 and L1, the session's L1 entry is made
  to hold the chain by loading the blocks it lacks from the tier into the slots a write plan
  reserves; the cache then restores from L1 to the GPU as for any L1 hit (tier -> host -> GPU).
  A failed or partial load commits the verified prefix only; the turn recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cache.hashing import BlockHash
from cache.l1_index import L1Entry, L1Index
from cache.sessions import SessionId


class KVTier(Protocol):
    # True for a store other nodes write to (its holdings must be asked with ``probe``); False
    # for a local one, whose index is in memory, so the turn's path skips the probe altogether.
    shared: bool

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain the tier holds (cheap; no I/O)."""
        ...

    async def save(self, hashes: Sequence[BlockHash], parent_hash: BlockHash, host_slot: int) -> int:
        """Store the chain's blocks the tier lacks, reading block ``i`` from host slot
        ``host_slot + i``; returns the blocks newly stored. Failures store nothing, never raise."""
        ...

    async def load(self, hashes: Sequence[BlockHash], first: int, count: int, host_slot: int) -> int:
        """Copy blocks ``first .. first+count-1`` into host slots from ``host_slot``; returns how
        many leading ones arrived verified. Failures return fewer, never raise."""
        ...

    def stored(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks every store of the tier holds (a spill writes the rest)."""
        ...

    async def probe(self, hashes: Sequence[BlockHash]) -> None:
        """Learn, before ``match``, what a store shared with other nodes holds of the chain
        (bounded in time; a no-op for a local store). Never raises."""
        ...


@dataclass(frozen=True, slots=True)
class Fill:
    """The outcome of ``TierLink.fill``: ``entry`` holds ``hashes[:num_blocks]`` readable (None:
    nothing usable); blocks ``first_loaded .. first_loaded+num_loaded-1`` came from the tier."""

    entry: L1Entry | None
    num_blocks: int
    first_loaded: int = 0
    num_loaded: int = 0

    def loaded_within(self, first: int, count: int) -> int:
        """How many of blocks ``first .. first+count-1`` came from the tier."""
        lo = max(first, self.first_loaded)
        hi = min(first + count, self.first_loaded + self.num_loaded)
        return max(0, hi - lo)


@dataclass(slots=True)
class LinkCounters:
    spilled_blocks: int = 0
    filled_blocks: int = 0
    short_fills: int = 0  # the tier returned fewer blocks than it matched (corrupt, vanished, I/O error)


class TierLink:
    """See the module docstring. One event loop; ``root`` is the chain's root hash (the parent
    of block 0). A spill of one session runs at a time; one asked for meanwhile runs after it,
    on the entry as it is then."""

    def __init__(self, l1: L1Index, tier: KVTier, root: BlockHash) -> None:
        self.l1 = l1
        self.tier = tier
        self.root = root
        self.counters = LinkCounters()
        self._spilling: dict[SessionId, bool] = {}  # session -> asked again while spilling

    def match(self, hashes: Sequence[BlockHash]) -> int:
        return self.tier.match(hashes)

    def stored(self, hashes: Sequence[BlockHash]) -> int:
        return self.tier.stored(hashes)

    @property
    def shared(self) -> bool:
        return self.tier.shared

    async def probe(self, hashes: Sequence[BlockHash], held: int) -> None:
        """Ask a shared store what it holds of a prompt whose first ``held`` blocks this node's
        L0 already has, unless this node holds all of it that a turn can use."""
        if max(held, self.l1.match(hashes)[1], self.tier.match(hashes)) < len(hashes) - 1:
            await self.tier.probe(hashes)

    def is_spilling(self) -> bool:
        return bool(self._spilling)

    async def spill(self, session_id: SessionId) -> int:
        """Save the blocks of the session's L1 entry that the tier lacks. Returns blocks stored."""
        if session_id in self._spilling:
            self._spilling[session_id] = True
            return 0
        self._spilling[session_id] = False
        stored = 0
        try:
            while True:
                entry = self.l1.entries.get(session_id)
                if entry is not None and self.tier.stored(entry.hashes) < len(entry.hashes):
                    hashes = list(entry.hashes)
                    self.l1.begin_read(entry)
                    try:
                        stored += await self.tier.save(hashes, self.root, entry.start_slot)
                    finally:
                        self.l1.end_read(entry)
                if not self._spilling[session_id]:
                    break
                self._spilling[session_id] = False
        finally:
            del self._spilling[session_id]
        self.counters.spilled_blocks += stored
        return stored

    async def fill(
        self, session_id: SessionId, hashes: Sequence[BlockHash], count: int, now_s: float,
        score: Callable[[SessionId], float] | None = None,
    ) -> Fill:
        """Make the session's L1 entry hold ``hashes[:count]`` (``count`` <= ``match``), loading
        what it lacks from the tier. The caller has waited for the session's L1 write in flight
        (a plan cannot be made meanwhile: the result is then empty, as it is with no L1 room)."""
        chain = list(hashes[:count])
        plan = self.l1.plan_write(session_id, chain, now_s, score)
        if plan is None:
            entry = self.l1.entries.get(session_id)
            held = entry is not None and self.l1.holds_chain(session_id, chain)
            return Fill(entry if held else None, count if held else 0)
        first = plan.first_block
        try:
            got = await self.tier.load(chain, first, count - first, plan.host_slot)
        except BaseException:
            self.l1.abort(plan)  # cancelled: the store waited for its reads, the slots are ours again
            raise
        if got < count - first:
            self.counters.short_fills += 1
        if got == 0 or plan.generation != self.l1.generation:
            self.l1.abort(plan)
            return Fill(None, 0)
        plan.hashes = chain[: first + got]
        self.l1.commit(plan, now_s)
        self.counters.filled_blocks += got
        entry = self.l1.entries.get(session_id)
        if entry is None or not self.l1.holds_chain(session_id, plan.hashes):
            return Fill(None, 0)  # the session was dropped meanwhile (the commit was an abort)
        return Fill(entry, first + got, first, got)
