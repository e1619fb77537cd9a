"""Direct I/O between extent files and host memory, in chunks that a thread pool runs side by side.

Direct I/O (``O_DIRECT``) moves bytes between the disk and our buffers without the page cache:
restoring hundreds of GB of KV through the page cache would evict what the host needs (the L1
pool is RAM too) and cost an extra copy. It needs the file offset, the length and the buffer
address aligned (``ALIGN`` covers every logical block size in use). Extent files keep offsets
and lengths aligned by padding; buffers are aligned when a host slot run starts on a page
boundary (``bytes_per_block`` a multiple of 4096), and otherwise go through a per-thread bounce
buffer (one memcpy, which costs far less than the disk). Filesystems without ``O_DIRECT``
(tmpfs on older kernels, some FUSE) get buffered I/O on the same code path.

Every function here is blocking and thread-safe (``pread``/``pwrite`` release the GIL, and so do
numpy's copies and xxhash over large buffers); ``cache/l2_store.py`` runs them on its pool.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cache.l2_format import ALIGN, align_up, block_checksum

MIB = 1 << 20


class ShortRead(EOFError):
    """The file ended before the bytes its header promised (truncated under us)."""


def open_direct(path: str, flags: int, *, direct: bool = True) -> tuple[int, bool]:
    """Open with ``O_DIRECT`` where the filesystem takes it; returns (fd, is_direct)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


class _Bounce(threading.local):
    buf: np.ndarray | None = None

    def get(self, nbytes: int) -> np.ndarray:
        if self.buf is None or len(self.buf) < nbytes:
            size = align_up(max(nbytes, 4 * MIB), MIB)
            self.buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)  # page aligned
        return self.buf[:nbytes]


_bounce = _Bounce()


def _is_aligned(arr: np.ndarray) -> bool:
    return arr.ctypes.data % ALIGN == 0 and arr.nbytes % ALIGN == 0


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ShortRead(f"file ends at {offset + done}, wanted {offset + len(view)}")
        done += got


def write_at(fd: int, is_direct: bool, offset: int, src: np.ndarray) -> None:
    """Write ``src`` (uint8, 1-D) at ``offset``; with direct I/O the tail is zero-padded to ALIGN
    (``offset`` must be aligned then)."""
    if not is_direct:
        _pwrite_all(fd, src, offset)
        return
    assert offset % ALIGN == 0, offset
    n = src.nbytes
    padded = align_up(n)
    if n == padded and _is_aligned(src):
        _pwrite_all(fd, src, offset)
        return
    buf = _bounce.get(padded)
    buf[:n] = src
    buf[n:] = 0
    _pwrite_all(fd, buf, offset)


def read_at(fd: int, is_direct: bool, offset: int, dst: np.ndarray) -> None:
    """Fill ``dst`` (uint8, 1-D) from ``offset``. With direct I/O an unaligned range is read as the
    aligned range around it (extent files are padded, so it exists) into the bounce buffer."""
    n = dst.nbytes
    if not is_direct:
        _pread_all(fd, dst, offset)
        return
    start = offset - offset % ALIGN
    end = align_up(offset + n)
    if start == offset and end == offset + n and _is_aligned(dst):
        _pread_all(fd, dst, offset)
        return
    buf = _bounce.get(end - start)
    _pread_all(fd, buf, start)
    dst[:] = buf[offset - start : offset - start + n]


def checksums(blocks: np.ndarray, bytes_per_block: int) -> list[int]:
    """xxh3_64 of each ``bytes_per_block`` row of a contiguous uint8 run."""
    view = blocks.data.cast("B")
    return [block_checksum(view[i : i + bytes_per_block]) for i in range(0, len(view), bytes_per_block)]


def byte_chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``nbytes``; every start is a multiple of ``chunk_bytes``."""
    return [(s, min(s + chunk_bytes, nbytes)) for s in range(0, nbytes, chunk_bytes)]


def block_chunks(first: int, count: int, blocks_per_chunk: int) -> list[tuple[int, int]]:
    """``(first_block, num_blocks)`` pieces of ``count`` blocks from ``first``."""
    end = first + count
    return [(b, min(blocks_per_chunk, end - b)) for b in range(first, end, blocks_per_chunk)]


def drop_cache(fd: int) -> None:
    """Ask the kernel to forget a buffered file's pages (no-op where unsupported)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


