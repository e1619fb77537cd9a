"""``move_session`` chains after an L1 write of the same session that is still in flight (2 x H200
run: the move answered False until the finished turn's write-through landed; the caller retried
3 times). It answers False only when the move is really impossible."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.turns import Tier
from tests.cache.cache_harness import make_group, make_manager, next_prompt, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(120)


def test_move_waits_for_the_write_in_flight_then_hits_on_the_new_rank() -> None:
    async def main() -> None:
        rng = np.random.default_rng(12)
        group = await make_group(num_blocks=96, num_ranks=2, host_slots=256)
        mgr, registry = make_manager(group, l1_write_watermark=0.0)  # every finish writes through
        gate = asyncio.Event()
        exporting = asyncio.Event()
        num_exports = 0
        real_export = group.export_blocks

        async def slow_export(rank: int, block_ids: list[int], host_slot: int) -> None:
            nonlocal num_exports
            num_exports += 1
            exporting.set()
            await gate.wait()  # the rank is in a long step: the copy lands later
            await real_export(rank, block_ids, host_slot)

        try:
            group.export_blocks = slow_export  # type: ignore[method-assign]
            first = await run_turn(mgr, group, tokens(rng, 300), "a")
            src = first.admission.rank
            await exporting.wait()  # the finish's write-through starts and waits on the rank
            assert num_exports == 1 and mgr.l1.is_writing(first.admission.session_id)
            move = asyncio.create_task(mgr.move_session("a", 1 - src))
            await asyncio.sleep(0.05)
            assert not move.done()  # chained after the write, not refused
            gate.set()
            assert await move is True
            assert num_exports == 1  # the write in flight already copied the whole chain
            second = await run_turn(mgr, group, next_prompt(first, tokens(rng, 10)), "a")
            assert second.admission.rank == 1 - src
            assert second.admission.cached_tokens_by_tier[Tier.L1] >= 256
            assert registry.get_sample_value("deepinfer_cache_sessions_moved_total") == 1.0
            await settle(mgr, group)
        finally:
            gate.set()
            await group.close()

    asyncio.run(main())


def test_move_is_refused_only_when_impossible() -> None:
    async def main() -> None:
        rng = np.random.default_rng(13)
        group = await make_group(num_blocks=96, num_ranks=2, host_slots=256)
        mgr, _ = make_manager(group)
        try:
            first = await run_turn(mgr, group, tokens(rng, 300), "a")
            src = first.admission.rank
            victims = mgr.l0[src].evict(1000, mgr.policy.scorer(src, 0.0), mgr.policy.chooser(src, 0.0, True))
            await group.release(src, [v.block_id for v in victims])
            assert await mgr.move_session("a", 1 - src) is True  # nothing resident: nothing to copy
            assert await mgr.move_session("nobody", 1 - src) is False
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
