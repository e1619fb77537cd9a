"""L2 restores at the disk's speed: one stream of large aligned reads, copied and verified behind it.

A restore reads consecutive blocks of one or more extent files into consecutive host slots and
checks each block's xxh3_64 against its header (``cache/l2_format.py``). Three kinds of work:
the disk read, a copy out of the aligned read buffer (host slot runs of 114,048-byte rows start
anywhere in a page, so ``O_DIRECT`` cannot read into them), and the checksums. When each thread
did all three for its own chunk, one thread left the disk idle while it copied and hashed, and N
threads issued N reads at once that the disk served no faster than one stream (restore 0.93-1.40
GB/s against 2.02 GB/s raw on the H200 host; 0.29-0.36 against 0.80 on the 2-core build machine).

Here one reader thread (``read_windows``, on the store's one-thread reader executor) issues the
reads back to back, in chain order, each into the next free buffer of a ring (``BufferRing``:
page-aligned, one window plus the alignment slack each), and hands every filled buffer to the
verify pool, which copies the window's blocks into their slots, hashes them and returns the
buffer to the ring. So the disk has the next read as soon as the last one ends, like ``dd
iflag=direct``, while the CPU work runs beside it: the restore runs at the raw read speed as long
as copy and hash (several GB/s per thread) keep ahead of the disk. Verify threads only add CPU
for that copy and hash, so more of them are never slower than fewer; the number of reads in
flight stays one.

A window is whole blocks, so it is verified alone; windows are cut where a block starts on a page
(``window_blocks``), so their aligned byte ranges follow each other with no gap and no overlap,
except where no such cut fits in a window (rows whose size shares no factor of 2 with ``ALIGN``:
then neighbours overlap by less than a page, read twice). A window
whose slots and file range are both aligned (rows a multiple of 4096) is read straight into its
slots, with no copy. The first window that fails (a short read: the file was truncated; an I/O
error; a checksum) ends the restore there: no later window is read, and the result lists the
windows up to that one (``cache/l2_store.py`` turns it into the verified prefix and drops the
extent).

Every function here blocks; ``read_windows`` must not run on an event loop's thread unless the
store runs inline (``io_threads=0``, the virtual-time tests), where the verify "pool" is inline too.
"""

from __future__ import annotations

import math
import mmap
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from cache.l2_format import ALIGN, align_up, block_checksum
from cache.l2_io import read_at

# Read buffers: one being read and two being verified or waiting for a verify thread. A window's
# hash and copy take less than its read wherever the restore can keep up with the disk, and the
# second absorbs a slow one (a thread descheduled); a deeper ring would only hold memory.
RING_DEPTH = 3


@dataclass(frozen=True, slots=True)
class Window:
    """Blocks of one extent to restore in one read: ``dst`` (uint8, 1-D, contiguous: host slots)
    gets the file's bytes from ``offset``; ``checksums`` holds one expected xxh3_64 per block."""

    fd: int
    is_direct: bool
    offset: int
    dst: np.ndarray
    checksums: Sequence[int]

    @property
    def num_blocks(self) -> int:
        return len(self.checksums)


class BufferRing:
    """``depth`` page-aligned buffers of ``nbytes``, handed out and back across threads;
    ``acquire`` blocks while every buffer is out. Their pages are touched here, once: a first
    touch inside a restore costs a page fault per 4 KiB (16 MiB: several ms on a small VM)."""

    def __init__(self, depth: int, nbytes: int) -> None:
        if depth < 1 or nbytes < ALIGN:
            raise ValueError(f"a ring needs depth >= 1 and buffers of >= {ALIGN} bytes")
        self.nbytes = align_up(nbytes)
        self.depth = depth
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(depth):
            buf = np.frombuffer(mmap.mmap(-1, self.nbytes), dtype=np.uint8)
            buf[::ALIGN] = 0
            self._free.put(buf)

    def acquire(self) -> np.ndarray:
        return self._free.get()

    def release(self, buf: np.ndarray) -> None:
        self._free.put(buf)


