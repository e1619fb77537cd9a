"""L1 over real engines: restored prefixes give the cold answer, moved sessions still hit,
eviction keeps sessions about to return, admission queues instead of thrashing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.sessions import StopKind
from cache.turns import Tier
from protocol.errors import PromptTooLong
from tests.cache.cache_harness import (
    make_group,
    make_manager,
    next_prompt,
    run_turn,
    settle,
    tokens,
)

pytestmark = pytest.mark.timeout(180)


def test_l1_restored_prefix_answers_token_identical_to_cold() -> None:
    async def main() -> None:
        rng = np.random.default_rng(10)
        a1 = tokens(rng, 100)  # 6 kept blocks of 16 tokens
        b1 = tokens(rng, 320)  # needs 21 blocks: all of a's must go
        group = await make_group("tiny", num_blocks=24, num_ranks=1, host_slots=64)
        mgr, registry = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
        try:
            first = await run_turn(mgr, group, a1, "a", stop=StopKind.END_TURN)
            await mgr.drain()
            assert mgr.l1.backed_blocks(first.admission.session_id) > 0
            await run_turn(mgr, group, b1, "b", stop=StopKind.END_TURN)  # pushes a out of the GPU
            await mgr.drain()
            a2 = next_prompt(first, tokens(rng, 20))
            assert mgr.l0[0].match(mgr.hasher.hashes(a2)) == 0
            warm = await run_turn(mgr, group, a2, "a", max_tokens=12)
            assert warm.admission.cached_tokens_by_tier[Tier.L1] == 80  # 6 blocks held, the last replayed
            assert warm.admission.num_cached_tokens == 80
            restored = registry.get_sample_value("deepinfer_cache_l1_restored_tokens_total")
            assert restored == warm.admission.cached_tokens_by_tier[Tier.L1]
            await settle(mgr, group)
        finally:
            await group.close()
        cold_group = await make_group("tiny", num_blocks=24, num_ranks=1, host_slots=0)
        cold_mgr, _ = make_manager(cold_group, prefix_cache=False)
        try:
            cold = await run_turn(cold_mgr, cold_group, a2, "a", max_tokens=12)
            assert cold.admission.num_cached_tokens == 0
            assert warm.output_ids == cold.output_ids
            await settle(cold_mgr, cold_group)
        finally:
            await cold_group.close()

    asyncio.run(main())


def test_l1_moved_session_still_hits_on_new_rank() -> None:
    async def main() -> None:
        rng = np.random.default_rng(11)
        group = await make_group(num_blocks=96, num_ranks=2, host_slots=256)
        mgr, registry = make_manager(group)
        try:
            first = await run_turn(mgr, group, tokens(rng, 300), "a")
            src = first.admission.rank
            assert await mgr.move_session("a", 1 - src)
            second = await run_turn(mgr, group, next_prompt(first, tokens(rng, 10)), "a")
            assert second.admission.rank == 1 - src
            assert second.admission.cached_tokens_by_tier[Tier.L1] >= 256
            assert registry.get_sample_value("deepinfer_cache_sessions_moved_total") == 1.0
            third = await run_turn(mgr, group, next_prompt(second, tokens(rng, 10)), "a")
            assert third.admission.rank == 1 - src and third.admission.cached_tokens_by_tier[Tier.L0] >= 288
            await settle(mgr, group)
            # the copies left on the old rank go first when that rank needs room
            victims = mgr.l0[src].evict(1000, mgr.policy.scorer(src, 0.0),
                                        mgr.policy.chooser(src, 0.0, False))
            assert len(victims) > 0
            await group.release(src, [v.block_id for v in victims])
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_l1_rebalance_moves_idle_sessions_off_a_heavy_rank() -> None:
    async def main() -> None:
        rng = np.random.default_rng(12)
        group = await make_group(num_blocks=256, num_ranks=2, host_slots=512)
        mgr, _ = make_manager(group, move_min_tokens=0, overload_ratio=1.0, move_cooldown_s=0.0)
        try:
            turns = [await run_turn(mgr, group, tokens(rng, 200), f"s{i}") for i in range(3)]
            # pile every session onto rank 0 by hand, as if rank 1 had been busy when they came
            for i, t in enumerate(turns):
                if t.admission.rank != 0:
                    assert await mgr.move_session(f"s{i}", 0)
            await mgr.drain()
            before = [load.load_tokens for load in mgr.loads()]
            assert before[1] == 0
            assert await mgr.rebalance() >= 1
            after = [load.load_tokens for load in mgr.loads()]
            assert max(after) < max(before)
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_eviction_keeps_session_about_to_return() -> None:
    async def main() -> None:
        rng = np.random.default_rng(13)
        group = await make_group(num_blocks=48, num_ranks=1, host_slots=0)
        mgr, registry = make_manager(group, protect_s=30.0)
        try:
            tool = await run_turn(mgr, group, tokens(rng, 200), "tool", stop=StopKind.TOOL_USE)
            human = await run_turn(mgr, group, tokens(rng, 200), "human", stop=StopKind.END_TURN)
            await mgr.drain()
            await run_turn(mgr, group, tokens(rng, 400), "new")  # needs room held by one of them
            await mgr.drain()
            tool_hashes = mgr.hasher.hashes(tool.prompt)
            human_hashes = mgr.hasher.hashes(human.prompt)
            assert mgr.l0[0].match(tool_hashes) == len(tool_hashes)  # kept: back in seconds
            assert mgr.l0[0].match(human_hashes) < len(human_hashes)  # evicted: a person reads
            evicted = registry.get_sample_value("deepinfer_cache_evicted_blocks_total",
                                                {"tier": "l0", "l1_backed": "false"})
            assert evicted and evicted > 0
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_admission_queues_when_pool_is_full_and_rejects_impossible_turns() -> None:
    async def main() -> None:
        rng = np.random.default_rng(14)
        group = await make_group(num_blocks=40, num_ranks=1, host_slots=0)
        mgr, registry = make_manager(group)
        try:
            # six turns of ~10 blocks each on a 37-block budget: at most three run at once
            results = await asyncio.gather(
                *(run_turn(mgr, group, tokens(rng, 140), f"q{i}", max_tokens=16, stop=StopKind.END_TURN)
                  for i in range(6))
            )
            assert len(results) == 6
            assert max(r.admission.queue_time_s for r in results) > 0.0
            queued = registry.get_sample_value("deepinfer_cache_admission_queue_seconds_count")
            assert queued == 6.0
            with pytest.raises(PromptTooLong):
                await mgr.admit(tokens(rng, 40 * 16), "huge", 8)
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
