"""Pinning the L1 pool chunk by chunk (``rank/host_pin.py``) and the copies cut where chunks end.

CUDA's register is replaced by a recorder here (this host has no GPU); the H200 check of the
real thing is ``bench/l1_restore_gpu.py`` and ``bench/multi_gpu_run.py --kill-at`` (docs/cache.md).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from rank import host_pin, host_pool as host_pool_module
from rank.host_pin import PAGE, ChunkPin, chunk_pieces, chunk_slots, prefault
from rank.host_pool import HostPool

BPB = 3 * 1024 + 128  # a slot size that is no divisor of a page: 32 slots make a page-aligned group


class Driver:
    """Records what would have been registered: {ptr: size}, and every call in order."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.hold: threading.Event | None = None  # when set, a register waits for it
        self.entered = threading.Semaphore(0)

    def register(self, ptr: int, size: int) -> None:
        self.entered.release()
        if self.hold is not None:
            self.hold.wait(10)
        assert ptr not in self.live
        assert all(ptr + size <= p or p + s <= ptr for p, s in self.live.items()), "overlapping registers"
        self.live[ptr] = size
        self.calls.append(("register", ptr))

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, "unregister of a pointer never registered"
        del self.live[ptr]
        self.calls.append(("unregister", ptr))


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Driver]:
    d = Driver()
    monkeypatch.setattr(host_pin, "cuda_register", d.register)
    monkeypatch.setattr(host_pin, "cuda_unregister", d.unregister)
    monkeypatch.delenv(host_pin.PIN_DELAY_ENV, raising=False)
    yield d


@given(st.integers(1, 300_000), st.integers(1, 1 << 28))
def test_a_chunk_is_whole_slots_and_whole_pages_and_as_large_as_fits(bytes_per_block: int,
                                                                     target: int) -> None:
    n = chunk_slots(bytes_per_block, target)
    unit = PAGE // math.gcd(bytes_per_block, PAGE)
    assert n >= 1 and n % unit == 0 and n * bytes_per_block % PAGE == 0
    assert n == unit or n * bytes_per_block <= target < (n + unit) * bytes_per_block


def test_the_h200_slot_size_chunks_at_32_slots() -> None:
    """'medium' on the H200 host: 114,048 bytes a slot, 128 bytes past a page multiple."""
    n = chunk_slots(114_048)
    assert n % 32 == 0 and n * 114_048 <= host_pin.PIN_CHUNK_BYTES < (n + 32) * 114_048


