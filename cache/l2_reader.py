"""L2 restores at the disk's speed: a stream of large aligned reads, copied and verified behind it.

A restore reads consecutive blocks of one or more extent files into consecutive host slots and
checks each block's xxh3_64 against its header (``cache/l2_format.py``). Three kinds of work:
the disk read, a copy out of the aligned read buffer (host slot runs of 114,048-byte rows start
anywhere in a page, so ``O_DIRECT`` cannot read into them), and the checksums. When each thread
did all three for its own chunk, one thread left the disk idle while it copied and hashed, and N
threads issued N reads at once that the disk served no faster than one stream (restore 0.93-1.40
GB/s against 2.02 GB/s raw on the H200 host; 0.29-0.36 against 0.80 on the 2-core build machine).

Here one thread (``read_windows``, on the store's one-thread reader executor) issues the reads in
chain order, each into the next free buffer of a ring (``BufferRing``: page-aligned, one window
plus the alignment slack each), and hands every filled buffer to the verify pool, which copies
the window's blocks into their slots, hashes them and returns the buffer to the ring. Up to
``depth`` reads are in flight at once (``READ_DEPTH``, each on a thread of the store's reads
pool): with one, the disk waited between reads for the reader to take the GIL back, hand the
buffer over and issue the next, and an NVMe drive's queue drained at the end of every read (the
H200 host: restores at 63-87% of a one-stream raw read, levelling off at 2.0-2.1 GB/s where raw
read 2.7). With two, the next read is already queued when one ends, as ``fio --iodepth=2`` keeps
it. CPU work runs beside the reads: the restore runs at the raw read speed as long as copy and
hash (several GB/s per thread; xxhash and numpy's copy release the GIL for these sizes) keep
ahead of the disk. Verify threads only add CPU for that copy and hash, and the store gives no
more of them than the ring has buffers, so more of them are never slower than fewer.

A window is whole blocks, so it is verified alone; windows are cut where a block starts on a page
(``window_blocks``), so their aligned byte ranges follow each other with no gap and no overlap,
except where no such cut fits in a window (rows whose size shares no factor of 2 with ``ALIGN``:
then neighbours overlap by less than a page, read twice). A window
whose slots and file range are both aligned (rows a multiple of 4096) is read straight into its
slots, with no copy. The first window that fails (a short read: the file was truncated; an I/O
error; a checksum) ends the restore there: no later window is started, and the result lists the
windows up to that one (``cache/l2_store.py`` turns it into the verified prefix and drops the
extent). Reads in flight may end in any order; a window is cut only by a failure before it, so
the outcome does not depend on which read ended first (``_FirstFailure``).

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

# Reads in flight by default (``read_windows``'s ``depth``), and the read buffers beyond them: two
# being verified or waiting for a verify thread. A window's hash and copy take less than its read
# wherever the restore can keep up with the disk, and the second absorbs a slow one (a thread
# descheduled); a deeper ring would only hold memory.
READ_DEPTH = 2
VERIFY_BUFFERS = 2


def ring_depth(read_depth: int) -> int:
    """Buffers for ``read_depth`` reads in flight and the windows verified behind them."""
    return read_depth + VERIFY_BUFFERS


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

    @property
    def num_free(self) -> int:
        return self._free.qsize()


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


class _FirstFailure:
    """The lowest index of a window that failed so far, across the reading and verify threads.
    A window after it is not read; every window before it is, whatever order reads end in, so the
    verified prefix does not depend on which read finished first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.index = math.inf

    def set(self, index: int) -> None:
        with self._lock:
            self.index = min(self.index, index)

    def after(self, index: int) -> bool:
        return index > self.index


def read_windows(windows: Sequence[Window], ring: BufferRing, verify: Executor, *,
                 reads: Executor | None = None, depth: int = 1) -> list[int | BaseException]:
    """Restore ``windows`` (module docstring) with up to ``depth`` reads in flight: the calling
    thread issues them in order, each on a ``reads`` thread (``depth`` > 1 needs ``reads``; at
    ``depth`` 1 the calling thread reads). Returns, per window up to the first that failed, the
    number of leading blocks verified or the exception its read raised (``ShortRead``,
    ``OSError``); no window after a failure is started. Returns only once every read and copy it
    started has ended (the caller may reuse the slots then)."""
    if depth < 1 or (depth > 1 and reads is None):
        raise ValueError(f"read depth {depth} needs depth >= 1 and, above 1, a reads executor")
    first_failure = _FirstFailure()
    issued = threading.Semaphore(depth)  # reads issued (or waiting for a buffer) and not yet ended

    def copy_and_verify(index: int, window: Window, data: np.ndarray | None, buf: np.ndarray) -> int:
        try:
            got = verify_into(window, data)
        finally:
            ring.release(buf)
        if got < window.num_blocks:
            first_failure.set(index)
        return got

    def read_one(index: int, window: Window) -> Future[int] | BaseException | None:
        """The window's verify, the exception its read raised, or None: not read (after a failure)."""
        buf = None
        try:
            buf = ring.acquire()  # waits while the ring's buffers are all being read or verified
            if first_failure.after(index):
                return None
            try:
                data = _read(window, buf)
            except (OSError, EOFError, ValueError) as exc:
                first_failure.set(index)
                return exc
            verified = verify.submit(copy_and_verify, index, window, data, buf)
            buf = None  # the verify returns it to the ring
            return verified
        except BaseException:
            first_failure.set(index)  # unexpected (a pool shut down): no later window starts
            raise
        finally:
            if buf is not None:
                ring.release(buf)
            issued.release()

    started: list[Future[Future[int] | BaseException | None]] = []
    try:
        for index, window in enumerate(windows):
            issued.acquire()
            if first_failure.after(index):
                issued.release()
                break
            if reads is None or depth == 1:
                started.append(_done(read_one(index, window)))
            else:
                started.append(reads.submit(read_one, index, window))
    finally:
        results = [_outcome(future) for future in started]  # every read and copy ends before this returns
    return _up_to_first_failure(results, windows)


def _done(value: Future[int] | BaseException | None) -> Future[Future[int] | BaseException | None]:
    future: Future[Future[int] | BaseException | None] = Future()
    future.set_result(value)
    return future


def _outcome(read: Future[Future[int] | BaseException | None]) -> int | BaseException | None:
    """A window's result once its read and verify have ended: blocks verified, an exception, or
    None where it was not read."""
    raised = read.exception()
    if raised is not None:
        return raised
    value = read.result()
    if not isinstance(value, Future):
        return value
    raised = value.exception()
    return raised if raised is not None else value.result()


def _up_to_first_failure(results: list[int | BaseException | None],
                         windows: Sequence[Window]) -> list[int | BaseException]:
    out: list[int | BaseException] = []
    for i, res in enumerate(results):
        if res is None:  # not read: a window before it failed (it is in ``out`` already)
            break
        out.append(res)
        if isinstance(res, BaseException) or res < windows[i].num_blocks:
            break
    return out


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
