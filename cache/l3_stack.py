"""L2 and L3 as one tier below L1 (``KVTier``): the local disk first, the shared store after it.

``match`` is the longer of the two prefixes; ``load`` reads from L2 what it holds and the rest of
the run from L3 (a short read from either ends the run: the turn recomputes the rest); ``save``
writes to both at once (L3 best-effort, so a slow or full shared store never holds back the
disk); ``stored`` is what both already hold, so a spill goes on until each has the chain.
Without L2 (``l2_gb`` 0) the stack is L3 alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from cache.hashing import BlockHash
from cache.kv_tier import KVTier
from cache.l3_store import L3Store


class StackedTier:
    shared = True  # L3 below it (cache/kv_tier.py)

    def __init__(self, l2: KVTier | None, l3: L3Store) -> None:
        self.l2 = l2
        self.l3 = l3

    def match(self, hashes: Sequence[BlockHash]) -> int:
        m2 = self.l2.match(hashes) if self.l2 is not None else 0
        return max(m2, self.l3.match(hashes))

    def stored(self, hashes: Sequence[BlockHash]) -> int:
        s2 = self.l2.stored(hashes) if self.l2 is not None else len(hashes)
        return min(s2, self.l3.stored(hashes))

    async def probe(self, hashes: Sequence[BlockHash]) -> None:
        if self.l2 is None or self.l2.match(hashes) < len(hashes) - 1:
            await self.l3.probe(hashes)

    async def save(self, hashes: Sequence[BlockHash], parent_hash: BlockHash, host_slot: int) -> int:
        if self.l2 is None:
            return await self.l3.save(hashes, parent_hash, host_slot)
        on_disk, _ = await asyncio.gather(self.l2.save(hashes, parent_hash, host_slot),
                                          self.l3.save(hashes, parent_hash, host_slot))
        return on_disk

    async def load(self, hashes: Sequence[BlockHash], first: int, count: int, host_slot: int) -> int:
        got = 0
        m2 = self.l2.match(hashes) if self.l2 is not None else 0
        if self.l2 is not None and first < m2:
            want = min(count, m2 - first)
            got = await self.l2.load(hashes, first, want, host_slot)
            if got < want or got == count:
                return got
        return got + await self.l3.load(hashes, first + got, count - got, host_slot + got)
