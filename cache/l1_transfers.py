"""L1 transfers: every copy of KV between a rank's GPU pool and the shared host pool (L1).

* **Restore** (``restore``): an admission whose prefix L1 holds further than the GPU imports the
  missing blocks into the rank and files them under the prefix it pinned.
* **Prefetch** (``start_prefetch``): the same, started from the session header alone, before the
  prompt is tokenized; the turn's admission waits for it and counts its blocks as L1 hits.
* **Write-through** (``write_through_later``): a finished turn's new blocks are copied to L1 (and
  spilled to L2 behind it) after every turn (``l1_write_watermark``, 0 by default), so a later
  eviction drops them for free and a rank kill or a backend crash loses only the turns in flight.
  It never holds up a turn: one background export per rank at a time (a restore behind it waits
  for at most one export part on the rank), and a session's turns that finish meanwhile coalesce
  into one write of its latest chain.
* **Retire** (``evicted`` + ``retire``): blocks an admission or a growing reply evicted are
  written to L1 where it lacks their session's chain, then released.
* **Move** (``move``): a session handed to another rank goes through L1.
* **L2** (``cache/kv_tier.py``): every committed L1 write is spilled to disk
  (write-behind); a restore whose blocks L1 lacks fills the session's L1 entry from disk first;
  ``flush_to_l2`` writes idle sessions out at a graceful stop.

One write per session at a time (a later one waits for the earlier and copies only what that did
not). Transfers check the epoch after every await: a restart voids what they carried.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from cache.hashing import BlockHash
from cache.l0_index import Node
from cache.l1_index import L1Entry, WritePlan
from cache.restart import RANK_ERRORS, disable_l1_if_unsupported
from cache.sessions import Session, SessionId
from cache.state import CacheState
from cache.turns import Admission, Tier
from rank.engine import CapacityExhausted
from rank.ids import BlockId, Epoch, HostSlot, Rank

log = logging.getLogger("cache.manager")

_IMPORT_ATTEMPTS = 3  # an import the engine is short for is retried (see _import)
_IMPORT_RETRY_S = 0.02  # x attempt number: about one engine step between tries


@dataclass(frozen=True, slots=True, eq=False)
class ChainExport:
    """An evicted session's chain to write to L1 before its blocks are released: ``pinned`` is
    the filed prefix of it (one use held on its deepest node until the export is done)."""

    owner: SessionId
    chain_nodes: tuple[Node, ...]
    pinned: tuple[BlockHash, ...]


class L1Transfers:
    """Owns the copies to and from L1 (see the module docstring). One event loop."""

    def __init__(self, state: CacheState) -> None:
        self._s = state
        self._writes: dict[SessionId, asyncio.Event] = {}  # set when the session's write ends
        self._prefetches: dict[SessionId, asyncio.Task[None]] = {}
        # Blocks a prefetch restored from L1 that no admission of the session has counted yet:
        # its next admission finds them resident but counts them as L1 (restored), not L0.
        self._prefetched: dict[SessionId, set[BlockHash]] = {}
        # Write-through queue: the latest chain per session waiting for its rank's turn, and one
        # background export per rank at a time (``write_through_later``).
        self._queued: dict[SessionId, tuple[Rank, list[BlockHash], Epoch]] = {}
        self._rank_turns = [asyncio.Lock() for _ in range(state.num_ranks)]
        # Diagnostics (also in metrics): blocks dropped from a GPU with no L1 copy and exports
        # of evicted sessions that could not be written.
        self.num_evicted_unbacked_blocks = 0
        self.num_export_failures = 0

    def reset(self) -> None:
        """A restart: prefetches and their counts of the old epoch mean nothing (queued
        write-throughs of the old epoch find the epoch changed and do nothing)."""
        self._prefetches.clear()
        self._prefetched.clear()

    # ================================================================= restore

    async def restore(self, adm: Admission, hashes: list[BlockHash], first: int, count: int) -> bool:
        """Copy blocks ``first .. first+count`` of the prompt's chain from L1 into the rank and
        move the admission's pin onto them. False when L1 no longer holds them or the copy failed
        (the turn then computes them: they stay reserved)."""
        s = self._s
        rank, epoch = adm.rank, adm.epoch
        entry, m1 = s.l1.match(hashes)
        started = s.clock()
        num_l2 = 0
        if m1 < first + count and s.l2 is not None:  # disk -> host first; a short fill restores less
            entry, m1, num_l2 = await self._fill_from_l2(adm, hashes, first, count)
            count = min(count, m1 - first)
        ok = False
        if entry is not None and count > 0 and m1 >= first + count:
            s.l1.begin_read(entry)
            try:
                ids = await self.import_blocks(rank, HostSlot(entry.start_slot + first), count, epoch)
            except RANK_ERRORS as exc:
                log.warning("L1 restore of %d blocks on rank %d failed: %s", count, rank, exc)
                ids = None
                disable_l1_if_unsupported(s, exc)
            finally:
                s.l1.end_read(entry)
            adm.restore_s = s.clock() - started
            if ids is not None and s.epoch == epoch:
                idx = s.l0[rank]
                self._file_restored(rank, hashes[: first + count], first, ids, adm.session_id)
                idx.acquire(hashes[: first + count], adm.session_id, s.clock())  # move the pin
                idx.release_uses(hashes[:first])
                adm.num_used_blocks = first + count
                adm.cached_tokens_by_tier[Tier.L1] = (count - num_l2) * s.block_size
                adm.cached_tokens_by_tier[Tier.L2] = num_l2 * s.block_size
                ok = True
                if s.metrics is not None:
                    s.metrics.restored_tokens.inc(count * s.block_size)
                    s.metrics.restore_seconds.observe(adm.restore_s)
        if ok:  # filed in the index now (blocks a short fill did not restore stay reserved)
            s.ledgers[rank].restored(adm, count)
        return ok

    async def _fill_from_l2(
        self, adm: Admission, hashes: list[BlockHash], first: int, count: int
    ) -> tuple[L1Entry | None, int, int]:
        """Make the session's L1 entry hold ``hashes[:first+count]`` from disk. Returns (the
        entry, the blocks it holds, how many of blocks ``first .. first+count`` came from disk)."""
        s = self._s
        assert s.l2 is not None
        if not await self._wait_write(adm.session_id, adm.epoch):
            return None, 0, 0
        fill = await s.l2.fill(adm.session_id, hashes, first + count, s.clock(), s.l1_score)
        if s.epoch != adm.epoch or fill.entry is None:
            return None, 0, 0
        return fill.entry, fill.num_blocks, fill.loaded_within(first, count)

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
        num_l0_blocks = adm.num_used_blocks - adm.cached_tokens_by_tier[Tier.L1] // bs  # the chain's start
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

    # ================================================================= write-through

    def write_through_later(self, rank: Rank, sid: SessionId, chain: list[BlockHash]) -> None:
        """Queue a finished turn's chain for L1 (module docstring: bounded, coalesced per session).
        Only the blocks the session's L1 entry lacks are copied (``L1Index.plan_write``)."""
        queued = sid in self._queued
        self._queued[sid] = (rank, chain, self._s.epoch)
        if not queued:
            self._s.tasks.spawn(self._write_queued(sid))

    async def _write_queued(self, sid: SessionId) -> None:
        rank = self._queued[sid][0]
        async with self._rank_turns[rank]:
            rank, chain, epoch = self._queued.pop(sid)
            if self._s.epoch == epoch and self._s.l1_enabled:
                await self.write_through(rank, sid, chain, epoch)

    async def write_through(
        self, rank: Rank, sid: SessionId, chain: list[BlockHash], epoch: Epoch,
        nodes: tuple[Node, ...] | None = None,
    ) -> bool:
        """Copy a session's chain (blocks filed on ``rank``, or ``nodes`` being evicted) to L1.

        Chained after a write of the same session still in flight (one write per session at a
        time, and the later one copies only what the earlier did not). Returns True when L1
        holds the chain afterwards; False only when it cannot (not resident, no L1 room, the
        copy failed, or the group restarted)."""
        s = self._s
        if not await self._wait_write(sid, epoch):
            return False
        plan = s.l1.plan_write(sid, chain, s.clock(), s.l1_score)
        if plan is None:
            return s.l1.holds_chain(sid, chain)
        done = asyncio.Event()
        self._writes[sid] = done
        try:
            return await self._export(rank, plan, chain, epoch, nodes)
        finally:
            if self._writes.get(sid) is done:
                del self._writes[sid]
            done.set()

    async def _wait_write(self, sid: SessionId, epoch: Epoch) -> bool:
        """Wait until no L1 write of ``sid`` is in flight. False if the group restarted meanwhile.
        Returns without awaiting when none is (callers rely on that: see ``retire``)."""
        while (pending := self._writes.get(sid)) is not None:
            await pending.wait()
        return self._s.epoch == epoch

    async def _export(
        self, rank: Rank, plan: WritePlan, chain: list[BlockHash], epoch: Epoch,
        nodes: tuple[Node, ...] | None,
    ) -> bool:
        s = self._s
        idx = s.l0[rank]
        part = chain[plan.first_block :]
        if nodes is None:
            if idx.match(chain) < len(chain):
                s.l1.abort(plan)
                return False
            pinned = chain
            ids = idx.block_ids(part)
        else:  # an evicted tail (held until released) under a still-filed prefix
            pinned = [n.block_hash for n in nodes if idx.nodes.get(n.block_hash) is n]
            ids = [n.block_id for n in nodes[plan.first_block :]]
        idx.pin(pinned)
        ok = False
        try:
            await s.client.export_blocks(rank, ids, plan.host_slot)
            ok = s.epoch == epoch
        except RANK_ERRORS as exc:
            log.warning("L1 write of %d blocks from rank %d failed: %s", len(ids), rank, exc)
            disable_l1_if_unsupported(s, exc)
        finally:
            if s.epoch == epoch:
                idx.release_uses(pinned)
        if ok:
            s.l1.commit(plan, s.clock())
            if s.l2 is not None:  # write-behind: an L1 eviction then drops nothing L2 lacks
                s.tasks.spawn(s.l2.spill(plan.entry.session_id))
            if s.metrics is not None:
                s.metrics.written_blocks.inc(len(ids))
                s.metrics.written_bytes.inc(len(ids) * s.client.bytes_per_block)
        else:
            s.l1.abort(plan)
        return ok

    # ================================================================= evicted blocks

    def evicted(self, rank: Rank, victims: list[Node]) -> tuple[ChainExport, ...]:
        """Called in the same synchronous step as the eviction of ``victims``: they count as
        releasing from now on, and for each owner (homed here) whose L1 copy lacks the chain
        ending at its deepest victim, the part of that chain still filed in L0 is pinned.
        Otherwise another admission could evict and release those ancestors before this one's
        export runs, and the chain (hence the session's L1 copy) would be lost or cut short: the
        partial restores seen at 500K x 200. The pins end in ``retire`` once the export is done."""
        s = self._s
        s.releases.hold(rank, len(victims))
        if not (victims and s.l1_enabled):
            return ()
        deepest: dict[SessionId, Node] = {}
        for node in victims:
            owner = node.owner
            session = s.sessions.get(owner) if owner is not None else None
            if owner is None or session is None or session.home_rank != rank:
                continue  # nobody will ask for these here again
            if owner not in deepest or node.depth > deepest[owner].depth:
                deepest[owner] = node
        idx = s.l0[rank]
        held = {id(n) for n in victims}
        out: list[ChainExport] = []
        for owner, node in deepest.items():
            chain_nodes = node.chain()
            if s.l1.holds_chain(owner, [n.block_hash for n in chain_nodes]):
                continue  # already complete in L1: dropping it is free
            filed = tuple(n.block_hash for n in chain_nodes if id(n) not in held)
            assert all(idx.nodes.get(h) is not None for h in filed), "evicted chain not prefix-closed"
            idx.pin(filed)
            out.append(ChainExport(owner, tuple(chain_nodes), filed))
        return tuple(out)

    def retire_later(self, rank: Rank, victims: list[Node], exports: tuple[ChainExport, ...]) -> None:
        self._s.tasks.spawn(self.retire(rank, victims, self._s.epoch, exports=exports))

    async def retire(
        self, rank: Rank, victims: list[Node], epoch: Epoch, wait_release: bool = True,
        exports: tuple[ChainExport, ...] = (),
    ) -> None:
        """Write the evicted blocks' sessions to L1 where it lacks them, then release the blocks.

        ``exports`` are the chains ``evicted`` pinned when the blocks were evicted. The exports
        are awaited before the release is sent, and the rank applies commands in the order sent,
        so no block is dropped before its copy to L1 (when L1 has room).

        A rank runs submits only between steps (and, on DeepInfer, releases, imports and
        exports too; the reference engine runs those beside the step, a release unless an
        add still queued names its blocks: ``rank/transfers.py``), so a round trip here can
        cost a step: the owners' exports go out together (one boundary), and with
        ``wait_release=False`` the release is sent but not waited for, so the caller's next
        command (an import, a submit) rides in the same boundary. The rank applies them in the
        order sent (an import that needs the released blocks waits for the release), so the
        blocks are free by then; they stay counted as releasing until the reply."""
        s = self._s
        try:
            if s.l1_enabled and s.epoch == epoch and exports:
                await asyncio.gather(*[self._retire_owner(rank, ex, epoch) for ex in exports])
        finally:
            if s.epoch == epoch:
                idx = s.l0[rank]
                for ex in exports:
                    idx.release_uses(ex.pinned)
                num_unbacked = sum(
                    1 for n in victims
                    if n.owner is None or not s.l1.holds_block(n.owner, n.depth, n.block_hash)
                )
                self.num_evicted_unbacked_blocks += num_unbacked
                if s.metrics is not None:
                    s.metrics.evicted_blocks.labels("l0", "false").inc(num_unbacked)
                    s.metrics.evicted_blocks.labels("l0", "true").inc(len(victims) - num_unbacked)
            release = s.releases.send(rank, [n.block_id for n in victims], epoch)
            if wait_release:
                await release
            else:
                s.tasks.spawn(release)
                await asyncio.sleep(0)  # the task's first step sends the command

    async def _retire_owner(self, rank: Rank, ex: ChainExport, epoch: Epoch) -> None:
        """Write one evicted session's chain to L1 unless it holds it (its filed part is pinned)."""
        if not await self._wait_write(ex.owner, epoch):  # chain after its write in flight
            return
        ok = await self.write_through(rank, ex.owner, [n.block_hash for n in ex.chain_nodes], epoch,
                                      nodes=ex.chain_nodes)
        if not ok:
            self.num_export_failures += 1
            log.debug("L1 copy of evicted session %s on rank %d not written (no room or failed)",
                      ex.owner, rank)

    # ================================================================= moves

    async def move(
        self, session: Session, src: Rank, dst: Rank, hashes: list[BlockHash], num_src_blocks: int
    ) -> bool:
        """Hand a session from ``src`` to ``dst``: make sure L1 holds its blocks from ``src``;
        its next admission on ``dst`` restores them. Its blocks on ``src`` become free to drop."""
        s = self._s
        if num_src_blocks > 0:
            chain = list(hashes[:num_src_blocks])
            if not await self.write_through(src, session.session_id, chain, s.epoch):
                return False
        s.sessions.moved(session, dst, s.clock())
        log.info("moved session %s from rank %d to rank %d through L1 (%d blocks)",
                 session.session_id, src, dst, num_src_blocks)
        if s.metrics is not None:
            s.metrics.sessions_moved.inc()
        return True

    async def flush_to_l2(self) -> None:
        """A graceful stop: each idle session's chain that L2 lacks goes through L1 to disk,
        soonest expected back first (the caller bounds the time)."""
        s = self._s
        assert s.l2 is not None
        epoch = s.epoch
        for session in sorted(s.sessions, key=lambda x: s.l1_score(x.session_id)):
            rank = session.home_rank
            if rank is None or session.num_in_flight or s.epoch != epoch:
                continue
            chain = self.session_chain(rank, session)
            if chain and s.l2.stored(chain) < len(chain) and await self.write_through(
                    rank, session.session_id, chain, epoch):
                await s.l2.spill(session.session_id)

    def session_chain(self, rank: Rank, session: Session) -> list[BlockHash]:
        """The session's longest chain filed on ``rank`` (ending at one of its tails)."""
        idx = self._s.l0[rank]
        best: list[BlockHash] = []
        for tail in session.tail_hashes:
            node = idx.nodes.get(tail)
            if node is not None and node.depth + 1 > len(best):
                best = [n.block_hash for n in node.chain()]
        return best
