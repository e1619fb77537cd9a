"""The release ledger: blocks out of the index are not free until their release lands; a waiter
wakes on the rank's event when the last one lands (no polling), gives up after its bound, and a
restart wakes it and voids the old epoch's counts. Virtual time (``conftest.py``)."""

from __future__ import annotations

import asyncio

from cache.config import CacheConfig
from cache.state import CacheState
from tests.cache.cache_harness import SizesOnlyClient


def _state(client: SizesOnlyClient) -> CacheState:
    return CacheState(client, CacheConfig(reserve_blocks=0, usable_fraction=1.0), None,
                      # type: ignore[arg-type]
                      clock=asyncio.get_running_loop().time)


def test_blocks_are_free_only_once_their_release_lands_and_the_waiter_wakes_then() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        client = SizesOnlyClient(num_ranks=2)
        client.gate.clear()  # the rank is busy: the release lands when the gate opens
        state = _state(client)
        state.releases.release_later(0, [3, 4, 5])
        assert state.releases.pending(0) == 3 and state.releases.pending(1) == 0
        assert state.ledgers[0].free_blocks() == 12 - 3 and state.ledgers[1].free_blocks() == 12
        waiter = loop.create_task(state.releases.wait_idle(0, state.epoch))
        await asyncio.sleep(0.5)
        assert not waiter.done()
        opened_at = loop.time()
        client.gate.set()
        await waiter
        assert loop.time() == opened_at  # woken by the landing itself, not by a poll tick
        assert state.releases.pending(0) == 0 and client.released == [[3, 4, 5]]
        assert state.ledgers[0].free_blocks() == 12
        await state.releases.wait_idle(0, state.epoch)  # nothing pending: returns at once
        assert loop.time() == opened_at
        await state.tasks.drain()

    asyncio.run(main())


def test_a_waiter_gives_up_after_its_bound() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        client = SizesOnlyClient()
        client.gate.clear()
        state = _state(client)
        state.releases.release_later(0, [7])
        started = loop.time()
        await state.releases.wait_idle(0, state.epoch, timeout_s=2.0)
        assert loop.time() - started == 2.0 and state.releases.pending(0) == 1
        client.gate.set()
        await state.tasks.drain()
        assert state.releases.pending(0) == 0

    asyncio.run(main())


def test_a_restart_wakes_waiters_and_old_releases_do_not_count_against_the_new_epoch() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        client = SizesOnlyClient()
        client.gate.clear()
        state = _state(client)
        state.releases.release_later(0, [1, 2])
        waiter = loop.create_task(state.releases.wait_idle(0, state.epoch))
        await asyncio.sleep(0.1)
        state.reset(new_epoch=1)
        await waiter  # woken by the restart
        assert state.releases.pending(0) == 0
        state.releases.hold(0, 4)  # the new epoch's own eviction
        client.gate.set()
        await state.tasks.drain()  # the old epoch's release ends; the new count stays
        assert state.releases.pending(0) == 4

    asyncio.run(main())
