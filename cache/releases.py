"""The release ledger: blocks out of the L0 index whose ``release`` has not landed on the rank.

Such a block is still held by the engine, so it is not free for any planner (planning on it made
imports fail with ``CapacityExhausted``); it is counted here per rank from the moment it leaves
the index until the rank's reply. The one planner that evicted blocks for itself may count them:
it sends the release before its own command (import or submit), and the rank applies commands in
the order sent.

Each rank has an ``asyncio.Event`` that is set while nothing is pending there, so a caller that
needs the blocks back (an import the engine was short for) waits on the event, bounded, instead
of polling. A restart (``reset``) wakes every waiter: the old epoch's blocks are gone anyway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rank.errors import RankFailed, RankUnavailable
from rank.ids import BlockId, Epoch, Rank

if TYPE_CHECKING:
    from cache.state import CacheState

log = logging.getLogger("cache.manager")

WAIT_TIMEOUT_S = 2.0  # a wall bound on ``wait_idle`` (the loop's time, whatever the policy's clock)


class ReleaseLedger:
    """Per-rank pending releases (see the module docstring). One event loop."""

    def __init__(self, state: CacheState) -> None:
        self._state = state
        self._pending: list[int] = []
        self._idle: list[asyncio.Event] = []
        self.reset()

    def pending(self, rank: int) -> int:
        """Blocks out of ``rank``'s index whose release has not landed yet."""
        return self._pending[rank]

    def hold(self, rank: int, num_blocks: int) -> None:
        """``num_blocks`` left ``rank``'s index (evicted); their release is sent by ``send``."""
        if num_blocks:
            self._pending[rank] += num_blocks
            self._idle[rank].clear()

    def release_later(self, rank: Rank, block_ids: list[BlockId]) -> None:
        """Give the cache refs on ``block_ids`` back to ``rank`` in the background."""
        if block_ids:
            self.hold(rank, len(block_ids))
            self._state.tasks.spawn(self.send(rank, block_ids, self._state.epoch))

    async def send(self, rank: Rank, block_ids: list[BlockId], epoch: Epoch,
                   num_held: int | None = None) -> None:
        """Send the release of held blocks and count them free once it lands (or failed: a
        dead rank's blocks go with its epoch). ``num_held``: the blocks ``hold`` counted, when
        fewer came to exist (an import held before its reply, which failed: nothing to send)."""
        state = self._state
        try:
            if block_ids and state.epoch == epoch:
                await state.client.release(rank, block_ids)
        except (RankFailed, RankUnavailable) as exc:
            log.info("release of %d blocks on rank %d dropped: %s", len(block_ids), rank, exc)
        finally:
            if state.epoch == epoch:
                self._landed(rank, len(block_ids) if num_held is None else num_held)
            state.queue.notify(rank)
            state.on_change()

    async def wait_idle(self, rank: int, epoch: int, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Wait (bounded) until no release is pending on ``rank`` or the group restarted."""
        if self._state.epoch != epoch or self._pending[rank] == 0:
            return
        try:
            await asyncio.wait_for(self._idle[rank].wait(), timeout_s)
        except asyncio.TimeoutError:
            log.debug("rank %d: %d releases still pending after %.1f s", rank, self._pending[rank], timeout_s)

    def reset(self) -> None:
        """A restart: nothing of the old epoch is pending any more; wake whoever waits."""
        for event in self._idle:
            event.set()
        num_ranks = self._state.num_ranks
        self._pending = [0] * num_ranks
        self._idle = [asyncio.Event() for _ in range(num_ranks)]
        for event in self._idle:
            event.set()

    def _landed(self, rank: int, num_blocks: int) -> None:
        self._pending[rank] -= num_blocks
        assert self._pending[rank] >= 0, f"rank {rank}: more releases landed than were sent"
        if self._pending[rank] == 0:
            self._idle[rank].set()