@given(st.integers(0, 200), st.integers(0, 100), st.integers(1, 17))
def test_pieces_cover_a_transfer_once_and_never_cross_a_chunk(first: int, count: int, per_chunk: int) -> None:
    pieces = chunk_pieces(first, count, per_chunk)
    assert [i for a, b in pieces for i in range(a, b)] == list(range(count))
    for a, b in pieces:
        assert b > a and (first + a) // per_chunk == (first + b - 1) // per_chunk
    assert len(pieces) == len({(first + i) // per_chunk for i in range(count)})  # no needless cut


def _pool(tmp_path: Path, slots: int, **kw: object) -> HostPool:
    pool = HostPool(str(tmp_path / "l1"), slots * BPB, pin=True, pin_chunk_bytes=32 * BPB, **kw)  # type: ignore[arg-type]
    return pool


def test_open_registers_every_chunk_in_order_and_close_unregisters_each(tmp_path: Path,
                                                                        driver: Driver) -> None:
    pool = _pool(tmp_path, 100)
    pool.open(BPB)
    assert pool.tensor is not None and pool.pinned and pool.slots_per_chunk == 32
    base = pool.tensor.data_ptr()
    assert [p for _, p in driver.calls] == [base + i * 32 * BPB for i in range(4)]
    assert sorted(driver.live.values()) == [4 * BPB] + [32 * BPB] * 3  # 100 slots: 32+32+32+4
    assert all(p % PAGE == 0 for p in driver.live)
    pool.close()
    assert driver.live == {} and not pool.pinned
    assert [p for c, p in driver.calls if c == "unregister"] == [base + i * 32 * BPB for i in (3, 2, 1, 0)]


def test_a_background_pin_starts_only_when_asked_and_close_stops_it_between_chunks(
        tmp_path: Path, driver: Driver) -> None:
    pool = _pool(tmp_path, 32 * 6, background_pin=True)
    pool.open(BPB)
    assert driver.calls == [] and not pool.pinned  # open pinned nothing: the engine builds first
    driver.hold = threading.Event()
    pool.start_pin()
    pool.start_pin()  # idempotent: still one thread
    assert driver.entered.acquire(timeout=10)  # the first chunk's register is under way
    closing = threading.Thread(target=pool.close)
    closing.start()
    driver.hold.set()  # the chunk in progress finishes; the thread stops before the next one
    closing.join(10)
    assert not closing.is_alive()
    registered = [p for c, p in driver.calls if c == "register"]
    assert 1 <= len(registered) < 6
    assert driver.live == {}  # every chunk it registered was unregistered, nothing else


def _record_copies(monkeypatch: pytest.MonkeyPatch, pool: HostPool) -> list[tuple[int, int, bool]]:
    """Each copy the pool makes: (first slot, slots, non_blocking) of its host range."""
    assert pool.tensor is not None
    base = pool.tensor.data_ptr()
    seen: list[tuple[int, int, bool]] = []

    def record(rows: torch.Tensor, slots: torch.Tensor, *args: object) -> None:
        seen.append(((slots.data_ptr() - base) // BPB, len(slots), bool(args[-1])))

    monkeypatch.setattr(host_pool_module, "by_runs", record)
    monkeypatch.setattr(host_pool_module, "by_kernel", record)
    return seen


@given(st.data())
def test_no_copy_spans_two_chunks_and_dma_only_where_its_chunk_is_pinned(
        tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    tmp_path = tmp_path_factory.mktemp("pin")
    mp = pytest.MonkeyPatch()
    driver = Driver()
    mp.setattr(host_pin, "cuda_register", driver.register)
    mp.setattr(host_pin, "cuda_unregister", driver.unregister)
    mp.delenv(host_pin.PIN_DELAY_ENV, raising=False)
    pool = _pool(tmp_path, 32 * 5, background_pin=True)
    try:
        pool.open(BPB)
        assert pool._chunks is not None
        pinned_chunks = data.draw(st.integers(0, 5))
        for _ in range(pinned_chunks):  # the background thread's progress so far
            chunk = pool._chunks.done
            driver.register(pool._chunks.ptr + chunk * pool._chunks.chunk_bytes, pool._chunks.chunk_bytes)
            pool._chunks.done += 1
        first = data.draw(st.integers(0, 32 * 5 - 1))
        ids = data.draw(st.lists(st.integers(0, 999), unique=True, min_size=1, max_size=32 * 5 - first))
        seen = _record_copies(mp, pool)
        for to_device in (True, False):
            seen.clear()
            pool._copy(torch.empty(0), pool._slots(first, len(ids)), ids, first, to_device=to_device)
            assert sum(n for _, n, _ in seen) == len(ids)
            for slot, n, non_blocking in seen:
                assert slot // 32 == (slot + n - 1) // 32, f"slots {slot}..{slot + n - 1} span two chunks"
                assert non_blocking == (slot // 32 < pinned_chunks)
    finally:
        pool.close()
        mp.undo()
        assert driver.live == {}


def test_prefault_keeps_the_bytes_and_allocates_the_pages(tmp_path: Path) -> None:
    """The pool file is sparse; a prefault makes its pages real without writing to them (what L1
    held before a restart stays)."""
    path = str(tmp_path / "sparse")
    size = 64 * PAGE
    with open(path, "wb") as f:
        f.truncate(size)
    mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    mapping[:PAGE] = 7  # one page has contents; the other 63 are holes
    before = os.stat(path).st_blocks * 512
    if not prefault(mapping.data_ptr(), size):
        pytest.skip("madvise(MADV_POPULATE_WRITE) needs Linux 5.14")
    assert os.stat(path).st_blocks * 512 >= size > before
    assert int(mapping[:PAGE].min()) == 7 and int(mapping[PAGE:].max()) == 0


def test_the_simulated_pin_registers_nothing(tmp_path: Path, driver: Driver,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The test knob on a host without CUDA: the phase runs (and ends) but nothing is registered."""
    monkeypatch.setenv(host_pin.PIN_DELAY_ENV, "0.001")
    pool = HostPool(str(tmp_path / "l1"), 64 * BPB, pin=False, background_pin=True, pin_chunk_bytes=32 * BPB)
    pool.open(BPB)
    pool.start_pin()
    assert not pool.wait_pinned(10)  # ended, not pinned: nothing was registered
    assert pool.pin_seconds is not None and driver.calls == []
    assert ChunkPin(1 << 12, 1, 1, registers=False).summary().endswith("(simulated: no CUDA)")
    pool.close()


def test_the_heartbeat_shows_the_pin_until_it_ends(tmp_path: Path, driver: Driver) -> None:
    """Each chunk reports (done, chunks) on the pin's thread; the rank puts it in its heartbeat's
    progress (``/healthz``, per rank) and clears it when the last chunk is in."""
    from rank.rank_setup import RankStatus, _pin_progress

    status = RankStatus()
    status.phase = "ready"
    seen: list[str] = []

    def progress(done: int, chunks: int) -> None:
        _pin_progress(status, done, chunks)
        seen.append(status.progress)

    pool = _pool(tmp_path, 100, background_pin=True)
    pool.open(BPB)
    pool.start_pin(progress)
    assert pool.wait_pinned(10)
    pool.close()
    assert seen == [f"L1 pool pinned {n}/4 chunks" for n in (1, 2, 3)] + [""]
