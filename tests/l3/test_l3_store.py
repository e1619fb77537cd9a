"""L3Store against an in-process stand-in for Mooncake Store (``RemoteKV``): two stores sharing it
are two workers. What is restored is compared byte for byte; every fault ends in fewer blocks
restored (only verified ones), never an exception, and a hang turns L3 off instead of blocking."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time

import numpy as np

from cache.hashing import ChainHasher
from cache.host_slots import HostSlots
from cache.l2_format import L2Stamp
from cache.l3_format import HEADER_BYTES
from cache.l3_stack import StackedTier
from cache.l3_store import L3Store

BS = 16
BPB = 256
HASHER = ChainHasher(BS, b"test-salt")
STAMP = L2Stamp("test-salt", BS, BPB, "layout-a")


class FakeStore:
    """The shared store: objects by key, with the faults of a real one."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.objects: dict[str, bytes] = {}
        self.capacity = capacity
        self.hang_s = 0.0  # every call blocks this long (a dead master)
        self.vanished: set[str] = set()  # present for exists, absent for get (a killed holder)
        self.lock = threading.Lock()

    def client(self) -> FakeClient:
        return FakeClient(self)


class FakeClient:
    def __init__(self, store: FakeStore) -> None:
        self.store = store

    def _wait(self) -> None:
        if self.store.hang_s:
            time.sleep(self.store.hang_s)

    def register(self, address: int, nbytes: int) -> None:
        pass

    def exists(self, keys: list[str]) -> list[int]:
        self._wait()
        return [int(k in self.store.objects) for k in keys]

    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        self._wait()
        out = []
        with self.store.lock:
            for k, a, n in zip(keys, addresses, sizes, strict=True):
                if k not in self.store.objects and len(self.store.objects) >= self.store.capacity:
                    out.append(-200)
                    continue
                self.store.objects.setdefault(k, ctypes.string_at(a, n))
                out.append(0)
        return out

    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        self._wait()
        out = []
        for k, a, n in zip(keys, addresses, sizes, strict=True):
            obj = self.store.objects.get(k)
            if obj is None or k in self.store.vanished or len(obj) > n:
                out.append(-704)
                continue
            ctypes.memmove(a, obj, len(obj))
            out.append(len(obj))
        return out

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(shared: FakeStore, clock: Clock | None = None, stamp: L2Stamp = STAMP, **kw: object) -> L3Store:
    host = HostSlots.in_memory(BPB, 64)
    options: dict = {"staging_bytes": 8 * (HEADER_BYTES + BPB), "probe_timeout_s": 0.2, "call_timeout_s": 0.5,
                     "retry_s": 30.0, "prefill_tokens_per_s": 1.0}  # tiny blocks: restoring always pays
    options.update(kw)
    return L3Store(shared.client, stamp, host, HASHER.root, clock=clock or Clock(), **options)


def _chain(n: int, seed: int = 0) -> list[int]:
    return HASHER.hashes(np.arange(seed, seed + n * BS + 3, dtype=np.int32))[:n]


def _fill(store: L3Store, n: int, seed: int = 7) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (n, BPB), dtype=np.uint8)
    store.host.array[:n] = data
    return data


def test_a_chain_saved_by_one_worker_is_restored_verbatim_by_another() -> None:
    async def run() -> None:
        shared = FakeStore()
        a, b = _store(shared), _store(shared)
        assert await a.start() and await b.start()
        chain = _chain(20)  # 20 blocks: three staging rounds of 8
        data = _fill(a, 20)
        assert await a.save(chain, HASHER.root, 0) == 20
        assert await a.save(chain, HASHER.root, 0) == 0  # known: nothing written twice
        assert b.match(chain) == 0  # no I/O in match: b has not looked yet
        await b.probe(chain)
        assert b.match(chain) == 20
        assert await b.load(chain, 4, 16, 30) == 16
        assert np.array_equal(b.host.array[30:46], data[4:20])
        assert b.counters.loaded_blocks == 16 and b.counters.rejected_objects == 0
        a.close(), b.close()

    asyncio.run(run())


def test_a_garbled_object_ends_the_restore_before_it() -> None:
    async def run() -> None:
        shared = FakeStore()
        a, b = _store(shared), _store(shared)
        await a.start(), await b.start()
        chain = _chain(10)
        data = _fill(a, 10)
        await a.save(chain, HASHER.root, 0)
        key = a._key(chain[6])
        raw = bytearray(shared.objects[key])
        raw[HEADER_BYTES + 100] ^= 0x5A
        shared.objects[key] = bytes(raw)
        await b.probe(chain)
        b.host.array[:] = 0
        assert await b.load(chain, 0, 10, 0) == 6
        assert np.array_equal(b.host.array[:6], data[:6])
        assert not b.host.array[6:10].any()  # nothing unverified reached a host slot
        assert b.counters.rejected_objects == 1
        assert b.match(chain) == 6  # forgotten from there
        await b.probe(chain)
        assert b.match(chain) == 6  # and not asked for again for retry_s
        a.close(), b.close()

    asyncio.run(run())


