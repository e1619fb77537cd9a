"""New sessions of one client share its system prompt and tools: a new session placed by load on
a rank that lacks that prefix, while another rank holds it, reuses it (restored from L1, or
copied there first) instead of paying its whole prefill. Four ranks, real engines, sessions one
after another with different session keys (as an agent CLI opens them: each new session's first
prompt is the client's system prompt and tools, then its task)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.sessions import StopKind
from cache.turns import Tier
from tests.cache.cache_harness import make_group, make_manager, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(180)

SHARED = 160  # the client's system prompt + tools, tokens (10 blocks of 16)
TASK = 48  # each session's own first message


async def _sessions(host_slots: int = 512, **cfg: object) -> dict[str, object]:
    rng = np.random.default_rng(11)
    group = await make_group(num_blocks=256, num_ranks=4, host_slots=host_slots, step_s=0.01)
    mgr, registry = make_manager(group, **cfg)
    try:
        shared = tokens(rng, SHARED)
        ranks, cached, from_l1 = [], [], []
        for i in range(4):
            turn = await run_turn(mgr, group, np.concatenate([shared, tokens(rng, TASK)]), f"session-{i}",
                                  max_tokens=16, stop=StopKind.END_TURN)
            await mgr.drain()  # its write-through lands before the next session opens
            ranks.append(turn.admission.rank)
            cached.append(turn.admission.num_cached_tokens)
            from_l1.append(turn.admission.cached_tokens_by_tier[Tier.L1])
        out = {
            "ranks": ranks, "cached": cached, "from_l1": from_l1,
            "copies": registry.get_sample_value("deepinfer_cache_prefix_copies_total", {"outcome": "copied"}),
        }
        await settle(mgr, group)
        return out
    finally:
        await group.close()


# The shared prefix's full blocks but the one the engine replays (rank.engine.usable_prefix_blocks).
REUSED = (SHARED // 16 - 1) * 16


def test_a_new_session_placed_off_the_prefix_rank_restores_the_shared_prefix_from_l1() -> None:
    """Each new session goes to an empty rank (the previous ones stay homed, idle, where they
    ran) and gets the shared prefix from L1, where the first session's turn was written through."""
    out = asyncio.run(_sessions())
    assert out["ranks"] == [0, 1, 2, 3]
    assert out["cached"][0] == 0  # type: ignore[index]
    for i in (1, 2, 3):
        assert out["from_l1"][i] >= REUSED, out  # type: ignore[index]
    assert not out["copies"]  # L1 held it already: no copy


def test_a_new_session_gets_the_prefix_by_one_copy_when_l1_lacks_it() -> None:
    """No write-through (only on a full pool): the second session's prefix is copied from rank 0
    to L1 once; the third and fourth restore that copy."""
    out = asyncio.run(_sessions(l1_write_watermark=1.0, copy_min_tokens=0))
    assert out["ranks"] == [0, 1, 2, 3]
    for i in (1, 2, 3):
        assert out["from_l1"][i] >= REUSED, out  # type: ignore[index]
    assert out["copies"] == 1


def test_without_l1_the_new_session_pays_the_whole_prefill() -> None:
    """The checks above could fail: with no host pool (no L1, so no copy and no restore) a new
    session placed by load on a rank without the prefix gets nothing of it cached, the case seen
    with an agent CLI's third session (0 of ~12K prompt tokens cached while another rank held
    ~11.6K of them)."""
    out = asyncio.run(_sessions(host_slots=0))
    assert out["ranks"][1] != 0  # type: ignore[index]
    assert out["cached"][1] == 0  # type: ignore[index]