def window_blocks(bytes_per_block: int, chunk_bytes: int) -> int:
    """Blocks per window: about ``chunk_bytes``, and a multiple of the blocks that span a whole
    number of ``ALIGN`` pages where that fits (32 blocks of 114,048 B), so windows cut at such
    multiples (``aligned_windows``) start on a page: the reads are then back to back with no
    page read twice, as one ``dd`` stream's are. Reads that overlapped by a page streamed at 1.39
    GB/s where back-to-back ones did 1.82 on the H200 host's disk."""
    per = max(1, chunk_bytes // bytes_per_block)
    period = ALIGN // math.gcd(bytes_per_block, ALIGN)
    return per // period * period if period <= per else per


def aligned_windows(first: int, count: int, per: int) -> list[tuple[int, int]]:
    """``(first_block, num_blocks)`` pieces of blocks ``first .. first+count-1`` of an extent,
    cut at multiples of ``per`` counted from the extent's block 0."""
    out = []
    b, end = first, first + count
    while b < end:
        nxt = min(end, (b // per + 1) * per)
        out.append((b, nxt - b))
        b = nxt
    return out


def ring_bytes(chunk_bytes: int) -> int:
    """A buffer for a window of up to ``chunk_bytes`` read as the aligned range around it."""
    return align_up(chunk_bytes) + 2 * ALIGN


def _aligned(arr: np.ndarray) -> bool:
    return arr.ctypes.data % ALIGN == 0 and arr.nbytes % ALIGN == 0


def _read(window: Window, buf: np.ndarray) -> np.ndarray | None:
    """Read the window: straight into its slots (returns None) where direct I/O allows that or
    the file is buffered, else its aligned range into ``buf`` (returns the view of its bytes)."""
    n = window.dst.nbytes
    if not window.is_direct or (window.offset % ALIGN == 0 and _aligned(window.dst)):
        read_at(window.fd, window.is_direct, window.offset, window.dst)
        return None
    start = window.offset - window.offset % ALIGN
    end = align_up(window.offset + n)
    if end - start > len(buf):
        raise ValueError(f"a {n}-byte window needs {end - start} bytes of buffer, the ring has {len(buf)}")
    read_at(window.fd, True, start, buf[: end - start])
    return buf[window.offset - start : window.offset - start + n]


def verify_into(window: Window, data: np.ndarray | None) -> int:
    """Check the window's blocks and put them in its slots; how many leading blocks match their
    checksums. ``data``: the window's bytes in a read buffer, or None when the read landed in the
    slots. Block by block, hash then copy: the copy reads the block from the CPU cache the hash
    just brought it into, so the restore's memory traffic is one read and one write per byte
    (copying the window and then hashing the slots reads it three times: 1 thread could not keep
    up with a 2 GB/s disk on the H200 host)."""
    dst = window.dst
    count = window.num_blocks
    bpb = dst.nbytes // count
    src = dst if data is None else data
    view = src.data.cast("B")
    for i in range(count):
        a, b = i * bpb, (i + 1) * bpb
        if block_checksum(view[a:b]) != window.checksums[i]:
            return i
        if data is not None:
            dst[a:b] = data[a:b]
    return count


def read_windows(windows: Sequence[Window], ring: BufferRing, verify: Executor) -> list[int | BaseException]:
    """Restore ``windows`` in order (module docstring). Returns, per window up to the first that
    failed, the number of leading blocks verified or the exception its read raised (``ShortRead``,
    ``OSError``); the windows after a failure are not read. Returns only once every copy it
    started has ended (the caller may reuse the slots then)."""
    failed = threading.Event()
    started: list[Future[int]] = []

    def copy_and_verify(window: Window, data: np.ndarray | None, buf: np.ndarray) -> int:
        try:
            got = verify_into(window, data)
        finally:
            ring.release(buf)
        if got < window.num_blocks:
            failed.set()
        return got

    error: BaseException | None = None
    try:
        for window in windows:
            buf = ring.acquire()  # waits while the ring's buffers are all being verified
            if failed.is_set():
                ring.release(buf)
                break
            try:
                data = _read(window, buf)
            except (OSError, EOFError, ValueError) as exc:
                ring.release(buf)
                error = exc
                break
            started.append(verify.submit(copy_and_verify, window, data, buf))
    finally:
        results: list[int | BaseException] = []
        for future in started:  # every copy ends before this returns, even on an unexpected raise
            raised = future.exception()
            results.append(raised if raised is not None else future.result())
    if error is not None:
        results.append(error)
    return _up_to_first_failure(results, windows)


def _up_to_first_failure(results: list[int | BaseException],
                         windows: Sequence[Window]) -> list[int | BaseException]:
    for i, res in enumerate(results):
        if isinstance(res, BaseException) or res < windows[i].num_blocks:
            return results[: i + 1]
    return results


class RestoresFirst:
    """The disk goes to restores first: a save's next write waits while a restore runs.

    A turn waits for its restore; nobody waits for a save (it is write-behind). Both share one
    disk, so a save beside a restore took about half its bandwidth: on the build machine a 91 MB
    restore took 140-175 ms alone and 255-320 ms with a save of the same size in flight. A write
    already issued still ends (at most the save pool's threads x ``chunk_bytes``), and a write
    waits at most ``max_wait_s`` at a time, so back-to-back restores slow saves down but never
    stop them. Off (``enabled`` False) where the store runs inline: a wait there would block the
    event loop that the restore needs."""

    def __init__(self, enabled: bool = True, max_wait_s: float = 0.5) -> None:
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._active = 0

    @property
    def num_active(self) -> int:
        return self._active

    @contextmanager
    def restoring(self) -> Iterator[None]:
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def wait_for_restores(self) -> None:
        """Before a save's write: until no restore runs (or ``max_wait_s`` has passed)."""
        if self.enabled:
            with self._cond:
                self._cond.wait_for(lambda: self._active == 0, self.max_wait_s)
