"""Blocks a prefetch restores from L1 before the admission count as L1 hits (2 x H200 run: the
admission found them resident and counted them as L0, so /metrics understated the L1 share)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.sessions import StopKind
from cache.turns import Tier, TierTokens
from tests.cache.cache_harness import (
    BLOCK_SIZE,
    make_group,
    make_manager,
    next_prompt,
    run_turn,
    settle,
    tokens,
)

pytestmark = pytest.mark.timeout(120)


def test_prefetched_blocks_count_as_l1_in_the_admission_and_the_metrics() -> None:
    async def main() -> None:
        rng = np.random.default_rng(21)
        group = await make_group("null", num_blocks=64, num_ranks=1, host_slots=64)
        mgr, registry = make_manager(group, l1_write_watermark=0.0)
        try:
            first = await run_turn(mgr, group, tokens(rng, 100), "a", stop=StopKind.END_TURN)
            await mgr.drain()
            sid = first.admission.session_id
            assert mgr.l1.backed_blocks(sid) == 6
            # The GPU needed the room: a's blocks were dropped (L1 keeps the copy).
            victims = mgr.l0[0].evict(1000, mgr.policy.scorer(0, 0.0), mgr.policy.chooser(0, 0.0, True))
            await group.release(0, [v.block_id for v in victims])
            before = {t: registry.get_sample_value("deepinfer_cache_cached_tokens_total", {"tier": t})
                      for t in
                      ("l0", "l1")}
            mgr.prefetch("a")  # as the service does once the headers are read
            await mgr.drain()  # the prefetch lands before the prompt is even tokenized
            prompt = next_prompt(first, tokens(rng, 20))
            assert mgr.l0[0].match(mgr.hasher.hashes(prompt)) == 5  # resident again, by the prefetch
            second = await run_turn(mgr, group, prompt, "a")
            tiers = second.admission.cached_tokens_by_tier
            assert tiers == TierTokens(l0=0, l1=5 * BLOCK_SIZE)
            assert second.admission.num_cached_tokens == 5 * BLOCK_SIZE
            after = {t: registry.get_sample_value("deepinfer_cache_cached_tokens_total", {"tier": t}) for t in
                     ("l0", "l1")}
            assert after["l1"] - before["l1"] == 5 * BLOCK_SIZE and after["l0"] == before["l0"]
            assert registry.get_sample_value("deepinfer_cache_l1_restored_tokens_total") == 5 * BLOCK_SIZE
            # The turn after that hits its own blocks on the GPU: L0 again.
            third = await run_turn(mgr, group, next_prompt(second, tokens(rng, 20)), "a")
            assert third.admission.cached_tokens_by_tier[Tier.L1] == 0
            assert third.admission.cached_tokens_by_tier[Tier.L0] > 5 * BLOCK_SIZE
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_prefetch_holds_its_l1_blocks_from_the_moment_it_is_started() -> None:
    """A write-through of the same session that cut the L1 entry back between ``prefetch()`` and
    the start of its task changed the slots the task was about to import (the full suite's
    disconnect storm: '14 hashes for 18 blocks' in the prefetch, then a cache balance error).
    The prefetch takes its read hold and its chain when it is started, so a later cut must go to a
    new extent and the imported bytes stay the ones its hashes name."""

    async def main() -> None:
        rng = np.random.default_rng(22)
        group = await make_group("null", num_blocks=64, num_ranks=1, host_slots=64)
        mgr, _ = make_manager(group, l1_write_watermark=0.0)
        try:
            first = await run_turn(mgr, group, tokens(rng, 100), "a", stop=StopKind.END_TURN)
            await mgr.drain()
            sid = first.admission.session_id
            entry = mgr.l1.entries[sid]
            chain = list(entry.hashes)
            victims = mgr.l0[0].evict(1000, mgr.policy.scorer(0, 0.0), mgr.policy.chooser(0, 0.0, True))
            await group.release(0, [v.block_id for v in victims])
            mgr.prefetch("a")  # the task is spawned, not yet run
            # The session's history diverged after block 2: its write-through plans a cut-back.
            plan = mgr.l1.plan_write(sid, chain[:2] + [h ^ 1 for h in chain[2:]], 0.0)
            assert plan is not None
            assert entry.hashes == chain, "the prefetch's hold must keep the entry from being cut"
            mgr.l1.abort(plan)
            await mgr.drain()
            assert mgr.l0[0].match(chain) == len(chain) - 1  # restored under the right hashes
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
