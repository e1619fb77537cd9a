"""The reference engine's L1 <-> KV pool copies, safe beside a step in progress.

The rank worker's transfer thread (``rank/transfers.py``) calls ``export``/``import_`` while the
loop thread runs ``ReferenceEngine.step``. Block bookkeeping is shared through the
``BlockManager``'s lock. The bytes need no lock, because neither side touches rows the other
may be using:

* An import writes only blocks it takes from the free list. No step is using such a block: the
  engine holds no reference to it. On CPU that is the whole argument (a copy runs to completion
  on the calling thread). On CUDA a freed block may still have a *queued* kernel writing it,
  since the compute stream runs behind the host. Only a running sequence's blocks freed before
  the host synchronized with that sequence's last forward are exposed: a sequence aborted after
  a prefill chunk that sampled nothing (the host does not wait for such a chunk), and any
  sequence of the null model (whose steps never wait). The engine calls ``fence()`` before those
  frees. It records an event on the compute stream after every kernel queued so far, and an
  import's copy waits for that event on the device (an event not re-recorded since is long
  past, so in the common case that wait costs nothing; it never covers the step in progress).
  Every other free follows a host sync with the block's last write. A finished or failed
  sequence's blocks are freed after its step sampled (``sample`` returns host ints, which waits
  for the forward). ``release`` and the prefix refs of a request that was never admitted drop
  cache-held blocks, which are never written (next point).
* A release may run on the transfer thread (``rank/transfers.py`` says when), so a block can
  reach count 0 there after the loop thread dropped a sequence's ref on it. Such a block has no
  queued write: a cache ref exists only after a host sync with the block's last write
  (``to_cache`` after ``sample``, an import after its own synchronize), and shared blocks are
  never written. It may have a queued *read*: an aborted sequence's last prefill chunk reads its
  prefix blocks. The engine records the fence before it drops any running sequence's refs
  (``_finish_aborted``), not only before blocks reach 0, and the null model records it after
  every forward. So the record an import waits on (the latest, never an older one) follows
  every kernel of a sequence whose ref is gone, whichever thread frees the block later.
* An export reads only blocks the cache holds (the backend learns a block id from a finished
  request's ``kept_blocks`` or from an import's reply). Such a block is full and immutable:
  shared blocks are never written (``rank/engine.py``). Its last write was queued before the host
  sync that produced the finishing step's sampled tokens (``sample`` returns host ints), or
  before an import's own synchronize, and the backend saw the id only after that. While it
  copies, the export pins the blocks (``BlockManager.pin_held``), so a release that lands
  mid-copy cannot free a block that a step could then reallocate and write.

Copies run on a side stream, ``torch.cuda.Stream``, which the calling thread waits on
(``synchronize`` releases the GIL). The compute stream is never synchronized, so a transfer
never waits for the step's kernels. An import also waits on its stream before it returns, so
the blocks are in place before the backend can send the request that reads them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from rank.engine import CapacityExhausted, EngineStats, checked_host_pool

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from rank.block_manager import BlockManager
    from rank.host_pool import HostPool


EXPORT_PART_BYTES = 32 << 20  # ~0.6 ms of copy at the H200's ~54 GB/s: what a restore waits at most
EXPORT_PART_ENV = "DIB_EXPORT_PART_BYTES"  # tests and benchmarks: another part size


def export_part_bytes() -> int:
    return int(os.environ.get(EXPORT_PART_ENV, EXPORT_PART_BYTES))


def export_in_parts(host_pool: HostPool, pool: torch.Tensor, block_ids: list[int], host_slot: int,
                    stream: torch.cuda.Stream | None, between: Callable[[], None] | None) -> None:
    """Copy ``block_ids`` to consecutive host slots from ``host_slot`` on ``stream``, in parts of at
    most ``export_part_bytes()`` with ``between`` after each part but the last (one part without
    ``between``). The caller keeps the blocks pinned."""
    part = max(1, export_part_bytes() // host_pool.bytes_per_block) if between else len(block_ids)
    for start in range(0, len(block_ids), part):
        host_pool.copy_from_device(pool, block_ids[start : start + part], host_slot + start, stream=stream)
        if between is not None and start + part < len(block_ids):
            between()


class PoolTransfers:
    """Host tier operations of one engine's pool (see the module docstring). Thread-safe for
    one transfer thread beside the loop thread; ``fence`` runs on the loop thread only."""

    def __init__(self, blocks: BlockManager, host_pool: HostPool | None, device: torch.device) -> None:
        self.blocks = blocks
        self.host_pool = host_pool
        self.device = device
        cuda = device.type == "cuda"
        # (torch's stubs leave both constructors untyped)
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if cuda else None)  # type: ignore[no-untyped-call]
        self._fence: torch.cuda.Event | None = (
            torch.cuda.Event() if cuda else None)  # type: ignore[no-untyped-call]
        # torch creates an event at its first record: do that here, before a transfer thread
        # can wait on it, so the two threads never race on the creation (only on records,
        # which CUDA orders itself).
        self.fence()

    def fence(self) -> None:
        """Record "every kernel queued so far" on the compute stream. The loop thread calls it
        before it drops refs on blocks that a queued kernel may still write or read, whether or
        not they reach 0 then (a release on the transfer thread may free them later: module
        docstring)."""
        if self._fence is not None:
            self._fence.record(torch.cuda.current_stream(self.device))

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one cache ref on each block, atomically (either thread: ``rank/transfers.py``
        says when the transfer thread may; the module docstring why the bytes need no fence)."""
        self.blocks.release_held(list(block_ids), what="release")

    def export(self, pool: torch.Tensor, block_ids: Sequence[int], host_slot: int,
               between: Callable[[], None] | None = None) -> None:
        """Copy in parts of at most ``export_part_bytes``, calling ``between`` after each but the
        last (``Engine.export_blocks``); the blocks stay pinned throughout."""
        ids = list(block_ids)
        host_pool = checked_host_pool(self.host_pool, host_slot, len(ids))
        self.blocks.pin_held(ids, what="export")
        try:
            export_in_parts(host_pool, pool, ids, host_slot, self.stream, between)
        finally:
            self.blocks.unpin(ids)

    def import_(self, pool: torch.Tensor, host_slot: int, num_blocks: int) -> list[int]:
        host_pool = checked_host_pool(self.host_pool, host_slot, num_blocks)
        ids = self.blocks.try_allocate(num_blocks, cache_ref=True)
        if ids is None:
            raise CapacityExhausted(f"import of {num_blocks} blocks: {self.blocks.num_free_blocks} free")
        ids.sort()  # any free rows will do: in order, they form the longest runs (rank/host_pool.py)
        try:
            host_pool.copy_to_device(pool, ids, host_slot, stream=self.stream, after=self._fence)
        except BaseException:
            self.blocks.decref(ids, cache_ref=True)  # nobody learns these ids: give them back
            raise
        return ids

    def stats(self, last: EngineStats) -> EngineStats:
        return dataclasses.replace(last, num_free_blocks=self.blocks.num_free_blocks,
                                   num_cached_blocks=self.blocks.num_cached_blocks)
