"""The pipelined restore reader (cache/l2_reader.py): exact bytes, short and partial reads, bad
files cut the restore, and the same outcome whatever the number of verify threads and of reads
in flight, in whatever order those reads end."""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from cache.l2_format import ALIGN, align_up, block_checksum
from cache.l2_io import ShortRead, open_direct
from cache.l2_reader import (
    BufferRing,
    RestoresFirst,
    Window,
    aligned_windows,
    read_windows,
    ring_bytes,
    ring_depth,
    window_blocks,
)
from cache.l2_store import InlineExecutor
from tests.l2.l2_helpers import HASHER, ODD_BPB, chain, files, fill, make_store, run

PAYLOAD_OFFSET = 3 * ALIGN  # as a header would leave it: aligned


def _extent_file(path: str, blocks: np.ndarray) -> list[int]:
    """A file laid out like an extent (aligned payload offset, padded to ALIGN); the checksums."""
    payload = blocks.tobytes()
    with open(path, "wb") as f:
        f.write(bytes(PAYLOAD_OFFSET) + payload + bytes(align_up(len(payload)) - len(payload)))
    bpb = blocks.shape[1]
    return [block_checksum(payload[i * bpb : (i + 1) * bpb]) for i in range(blocks.shape[0])]


def _windows(fd: int, is_direct: bool, dst: np.ndarray, sums: list[int], bpb: int, per: int,
             first: int = 0) -> list[Window]:
    """Windows of ``per`` blocks restoring blocks ``first..`` of the file into ``dst`` (rows)."""
    out = []
    for i in range(0, dst.shape[0], per):
        c = min(per, dst.shape[0] - i)
        out.append(Window(fd, is_direct, PAYLOAD_OFFSET + (first + i) * bpb, dst[i : i + c].reshape(-1),
                          sums[first + i : first + i + c]))
    return out


