"""Copies between L1 and a rank racing a client that goes away, or a rank group restart: nothing
leaks ("a dead rank, a dropped client or a full KV pool leaks nothing").

The 4-rank-process disconnect storm (``tests/reliability/test_reliability_disconnect_storm.py``)
failed about half its runs with "engine holds N cached blocks, index N-k": every leaked block
came from an L1 -> GPU import (traced at the rank messenger: the import's reply arrived, its ids
were never filed nor released). With rank processes ``import_blocks`` is a round trip; the rank
imports whether or not anyone still waits for the reply, and a turn cancelled while it waited
(its client went away) lost the block ids, so their cache refs were never given back. A copy
to L1 the turn waited for (its victims' chains) had the same shape: its L1 write stayed planned.

The rank's side is stood in for by the engine's own call (done at once) followed by a reply the
test holds and lets land, so each race is replayed exactly, e.g. the reply lands and the task is
cancelled in the same step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from cache.l1_restores import FOLD_ENV
from cache.manager import CacheManager
from cache.sessions import SessionId, StopKind
from protocol.errors import Overloaded
from rank.errors import RankFailed
from rank.ids import BlockId, HostSlot, Rank
from rank.local_group import LocalRankGroup
from tests.cache.cache_harness import make_group, make_manager, next_prompt, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _restores_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    """These races are the awaited restore's (big restores, fills from L2); a small one is folded
    into the turn's add instead (``tests/cache/test_cache_folded_restores.py``)."""
    monkeypatch.setenv(FOLD_ENV, "0")

Import = Callable[[Rank, HostSlot, int], Awaitable[list[BlockId]]]


class HeldReply:
    """Wraps ``group.import_blocks``: the engine imports at once (as a rank process does when the
    command arrives), the reply is held until the test lets it land. A restart meanwhile fails
    it, as ``RankMessenger.fail_all`` fails an epoch's pending commands."""

    def __init__(self, group: LocalRankGroup) -> None:
        self.group = group
        self.real: Import = group.import_blocks
        self.sent = asyncio.Event()
        self.reply: asyncio.Future[None] | None = None
        self.imported: list[BlockId] = []

    async def __call__(self, rank: Rank, host_slot: HostSlot, num_blocks: int) -> list[BlockId]:
        epoch = self.group.epoch
        ids = await self.real(rank, host_slot, num_blocks)
        self.imported = list(ids)
        self.reply = asyncio.get_running_loop().create_future()
        self.sent.set()
        await self.reply
        if self.group.epoch != epoch:
            raise RankFailed(f"rank group epoch {epoch} failed: restarted")
        return ids

    def land(self) -> None:
        """The reply arrives (dropped, as the messenger drops it, when its waiter is gone)."""
        assert self.reply is not None
        if not self.reply.done():
            self.reply.set_result(None)


async def _session_in_l1(mgr: CacheManager, group: LocalRankGroup, rng: np.random.Generator,
                         head: np.ndarray) -> np.ndarray:
    """Session "a"'s next prompt, whose chain L1 holds while the GPU holds only ``head`` (shared
    with session "b", whose longer turn pushed a's own blocks out of the GPU)."""
    first = await run_turn(mgr, group, np.concatenate([head, tokens(rng, 100)]), "a", stop=StopKind.END_TURN)
    await mgr.drain()
    await run_turn(mgr, group, np.concatenate([head, tokens(rng, 300)]), "b", stop=StopKind.END_TURN)
    await mgr.drain()
    assert mgr.l1.backed_blocks(first.admission.session_id) > 0
    return next_prompt(first, tokens(rng, 20))


def test_a_turn_cancelled_as_its_restore_reply_lands_releases_the_imported_blocks() -> None:
    async def main() -> None:
        rng = np.random.default_rng(11)
        group = await make_group("null", num_blocks=26, num_ranks=1, host_slots=64)
        mgr, _ = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
        held = HeldReply(group)
        try:
            a2 = await _session_in_l1(mgr, group, rng, tokens(rng, 32))
            group.import_blocks = held  # type: ignore[method-assign]
            task = asyncio.get_running_loop().create_task(run_turn(mgr, group, a2, "a"))
            await asyncio.wait_for(held.sent.wait(), 5.0)  # the turn restores
            assert held.imported  # the rank holds them for the cache from now on
            held.land()
            task.cancel()  # the client went away in the same step as the reply arrived
            with pytest.raises(asyncio.CancelledError):
                await task
            group.import_blocks = held.real  # type: ignore[method-assign]
            assert mgr.num_open_turns == 0
            await settle(mgr, group)  # engine cache-held blocks == L0 index, refs balanced
            assert not set(held.imported) & {n.block_id for n in mgr.l0[0].nodes.values()}
            # and the session's next turn restores the chain as if nothing happened
            await run_turn(mgr, group, a2, "a")
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_turn_cancelled_before_its_restore_reply_lands_releases_the_imported_blocks() -> None:
    async def main() -> None:
        rng = np.random.default_rng(12)
        group = await make_group("null", num_blocks=26, num_ranks=1, host_slots=64)
        mgr, _ = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
        held = HeldReply(group)
        try:
            a2 = await _session_in_l1(mgr, group, rng, tokens(rng, 32))
            group.import_blocks = held  # type: ignore[method-assign]
            task = asyncio.get_running_loop().create_task(run_turn(mgr, group, a2, "a"))
            await asyncio.wait_for(held.sent.wait(), 5.0)  # the turn restores
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Until the reply lands the blocks are held by the rank but not filed: they count as
            # releasing, so no planner counts them free.
            assert mgr.state.releases.pending(0) == len(held.imported)
            held.land()
            group.import_blocks = held.real  # type: ignore[method-assign]
            await settle(mgr, group)
            assert mgr.state.releases.pending(0) == 0
        finally:
            await group.close()

    asyncio.run(main())


