"""L1 writes: copies of KV from a rank's GPU pool to the shared host pool (L1), and what rides
on them.

* **Write-through** (``write_through_later``): a finished turn's new blocks are copied to L1 (and
  spilled to L2 behind it) after every turn (``l1_write_watermark``, 0 by default), so a later
  eviction drops them for free and a rank kill or a backend crash loses only the turns in flight.
  It never holds up a turn: one background export per rank at a time (a restore behind it waits
  for at most one export part on the rank), and a session's turns that finish meanwhile coalesce
  into one write of its latest chain.
* **A chain on demand** (``write_through``): the evicted chains ``cache/retire.py`` saves, a
  prefix copied for a new branch (``cache/branches.py``), a session handed to another rank
  (``move``) and the flush of idle sessions to L2 at a graceful stop (``flush_to_l2``).
* **L2** (``cache/kv_tier.py``): every committed L1 write is spilled to disk (write-behind).

One write per session at a time (a later one waits for the earlier, ``wait_write``, and copies
only what that did not). Writes check the epoch after every await: a restart voids what they
carried.
"""

from __future__ import annotations

import asyncio
import logging

from cache.hashing import BlockHash
from cache.l0_index import Node
from cache.l1_index import WritePlan
from cache.restart import RANK_ERRORS, disable_l1_if_unsupported
from cache.sessions import Session, SessionId
from cache.state import CacheState
from rank.ids import Epoch, Rank

log = logging.getLogger("cache.manager")


class L1Writes:
    """Owns the copies to L1 (see the module docstring). One event loop."""

    def __init__(self, state: CacheState) -> None:
        self._s = state
        self._writes: dict[SessionId, asyncio.Event] = {}  # set when the session's write ends
        # Write-through queue: the latest chain per session waiting for its rank's turn, and one
        # background export per rank at a time (``write_through_later``).
        self._queued: dict[SessionId, tuple[Rank, list[BlockHash], Epoch]] = {}
        self._rank_turns = [asyncio.Lock() for _ in range(state.num_ranks)]

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
        copy failed, or the group restarted).

        Once planned, the copy runs in a task of its own: the rank copies whether or not the
        caller still waits (a turn whose client went away is cancelled), and only the copy's
        end may commit or abort the plan and unpin the chain. A cancelled caller that left the
        plan pending kept its slots and refused every later write of the session. The task's
        first step sends the export before a cancelled caller resumes (the loop runs callbacks
        in order), so a release the caller sends then reaches the rank after the export."""
        s = self._s
        if not await self.wait_write(sid, epoch):
            return False
        plan = s.l1.plan_write(sid, chain, s.clock(), s.l1_score)
        if plan is None:
            return s.l1.holds_chain(sid, chain)
        done = asyncio.Event()
        self._writes[sid] = done
        return await asyncio.shield(s.tasks.spawn(self._write(rank, sid, plan, chain, epoch, nodes, done)))

    async def _write(
        self, rank: Rank, sid: SessionId, plan: WritePlan, chain: list[BlockHash], epoch: Epoch,
        nodes: tuple[Node, ...] | None, done: asyncio.Event,
    ) -> bool:
        try:
            return await self._export(rank, plan, chain, epoch, nodes)
        finally:
            if self._writes.get(sid) is done:
                del self._writes[sid]
            done.set()

    async def wait_write(self, sid: SessionId, epoch: Epoch) -> bool:
        """Wait until no L1 write of ``sid`` is in flight. False if the group restarted meanwhile.
        Returns without awaiting when none is (callers rely on that: see ``Retirer.retire``)."""
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

    # ================================================================= moves and the stop

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
