"""An admission that evicts and restores waits for as few rank step boundaries as possible
(2 x H200 run: restores took ~49 ms, one decode step, against 1-9 ms for the copy, because a
rank runs commands only between steps and the admission made one round trip after another).

``SteppedClient`` models the worker: commands queue up and run only at a "boundary", in the
order sent. The admission's eviction release and its L1 import now share one boundary, and
several evicted sessions' exports go out together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from cache.config import CacheConfig
from cache.l1_restores import FOLD_ENV
from cache.manager import CacheManager
from cache.metrics import CacheMetrics
from cache.sessions import StopKind
from cache.turns import Tier
from rank.local_group import LocalRankGroup
from tests.cache.cache_harness import make_group, next_prompt, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(120)
STEP_S = 0.002


class SteppedClient:
    """A LocalRankGroup whose release/export/import run only at ``boundary()``, FIFO."""

    def __init__(self, group: LocalRankGroup) -> None:
        self._group = group
        self._queue: list[tuple[Callable[..., Awaitable[Any]], tuple[Any, ...], asyncio.Future[Any]]] = []
        self.num_boundaries = 0  # boundaries that ran at least one command

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    async def _command(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((fn, args, fut))
        return await fut

    async def release(self, rank: int, block_ids: list[int]) -> None:
        await self._command(self._group.release, rank, block_ids)

    async def export_blocks(self, rank: int, block_ids: list[int], host_slot: int) -> None:
        await self._command(self._group.export_blocks, rank, block_ids, host_slot)

    async def import_blocks(self, rank: int, host_slot: int, num_blocks: int) -> list[int]:
        return list(await self._command(self._group.import_blocks, rank, host_slot, num_blocks))

    async def boundary(self) -> None:
        batch, self._queue = self._queue, []
        if batch:
            self.num_boundaries += 1
        for fn, args, fut in batch:
            try:
                fut.set_result(await fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as a reply would be
                fut.set_exception(exc)

    async def run_steps(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(STEP_S)  # a step (virtual time): the event loop runs the backend meanwhile
            await self.boundary()


def test_evict_release_and_restore_share_one_step_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    # The awaited restore (a big one); a small one rides in the turn's add: no boundary of its own.
    monkeypatch.setenv(FOLD_ENV, "0")

    async def main() -> None:
        rng = np.random.default_rng(31)
        group = await make_group("null", num_blocks=24, num_ranks=1, host_slots=96)
        client = SteppedClient(group)
        stop = asyncio.Event()
        stepper = asyncio.create_task(client.run_steps(stop))
        registry = CollectorRegistry()
        config = CacheConfig(queue_recheck_s=0.01, l1_write_watermark=0.0, protect_s=0.0)
        mgr = CacheManager(client, config, CacheMetrics(registry),  # type: ignore[arg-type]
                           clock=asyncio.get_running_loop().time)
        try:
            first = await run_turn(mgr, group, tokens(rng, 100), "a", stop=StopKind.END_TURN)
            await mgr.drain()
            await run_turn(mgr, group, tokens(rng, 320), "b", stop=StopKind.END_TURN)  # a -> L1 only
            await mgr.drain()
            prompt = next_prompt(first, tokens(rng, 20))
            assert mgr.l0[0].match(mgr.hasher.hashes(prompt)) == 0
            b_id = next(iter(s.session_id for s in mgr.sessions if s.session_id.endswith(":b")))
            assert mgr.l1.backed_blocks(b_id) > 0  # evicting b is a free drop: no export
            before = client.num_boundaries
            adm = await mgr.admit(prompt, "a", 8)
            assert adm.cached_tokens_by_tier[Tier.L1] == 80  # evicted b, restored a
            # release of b's blocks + import of a's: one boundary (was two: release, then import)
            assert client.num_boundaries - before == 1
            mgr.abort(adm)
            await settle(mgr, group)
        finally:
            stop.set()
            await stepper
            await group.close()

    asyncio.run(main())
