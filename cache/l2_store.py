"""L2: the persistent KV tier on local disk (``l2_dir``, bounded by ``l2_gb``).

It moves chain blocks between host slots (``HostSlots``, the shared L1 pool) and extent files
(``cache/l2_format.py``): ``save`` spills a chain held in consecutive slots, ``load`` restores
a run of a chain into consecutive slots; a restore then goes on to the GPU through the rank's
``import_blocks``, so it is disk -> host -> GPU. Saves run on a thread pool in chunks that
overlap (several writes in flight, checksums computed alongside) with direct I/O
(``cache/l2_io.py``). Restores have threads of their own, so a restore never queues behind a
save's writes: one thread that keeps ``read_depth`` large reads in flight (2 by default) and a
verify pool that copies and hashes behind them (``cache/l2_reader.py``). The index
(``cache/l2_index.py``) lives in memory and is rebuilt from the files' headers at ``open``
(``cache/l2_scan.py``), so it survives a backend restart.

Failure is never the client's problem: disk full, a vanished directory, an unreadable, corrupt
or truncated file all end in "not cached" (``save`` stores nothing, ``load`` returns the prefix
it verified) plus a log line and a counter; the turn recomputes what is missing.

Threading: the public methods run on one event loop; the index is touched only there.
``io_threads``: the save pool's threads and the restore's verify threads (at most the restore's
read buffers: ``read_depth`` + 2; the reads have ``read_depth`` threads of their own). With
``io_threads=0`` every file operation runs inline on the loop's thread (``InlineExecutor``): the
tests on virtual time use it, as that loop cannot wait for real threads and an outcome must not
depend on how long a read took; one window is read at a time there. A call that is cancelled
still waits for its chunks in flight (they hold its file descriptor and write into its host
slots) before it lets the cancellation through, so the caller may reuse the slots as soon as the
call has returned or raised.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from cache.hashing import BlockHash
from cache.host_slots import HostSlots
from cache.l2_format import EXTENT_SUFFIX, ExtentHeader, L2Stamp
from cache.l2_index import L2Extent, L2Index
from cache.l2_io import (
    ShortRead,
    block_chunks,
    byte_chunks,
    checksums,
    drop_cache,
    open_direct,
    write_at,
)
from cache.l2_reader import (
    READ_DEPTH,
    BufferRing,
    RestoresFirst,
    Window,
    aligned_windows,
    read_windows,
    ring_bytes,
    ring_depth,
    window_blocks,
)
from cache.l2_scan import TMP_SUFFIX, ScanReport, extent_from_header, scan_into

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

MIB = 1 << 20
T = TypeVar("T")
P = ParamSpec("P")


@dataclass(slots=True)
class L2Counters:
    saved_blocks: int = 0
    saved_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evicted_extents: int = 0
    rejected_extents: int = 0  # corrupt or truncated found at load time
    write_errors: int = 0  # disk full, vanished directory, I/O errors on save
    read_errors: int = 0  # vanished or unreadable files on load
    skipped_saves: int = 0  # no room under the bound (or L2 off)


class InlineExecutor(Executor):
    """Runs each call when it is submitted, on the caller's thread (see the module docstring)."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            future.set_exception(exc)
        return future