def _slots(num: int, bpb: int, shift: int = 0) -> np.ndarray:
    """``num`` rows of ``bpb`` bytes starting ``shift`` bytes into a page (host slots need not be
    aligned)."""
    raw = np.zeros(num * bpb + shift + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN + shift
    return raw[start : start + num * bpb].reshape(num, bpb)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("bpb", [ODD_BPB, 4 * ALIGN], ids=["odd-rows", "aligned-rows"])
@pytest.mark.parametrize("threads", [0, 1, 4])
@pytest.mark.parametrize("depth", [1, 3])
def test_restores_exact_bytes(tmp_path, direct: bool, bpb: int, threads: int, depth: int) -> None:
    blocks = np.random.default_rng(1).integers(0, 256, (40, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    fd, is_direct = open_direct(path, os.O_RDONLY, direct=direct)
    verify = ThreadPoolExecutor(threads) if threads else InlineExecutor()
    reads = ThreadPoolExecutor(depth)
    try:
        per = 7  # window edges fall inside pages
        ring = BufferRing(ring_depth(depth), ring_bytes(per * bpb))
        for shift in (0, 123):
            dst = _slots(33, bpb, shift)
            results = read_windows(_windows(fd, is_direct, dst, sums, bpb, per, first=5), ring, verify,
                                   reads=reads, depth=depth)
            assert results == [7, 7, 7, 7, 5]
            assert np.array_equal(dst, blocks[5:38])
    finally:
        os.close(fd)
        verify.shutdown()
        reads.shutdown()


def test_partial_reads_are_resumed(tmp_path, monkeypatch) -> None:
    """``preadv`` may return fewer bytes than asked (a signal, a slow device): the reader asks
    again for the rest."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(2).integers(0, 256, (20, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    real = os.preadv
    calls = []

    def dribbling(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        view = memoryview(buffers[0])
        return real(fd, [view[: min(len(view), 3 * ALIGN)]], offset)  # aligned, but short

    monkeypatch.setattr(os, "preadv", dribbling)
    fd, is_direct = open_direct(path, os.O_RDONLY)
    try:
        dst = _slots(20, bpb, 77)
        results = read_windows(_windows(fd, is_direct, dst, sums, bpb, 8), BufferRing(2, ring_bytes(8 * bpb)),
                               InlineExecutor())
    finally:
        os.close(fd)
    assert results == [8, 8, 4] and np.array_equal(dst, blocks)
    assert len(calls) > 3 * 3  # every window took several reads


@pytest.mark.parametrize("threads", [0, 1, 4])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_truncated_file_ends_the_restore_at_the_cut(tmp_path, threads: int, depth: int) -> None:
    """A short read at the end of a cut file: the windows before the cut are restored, whatever
    reads were in flight past it; the one it cuts is reported as ``ShortRead``, nothing after."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(3).integers(0, 256, (30, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    os.truncate(path, PAYLOAD_OFFSET + 17 * bpb)  # inside the third window of 8
    fd, is_direct = open_direct(path, os.O_RDONLY)
    verify = ThreadPoolExecutor(threads) if threads else InlineExecutor()
    reads = ThreadPoolExecutor(depth)
    try:
        dst = _slots(30, bpb)
        results = read_windows(_windows(fd, is_direct, dst, sums, bpb, 8), BufferRing(ring_depth(depth),
                               ring_bytes(8 * bpb)), verify, reads=reads, depth=depth)
    finally:
        os.close(fd)
        verify.shutdown()
        reads.shutdown()
    assert results[:2] == [8, 8] and len(results) == 3 and isinstance(results[2], ShortRead)
    assert np.array_equal(dst[:16], blocks[:16])


class CountingInline(InlineExecutor):
    """Inline, counting the windows handed to it."""

    def __init__(self) -> None:
        self.num = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[no-untyped-def, override]
        self.num += 1
        return super().submit(fn, *args, **kwargs)


def test_a_checksum_failure_stops_further_reads(tmp_path) -> None:
    bpb = ODD_BPB
    blocks = np.random.default_rng(4).integers(0, 256, (40, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    with open(path, "r+b") as f:  # one byte of block 11
        f.seek(PAYLOAD_OFFSET + 11 * bpb + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    fd, is_direct = open_direct(path, os.O_RDONLY)
    verify = CountingInline()
    try:
        results = read_windows(_windows(fd, is_direct, _slots(40, bpb), sums, bpb, 4),
                               BufferRing(2, ring_bytes(4 * bpb)), verify)
    finally:
        os.close(fd)
    assert results == [4, 4, 3]  # block 8 + 3 = 11 failed
    assert verify.num == 3  # windows 4.. were never read


def test_a_checksum_failure_with_reads_in_flight(tmp_path) -> None:
    """With several reads in flight, windows after a bad block may already be read; the result
    still ends at the bad block, and those windows are not reported."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(4).integers(0, 256, (40, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    sums[11] ^= 1  # as if block 11's bytes had changed
    fd, is_direct = open_direct(path, os.O_RDONLY)
    reads, verify = ThreadPoolExecutor(3), ThreadPoolExecutor(2)
    try:
        dst = _slots(40, bpb)
        results = read_windows(_windows(fd, is_direct, dst, sums, bpb, 4), BufferRing(ring_depth(3),
                               ring_bytes(4 * bpb)), verify, reads=reads, depth=3)
    finally:
        os.close(fd)
        reads.shutdown()
        verify.shutdown()
    assert results == [4, 4, 3] and np.array_equal(dst[:11], blocks[:11])


def _gated_preadv(monkeypatch, hold: int, until: int) -> tuple[list[int], threading.Event]:
    """``os.preadv`` where the read at offset ``hold`` waits until the read at ``until`` has
    returned (or raised); returns the offsets in the order their reads ended and the event."""
    real = os.preadv
    ended: list[int] = []
    released = threading.Event()

    def gated(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == hold:
            assert released.wait(5), "the later read never ran: reads were not in flight together"
        try:
            return real(fd, buffers, offset)
        finally:
            ended.append(offset)
            if offset == until:
                released.set()

    monkeypatch.setattr(os, "preadv", gated)
    return ended, released


def _page(offset: int) -> int:
    return offset - offset % ALIGN


@pytest.mark.parametrize("verify_threads", [0, 2])
def test_reads_that_end_out_of_order(tmp_path, monkeypatch, verify_threads: int) -> None:
    """The first window's read ends after the third's (one slow request): every block still
    lands in its own slot, verified, and the result lists the windows in chain order."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(6).integers(0, 256, (24, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    third = _page(PAYLOAD_OFFSET + 16 * bpb)
    ended, _ = _gated_preadv(monkeypatch, hold=PAYLOAD_OFFSET, until=third)
    fd, is_direct = open_direct(path, os.O_RDONLY)
    reads = ThreadPoolExecutor(3)
    verify = ThreadPoolExecutor(verify_threads) if verify_threads else InlineExecutor()
    try:
        dst = _slots(24, bpb, 99)
        results = read_windows(_windows(fd, is_direct, dst, sums, bpb, 8), BufferRing(ring_depth(3),
                               ring_bytes(8 * bpb)), verify, reads=reads, depth=3)
    finally:
        os.close(fd)
        reads.shutdown()
        verify.shutdown()
    assert ended.index(third) < ended.index(PAYLOAD_OFFSET)  # the reads did end out of order
    assert results == [8, 8, 8] and np.array_equal(dst, blocks)


def test_a_later_read_failing_first_does_not_cut_earlier_windows(tmp_path, monkeypatch) -> None:
    """The read past the end of a cut file fails while the first window's read is still in
    flight: the windows before the cut are restored all the same (the verified prefix does not
    depend on which read ended first)."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(7).integers(0, 256, (24, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    os.truncate(path, align_up(PAYLOAD_OFFSET + 16 * bpb))  # the third window is gone
    third = _page(PAYLOAD_OFFSET + 16 * bpb)
    ended, _ = _gated_preadv(monkeypatch, hold=PAYLOAD_OFFSET, until=third)
    fd, is_direct = open_direct(path, os.O_RDONLY)
    reads = ThreadPoolExecutor(3)
    try:
        dst = _slots(24, bpb)
        results = read_windows(_windows(fd, is_direct, dst, sums, bpb, 8), BufferRing(ring_depth(3),
                               ring_bytes(8 * bpb)), InlineExecutor(), reads=reads, depth=3)
    finally:
        os.close(fd)
        reads.shutdown()
    assert ended.index(third) < ended.index(PAYLOAD_OFFSET)
    assert results[:2] == [8, 8] and len(results) == 3 and isinstance(results[2], ShortRead)
    assert np.array_equal(dst[:16], blocks[:16])


def test_reads_in_flight_are_bounded_by_the_depth(tmp_path, monkeypatch) -> None:
    """At most ``depth`` reads are in the disk's hands at once (and more than one is)."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(8).integers(0, 256, (48, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    real = os.preadv
    lock = threading.Lock()
    now, peak = [0], [0]
    overlapped = threading.Event()

    def counted(fd: int, buffers: list[memoryview], offset: int) -> int:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
            if now[0] >= 2:
                overlapped.set()
        try:
            if offset == PAYLOAD_OFFSET:  # the first read ends only once a second one has started
                assert overlapped.wait(5), "no second read was issued while the first was in flight"
            return real(fd, buffers, offset)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(os, "preadv", counted)
    fd, is_direct = open_direct(path, os.O_RDONLY)
    reads, verify = ThreadPoolExecutor(8), ThreadPoolExecutor(2)  # more read threads than the depth
    try:
        dst = _slots(48, bpb)
        results = read_windows(_windows(fd, is_direct, dst, sums, bpb, 4), BufferRing(ring_depth(3),
                               ring_bytes(4 * bpb)), verify, reads=reads, depth=3)
    finally:
        os.close(fd)
        reads.shutdown()
        verify.shutdown()
    assert results == [4] * 12 and np.array_equal(dst, blocks)
    assert 2 <= peak[0] <= 3


def test_a_refused_verify_ends_the_restore_and_keeps_every_buffer(tmp_path) -> None:
    """A verify pool that refuses work (shut down under a restore): the restore ends at the
    first window with that error, and every read buffer is back in the ring for the next one."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(9).integers(0, 256, (16, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    fd, is_direct = open_direct(path, os.O_RDONLY)
    verify, reads = ThreadPoolExecutor(1), ThreadPoolExecutor(2)
    verify.shutdown()
    ring = BufferRing(ring_depth(2), ring_bytes(4 * bpb))
    try:
        results = read_windows(_windows(fd, is_direct, _slots(16, bpb), sums, bpb, 4), ring, verify,
                               reads=reads, depth=2)
    finally:
        os.close(fd)
        reads.shutdown()
    assert len(results) == 1 and isinstance(results[0], RuntimeError)
    assert ring.num_free == ring.depth  # none lost


def test_depth_above_one_needs_a_reads_executor() -> None:
    ring = BufferRing(1, ALIGN)
    with pytest.raises(ValueError, match="read depth"):
        read_windows([], ring, InlineExecutor(), depth=2)
    with pytest.raises(ValueError, match="read depth"):
        read_windows([], ring, InlineExecutor(), depth=0)


def test_reads_wait_for_a_free_buffer(tmp_path) -> None:
    """At most ``depth`` windows are read ahead of their verification: the ring bounds memory."""
    bpb = ODD_BPB
    blocks = np.random.default_rng(5).integers(0, 256, (24, bpb), dtype=np.uint8)
    path = str(tmp_path / "e.kv")
    sums = _extent_file(path, blocks)
    gate = threading.Event()
    in_flight = []
    lock = threading.Lock()
    peak = [0]

    class Held(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[no-untyped-def, override]
            with lock:
                in_flight.append(1)
                peak[0] = max(peak[0], len(in_flight))

            def held() -> int:
                gate.wait(5)
                with lock:
                    in_flight.pop()
                return int(fn(*args, **kwargs))

            return super().submit(held)

    fd, is_direct = open_direct(path, os.O_RDONLY)
    verify = Held(4)
    try:
        dst = _slots(24, bpb)
        ring = BufferRing(2, ring_bytes(4 * bpb))
        result: list[list[int | BaseException]] = []
        reader = threading.Thread(target=lambda: result.append(
            read_windows(_windows(fd, is_direct, dst, sums, bpb, 4), ring, verify)))
        reader.start()
        deadline = time.monotonic() + 5
        while peak[0] < 2 and time.monotonic() < deadline:  # however loaded the machine is
            reader.join(0.01)
        reader.join(0.1)
        assert reader.is_alive() and peak[0] == 2  # two windows read, the third waits for a buffer
        gate.set()
        reader.join(5)
    finally:
        os.close(fd)
        verify.shutdown()
    assert result == [[4] * 6] and np.array_equal(dst, blocks) and peak[0] <= 2


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("read_depth", [1, 2, 4])
def test_store_restores_the_same_whatever_the_threads(tmp_path, threads: int, read_depth: int) -> None:
    """The store with one verify thread or several, one read in flight or several: same bytes,
    same verified prefix, and a truncated extent is dropped, never restored past its cut."""
    d = str(tmp_path / f"t{threads}")
    store = make_store(d, io_threads=threads, read_depth=read_depth)
    c = chain(120)
    data = fill(store.host, 0, 120, seed=9)
    assert run(store.save(c[:50], HASHER.root, 0)) == 50
    assert run(store.save(c, HASHER.root, 0)) == 70  # a second extent: blocks 50..119
    store.host.array[:] = 0
    assert run(store.load(c, 0, 120, 130)) == 120
    assert np.array_equal(store.host.array[130:250], data)
    second = next(n for n in files(d) if "-70-" in n)
    os.truncate(os.path.join(d, second), os.path.getsize(os.path.join(d, second)) - 30 * ODD_BPB)
    store.host.array[:] = 0
    got = run(store.load(c, 0, 120, 130))
    assert 50 <= got < 120 and store.match(c) == 50  # the cut extent is dropped
    assert np.array_equal(store.host.array[130 : 130 + got], data[:got])
    store.close()
    assert second not in files(d)


@pytest.mark.parametrize(("io_threads", "read_depth", "depth", "verify"),
                         [(0, 2, 1, 0), (1, 2, 2, 1), (4, 2, 2, 4), (8, 2, 2, 4), (8, 1, 1, 3), (8, 4, 4, 6)])
def test_verify_threads_stop_at_the_read_buffers(tmp_path, io_threads: int, read_depth: int, depth: int,
                                                 verify: int) -> None:
    """A verify thread beyond the ring's buffers would never get a window: 8 io_threads restore
    with the same threads as 4. The inline store (virtual-time tests) reads one window at a time."""
    store = make_store(str(tmp_path), io_threads=io_threads, read_depth=read_depth)
    try:
        assert (store.read_depth, store.verify_threads) == (depth, verify)
    finally:
        store.close()


@pytest.mark.parametrize("bpb", [114_048, ODD_BPB, 4 * ALIGN, 12_345])
def test_windows_start_on_a_page_and_follow_each_other(bpb: int) -> None:
    """Windows cut at multiples of ``window_blocks`` begin on a page where such a cut fits, so
    each read starts where the previous ended (no page read twice)."""
    per = window_blocks(bpb, 16 << 20)
    assert 1 <= per <= max(1, (16 << 20) // bpb)
    pieces = aligned_windows(5, 3 * per + 7, per)
    assert sum(c for _, c in pieces) == 3 * per + 7 and pieces[0] == (5, per - 5)
    assert all(b + c == nb for (b, c), (nb, _) in itertools.pairwise(pieces))
    if bpb % 2 == 0:  # rows sharing a factor of 2 with ALIGN: a page-aligned cut fits in 16 MiB
        assert all((b * bpb) % ALIGN == 0 for b, _ in pieces[1:])


def test_a_save_waits_for_the_restore_in_progress(tmp_path) -> None:
    """``RestoresFirst``: a save's writes start only once no restore runs (a turn waits for its
    restore, nobody for a save), and a save still ends if restores never stop (``max_wait_s``)."""
    store = make_store(str(tmp_path), io_threads=2)
    c = chain(60)
    fill(store.host, 0, 60, seed=13)
    saved: list[int] = []
    saver = threading.Thread(target=lambda: saved.append(run(store.save(c, HASHER.root, 0))))
    gate = store._restores_first
    with gate.restoring():
        saver.start()
        saver.join(0.3)
        assert saver.is_alive() and saved == []  # held before its first write
        tmp = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        assert all(os.path.getsize(os.path.join(tmp_path, n)) == 0 for n in tmp)
    saver.join(10)
    assert saved == [60] and store.match(c) == 60 and gate.num_active == 0
    store.close()

    starved = RestoresFirst(max_wait_s=0.01)
    with starved.restoring():
        starved.wait_for_restores()  # returns after max_wait_s although the restore goes on
    inline = RestoresFirst(enabled=False)
    with inline.restoring():
        inline.wait_for_restores()  # the inline store never waits (its loop runs the restore)
