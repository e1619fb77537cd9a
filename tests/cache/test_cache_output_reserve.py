"""A turn without max_tokens must not reserve the whole pool (found by the OpenAI e2e flows:
a second turn waited for the first's impossible reservation and got 503 after 120 s)."""

from __future__ import annotations

import asyncio

import numpy as np
from cache_harness import make_group, make_manager


def test_cache_output_reserve_caps_what_a_turn_reserves() -> None:
    async def run() -> tuple[int, int]:
        group = await make_group(num_blocks=96, num_ranks=1)
        try:
            # 96 blocks x 16 tokens = 1536 tokens: an uncapped 8000-token reservation never fits.
            mgr, _ = make_manager(group, output_reserve_tokens=64, queue_fail_after_s=2.0)
            first = await mgr.admit(np.arange(3, 203, dtype=np.int32), "a", 8000)
            second = await asyncio.wait_for(mgr.admit(np.arange(5, 205, dtype=np.int32), "b", 8000), 1.5)
            ranks = (first.rank, second.rank)
            mgr.abort(first)
            mgr.abort(second)
            mgr.check_balance()
            return ranks
        finally:
            await group.close()

    assert asyncio.run(run()) == (0, 0)
