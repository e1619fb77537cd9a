"""Page-locking the L1 host pool chunk by chunk (``HostPool`` owns one ``ChunkPin``).

Why chunks: ``cudaHostRegister`` holds the CUDA driver while it runs. One call for a whole
48 GiB pool held it 35.6 s on an H200 host, and everything else the rank asked of the driver
waited: its engine build (ready in 38 s instead of 5.8 s) and, after a rank SIGKILL, the new
group's start (13.8 s instead of 3.3 s). Registered in chunks of about ``PIN_CHUNK_BYTES`` one
after another, by a thread that starts once the rank's engine is built and its group joined
(``rank/rank_setup.py``), the driver is held for one chunk at a time and steps run in between.

Why aligned: a copy whose host range spans two registrations fails with
``cudaErrorInvalidValue`` (measured on that host), so a chunk is a whole number of slots and of
pages (``chunk_slots``) and the pool cuts every copy where a chunk ends (``chunk_pieces``). A
chunk is either registered or not; a copy into one that is not yet registered is the pageable
(synchronous) copy, correct and slower.

Why prefault first: on a fresh ``/dev/shm`` file most of a register's time is the kernel
allocating and zeroing the file's pages as the driver faults them in. On the H200 host, 8 GiB:
``madvise(MADV_POPULATE_WRITE)`` 3.3 s, then the register 0.3 s (0.7 s with a first-use
warm-up), unregister 0.1 s (transparent huge pages for shmem were off there). The madvise
(Linux 5.14+) runs outside the driver and leaves the bytes as they are: a restarted group's pool
keeps what L1 held. Where the kernel lacks it the register faults the pages itself, as before.

``DIB_HOST_POOL_PIN_S_PER_GIB`` (TEST ONLY) stretches each chunk's phase by that many seconds
per GiB, so the behaviour shows on a host without CUDA; ``registers`` is then false and nothing
is registered.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable

from rank.host_budget import GIB

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
PIN_CHUNK_BYTES = 128 << 20  # one prefaulted register held the driver <= 16 ms on the H200 host
PIN_DELAY_ENV = "DIB_HOST_POOL_PIN_S_PER_GIB"  # TEST ONLY (module docstring)
MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.13


def chunk_slots(bytes_per_block: int, target_bytes: int = PIN_CHUNK_BYTES) -> int:
    """Slots per chunk: the most whole slots within ``target_bytes`` whose bytes are a whole number
    of pages (at least one such group, however large)."""
    unit = PAGE // math.gcd(bytes_per_block, PAGE)  # slots per page-aligned group
    return max(unit, target_bytes // bytes_per_block // unit * unit)


def chunk_pieces(first_slot: int, count: int, slots_per_chunk: int) -> list[tuple[int, int]]:
    """(start, end) index ranges of a transfer of ``count`` consecutive slots from ``first_slot``,
    cut where a chunk ends; in order, covering ``range(count)`` once."""
    pieces: list[tuple[int, int]] = []
    start = 0
    while start < count:
        end = min(count, start + slots_per_chunk - (first_slot + start) % slots_per_chunk)
        pieces.append((start, end))
        start = end
    return pieces


_libc: ctypes.CDLL | None = None


def prefault(ptr: int, size: int) -> bool:
    """Fault ``[ptr, ptr + size)`` of a shared mapping in, writable, without changing its bytes.
    False where the kernel cannot (the register then faults the pages in itself)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    rc = _libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_int(MADV_POPULATE_WRITE))
    return int(rc) == 0


def cuda_register(ptr: int, size: int) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes of the L1 host pool failed: error {int(err)}")


def cuda_unregister(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


class ChunkPin:
    """The pin phase of one mapping: chunks ``[i * chunk_bytes, ...)`` registered in order by ``run``.

    Invariants: chunks ``0 .. done - 1`` are registered (when ``registers``), no other chunk is;
    ``done`` only grows until ``unregister_all``; ``run`` checks ``stop`` between chunks."""

    def __init__(self, ptr: int, nbytes: int, chunk_bytes: int, *, registers: bool,
                 on_progress: Callable[[int, int], None] | None = None) -> None:
        if chunk_bytes <= 0 or nbytes <= 0:
            raise ValueError(f"chunk_bytes and nbytes must be positive, got {chunk_bytes}, {nbytes}")
        self.ptr, self.nbytes, self.chunk_bytes = ptr, nbytes, chunk_bytes
        self.registers = registers
        self.num_chunks = -(-nbytes // chunk_bytes)
        self.done = 0
        self.seconds: float | None = None  # the whole phase, once it has ended
        self.prefault_s = 0.0
        self.longest_hold_s = 0.0  # the longest single register: how long the driver was held
        self.prefaulted = True
        self._stop = threading.Event()
        self.on_progress = on_progress  # (chunks done, chunks) after each chunk: the rank's heartbeat

    @property
    def complete(self) -> bool:
        return self.done == self.num_chunks

    def is_pinned(self, chunk: int) -> bool:
        return self.registers and chunk < self.done

    def stop(self) -> None:
        """Ask ``run`` to end after the chunk it is on (the pool is closing)."""
        self._stop.set()

    def run(self) -> None:
        """Register every chunk in order, each prefaulted first (module docstring); raises on a
        failed register, leaving the chunks before it registered."""
        started = time.monotonic()
        delay_s_per_gib = float(os.environ.get(PIN_DELAY_ENV) or 0)
        if delay_s_per_gib > 0:
            log.warning("%s: TEST knob, the L1 pool's pin takes %.1f s longer", PIN_DELAY_ENV,
                        delay_s_per_gib * self.nbytes / GIB)
        for chunk in range(self.done, self.num_chunks):
            if self._stop.is_set():
                return
            ptr = self.ptr + chunk * self.chunk_bytes
            size = min(self.chunk_bytes, self.nbytes - chunk * self.chunk_bytes)
            if delay_s_per_gib > 0:
                time.sleep(delay_s_per_gib * size / GIB)
            if self.registers:
                t0 = time.monotonic()
                self.prefaulted = self.prefaulted and prefault(ptr, size)
                t1 = time.monotonic()
                cuda_register(ptr, size)
                self.prefault_s += t1 - t0
                self.longest_hold_s = max(self.longest_hold_s, time.monotonic() - t1)
            self.done = chunk + 1
            if self.on_progress is not None:
                self.on_progress(self.done, self.num_chunks)
        self.seconds = time.monotonic() - started

    def summary(self) -> str:
        """What the rank logs once ``run`` has ended."""
        if not self.registers:
            return f"in {self.seconds or 0.0:.1f} s (simulated: no CUDA)"
        faulted = "" if self.prefaulted else " (not available: the register faulted)"
        return (f"in {self.seconds or 0.0:.1f} s: {self.num_chunks} chunks of {self.chunk_bytes >> 20} MiB, "
                f"prefault {self.prefault_s:.1f} s{faulted}, "
                f"driver held at most {self.longest_hold_s * 1e3:.0f} ms at once")

    def unregister_all(self) -> None:
        """Unregister every registered chunk, last first; call only once ``run`` has returned."""
        if self.registers:
            for chunk in reversed(range(self.done)):
                cuda_unregister(self.ptr + chunk * self.chunk_bytes)
        self.done = 0
