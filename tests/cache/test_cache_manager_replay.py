"""CacheManager over real engines: replays hit the cache, sessions stick, nothing leaks."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from cache.turns import Tier
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


def test_manager_multi_session_replay_hits_and_sticks() -> None:
    async def main() -> None:
        group = await make_group(num_blocks=128, num_ranks=2)
        mgr, registry = make_manager(group)
        rng = np.random.default_rng(0)
        system = tokens(rng, 40)  # shared by every session
        last = {}
        homes: dict[str, set[int]] = {}
        try:
            for turn in range(4):
                for s in range(4):
                    hint = f"s{s}"
                    if turn == 0:
                        prompt = np.concatenate([system, tokens(rng, 30 + 7 * s)])
                    else:
                        prompt = next_prompt(last[hint], tokens(rng, 20))
                    res = await run_turn(mgr, group, prompt, hint)
                    homes.setdefault(hint, set()).add(res.admission.rank)
                    if turn > 0:
                        prev_ctx = len(last[hint].prompt) + len(last[hint].output_ids)
                        # everything but the replayed block and the partial tail is cached
                        assert res.admission.num_cached_tokens >= (prev_ctx // BLOCK_SIZE - 2) * BLOCK_SIZE
                        assert res.admission.cached_tokens_by_tier[Tier.L0] == res.admission.num_cached_tokens
                    last[hint] = res
                await settle(mgr, group)
            assert all(len(r) == 1 for r in homes.values()), homes  # never scattered
            assert sorted(next(iter(r)) for r in homes.values()) == [0, 0, 1, 1]  # balanced
            cached = registry.get_sample_value("deepinfer_cache_cached_tokens_total", {"tier": "l0"})
            prompt_total = registry.get_sample_value("deepinfer_cache_prompt_tokens_total")
            assert cached is not None and prompt_total is not None and cached / prompt_total > 0.5
        finally:
            await group.close()

    asyncio.run(main())


def test_manager_no_hint_session_recognised_by_prefix() -> None:
    async def main() -> None:
        group = await make_group(num_blocks=128, num_ranks=2)
        mgr, _ = make_manager(group)
        rng = np.random.default_rng(1)
        try:
            first = await run_turn(mgr, group, tokens(rng, 100), None)
            other = await run_turn(mgr, group, tokens(rng, 100), None)
            second = await run_turn(mgr, group, next_prompt(first, tokens(rng, 10)), None)
            assert second.admission.session_id == first.admission.session_id
            assert second.admission.rank == first.admission.rank != other.admission.rank
            assert second.admission.num_cached_tokens > 0
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_manager_prefix_cache_off_serves_everything_cold() -> None:
    async def main() -> None:
        group = await make_group(num_blocks=96, num_ranks=2)
        mgr, _ = make_manager(group, prefix_cache=False)
        rng = np.random.default_rng(2)
        try:
            first = await run_turn(mgr, group, tokens(rng, 80), "a")
            second = await run_turn(mgr, group, next_prompt(first, tokens(rng, 10)), "a")
            assert second.admission.num_cached_tokens == 0 and not second.admission.keep_blocks
            assert not mgr.l1_enabled and "prefix_cache" in (mgr.l1_off_reason or "")
            await settle(mgr, group)
            assert all(group.stats(r).num_cached_blocks == 0 for r in range(2))
        finally:
            await group.close()

    asyncio.run(main())


def test_manager_abort_and_double_close_release_everything() -> None:
    async def main() -> None:
        group = await make_group(num_blocks=96, num_ranks=1)
        mgr, _ = make_manager(group)
        rng = np.random.default_rng(3)
        try:
            first = await run_turn(mgr, group, tokens(rng, 64), "a")
            adm = await mgr.admit(next_prompt(first, tokens(rng, 5)), "a", 8)
            assert adm.num_cached_tokens > 0
            mgr.abort(adm)
            mgr.abort(adm)  # second close is a no-op
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_manager_restart_drops_l0_and_keeps_l1() -> None:
    """A restart kills GPU block ids only. L1's committed copies survive (the
    host pool outlives the ranks), so the session's next turn restores from L1 instead of
    recomputing (before: every entry dropped, ``num_cached_tokens == 0`` after a restart)."""

    async def main() -> None:
        group = await make_group(num_blocks=96, num_ranks=2)
        mgr, _ = make_manager(group, l1_write_watermark=0.0)
        rng = np.random.default_rng(4)
        try:
            first = await run_turn(mgr, group, tokens(rng, 64), "a")
            await mgr.drain()
            assert mgr.l0.num_blocks() > 0 and len(mgr.l1.entries) == 1
            num_l1_blocks = len(next(iter(mgr.l1.entries.values())).hashes)
            adm = await mgr.admit(next_prompt(first, tokens(rng, 5)), "a", 8)
            await group.restart("test kill")
            assert mgr.l0.num_blocks() == 0 and mgr.epoch == group.epoch
            assert len(mgr.l1.entries) == 1 and mgr.l1.alloc.num_used_slots > 0
            mgr.abort(adm)  # an admission of the dead epoch closes without touching new engines
            again = await run_turn(mgr, group, next_prompt(first, tokens(rng, 5)), "a")
            by_tier = again.admission.cached_tokens_by_tier
            assert by_tier[Tier.L0] == by_tier[Tier.L2] == 0
            assert by_tier[Tier.L1] == again.admission.num_cached_tokens >= (num_l1_blocks - 1) * BLOCK_SIZE
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_manager_l1_off_without_host_pool_says_why(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        group = await make_group(num_blocks=64, num_ranks=1, host_slots=0)
        with caplog.at_level(logging.INFO, logger="cache.manager"):
            mgr, _ = make_manager(group)
        try:
            assert not mgr.l1_enabled
            assert "L1 off: the rank group has no L1 host pool" in caplog.text
            await run_turn(mgr, group, tokens(np.random.default_rng(5), 40), "a")
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
