"""L1 restores: copies of KV from the shared host pool (L1) into a rank's GPU pool.

* **Restore** (``restore``): an admission whose prefix L1 holds further than the GPU imports the
  missing blocks into the rank and files them under the prefix it pinned. A restore whose
  blocks L1 lacks fills the session's L1 entry from the tier below first (L2, ``cache/kv_tier.py``),
  after any L1 write of the session in flight (``cache/l1_writes.py``).
* **Prefetch** (``start_prefetch``): the same, started from the session header alone, before the
  prompt is tokenized; the turn's admission waits for it and counts its blocks as L1 hits.

* **Folded restore** (``fold``): a restore small enough that its own round trip (command, reply,
  the event loop, then the turn's add: 0.6-1.1 ms on the H200 host) would cost more than its copy
  travels in the turn's add instead (``rank/engine.py`` ``FoldedImport``, ``rank/transfers.py``):
  the admission does not wait for it, and its reply, which reaches the cache before any output of
  the turn, files the blocks (``FoldedRestore``). A failed one lowers the turn's cached prefix on
  the rank, which computes the rest.

Imports check the epoch after every await: a restart voids what they carried. A restore's import
runs in a task of its own: the rank imports whether or not the turn still waits for its reply, so
a turn cancelled meanwhile (its client went away) leaves the import to end there, and the blocks
it hands back are released (they count as releasing from the cancellation on).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from cache.hashing import BlockHash
from cache.l1_index import L1Entry
from cache.l1_writes import L1Writes
from cache.restart import RANK_ERRORS, disable_l1_if_unsupported
from cache.sessions import Session, SessionId
from cache.state import CacheState
from cache.turns import Admission, Tier
from rank.engine import CapacityExhausted, FoldedImport
from rank.ids import BlockId, Epoch, HostSlot, Rank

log = logging.getLogger("cache.manager")

# A restore of at most this many bytes (from L1 alone) is folded into the turn's add: about 1.4 ms
# of copy at the H200's ~45 GB/s pinned rate, twice the round trip it saves, so the fold removes
# at least a third of such a restore's wall. ``FOLD_ENV`` overrides it (0: never fold), for A/B runs.
FOLD_MAX_BYTES = 64 << 20
FOLD_ENV = "DIB_L1_FOLD_MAX_BYTES"
_IMPORT_ATTEMPTS = 3  # an import the engine is short for is retried (see import_blocks)
_IMPORT_RETRY_S = 0.02  # x attempt number: about one engine step between tries


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore did: ``num_blocks`` imported and filed (0: none), ``num_l2`` of them read
    from the tier below first, in ``seconds`` (0.0 when no import was tried)."""

    num_blocks: int
    num_l2: int
    seconds: float


@dataclass(eq=False)
class FoldedRestore:
    """A restore travelling in its turn's add (``L1Restores.fold``). ``state``: ``pending`` until
    the reply comes; ``orphaned`` when the turn closed first after the add left (its blocks are
    released when the reply comes, and count as releasing until then); ``done``."""

    rank: Rank
    epoch: Epoch
    sid: SessionId
    entry: L1Entry  # held for reading until the reply (or until dropped unsent)
    chain: list[BlockHash]  # the prompt's chain up to the restored blocks' end
    first: int
    request: FoldedImport
    started: float
    on_filed: Callable[[bool, float], None]  # the admission's part: (filed, seconds)
    state: str = "pending"

    @property
    def count(self) -> int:
        return self.request.num_blocks