def test_an_object_of_another_model_or_block_under_our_key_is_dropped() -> None:
    async def run() -> None:
        shared = FakeStore()
        a, b = _store(shared, stamp=L2Stamp("test-salt", BS, BPB, "layout-b")), _store(shared)
        await a.start(), await b.start()
        chain = _chain(4)
        _fill(a, 4)
        await a.save(chain, HASHER.root, 0)
        assert not any(k.startswith(f"dib/{b.digest:016x}/") for k in shared.objects)  # other keys
        for h in chain:  # planted under b's keys: foreign stamp inside
            shared.objects[b._key(h)] = shared.objects[a._key(h)]
        shared.objects[b._key(chain[0])] = shared.objects[a._key(chain[1])]
        await b.probe(chain)
        assert b.match(chain) == 4
        assert await b.load(chain, 0, 4, 0) == 0
        assert b.counters.rejected_objects == 1
        a.close(), b.close()

    asyncio.run(run())


def test_a_dead_master_turns_l3_off_for_a_while_without_blocking_turns() -> None:
    async def run() -> None:
        shared, clock = FakeStore(), Clock()
        a = _store(shared, clock)
        await a.start()
        chain = _chain(6)
        _fill(a, 6)
        await a.save(chain, HASHER.root, 0)
        shared.hang_s = 1.0
        began = time.perf_counter()
        await a.probe(_chain(6, seed=99))
        assert time.perf_counter() - began < 0.9  # bounded by probe_timeout_s, not the hang
        assert not a.up and a.counters.outages == 1 and a.counters.timeouts == 1
        assert a.match(chain) == 0
        assert await a.save(_chain(3, seed=5), HASHER.root, 0) == 0
        assert await a.load(chain, 0, 6, 0) == 0
        await a.probe(chain)  # still within retry_s: no call at all
        assert a.counters.outages == 1
        shared.hang_s = 0.0
        clock.now += 31
        await a.probe(chain)  # starts a reconnect in the background; the turn does not wait for it
        assert a._reconnect is not None
        await asyncio.wait_for(a._reconnect, 10)
        await a.probe(chain)  # and learns again what the store holds
        assert a.up and a.match(chain) == 6
        a.close()

    asyncio.run(run())


def test_a_full_pool_stores_fewer_blocks_and_restores_only_those() -> None:
    async def run() -> None:
        shared = FakeStore(capacity=5)
        a, b = _store(shared), _store(shared)
        await a.start(), await b.start()
        chain = _chain(12)
        data = _fill(a, 12)
        assert await a.save(chain, HASHER.root, 0) == 5
        assert a.counters.put_failures > 0 and a.up
        await b.probe(chain)
        assert b.match(chain) == 5
        assert await b.load(chain, 0, 12, 0) == 5
        assert np.array_equal(b.host.array[:5], data[:5])
        a.close(), b.close()

    asyncio.run(run())


def test_a_killed_holder_costs_the_blocks_it_held() -> None:
    async def run() -> None:
        shared = FakeStore()
        a, b = _store(shared), _store(shared)
        await a.start(), await b.start()
        chain = _chain(8)
        _fill(a, 8)
        await a.save(chain, HASHER.root, 0)
        shared.vanished = {a._key(h) for h in chain[3:]}
        await b.probe(chain)
        assert await b.load(chain, 0, 8, 0) == 3
        assert b.counters.get_failures == 1 and b.up
        a.close(), b.close()

    asyncio.run(run())


def test_a_restore_slower_than_prefill_is_not_matched() -> None:
    async def run() -> None:
        shared = FakeStore()
        a = _store(shared, prefill_tokens_per_s=1e15)
        await a.start()
        chain = _chain(4)
        _fill(a, 4)
        await a.save(chain, HASHER.root, 0)
        assert a.stored(chain) == 4 and a.match(chain) == 0
        a.prefill_tokens_per_s = 1.0
        assert a.match(chain) == 4
        a.close()

    asyncio.run(run())


def test_no_master_at_start_leaves_l3_off_and_the_stack_still_works() -> None:
    async def run() -> None:
        def refuse() -> FakeClient:
            raise ConnectionError("master unreachable")

        host = HostSlots.in_memory(BPB, 16)
        l3 = L3Store(refuse, STAMP, host, HASHER.root)
        assert not await l3.start() and l3.off_reason is not None
        stack = StackedTier(None, l3)
        chain = _chain(3)
        await stack.probe(chain)
        assert stack.match(chain) == 0 and stack.stored(chain) == 3
        assert await stack.save(chain, HASHER.root, 0) == 0
        assert await stack.load(chain, 0, 3, 0) == 0
        l3.close()

    asyncio.run(run())
