"""Rule 4 over real engines: a session with nothing on its home rank that L1 lacks waits in
every rank's queue and runs, restored from L1, on the first rank that has room for it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.sessions import StopKind
from cache.turns import Tier
from tests.cache.cache_harness import make_group, make_manager, next_prompt, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(180)


def _late_binding_run(place_homeless: bool) -> tuple[int, int, int, bool]:
    """X runs a turn on rank 0 (written to L1), B then takes rank 0's room (evicting X), A holds
    rank 1. X's next turn finds both ranks full and waits. A ends on rank 1. Returns X's rank,
    the tokens restored from L1, X's home afterwards, and whether X had run before B ended."""

    async def main() -> tuple[int, int, int, bool]:
        rng = np.random.default_rng(21)
        group = await make_group(num_blocks=40, num_ranks=2, host_slots=256)
        mgr, _ = make_manager(group, protect_s=0.0, l1_write_watermark=0.0, place_homeless=place_homeless)
        try:
            x1 = await run_turn(mgr, group, tokens(rng, 160), "x", max_tokens=8, stop=StopKind.TOOL_USE)
            await mgr.drain()
            assert x1.admission.rank == 0
            a = await mgr.admit(tokens(rng, 560), "a", 8)  # new session: the lighter rank 1
            b = await mgr.admit(tokens(rng, 560), "b", 8)  # rank 0, evicting X (in L1, unprotected)
            assert (a.rank, b.rank) == (1, 0)
            x_hashes = mgr.hasher.hashes(x1.prompt)
            # B evicted X's tail on rank 0 (what it needed); L1 holds more of X than rank 0 does
            assert mgr.l0[0].match(x_hashes) < mgr.l1.match(x_hashes)[1] == len(x_hashes)
            x2_prompt = next_prompt(x1, tokens(rng, 16))
            x2 = asyncio.create_task(run_turn(mgr, group, x2_prompt, "x", max_tokens=8))
            await asyncio.sleep(1.0)
            assert not x2.done()  # no room on either rank
            mgr.abort(a)  # rank 1's room comes back
            if place_homeless:
                result = await asyncio.wait_for(x2, 30.0)
                ran_before_b = True
            else:
                await asyncio.sleep(1.0)
                ran_before_b = x2.done()
                mgr.abort(b)
                result = await asyncio.wait_for(x2, 30.0)
            session = mgr.sessions.get(result.admission.session_id)
            assert session is not None and session.home_rank is not None
            if place_homeless:
                mgr.abort(b)
            out = (result.admission.rank, result.admission.cached_tokens_by_tier[Tier.L1],
                   session.home_rank, ran_before_b)
            await settle(mgr, group)
            return out
        finally:
            await group.close()

    return asyncio.run(main())


def test_homeless_turn_runs_on_the_first_rank_with_room() -> None:
    rank, from_l1, home, ran_before_b = _late_binding_run(place_homeless=True)
    assert (rank, home, ran_before_b) == (1, 1, True)
    assert from_l1 >= 9 * 16  # X's prefix came from L1 on rank 1, not from a prefill


def test_without_rule_4_the_turn_waits_for_its_home() -> None:
    rank, from_l1, home, ran_before_b = _late_binding_run(place_homeless=False)
    assert (rank, home, ran_before_b) == (0, 0, False)  # rank 1 had room; X waited for rank 0
    assert from_l1 >= 8 * 16  # the block B left on rank 0 plus the rest from L1
