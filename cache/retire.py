"""Retiring evicted blocks: an admission (``cache/planner.py``) or a growing reply
(``cache/output_room.py``) evicted blocks from a rank's L0 index; each evicted session's chain
is written to L1 where L1 lacks it (``cache/l1_writes.py``), then the blocks are released.

``evicted`` runs in the same synchronous step as the eviction: the blocks count as releasing
from then on (``cache/releases.py``), and the part of each owner's chain still filed in L0 is
pinned until its export is done, so no other admission can take the chain apart meanwhile.
``retire`` awaits the exports, then sends the release; the rank applies commands in the order
sent, so no block is dropped before its copy (when L1 has room).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from cache.hashing import BlockHash
from cache.l0_index import Node
from cache.l1_writes import L1Writes
from cache.sessions import SessionId
from cache.state import CacheState
from rank.ids import Epoch, Rank

log = logging.getLogger("cache.manager")


@dataclass(frozen=True, slots=True, eq=False)
class ChainExport:
    """An evicted session's chain to write to L1 before its blocks are released: ``pinned`` is
    the filed prefix of it (one use held on its deepest node until the export is done)."""

    owner: SessionId
    chain_nodes: tuple[Node, ...]
    pinned: tuple[BlockHash, ...]


class Retirer:
    """Evicted blocks to L1, then released (see the module docstring). One event loop."""

    def __init__(self, state: CacheState, writes: L1Writes) -> None:
        self._s = state
        self._writes = writes
        # Diagnostics (also in metrics): blocks dropped from a GPU with no L1 copy and exports
        # of evicted sessions that could not be written.
        self.num_evicted_unbacked_blocks = 0
        self.num_export_failures = 0

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
        if not await self._writes.wait_write(ex.owner, epoch):  # chain after its write in flight
            return
        chain = [n.block_hash for n in ex.chain_nodes]
        ok = await self._writes.write_through(rank, ex.owner, chain, epoch, nodes=ex.chain_nodes)
        if not ok:
            self.num_export_failures += 1
            log.debug("L1 copy of evicted session %s on rank %d not written (no room or failed)",
                      ex.owner, rank)
