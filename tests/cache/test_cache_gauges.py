"""The cache's load gauges follow the state without a new request: after a
burst they used to keep the values of the burst's last admit/finish for as long as no request
came (30+ s seen), so alerts on free blocks or load fired falsely. Runs on virtual time."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.cache.cache_harness import make_group, make_manager, run_turn, settle, tokens


def _gauge(registry: object, name: str, rank: int) -> float:
    value = registry.get_sample_value(f"deepinfer_cache_{name}",
                                      {"rank": str(rank)})  # type: ignore[attr-defined]
    assert value is not None, name
    return float(value)


def test_gauges_follow_releases_and_idle_sessions_without_requests() -> None:
    async def main() -> None:
        rng = np.random.default_rng(5)
        group = await make_group("null", num_blocks=64, num_ranks=1, host_slots=0)
        mgr, registry = make_manager(group, home_horizon_s=60.0)
        try:
            prompt = tokens(rng, 100)
            await run_turn(mgr, group, prompt, None, max_tokens=4)
            # The same prompt again: its kept blocks duplicate the filed ones and are released
            # in the background, after the finish that last refreshed the gauges.
            await run_turn(mgr, group, prompt.copy(), None, max_tokens=4)
            await settle(mgr, group)
            load = mgr.loads()[0]
            assert load.load_tokens > 0, "the idle session counts toward the rank's load"
            await asyncio.sleep(2.0)  # no request; the releases have landed
            assert _gauge(registry, "rank_free_blocks", 0) == mgr.loads()[0].num_free_blocks
            assert _gauge(registry, "rank_load_tokens", 0) == load.load_tokens
            await asyncio.sleep(61.0)  # past the home horizon: the idle session no longer counts
            assert mgr.loads()[0].load_tokens == 0
            assert _gauge(registry, "rank_load_tokens", 0) == 0
            assert _gauge(registry, "rank_cached_blocks", 0) == len(mgr.l0[0])
        finally:
            await group.close()

    asyncio.run(main())
