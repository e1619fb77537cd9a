"""The L1 host pool: one shared ``/dev/shm`` file that every rank process maps.

Layout: ``[num_slots, bytes_per_block]`` uint8, one slot = one KV block row of the engines'
device pools. Because the file is shared (``MAP_SHARED``) and named after the rank group, any
rank can restore blocks another rank exported, which is what moving a session off an
overloaded rank needs. On CUDA the mapping is page-locked with ``cudaHostRegister`` so copies are
real DMA (pageable memory runs at a third of the link; measured on the H200 host, ``docs/cache.md``).

Copies are shaped for the link. A session's blocks sit in consecutive slots but in scattered
rows, so a transfer is split into runs of consecutive row ids (``copy_plan``). A run of at least
``DIRECT_MIN_RUN_BYTES`` is one ``cudaMemcpyAsync`` between its slots and its rows: the copy
engines alone, no kernel and no staging buffer. Shorter runs next to each other (a fragmented free
list) go together, since their slots are consecutive too: an export gathers their rows on the
device into one staging tensor and moves it with one copy, and an import moves their slots with
one copy into a staging buffer and scatters it with ``index_copy_``; a lone short run is copied
directly. Deciding per stretch, not on the transfer's average, matters for the common mix of a few
hundred single-row holes and one long run: the average said "per run" and paid ~10 us of launch
for each hole (a 1M-token import on the H200: 1.48x the contiguous copy against 1.22x).
Why the runs (``bench/restore_copy_paths.py``): beside a step, the scatter's
kernel waits for streaming multiprocessors that the step's kernels hold, and its index tensor is
uploaded synchronously first; per-run copies need neither. Both paths synchronize the stream they
ran on before returning, so an exported slot is readable by every process, an imported block is
in place before any later step reads it, and the slots may be reused as soon as the call returns.

Lifecycle: the supervisor picks the path (``host_pool_path``) and the byte budget
(``plan_host_pool_bytes``; both in ``rank/host_budget.py``, which imports no torch), passes both
to every rank, creates and locks the file when the group starts (``rank/shm_claim.py``: L1 starts
empty) and removes it when the group stops. A restart keeps it: the new epoch's ranks map the
same file, never zeroed, so what L1 held outlives the ranks. Each rank constructs
``HostPool(path, budget_bytes)`` and the engine calls ``open(bytes_per_block)`` once it knows its
row size; every rank computes the same ``num_slots = budget_bytes // bytes_per_block``, so ranks
can create/size the file concurrently without a handshake (O_CREAT + ftruncate to the same size
are idempotent).

Pinning is its own phase, slow at the seed's sizes and done in chunks (``rank/host_pin.py``):
``cudaHostRegister`` of a fresh ``/dev/shm`` mapping took 0.46-0.58 s per GiB on an H200 host and
holds the CUDA driver while it runs. Without ``background_pin`` ``open`` pins every chunk before it
returns (benchmarks, tests). With it (the rank worker's choice) the pool serves at once, pageable
(copies are then synchronous host copies: correct, about a third of the link's speed), and
``start_pin`` (called once the engine is built) starts a thread that registers chunk after chunk;
each copy takes the pinned path once the chunk it lies in is registered, and the rank logs
``pinned in N s`` when all are. Every copy is cut where a chunk ends (``_copy``): a copy whose
host range spans two registrations fails.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rank.host_budget import GIB
from rank.host_pin import PAGE, PIN_CHUNK_BYTES, PIN_DELAY_ENV, ChunkPin, chunk_pieces, chunk_slots

log = logging.getLogger(__name__)

# A run of at least this many bytes is copied by itself (module docstring); below it a copy's fixed
# cost (~10 us of launch) outweighs what its share of the kernel path costs.
DIRECT_MIN_RUN_BYTES = 1 << 20
PIN_JOIN_S = 5.0  # close() waits this long for the chunk being pinned, then leaves the mapping to exit


def runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, first index into ``block_ids``, length) of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            out.append((block_ids[start], start, i - start))
            start = i
    return out


def copy_plan(block_ids: Sequence[int], min_run: int) -> list[tuple[bool, int, int]]:
    """(direct, start, end) stretches of ``block_ids`` in order, covering it exactly once.

    ``direct``: every run (``runs``) of the stretch is copied by itself (runs of at least
    ``min_run`` rows, or a short run with no short neighbour); otherwise the stretch is two or more
    adjacent short runs, moved through one staging copy and an index kernel."""
    plan: list[tuple[bool, int, int]] = []
    short: list[tuple[int, int]] = []  # adjacent short runs not yet placed: (start, end)

    def place(direct: bool, start: int, end: int) -> None:
        if direct and plan and plan[-1][0]:
            plan[-1] = (True, plan[-1][1], end)  # adjacent direct stretches: one call
        else:
            plan.append((direct, start, end))

    def flush() -> None:
        if short:
            place(len(short) == 1, short[0][0], short[-1][1])
            short.clear()

    for _, i, n in runs(block_ids):
        if n >= min_run:
            flush()
            place(True, i, i + n)
        else:
            short.append((i, i + n))
    flush()
    return plan


def by_runs(rows: torch.Tensor, slots: torch.Tensor, block_runs: list[tuple[int, int, int]],
            to_device: bool, non_blocking: bool) -> None:
    """One copy per run (``runs``) between ``slots`` (host) and ``rows`` (device)."""
    for row, i, n in block_runs:
        if to_device:
            rows[row : row + n].copy_(slots[i : i + n], non_blocking=non_blocking)
        else:
            slots[i : i + n].copy_(rows[row : row + n], non_blocking=non_blocking)


def by_kernel(rows: torch.Tensor, slots: torch.Tensor, block_ids: Sequence[int], to_device: bool,
              non_blocking: bool) -> None:
    """One copy through a device staging tensor, gathered or scattered by a kernel."""
    idx = torch.tensor(list(block_ids), dtype=torch.int64, device=rows.device)
    if to_device:
        rows.index_copy_(0, idx, slots.to(rows.device, non_blocking=non_blocking))
    else:
        slots.copy_(rows.index_select(0, idx), non_blocking=non_blocking)


# _CPU_COPY: on CPU the rows are copied with numpy, on one thread. A torch copy from a second
# thread (the worker's transfer thread) starts an OpenMP team of its own whose threads spin after
# it, taking cores from the step's team: CPU steps ran ~20% slower with a 4 MiB torch copy every
# 150 ms beside them, and no slower with numpy (reference 'small', 2 cores, measured).


class HostPool:
    """A rank's view of the shared L1 pool (see the module docstring).

    Invariants: ``tensor`` exists exactly while open; ``num_slots * bytes_per_block`` bytes of the
    file are mapped; when pinned, each chunk of the mapping is registered with CUDA at most once
    and unregistered before the mapping goes; no copy's host range spans two chunks.
    """

    def __init__(self, path: str, budget_bytes: int, *, pin: bool | None = None,
                 background_pin: bool = False, pin_chunk_bytes: int = PIN_CHUNK_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.path = path
        self.budget_bytes = budget_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.bytes_per_block = 0
        self.num_slots = 0
        self.background_pin = background_pin
        self.pin_chunk_bytes = pin_chunk_bytes
        self.slots_per_chunk = 1  # copies are cut every this many slots (``_copy``)
        self.tensor: torch.Tensor | None = None
        self._chunks: ChunkPin | None = None  # the pin phase, where there is one
        self._pin_thread: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self.tensor is not None

    def open(self, bytes_per_block: int) -> None:
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
        if self.tensor is not None:
            if bytes_per_block != self.bytes_per_block:
                raise ValueError(f"host pool already open with {self.bytes_per_block} bytes/block")
            return
        num_slots = self.budget_bytes // bytes_per_block
        nbytes = num_slots * bytes_per_block
        self.bytes_per_block, self.num_slots = bytes_per_block, num_slots
        self.slots_per_chunk = max(1, num_slots)
        if num_slots == 0:
            self.tensor = torch.empty(0, bytes_per_block, dtype=torch.uint8)
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        flat = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        self.tensor = flat.view(num_slots, bytes_per_block)
        if self.pin or os.environ.get(PIN_DELAY_ENV):
            ptr = flat.data_ptr()
            if ptr % PAGE == 0:  # a mapping is page-aligned; one registration otherwise
                self.slots_per_chunk = min(num_slots, chunk_slots(bytes_per_block, self.pin_chunk_bytes))
            self._chunks = ChunkPin(ptr, nbytes, self.slots_per_chunk * bytes_per_block, registers=self.pin)
        log.info("L1 host pool %s: %d slots x %d bytes (%.2f GiB)", self.path, num_slots, bytes_per_block,
                 nbytes / GIB)
        if self._chunks is not None and not self.background_pin:
            self._chunks.run()

    def start_pin(self, on_progress: Callable[[int, int], None] | None = None) -> None:
        """Start the background pin (``background_pin``): once the engine is built, so the build
        never waits on the driver behind a register. ``on_progress(done, chunks)`` is called after
        each chunk, on the pin's thread. Idempotent; a no-op with nothing to pin."""
        if self._chunks is None or self._pin_thread is not None or self._chunks.complete:
            return
        chunks = self._chunks
        chunks.on_progress = on_progress
        log.info("L1 host pool %s: pinning in the background, %d chunks of %d MiB", self.path,
                 chunks.num_chunks, chunks.chunk_bytes >> 20)
        self._pin_thread = threading.Thread(target=self._pin_logged, args=(chunks,), name="l1-pin",
                                            daemon=True)
        self._pin_thread.start()

    @property
    def pinned(self) -> bool:
        """Every chunk registered: copies anywhere in the pool are DMA."""
        return self._chunks is not None and self._chunks.registers and self._chunks.complete

    @property
    def pin_seconds(self) -> float | None:
        """How long the pin phase took, once it has ended."""
        return self._chunks.seconds if self._chunks is not None else None

    def wait_pinned(self, timeout_s: float | None = None) -> bool:
        """Wait for a background pin (benchmarks that measure pinned copies). True when pinned."""
        if self._pin_thread is not None:
            self._pin_thread.join(timeout_s)
        return self.pinned

    def _pin_logged(self, chunks: ChunkPin) -> None:
        try:
            chunks.run()
        except Exception:  # the chunks not registered stay pageable: slower, still correct
            log.exception("pinning the L1 host pool failed after %d of %d chunks; the rest stays pageable",
                          chunks.done, chunks.num_chunks)
            return
        if chunks.complete:
            log.info("L1 host pool %s pinned %s", self.path, chunks.summary())

    def slot(self, host_slot: int) -> torch.Tensor:
        """One slot's bytes (a writable view into the shared mapping)."""
        return self._slots(host_slot, 1)[0]

    def _slots(self, host_slot: int, num_blocks: int) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("host pool is not open")
        if num_blocks < 1 or host_slot < 0 or host_slot + num_blocks > self.num_slots:
            raise ValueError(
                f"host slots [{host_slot}, {host_slot + num_blocks}) outside 0..{self.num_slots}")
        return self.tensor[host_slot : host_slot + num_blocks]

    def copy_from_device(self, device_pool: torch.Tensor, block_ids: Sequence[int], host_slot: int, *,
                         stream: torch.cuda.Stream | None = None) -> None:
        """Export: rows to consecutive slots (module docstring: per run or by a kernel), then wait.

        ``stream``: run (and wait for) the copy there instead of the current stream, so it
        overlaps the compute stream's kernels; the caller vouches that no queued kernel writes
        these rows (``rank/pool_transfers.py``)."""
        dst = self._slots(host_slot, len(block_ids))
        if device_pool.device.type == "cpu":  # numpy: see _CPU_COPY
            np.take(device_pool.numpy(), np.asarray(block_ids, dtype=np.int64), axis=0, out=dst.numpy())
            return
        stream = stream if stream is not None else torch.cuda.current_stream(device_pool.device)
        with torch.cuda.stream(stream):
            self._copy(device_pool, dst, block_ids, host_slot, to_device=False)
        stream.synchronize()

    def copy_to_device(self, device_pool: torch.Tensor, block_ids: Sequence[int], host_slot: int, *,
                       stream: torch.cuda.Stream | None = None,
                       after: torch.cuda.Event | None = None) -> None:
        """Import: consecutive slots to rows (module docstring: per run or by a kernel), then wait.

        ``stream``: as in ``copy_from_device``; ``after``: an event the copy waits for on the
        device first (the engine's fence for kernels that may still touch freed rows)."""
        src = self._slots(host_slot, len(block_ids))
        if device_pool.device.type == "cpu":  # numpy: see _CPU_COPY
            device_pool.numpy()[np.asarray(block_ids, dtype=np.int64)] = src.numpy()
            return
        stream = stream if stream is not None else torch.cuda.current_stream(device_pool.device)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            self._copy(device_pool, src, block_ids, host_slot, to_device=True)
        # Waiting here puts the data in place before the caller replies (so before any step
        # that reads these blocks is even queued), and frees the host slots for reuse.
        stream.synchronize()

    def _copy(self, rows: torch.Tensor, slots: torch.Tensor, block_ids: Sequence[int], host_slot: int, *,
              to_device: bool) -> None:
        """Queue the copy of ``slots`` (from ``host_slot`` on) on the current stream: cut where a pin
        chunk ends, then per run or by a kernel (module docstring). DMA where the chunk is pinned."""
        min_run = -(-DIRECT_MIN_RUN_BYTES // self.bytes_per_block)
        chunks, per_chunk = self._chunks, self.slots_per_chunk
        for a, b in chunk_pieces(host_slot, len(block_ids), per_chunk):
            pinned = chunks is not None and chunks.is_pinned((host_slot + a) // per_chunk)
            piece, piece_ids = slots[a:b], block_ids[a:b]
            for direct, start, end in copy_plan(piece_ids, min_run):
                ids = piece_ids[start:end]
                if direct:
                    by_runs(rows, piece[start:end], runs(ids), to_device, pinned)
                else:
                    by_kernel(rows, piece[start:end], ids, to_device, pinned)

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks.stop()
        if self._pin_thread is not None:
            self._pin_thread.join(PIN_JOIN_S)
            if self._pin_thread.is_alive():  # unmapping under cudaHostRegister would crash
                log.warning("L1 host pool %s: pin still running at close; left mapped", self.path)
                return
        if self._chunks is not None:
            self._chunks.unregister_all()
            self._chunks = None
        self.tensor = None  # the storage unmaps when the last reference goes