def statvfs_free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class L2Store:
    """See the module docstring. ``min_free_bytes``: disk space left to others; the effective
    bound is ``min(max_bytes, our files + free space - min_free_bytes)``, re-read before every
    save, so a disk shared with other data shrinks L2 instead of failing writes."""

    shared = False  # one node's disk (cache/kv_tier.py)

    def __init__(
        self, directory: str, max_bytes: int, stamp: L2Stamp, host: HostSlots, *,
        io_threads: int = 4, chunk_bytes: int = 16 * MIB, direct: bool = True,
        read_depth: int = READ_DEPTH, min_free_bytes: int = 1 << 30, clock: Callable[[], float] = time.time,
        free_bytes: Callable[[str], int] = statvfs_free_bytes, header_key: bytes = b"",
    ) -> None:
        """``header_key``: the extent headers' HMAC key (``cache/l2_format.py``); the server
        passes one derived from its state key, b"" (tests, benches) makes the tag a checksum."""
        host.check_row_bytes(stamp.bytes_per_block)
        self.directory = directory
        self.max_bytes = max_bytes
        self.stamp = stamp
        self._header_key = header_key
        self.host = host
        self.index = L2Index(max_bytes)
        self.counters = L2Counters()
        self.chunk_bytes = max(MIB, chunk_bytes // MIB * MIB)
        self.blocks_per_chunk = max(1, self.chunk_bytes // stamp.bytes_per_block)
        self.direct = direct
        self.min_free_bytes = min_free_bytes
        self._clock = clock
        self._free_bytes = free_bytes
        self._pool: Executor = (ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="l2-io")
                                if io_threads > 0 else InlineExecutor())
        # Restores (cache/l2_reader.py): one thread issues the reads, ``read_depth`` threads
        # run them, and a ring of read buffers holds the windows being read and those being
        # copied out and verified. Verify threads beyond the ring's buffers would never get a
        # window, so there are at most that many (more io_threads cannot slow a restore down).
        inline = io_threads <= 0
        self.read_depth = 1 if inline else max(1, read_depth)
        depth = ring_depth(self.read_depth)
        self._reader: Executor = (InlineExecutor() if inline
                                  else ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2-read"))
        self._reads: Executor | None = (None if self.read_depth == 1 else ThreadPoolExecutor(
            max_workers=self.read_depth, thread_name_prefix="l2-pread"))
        self.verify_threads = 0 if inline else min(io_threads, depth)
        self._verify: Executor = (InlineExecutor() if inline else ThreadPoolExecutor(
            max_workers=self.verify_threads, thread_name_prefix="l2-verify"))
        self.blocks_per_window = window_blocks(stamp.bytes_per_block, self.chunk_bytes)
        self._ring = BufferRing(depth, ring_bytes(self.blocks_per_window * stamp.bytes_per_block))
        self._restores_first = RestoresFirst(enabled=io_threads > 0)
        self._seq = 0
        self._last_warning: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle

    def open(self) -> ScanReport:
        """Create the directory and rebuild the index from its files. Blocking (seconds for
        thousands of extents): call it in a thread. An unusable directory leaves L2 empty."""
        started = time.monotonic()
        try:
            os.makedirs(self.directory, exist_ok=True)
            report = scan_into(self.index, self.directory, self.stamp, self._header_key)
        except OSError as exc:
            log.warning("L2: cannot use %s (%s); the disk tier stays empty", self.directory, exc)
            return ScanReport()
        gib = 1 << 30
        log.info("L2 %s: %d extents, %d blocks, %.2f of %.2f GiB from %d files in %.2f s (%s)",
                 self.directory, len(self.index.extents), self.index.num_blocks, self.index.used_bytes / gib,
                 self.max_bytes / gib, report.num_files, time.monotonic() - started, report.summary())
        return report

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        if self._reads is not None:
            self._reads.shutdown(wait=True)
        self._verify.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    # ----------------------------------------------------------------- lookups

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of the chain on disk."""
        return self.index.match(hashes)

    def stored(self, hashes: Sequence[BlockHash]) -> int:
        return self.index.match(hashes)

    async def probe(self, hashes: Sequence[BlockHash]) -> None:
        """Nothing to learn: the index is in memory."""

    # ----------------------------------------------------------------- save

    async def save(self, hashes: Sequence[BlockHash], parent_hash: BlockHash, host_slot: int) -> int:
        """Spill a chain: block ``i`` of ``hashes`` is in host slot ``host_slot + i``; the blocks
        not yet on disk are written as one new extent. ``parent_hash`` is the root hash (the
        chain's block 0 parent). The caller keeps the slots unchanged until this returns.
        Returns the number of blocks newly stored (0 on any failure)."""
        k = self.index.match(hashes)
        n = len(hashes)
        if k >= n:
            return 0
        keep = self.index.path(hashes, k)
        now = self._clock()
        self.index.touch(keep, now)
        before = hashes[k - 1] if k else parent_hash
        header = ExtentHeader(self.stamp, k, before, list(hashes[k:]), [0] * (n - k))  # checksums: at write
        nbytes = header.file_bytes
        self._follow_free_space()
        victims = self.index.make_room(nbytes, keep)
        if victims is None:
            self.counters.skipped_saves += 1
            return 0
        self._delete(victims, evicted=True)
        self._seq += 1
        name = f"{hashes[k]:016x}-{n - k}-{time.time_ns():x}-{self._seq}{EXTENT_SUFFIX}"
        try:
            header = await self._write(name, header, host_slot + k)
        except OSError as exc:
            self.counters.write_errors += 1
            self._warn(f"write:{exc.errno}", "L2: spilling %d blocks failed (%s); they stay uncached on disk",
                       n - k, exc)
            if exc.errno == errno.ENOENT:
                self._directory_vanished()
            return 0
        finally:
            self.index.release(nbytes)
        extent = extent_from_header(name, header, self._clock())
        if not self.index.add(extent):  # its parent was evicted meanwhile, or another save won
            self._delete([extent])
            return 0
        self._touch_files(keep)
        stored = n - k - extent.first_live
        self.counters.saved_blocks += stored
        self.counters.saved_bytes += stored * self.stamp.bytes_per_block
        return stored

    def _write_chunk(self, fd: int, is_direct: bool, offset: int, data: np.ndarray) -> None:
        """One chunk of a save, after any restore in progress (``RestoresFirst``)."""
        self._restores_first.wait_for_restores()
        write_at(fd, is_direct, offset, data)

    async def _write(self, name: str, header: ExtentHeader, host_slot: int) -> ExtentHeader:
        path = os.path.join(self.directory, name)
        tmp = path + TMP_SUFFIX
        bpb = self.stamp.bytes_per_block
        payload = self.host.run(host_slot, header.num_blocks)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd, is_direct = await self._run(open_direct, tmp, flags, direct=self.direct)
        done = False
        try:
            writes = [self._submit(self._write_chunk, fd, is_direct, header.payload_offset + a, payload[a:b])
                      for a, b in byte_chunks(payload.nbytes, self.chunk_bytes)]
            sums = [self._submit(checksums, payload[i * bpb : (i + c) * bpb], bpb)
                    for i, c in block_chunks(0, header.num_blocks, self.blocks_per_chunk)]
            results = await _wait_all([*writes, *sums])
            header = header._replace(checksums=[s for part in results[len(writes):] for s in part])
            await self._run(_finish_file, fd, is_direct, header.encode(self._header_key), tmp, path)
            done = True
            return header
        finally:
            await self._run(os.close, fd)
            if not done:
                await self._run(_unlink_quietly, tmp)

    # ----------------------------------------------------------------- load

    async def load(self, hashes: Sequence[BlockHash], first: int, count: int, host_slot: int) -> int:
        """Restore blocks ``first .. first+count-1`` of the chain into host slots from
        ``host_slot``. Returns how many leading blocks were read and verified (0 .. count);
        the slots after those hold garbage. A bad extent is dropped (with everything after it)."""
        count = min(count, self.index.match(hashes) - first)
        if count <= 0:
            return 0
        runs = self.index.runs(hashes, first, count)
        self.index.touch(self.index.path(hashes, first + count), self._clock())
        extents = list({id(r.extent): r.extent for r in runs}.values())
        fds: dict[int, tuple[int, bool]] = {}
        windows: list[Window] = []
        where: list[tuple[L2Extent, int]] = []  # per window: its extent, its first block there
        verified = 0
        try:
            for extent in extents:
                try:
                    fds[id(extent)] = await self._on(self._reader, open_direct,
                                                     os.path.join(self.directory, extent.name),
                                                     os.O_RDONLY, direct=self.direct)
                except OSError as exc:
                    self._drop(extent, "cannot be opened", exc)
                    break  # the verified prefix cannot go past it
            slot = host_slot
            bpb = self.stamp.bytes_per_block
            for run in runs:
                opened = fds.get(id(run.extent))
                if opened is None:
                    break
                fd, is_direct = opened
                for b, c in aligned_windows(run.index, run.count, self.blocks_per_window):
                    dst = self.host.run(slot + b - run.index, c)
                    windows.append(Window(fd, is_direct, run.extent.payload_offset + b * bpb, dst,
                                          run.extent.checksums[b : b + c]))
                    where.append((run.extent, b))
                slot += run.count
            with self._restores_first.restoring():
                results = await self._on(self._reader, read_windows, windows, self._ring, self._verify,
                                         reads=self._reads, depth=self.read_depth)
        finally:
            for fd, _ in fds.values():
                await self._on(self._reader, os.close, fd)
        for (extent, b), window, res in zip(where, windows, results):  # the verified prefix
            if isinstance(res, BaseException):
                self._drop(extent, "is unreadable", res)
                break
            verified += res
            if res < window.num_blocks:
                self._drop(extent, f"failed its checksum at chain block {extent.first_block + b + res}", None)
                break
        self.counters.loaded_blocks += verified
        self.counters.loaded_bytes += verified * self.stamp.bytes_per_block
        self._touch_files(extents)
        return verified

    # ----------------------------------------------------------------- degrading

    def _drop(self, extent: L2Extent, what: str, exc: BaseException | None) -> None:
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(self.directory):
            self._directory_vanished()
            return
        if exc is None or isinstance(exc, ShortRead):
            self.counters.rejected_extents += 1
        else:
            self.counters.read_errors += 1
        removed = self.index.remove(extent)
        log.warning("L2: extent %s %s%s; dropped with %d dependent extents, the turn recomputes it",
                    extent.name, what, f" ({exc})" if exc else "", len(removed) - 1)
        self._delete(removed)

    def _directory_vanished(self) -> None:
        lost = self.index.clear()
        self._warn("vanished", "L2: directory %s is gone; forgot %d extents (recreated on the next spill)",
                   self.directory, len(lost))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError:
            pass

    def _follow_free_space(self) -> None:
        """Lower the bound to what the disk has room for (others may fill it); never above max_bytes."""
        try:
            free = self._free_bytes(self.directory)
        except OSError:
            return
        room = self.index.used_bytes + self.index.reserved_bytes + free - self.min_free_bytes
        bound = max(0, min(self.max_bytes, room))
        if bound < self.index.max_bytes:
            self._warn("full", "L2: the disk holding %s has room for %.2f GiB only; the L2 bound is lowered "
                       "from %.2f GiB to that", self.directory, bound / (1 << 30), self.max_bytes / (1 << 30))
        self._delete(self.index.set_bound(bound), evicted=True)

    def _warn(self, key: str, msg: str, *args: object) -> None:
        """Log a repeated failure at most once a minute per kind."""
        now = time.monotonic()
        if now - self._last_warning.get(key, -1e9) >= 60.0:
            self._last_warning[key] = now
            log.warning(msg, *args)

    def _delete(self, extents: Iterable[L2Extent], evicted: bool = False) -> None:
        names = [e.name for e in extents]
        if evicted:
            self.counters.evicted_extents += len(names)
        if names:
            self._pool.submit(_unlink_all, self.directory, names)

    def _touch_files(self, extents: Iterable[L2Extent]) -> None:
        """Carry the LRU order over a restart: the scan reads it back from the files' mtimes."""
        names = [e.name for e in extents]
        if names:
            self._pool.submit(_utime_all, self.directory, names)

    # ----------------------------------------------------------------- threads

    def _submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._on(self._pool, fn, *args, **kwargs)

    @staticmethod
    async def _on(executor: Executor, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        (result,) = await _wait_all([loop.run_in_executor(executor, lambda: fn(*args, **kwargs))])
        return cast(T, result)


async def _wait_all(futures: Sequence[Awaitable[Any]], return_exceptions: bool = False) -> list[Any]:
    """Results of every future, in order, after all of them ended, even if the caller is
    cancelled meanwhile (then CancelledError is raised once they have ended)."""
    ordered = [asyncio.ensure_future(f) for f in futures]
    pending = set(ordered)
    cancelled = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    results = []
    for f in ordered:
        exc = f.exception()
        if exc is not None and not return_exceptions:
            raise exc
        results.append(exc if exc is not None else f.result())
    return results


def _finish_file(fd: int, is_direct: bool, header: bytes, tmp: str, path: str) -> None:
    import numpy as np

    write_at(fd, is_direct, 0, np.frombuffer(header, dtype=np.uint8))
    os.fdatasync(fd)
    if not is_direct:
        drop_cache(fd)
    os.rename(tmp, path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _unlink_all(directory: str, names: list[str]) -> None:
    for name in names:
        _unlink_quietly(os.path.join(directory, name))


def _utime_all(directory: str, names: list[str]) -> None:
    for name in names:
        try:
            os.utime(os.path.join(directory, name))
        except OSError:
            pass