@dataclass(frozen=True, slots=True)
class DiskSpeed:
    """One sequential write + read of a scratch file (the disk's own speed, no L2 logic).
    ``read_*``: one read in flight (``dd iflag=direct``); ``read_bps_at_depth``: bytes/s of a
    read of the same file with that many reads in flight (1 included)."""

    write_bytes: int
    write_s: float
    read_bytes: int
    read_s: float
    is_direct: bool
    read_bps_at_depth: dict[int, float] = field(default_factory=dict)

    @property
    def write_bytes_per_s(self) -> float:
        return self.write_bytes / self.write_s if self.write_s > 0 else 0.0

    @property
    def read_bytes_per_s(self) -> float:
        return self.read_bytes / self.read_s if self.read_s > 0 else 0.0

    @property
    def best_read_bytes_per_s(self) -> float:
        """The fastest of the reads, whatever their depth."""
        return max([self.read_bytes_per_s, *self.read_bps_at_depth.values()])


def measure_read(fd: int, is_direct: bool, num_bytes: int, buffers: list[np.ndarray],
                 max_seconds: float = 10.0) -> tuple[int, float]:
    """Read ``num_bytes`` of an open file from offset 0 in ``len(buffers)`` streams that each take
    the next chunk (the buffers' size, aligned), so that many reads are in flight at once, as
    ``fio --rw=read --iodepth=N`` keeps them; one buffer is ``dd iflag=direct``. A read cut short
    by the end of the file ends it. Returns (bytes read, seconds); stops after ``max_seconds``."""
    chunk = len(buffers[0])
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    start = time.perf_counter()

    def stream(buf: np.ndarray) -> None:
        while time.perf_counter() - start < max_seconds:
            with lock:
                offset = state["next"]
                if offset >= num_bytes:
                    return
                state["next"] = offset + chunk
            got = os.preadv(fd, [buf[: min(chunk, align_up(num_bytes - offset))].data], offset)
            with lock:
                state["done"] += got
            if got < min(chunk, num_bytes - offset):
                return

    threads = [threading.Thread(target=stream, args=(buf,), name="l2-speed") for buf in buffers[1:]]
    for t in threads:
        t.start()
    stream(buffers[0])
    for t in threads:
        t.join()
    if not is_direct:
        drop_cache(fd)
    return state["done"], time.perf_counter() - start


def measure_sequential(directory: str, num_bytes: int, chunk_bytes: int = 16 * MIB,
                       max_seconds: float = 10.0, read_depths: tuple[int, ...] = ()) -> DiskSpeed:
    """Write then read ``num_bytes`` (rounded to chunks) in one stream, like ``dd oflag=direct``,
    then read it again with each of ``read_depths`` reads in flight (``measure_read``), then
    delete the file. Stops early after ``max_seconds`` per pass."""
    chunk_bytes = align_up(chunk_bytes)
    path = os.path.join(directory, f".l2-speed-{os.getpid()}-{threading.get_ident()}.tmp")
    num_buffers = max((1, *read_depths))
    buffers = [np.frombuffer(mmap.mmap(-1, chunk_bytes), dtype=np.uint8) for _ in range(num_buffers)]
    buf = buffers[0]
    buf[:] = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
    fd, is_direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        written = 0
        start = time.perf_counter()
        while written < num_bytes and time.perf_counter() - start < max_seconds:
            write_at(fd, is_direct, written, buf)
            written += chunk_bytes
        os.fdatasync(fd)
        write_s = time.perf_counter() - start
        if not is_direct:
            drop_cache(fd)
        done, read_s = measure_read(fd, is_direct, written, buffers[:1], max_seconds)
        at_depth = {}
        for depth in read_depths:
            got, seconds = measure_read(fd, is_direct, written, buffers[:depth], max_seconds)
            at_depth[depth] = got / seconds if seconds > 0 else 0.0
    finally:
        os.close(fd)
        os.unlink(path)
    return DiskSpeed(written, write_s, done, read_s, is_direct, at_depth)
