"""A turn without max_tokens must not reserve the whole pool (found by the OpenAI e2e flows:
a second turn waited for the first's impossible reservation and got 503 after 120 s). Its
default max_tokens (the rest of max_model_len) is trimmed to the KV room; an explicit one that
cannot fit is refused (tests/cache/test_cache_output_room.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.cache.cache_harness import make_group, make_manager


def test_cache_output_reserve_caps_what_a_turn_reserves() -> None:
    async def run() -> tuple[int, int]:
        group = await make_group(num_blocks=96, num_ranks=1)
        try:
            # 96 blocks x 16 tokens = 1536 tokens: an uncapped 8000-token reservation never fits.
            mgr, _ = make_manager(group, output_reserve_tokens=64, queue_fail_after_s=2.0)
            first = await mgr.admit(np.arange(3, 203, dtype=np.int32), "a", 8000, max_tokens_is_default=True)
            second = await asyncio.wait_for(
                mgr.admit(np.arange(5, 205, dtype=np.int32), "b", 8000, max_tokens_is_default=True), 1.5)
            ranks = (first.rank, second.rank)
            # the default (the rest of max_model_len) is trimmed to the pool: (95 - 2 reserve) x 16 - 200
            assert first.max_output_tokens == second.max_output_tokens == (95 - 2) * 16 - 200
            mgr.abort(first)
            mgr.abort(second)
            mgr.check_balance()
            return ranks
        finally:
            await group.close()

    assert asyncio.run(run()) == (0, 0)
