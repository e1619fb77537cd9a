"""L3 in the simulator: one store shared by every simulated worker, moving no bytes.

Each worker's ``CacheManager`` gets a ``SimL3`` as its tier below L1 (the seam of
``cache/kv_tier.py``; no L2), so the real cache code decides what to spill and what to restore.
The store keeps chain hashes only (LRU, bounded by ``capacity_blocks``); ``save`` and ``load``
take ``latency + bytes / bandwidth`` of virtual time, with the bandwidth ``bench/l3_bench.py``
measured; ``match`` applies the same "faster than prefill" estimate as ``cache/l3_store.py``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache.hashing import BlockHash


@dataclass(slots=True)
class SharedStore:
    capacity_blocks: int
    held: collections.OrderedDict[BlockHash, None] = field(default_factory=collections.OrderedDict)
    restored_blocks: int = 0

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self.held[h] = None
            self.held.move_to_end(h)
        while len(self.held) > self.capacity_blocks:
            self.held.popitem(last=False)

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.held:
                break
            n += 1
        return n


class SimL3:
    shared = True

    def __init__(self, store: SharedStore, bytes_per_block: int, block_tokens: int, bytes_per_s: float,
                 latency_s: float, prefill_tokens_per_s: float) -> None:
        self.store = store
        self.bytes_per_block = bytes_per_block
        self.block_tokens = block_tokens
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def _transfer_s(self, num_blocks: int) -> float:
        return self.latency_s + num_blocks * self.bytes_per_block / self.bytes_per_s

    def match(self, hashes: Sequence[BlockHash]) -> int:
        n = self.store.leading(hashes)
        return n if n and self._transfer_s(n) <= n * self.block_tokens / self.prefill_tokens_per_s else 0

    def stored(self, hashes: Sequence[BlockHash]) -> int:
        return self.store.leading(hashes)

    async def probe(self, hashes: Sequence[BlockHash]) -> None:
        await asyncio.sleep(self.latency_s)

    async def save(self, hashes: Sequence[BlockHash], parent_hash: BlockHash, host_slot: int) -> int:
        k = self.store.leading(hashes)
        if k >= len(hashes):
            return 0
        await asyncio.sleep(self._transfer_s(len(hashes) - k))
        self.store.add(hashes)
        return len(hashes) - k

    async def load(self, hashes: Sequence[BlockHash], first: int, count: int, host_slot: int) -> int:
        count = min(count, self.store.leading(hashes) - first)
        if count <= 0:
            return 0
        await asyncio.sleep(self._transfer_s(count))
        self.store.add(hashes[first : first + count])
        self.store.restored_blocks += count
        return count
