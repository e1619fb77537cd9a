"""Builders for the L2 tests: chains of real chain hashes, host slots with known bytes, stores.

The L2 tests live outside tests/cache because the store does real file I/O on a thread pool,
which the cache tests' virtual-time event loop cannot run (it has no real waiting)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from cache.hashing import BlockHash, ChainHasher
from cache.host_slots import HostSlots
from cache.l2_format import L2Stamp
from cache.l2_store import L2Store

T = TypeVar("T")
BLOCK_SIZE = 4
HASHER = ChainHasher(BLOCK_SIZE, b"test-model")
# Not a multiple of 4096 (as DeepSeek-V4.1-Flash's 114,048-byte rows are not): direct I/O goes
# through the bounce buffer and chunk edges fall inside blocks.
ODD_BPB = 12_360
STAMP = L2Stamp("reference:test-model", BLOCK_SIZE, ODD_BPB, "test:fp32:2x4x8")


def chain(num_blocks: int, base: int = 0) -> list[BlockHash]:
    """A chain of ``num_blocks`` blocks; chains with the same ``base`` share their prefixes."""
    return HASHER.hashes(np.arange(base, base + BLOCK_SIZE * num_blocks, dtype=np.int32))


def fill(host: HostSlots, slot: int, count: int, seed: int) -> np.ndarray:
    """Random bytes into ``count`` slots from ``slot``; returns a copy of them."""
    data = np.random.default_rng(seed).integers(0, 256, (count, host.bytes_per_block), dtype=np.uint8)
    host.array[slot : slot + count] = data
    return data


def make_store(directory: str, max_bytes: int = 1 << 30, *, stamp: L2Stamp = STAMP, num_slots: int = 256,
               host: HostSlots | None = None, **kwargs: Any) -> L2Store:
    kwargs.setdefault("chunk_bytes", 1 << 20)  # several chunks per extent, so overlap is exercised
    kwargs.setdefault("min_free_bytes", 0)
    host = host or HostSlots.in_memory(stamp.bytes_per_block, num_slots)
    store = L2Store(directory, max_bytes, stamp, host, **kwargs)
    store.open()
    return store


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def files(directory: str, suffix: str = ".kv") -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(suffix))


def disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
