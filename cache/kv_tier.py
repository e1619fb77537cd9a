"""The seam below L1: a tier that keeps chain blocks outside the host's RAM.

``cache/l2_store.py`` (local disk) implements it; a cross-node store (Mooncake Store, an LMCache
server: docs/cache.md, "Beyond one node") would implement the same three calls, so L1 spills to
and restores from either without knowing which. Blocks move between the tier and consecutive
slots of the shared L1 host pool; block ``i`` of a chain is named by its chain hash
``hashes[i]`` (``cache/hashing.py``), which also fixes its position and everything before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cache.hashing import BlockHash


class KVTier(Protocol):
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