class HeldExport:
    """Wraps ``group.export_blocks``: the engine copies at once, the reply is held until the test
    lets it land."""

    def __init__(self, group: LocalRankGroup) -> None:
        self.real = group.export_blocks
        self.sent = asyncio.Event()
        self.reply: asyncio.Future[None] | None = None

    async def __call__(self, rank: Rank, block_ids: list[BlockId], host_slot: HostSlot) -> None:
        await self.real(rank, block_ids, host_slot)
        self.reply = asyncio.get_running_loop().create_future()
        self.sent.set()
        await self.reply

    def land(self) -> None:
        """The reply arrives (dropped, as the messenger drops it, when its waiter is gone)."""
        assert self.reply is not None
        if not self.reply.done():
            self.reply.set_result(None)


def test_a_turn_cancelled_while_its_victims_go_to_l1_settles_the_l1_write() -> None:
    """A turn that evicted another session's blocks waits for their copy to L1 before their
    release (``Retirer.retire``). Its client going away meanwhile must not leave the L1 write
    planned forever: its slots leaked and every later write of that session refused."""

    async def main() -> None:
        rng = np.random.default_rng(13)
        group = await make_group("null", num_blocks=26, num_ranks=1, host_slots=64)
        # no write-through after a turn: the eviction itself copies the victims to L1
        mgr, _ = make_manager(group, l1_write_watermark=1.0, protect_s=0.0)
        held = HeldExport(group)
        try:
            first = await run_turn(mgr, group, tokens(rng, 132), "a", stop=StopKind.END_TURN)
            await mgr.drain()
            assert mgr.l1.backed_blocks(first.admission.session_id) == 0
            group.export_blocks = held  # type: ignore[method-assign]
            task = asyncio.get_running_loop().create_task(run_turn(mgr, group, tokens(rng, 300), "b"))
            await asyncio.wait_for(held.sent.wait(), 5.0)  # b evicted a's blocks: their copy runs
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            held.land()
            group.export_blocks = held.real  # type: ignore[method-assign]
            await settle(mgr, group)  # no L1 write pending, no slot leaked
            assert mgr.l1.backed_blocks(first.admission.session_id) > 0  # the copy did complete
        finally:
            await group.close()

    asyncio.run(main())


def test_a_restart_during_a_restore_leaves_the_new_epoch_untouched() -> None:
    """The rank group restarts while a turn's restore waits for its import: the import fails
    with the old epoch, and that turn, of the old epoch, must not touch the new epoch's index or
    ledger (it used to fall back to replaying its last L0 block there: a use taken on the new
    index and one given back that it never took, and a reservation on the new ledger that its
    close, skipping an old epoch's admission, never gave back). It is refused with a retry."""

    async def main() -> None:
        rng = np.random.default_rng(14)
        group = await make_group("null", num_blocks=26, num_ranks=1, host_slots=64)
        mgr, _ = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
        held = HeldReply(group)
        head = tokens(rng, 32)
        try:
            a2 = await _session_in_l1(mgr, group, rng, head)
            group.import_blocks = held  # type: ignore[method-assign]
            task = asyncio.get_running_loop().create_task(mgr.admit(a2, "a", 8))
            await asyncio.wait_for(held.sent.wait(), 5.0)
            old_epoch = mgr.epoch
            await group.restart("test: a rank died")
            assert mgr.epoch != old_epoch
            group.import_blocks = held.real  # type: ignore[method-assign]
            # The new epoch files the shared head again (another session's turn), so the old
            # turn's replay would find the blocks it wants to pin there.
            await run_turn(mgr, group, np.concatenate([head, tokens(rng, 40)]), "c")
            assert mgr.l0[0].match(mgr.hasher.hashes(a2)) >= 2
            ledger = mgr.state.ledgers[0]
            assert (ledger.reserved_blocks, ledger.running_tokens, ledger.num_open) == (0, 0, 0)
            held.land()  # the old epoch's import fails: the turn goes on with its reply
            with pytest.raises(Overloaded, match="restarted"):
                await task
            assert (ledger.reserved_blocks, ledger.running_tokens, ledger.num_open) == (0, 0, 0)
            assert mgr.num_open_turns == 0
            session = mgr.sessions.get(SessionId("hint:a"))
            assert session is not None and session.num_in_flight == 0
            await settle(mgr, group)  # no use refs on the new index, its ledger's sums hold
            await run_turn(mgr, group, a2, "a")  # the session's next turn runs in the new epoch
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