class L1Restores:
    """Owns the copies from L1 (see the module docstring). One event loop."""

    def __init__(self, state: CacheState, writes: L1Writes) -> None:
        self._s = state
        self._writes = writes
        self._prefetches: dict[SessionId, asyncio.Task[None]] = {}
        # Blocks a prefetch restored from L1 that no admission of the session has counted yet:
        # its next admission finds them resident but counts them as L1 (restored), not L0.
        self._prefetched: dict[SessionId, set[BlockHash]] = {}

    def reset(self) -> None:
        """A restart: prefetches and their counts of the old epoch mean nothing."""
        self._prefetches.clear()
        self._prefetched.clear()

    # ================================================================= restore

    async def restore(self, rank: Rank, epoch: Epoch, sid: SessionId, hashes: list[BlockHash], first: int,
                      count: int) -> Restored:
        """Copy blocks ``first .. first+count`` of the prompt's chain from L1 into ``rank`` and
        file them in its index (the caller moves its pin onto them before it awaits anything).
        None restored when L1 no longer holds them or the copy failed (the turn then computes
        them)."""
        s = self._s
        entry, m1 = s.l1.match(hashes)
        started = s.clock()
        num_l2 = 0
        restore_s = 0.0
        if m1 < first + count and s.l2 is not None:  # disk -> host first; a short fill restores less
            entry, m1, num_l2 = await self._fill_from_l2(sid, epoch, hashes, first, count)
            count = min(count, m1 - first)
        if entry is not None and count > 0 and m1 >= first + count:
            s.l1.begin_read(entry)  # ended by the import's task
            task = s.tasks.spawn(self._import_entry(rank, entry, first, count, epoch))
            try:
                ids = await asyncio.shield(task)
            except asyncio.CancelledError:
                self._orphan(rank, epoch, count, task)
                raise
            restore_s = s.clock() - started
            if ids is not None and s.epoch == epoch:
                self._file_restored(rank, hashes[: first + count], first, ids, sid)
                if s.metrics is not None:
                    s.metrics.restored_tokens.inc(count * s.block_size)
                    s.metrics.restore_seconds.observe(restore_s)
                return Restored(count, num_l2, restore_s)
        return Restored(0, 0, restore_s)

    def fold(self, rank: Rank, epoch: Epoch, sid: SessionId, hashes: list[BlockHash], first: int, count: int,
             fallback_blocks: int, on_filed: Callable[[bool, float], None]) -> FoldedRestore | None:
        """A restore of blocks ``first .. first+count`` to run in the turn's add, or None when it
        is not one to fold (too big, needs the tier below, or the client cannot): then
        ``restore``. ``on_filed(filed, seconds)`` runs when the reply comes while the turn is
        open: ``filed`` True when the blocks were imported and filed in L0 (the caller moves its
        pin onto them), False when the rank computes them (it kept ``fallback_blocks``)."""
        s = self._s
        max_bytes = int(os.environ.get(FOLD_ENV, FOLD_MAX_BYTES))
        if not getattr(s.client, "folds_imports", False) or count * s.client.bytes_per_block > max_bytes:
            return None
        entry, m1 = s.l1.match(hashes)
        if entry is None or m1 < first + count:
            return None
        s.l1.begin_read(entry)  # ended with the reply (or when dropped unsent)
        request = FoldedImport(HostSlot(entry.start_slot + first), count, fallback_blocks,
                               fallback_blocks * s.block_size, asyncio.get_running_loop().create_future())
        folded = FoldedRestore(rank, epoch, sid, entry, hashes[: first + count], first, request, s.clock(),
                               on_filed)
        request.reply.add_done_callback(lambda reply: self._folded(folded, reply))
        return folded

    def drop_fold(self, folded: FoldedRestore) -> None:
        """The turn closed before the fold's reply: an add never sent imported nothing; a sent one
        imports whether or not anyone waits, so its blocks count as releasing until the reply and
        are released then (as ``_orphan``)."""
        if folded.state != "pending":
            return
        s = self._s
        if not folded.request.sent:
            folded.state = "done"
            s.l1.end_read(folded.entry)
            folded.request.reply.cancel()
            return
        folded.state = "orphaned"
        if s.epoch == folded.epoch:
            s.releases.hold(folded.rank, folded.count)

    def _folded(self, folded: FoldedRestore, reply: asyncio.Future[list[BlockId]]) -> None:
        """The fold's reply (on the event loop, before any output of the turn is seen)."""
        if folded.state == "done":
            return
        s = self._s
        orphaned = folded.state == "orphaned"
        folded.state = "done"
        s.l1.end_read(folded.entry)
        ids: list[BlockId] | None = None
        if not reply.cancelled():
            exc = reply.exception()
            if exc is None:
                ids = reply.result()
            else:
                log.warning("folded L1 restore of %d blocks on rank %d failed: %s", folded.count,
                            folded.rank, exc)
                disable_l1_if_unsupported(s, exc)
        if s.epoch != folded.epoch:
            return  # that epoch's blocks are gone with its ranks
        rank = folded.rank
        if orphaned:
            s.tasks.spawn(s.releases.send(rank, ids or [], folded.epoch, num_held=folded.count))
            return
        seconds = s.clock() - folded.started
        if ids is not None:
            self._file_restored(rank, folded.chain, folded.first, ids, folded.sid)
            if s.metrics is not None:
                s.metrics.restored_tokens.inc(folded.count * s.block_size)
                s.metrics.restore_seconds.observe(seconds)
        folded.on_filed(ids is not None, seconds)

    async def _fill_from_l2(
        self, sid: SessionId, epoch: Epoch, hashes: list[BlockHash], first: int, count: int
    ) -> tuple[L1Entry | None, int, int]:
        """Make the session's L1 entry hold ``hashes[:first+count]`` from disk. Returns (the
        entry, the blocks it holds, how many of blocks ``first .. first+count`` came from disk)."""
        s = self._s
        assert s.l2 is not None
        if not await self._writes.wait_write(sid, epoch):
            return None, 0, 0
        fill = await s.l2.fill(sid, hashes, first + count, s.clock(), s.l1_score)
        if s.epoch != epoch or fill.entry is None:
            return None, 0, 0
        return fill.entry, fill.num_blocks, fill.loaded_within(first, count)

    async def _import_entry(self, rank: Rank, entry: L1Entry, first: int, count: int,
                            epoch: Epoch) -> list[BlockId] | None:
        """Import blocks ``first .. first+count`` of ``entry`` (held for reading by the caller;
        the hold ends here, when the rank is done with its slots). None when it failed."""
        s = self._s
        try:
            return await self.import_blocks(rank, HostSlot(entry.start_slot + first), count, epoch)
        except RANK_ERRORS as exc:
            log.warning("L1 restore of %d blocks on rank %d failed: %s", count, rank, exc)
            disable_l1_if_unsupported(s, exc)
            return None
        finally:
            s.l1.end_read(entry)

    def _orphan(self, rank: Rank, epoch: Epoch, count: int, task: asyncio.Task[list[BlockId] | None]) -> None:
        """The turn whose restore started ``task`` was cancelled (its client went away) before it
        took the imported block ids. The rank imports whether or not anyone waits for its reply,
        and the cache ref on each block it hands back is the cache's to give back, so the blocks
        count as releasing from now on and are released once the import ends (the turn's
        reservation, which covered them, is given back by its admission's undo)."""
        s = self._s
        if s.epoch != epoch:
            return  # that epoch's blocks are gone with its ranks
        s.releases.hold(rank, count)

        def ended(done: asyncio.Task[list[BlockId] | None]) -> None:
            ids = None if done.cancelled() or done.exception() is not None else done.result()
            if s.epoch == epoch:
                s.tasks.spawn(s.releases.send(rank, ids or [], epoch, num_held=count))

        task.add_done_callback(ended)

    async def import_blocks(self, rank: Rank, host_slot: HostSlot, count: int, epoch: Epoch) -> list[BlockId]:
        """``import_blocks`` that rides out blocks the engine still holds for a moment: releases
        in flight (waited for) and sequences aborted but not yet reaped (the engine frees them
        at its next step). Retried a bounded number of times; the last CapacityExhausted is raised."""
        for attempt in range(_IMPORT_ATTEMPTS):
            try:
                return await self._s.client.import_blocks(rank, host_slot, count)
            except CapacityExhausted:
                if attempt == _IMPORT_ATTEMPTS - 1 or self._s.epoch != epoch:
                    raise
                await self._s.releases.wait_idle(rank, epoch)
                await asyncio.sleep(_IMPORT_RETRY_S * (attempt + 1))
        raise AssertionError("unreachable")

    def _file_restored(
        self, rank: Rank, chain: list[BlockHash], first: int, ids: list[BlockId], sid: SessionId
    ) -> list[BlockHash]:
        """File ``ids`` (the imported blocks ``chain[first:]``) under their filed prefix
        ``chain[:first]`` (depth and parent links intact) and release the duplicates. Returns
        the hashes newly filed."""
        idx = self._s.l0[rank]
        known = idx.block_ids(chain[:first])  # they come back first among the duplicates: skipped
        duplicates = idx.insert(chain, known + list(ids), sid, self._s.clock())[first:]
        self._s.releases.release_later(rank, duplicates)
        dup = set(duplicates)
        return [h for h, block_id in zip(chain[first:], ids) if block_id not in dup]

    # ================================================================= prefetch

    def start_prefetch(self, session: Session) -> None:
        """Start restoring a known session's blocks from L1 to its home rank, when the rank has
        room without evicting (otherwise the turn's own admission decides)."""
        s = self._s
        rank = session.home_rank
        if rank is None or session.session_id in self._prefetches:
            return
        entry = s.l1.entries.get(session.session_id)
        if entry is None:
            return
        m0 = s.l0[rank].match(entry.hashes)
        num_restore = len(entry.hashes) - 1 - m0  # the last block is replayed by the next turn
        ledger = s.ledgers[rank]
        if num_restore <= 0 or ledger.plannable_free_blocks() < num_restore:
            return
        ledger.reserve(num_restore)
        # Hold the entry now, not when the task starts: a write-through in between could cut it
        # back and overwrite the very slots this import reads.
        s.l1.begin_read(entry)
        chain = entry.hashes[: m0 + num_restore]
        task = s.tasks.spawn(self._prefetch(session.session_id, rank, entry, chain, m0, s.epoch))
        self._prefetches[session.session_id] = task

    async def await_prefetch(self, sid: SessionId) -> None:
        """Let a prefetch of the session finish before its turn plans (never raises)."""
        pending = self._prefetches.pop(sid, None)
        if pending is not None:
            try:
                await asyncio.shield(pending)
            except Exception:  # a failed prefetch only means the turn restores or recomputes
                log.debug("prefetch for %s failed", sid, exc_info=True)

    def take_prefetched(self, adm: Admission, hashes: list[BlockHash]) -> None:
        """Blocks of the admission's resident (L0) prefix that a prefetch restored for this
        session count as L1 hits: they came from host memory, not from the GPU cache."""
        restored = self._prefetched.pop(adm.session_id, None)
        if not restored:
            return
        bs = self._s.block_size
        # the chain's start (a folded restore's blocks are counted though not filed yet)
        num_l0_blocks = (adm.num_cached_tokens - adm.cached_tokens_by_tier[Tier.L1]) // bs
        num_prefetched = sum(1 for h in hashes[:num_l0_blocks] if h in restored)
        adm.cached_tokens_by_tier[Tier.L1] += num_prefetched * bs
        adm.cached_tokens_by_tier[Tier.L0] -= num_prefetched * bs

    def forget_gone_sessions(self) -> None:
        for sid in [sid for sid in self._prefetched if self._s.sessions.get(sid) is None]:
            del self._prefetched[sid]

    async def _prefetch(
        self, sid: SessionId, rank: Rank, entry: L1Entry, chain: list[BlockHash], first: int, epoch: Epoch
    ) -> None:
        """Import ``chain[first:]`` from ``entry`` (held by ``start_prefetch``; released here)."""
        s = self._s
        count = len(chain) - first
        try:
            started = s.clock()
            try:
                ids = await s.client.import_blocks(rank, HostSlot(entry.start_slot + first), count)
            finally:
                s.l1.end_read(entry)
            restore_s = s.clock() - started
            if s.epoch != epoch:
                return
            if first and chain[first - 1] not in s.l0[rank].nodes:
                s.releases.release_later(rank, ids)  # its parent was evicted meanwhile
                return
            filed = self._file_restored(rank, chain, first, ids, sid)
            self._prefetched.setdefault(sid, set()).update(filed)
            if s.metrics is not None:
                s.metrics.restored_tokens.inc(len(filed) * s.block_size)
                s.metrics.restore_seconds.observe(restore_s)
        except RANK_ERRORS as exc:
            log.warning("L1 prefetch on rank %d failed: %s", rank, exc)
            disable_l1_if_unsupported(s, exc)
        finally:
            if s.epoch == epoch:
                s.ledgers[rank].unreserve(count)
            self._prefetches.pop(sid, None)
            s.queue.notify(rank)
