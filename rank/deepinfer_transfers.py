"""DeepInfer's cache refs and L1 copies, safe on the rank's transfer thread beside ``llm.step()``.

Why: through the adapter, DeepInfer ran L1 imports and exports on the loop thread
between steps, so a restore waited for the step in progress and the lockstep group stood for its
copy. The simulator put that at TTFT p95 16.6 s at 500K x 200 (3 s pacing), against 14.4 s with
copies beside the step (docs/loadtest.md). With this module the adapter declares
``concurrent_transfers`` and the worker's transfer thread (``rank/transfers.py``) runs imports,
exports and releases while the loop thread is inside ``llm.step()``.

Bookkeeping. DeepInfer's ``BlockManager`` is built for a second thread: the scheduler takes its
mutex around every allocation and free (``BlockManagerMutexAcquire``, csrc/engine/scheduler.hpp),
and the bindings of ``lock``, ``pin_blocks``, ``unpin_blocks`` and ``free_seq`` release the GIL
while they wait (csrc/engine/pybind_scheduler.cpp). An import allocates under ``lock()``
(``allocate_nolock`` throws part-way when short, so the free count is checked under the same
lock). The adapter's record of cache refs (``refs``: block -> pins the cache holds on it) is
changed by both threads: the loop thread pins a finished request's blocks, the transfer thread
releases and imports. Every check-and-change of it runs under ``_lock`` together with the
``BlockManager`` call that goes with it, so a release's validate-unpin-decrement cannot
interleave with the loop's pin of the same block. Lock order: ``_lock``, then the manager's
mutex; never the reverse. (Upstream's ``pin_blocks`` throws with its mutex held: a release's
and an export's ids are validated against ``refs`` first; ``pin_kept`` pins blocks the finished
sequence still holds, which DeepInfer frees only in a later call; an export's and a failed
import's unpin give back their own pins.)

Contention. The scheduler holds the manager's mutex through ``schedule``, including its vote
collective at vote points, so an import that comes then waits for it; after ``lock()`` returns
it needs the GIL back, so a step can wait up to one switch interval for it in turn. Upstream's
``lock()`` gives up after 20 s and throws: the transfer thread then fails the rank, as any
unexpected error there does (a schedule held that long means a peer is already stuck).

Bytes: the CUDA fence.

* An import writes blocks it takes from the free list. A block DeepInfer freed may still be
  used by a kernel the GPU has not run yet: under zero-overhead scheduling the host runs a step
  ahead, so a sequence that finished with step k's token is still in step k+1's batch (scheduled
  before its token was seen). A block DeepInfer frees during step call j was last used by
  kernels queued before call j, or was synchronized with on the host before the free: a finished
  sequence is freed in ``pre_sampler_sync`` of the call whose ``schedule`` listed it as finished
  (``finalize_seq``, engine/llm_engine.py), so not in that call's batch; an aborted or preempted
  one in a ``schedule`` that no longer batches it; a sequence's surplus blocks leave its table
  before the call's metadata is built (``_append_slot``); a clone's source blocks are unpinned in
  the same call, after ``clone_done_evt.synchronize()`` (``DeferredRelease``). ``fence()``
  records an event on the loop thread's stream (DeepInfer's: its CUDA graphs replay on the
  current stream, ``clone_and_zero_states_and_blocks_on_default_stream`` runs there too) after
  every ``llm.step()`` and ``flush_inflight_reqs()``, before the next call starts, and an import's
  copy waits for the latest record on the device. If the allocation follows a free in call j,
  the latest record at that point is at least the one after call j-1, which follows every kernel
  of call j-1 and earlier. The wait is short: after a prompt step (synced in place) the record is
  already past; after a decode step it completes with the GPU's step in progress (measured with
  stand-in kernels in DeepInfer's call order: ``bench/fence_wait.py``). It is conservative: the
  common free (``finalize_seq``) comes after the call's host sync with the previous step, so its
  blocks are idle already; only frees inside ``schedule`` (a preemption, a prompt aborted between
  chunks) can precede that sync. DeepInfer exposes no per-block free time that would let an
  import tell them apart, so every import waits for the latest record.
* A cache-held block is never written again (shared blocks are not written; a finished
  request's kept blocks are full, and the one position its in-flight ZOS step still writes,
  ``len - 1``, lies in the block after them). Its last write was queued before the host sync
  that read the finishing token (or before an import's own synchronize), and the backend learns
  the id only after that. So an export of cache-held blocks needs no fence; it pins them while it
  copies (a release mid-copy then frees them only at the end). Exports take cache-held blocks
  only (the only ones the cache ever exports): a running sequence's blocks may still be written.
* Copies run on a side stream the calling thread waits on; the compute stream is never
  synchronized. An import waits before it returns, so the blocks are in place before the backend
  can send the request that reads them.

What was not run: the CUDA side on DeepInfer (its kernels need SM100; no B200 here). The fence
argument rests on DeepInfer 0.1.0's source as cited; the bookkeeping runs against the compiled
``BlockManager`` and ``Scheduler`` on CPU (tests/deepinfer/test_deepinfer_native.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rank.engine import CapacityExhausted, EngineMisuse, checked_host_pool
from rank.ids import BlockId
from rank.pool_transfers import export_in_parts

if TYPE_CHECKING:
    import torch

    from rank.host_pool import HostPool


class DeepInferTransfers:
    """Cache refs and host-tier copies of one DeepInfer rank (module docstring). ``fence`` and
    ``pin_kept`` run on the loop thread; the rest on either thread."""

    def __init__(self, block_manager: Any, gpu_blocks: Callable[[], torch.Tensor], num_blocks: int,
                 host_pool: HostPool | None) -> None:
        import torch

        self._bm = block_manager
        self._gpu_blocks = gpu_blocks
        self.num_blocks = num_blocks
        self.host_pool = host_pool
        self.refs: dict[int, int] = {}  # block -> cache pins; changed only under _lock
        self._lock = threading.Lock()
        device = gpu_blocks().device
        cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if cuda else None)  # type: ignore[no-untyped-call]
        self._fence: torch.cuda.Event | None = (
            torch.cuda.Event() if cuda else None)  # type: ignore[no-untyped-call]
        self.fence()  # the first record creates the event: here, before a second thread can wait

    def fence(self) -> None:
        """Loop thread, after every ``llm.step()``/``flush_inflight_reqs()``: record "every kernel
        queued so far" on its stream (module docstring)."""
        if self._fence is not None:
            self._fence.record()

    # ------------------------------------------------------------------ refs

    def check_held(self, block_ids: Sequence[object], what: str) -> list[int]:
        """The ids as ints; EngineMisuse unless each is an int in range, given once and cache-held."""
        with self._lock:
            return self._check_held(block_ids, what)

    def _check_held(self, block_ids: Sequence[object], what: str) -> list[int]:
        seen: dict[int, None] = {}
        for b in block_ids:
            if not isinstance(b, (int, np.integer)) or isinstance(b, bool):
                raise EngineMisuse(f"{what}: block id {b!r} is not an int")
            if not 1 <= b < self.num_blocks:
                raise EngineMisuse(f"{what}: block id {b} outside 1..{self.num_blocks - 1}")
            if int(b) in seen:
                raise EngineMisuse(f"{what}: block id {b} given twice")
            seen[int(b)] = None
            if self.refs.get(int(b), 0) <= 0:
                raise EngineMisuse(f"{what}: block {b} holds no cache reference")
        return list(seen)

    def pin_kept(self, block_ids: list[int]) -> None:
        """Loop thread: a finished request's full blocks become cache refs (the caller vouches
        they are allocated: the sequence still holds them)."""
        with self._lock:
            self._bm.pin_blocks(block_ids)
            for b in block_ids:
                self.refs[b] = self.refs.get(b, 0) + 1

    def release(self, block_ids: Sequence[object]) -> None:
        with self._lock:
            blocks = self._check_held(block_ids, "release")
            self._bm.unpin_blocks(blocks)
            for b in blocks:
                left = self.refs[b] - 1
                if left:
                    self.refs[b] = left
                else:
                    del self.refs[b]

    # ------------------------------------------------------------------ copies

    def export(self, block_ids: Sequence[object], host_slot: int,
               between: Callable[[], None] | None = None) -> None:
        """Copy cache-held blocks to consecutive host slots, in parts with ``between`` after each
        but the last (``Engine.export_blocks``); pinned meanwhile."""
        pool = checked_host_pool(self.host_pool, host_slot, len(block_ids))
        with self._lock:
            blocks = self._check_held(block_ids, "export")
            self._bm.pin_blocks(blocks)
        try:
            export_in_parts(pool, self._gpu_blocks(), blocks, host_slot, self._stream, between)
        finally:
            self._bm.unpin_blocks(blocks)  # (a release meanwhile frees a block only here)

    def import_(self, host_slot: int, num_blocks: int) -> list[BlockId]:
        """Fresh blocks (one cache ref each) filled from consecutive host slots, or
        CapacityExhausted with nothing changed."""
        pool = checked_host_pool(self.host_pool, host_slot, num_blocks)
        self._bm.lock()
        try:
            free = int(self._bm.get_num_free_blocks())
            if free < num_blocks:
                raise CapacityExhausted(f"import of {num_blocks} blocks: {free} free")
            ids = sorted(int(b) for b in self._bm.allocate_nolock(num_blocks))  # sorted: longest runs
        finally:
            self._bm.unlock()
        try:
            pool.copy_to_device(self._gpu_blocks(), ids, host_slot, stream=self._stream, after=self._fence)
        except BaseException:
            if self._stream is not None:  # a part of the copy may be queued: let it land first
                with contextlib.suppress(Exception):
                    self._stream.synchronize()
            self._bm.unpin_blocks(ids)  # nobody learns these ids: give them back
            raise
        with self._lock:
            for b in ids:
                self.refs[b] = 1
        return cast("list[BlockId]", ids)
