"""L2 over L3 as one tier (``cache/l3_stack.py``), and the ``l3`` config key and its wiring."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np
import pytest

from cache.host_slots import HostSlots
from cache.l3_stack import StackedTier
from server.config import ConfigError, load_config
from tests.l3.test_l3_store import BPB, HASHER, FakeStore, _chain, _fill, _store


class DictL2:
    """A local tier holding copies of blocks by hash (the L2 seam, no disk)."""

    def __init__(self, host: HostSlots) -> None:
        self.host = host
        self.blocks: dict[int, np.ndarray] = {}

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def stored(self, hashes: Sequence[int]) -> int:
        return self.match(hashes)

    async def probe(self, hashes: Sequence[int]) -> None:
        pass

    async def save(self, hashes: Sequence[int], parent_hash: int, host_slot: int) -> int:
        new = [i for i, h in enumerate(hashes) if h not in self.blocks]
        for i in new:
            self.blocks[hashes[i]] = self.host.array[host_slot + i].copy()
        return len(new)

    async def load(self, hashes: Sequence[int], first: int, count: int, host_slot: int) -> int:
        count = min(count, self.match(hashes) - first)
        for i in range(max(0, count)):
            self.host.array[host_slot + i] = self.blocks[hashes[first + i]]
        return max(0, count)


def test_a_run_comes_from_l2_as_far_as_it_holds_then_from_l3() -> None:
    async def run() -> None:
        shared = FakeStore()
        a, b = _store(shared), _store(shared)
        await a.start(), await b.start()
        chain = _chain(12)
        data = _fill(a, 12)
        assert await a.save(chain, HASHER.root, 0) == 12
        l2 = DictL2(b.host)
        b.host.array[:5] = data[:5]
        assert await l2.save(chain[:5], HASHER.root, 0) == 5  # this worker's disk has the first 5
        stack = StackedTier(l2, b)
        assert stack.match(chain) == 5
        await stack.probe(chain)
        assert stack.match(chain) == 12 and stack.stored(chain) == 5  # a spill still owes L2 the rest
        b.host.array[:] = 0
        assert await stack.load(chain, 2, 10, 20) == 10
        assert np.array_equal(b.host.array[20:30], data[2:12])
        assert b.counters.loaded_blocks == 7  # blocks 5..11 came from L3
        a.close(), b.close()

    asyncio.run(run())


def test_l3_is_off_unless_configured_and_binds_loopback_by_default() -> None:
    assert load_config({}).l3 is None
    l3 = load_config({"l3": {"master": "10.0.0.5:50051"}}).l3
    assert l3 is not None and l3.bind_host == "127.0.0.1" and l3.segment_gb > 0
    with pytest.raises(ConfigError, match="l3.segmentgb"):
        load_config({"l3": {"master": "10.0.0.5:50051", "segmentgb": 4}})
    with pytest.raises(ConfigError, match="l3.master"):
        load_config({"l3": {"segment_gb": 4}})


class _Group:
    host_pool_path = "/nonexistent"
    num_host_slots = 4
    bytes_per_block = BPB
    block_size = 16


def test_without_mooncake_l3_stays_off_with_a_log_line(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import cache.l3_client
    from server.kv_disk import open_l3, tier_below_l1

    monkeypatch.setattr(cache.l3_client, "mooncake_available", lambda: "ImportError: no mooncake")
    config = load_config({"l3": {"master": "127.0.0.1:1"}})
    with caplog.at_level(logging.WARNING):
        store = asyncio.run(open_l3(config, _Group(), "salt"))  # type: ignore[arg-type]
    assert store is None
    assert "L3 (shared KV store) off" in caplog.text and "setup_l3.sh" in caplog.text
    assert tier_below_l1(None, None) is None
