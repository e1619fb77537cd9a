"""Branches of one session (parallel subagents under one session key) over real engines: each
branch is its own routing unit, so four concurrent branches take the four ranks; each one's
later turns and the parent's next turn stay where their prefixes are. With Claude Code's agent
id header and without it (detected from the prompts)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.sessions import RequestClass, SessionHint, StopKind
from cache.turns import Tier
from tests.cache.cache_harness import (
    TurnResult,
    make_group,
    make_manager,
    next_prompt,
    run_turn,
    settle,
    tokens,
)

pytestmark = pytest.mark.timeout(180)

SYSTEM = 96  # the prefix every branch shares with its parent (system prompt + tools), tokens
BRANCH = 160  # each branch's own fresh context


def _hint(agent: int | None) -> SessionHint | str:
    if agent is None:
        return "parent"
    return SessionHint(key="parent", agent_id=f"agent:{agent}", agent_type="Explore",
                       request_class=RequestClass.SUBAGENT)


async def _fan_out(agent_headers: bool, branch_routing: bool = True, **cfg: object) -> dict[str, object]:
    """The parent runs one turn (ending in the tool call that spawns the subagents), four
    branches run two turns each, all at once, then the parent's next turn."""
    rng = np.random.default_rng(7)
    group = await make_group(num_blocks=256, num_ranks=4, host_slots=512, step_s=0.01)
    mgr, registry = make_manager(group, branch_routing=branch_routing, **cfg)
    try:
        system = tokens(rng, SYSTEM)
        parent = await run_turn(mgr, group, np.concatenate([system, tokens(rng, 64)]), "parent",
                                stop=StopKind.TOOL_USE)
        await mgr.drain()
        prompts = [np.concatenate([system, tokens(rng, BRANCH)]) for _ in range(4)]
        in_flight = [0] * 4
        peak = [0] * 4
        firsts: list[TurnResult] = []
        seconds: list[TurnResult] = []

        async def branch(i: int) -> None:
            hint = _hint(i if agent_headers else None)
            first = await run_turn(mgr, group, prompts[i], hint, max_tokens=24)
            firsts.append(first)
            # the branch's second turn: its own context, a tool result appended
            second_prompt = next_prompt(first, tokens(rng, 24))
            async with mgr.turn(second_prompt, hint, 24) as turn:
                rank = turn.rank
                in_flight[rank] += 1
                peak[rank] = max(peak[rank], in_flight[rank])
                from rank.engine import SamplingParams
                async for out in group.submit(rank, turn.engine_request(f"b{i}", SamplingParams(
                        max_tokens=24, ignore_eos=True))):
                    turn.feed(out)
                turn.stop_kind = StopKind.END_TURN
                in_flight[rank] -= 1
            seconds.append(TurnResult(turn.admission, list(turn.output_ids), second_prompt))

        await asyncio.gather(*(branch(i) for i in range(4)))
        await mgr.drain()
        results = {f.admission.session_id: f for f in firsts}
        back = next_prompt(parent, tokens(rng, 48))  # the parent's next turn: the subagents' results
        parent2 = await run_turn(mgr, group, back, "parent")
        out = {
            "first_ranks": sorted(f.admission.rank for f in firsts),
            "peak": peak,
            "sticky": all(s.admission.rank == next(f.admission.rank for f in firsts
                                                    if f.admission.session_id == s.admission.session_id)
                          for s in seconds),
            # cached tokens of each branch's second turn less its first prompt's full blocks
            "second_cached": [s.admission.num_cached_tokens - (SYSTEM + BRANCH) // 16 * 16 for s in seconds],
            "parent_rank": (parent.admission.rank, parent2.admission.rank),
            # all of its first turn's blocks but the replayed last one (rank.engine.usable_prefix_blocks)
            "parent_cached": parent2.admission.num_cached_tokens - (len(parent.prompt) // 16 - 1) * 16,
            "lost": mgr.num_partial_prefix_admissions,
            "sessions": sorted(results),
            "l1_tokens": sum(f.admission.cached_tokens_by_tier[Tier.L1] for f in firsts),
            "copies": registry.get_sample_value("deepinfer_cache_prefix_copies_total", {"outcome": "copied"}),
            "joined": registry.get_sample_value("deepinfer_cache_prefix_copies_total", {"outcome": "joined"}),
        }
        await settle(mgr, group)
        return out
    finally:
        await group.close()


@pytest.mark.parametrize("agent_headers", [True, False], ids=["agent-id", "detected"])
def test_four_branches_under_one_session_take_four_ranks(agent_headers: bool) -> None:
    out = asyncio.run(_fan_out(agent_headers))
    assert out["first_ranks"] == [0, 1, 2, 3]  # one branch per rank
    assert max(out["peak"]) == 1  # type: ignore[call-overload]
    assert out["sticky"]  # each branch's second turn ran where its first did
    # ... from its own prefix: at least its first prompt's full blocks but the replayed last one
    assert min(out["second_cached"]) >= -16  # type: ignore[type-var]
    assert out["parent_rank"][0] == out["parent_rank"][1]  # type: ignore[index]
    assert out["parent_cached"] >= 0  # type: ignore[operator]
    assert out["lost"] == 0  # no turn got less of its own session's (branch's) prefix than it computed
    if agent_headers:
        assert out["sessions"] == [f"hint:parent/agent:agent:{i}" for i in range(4)]
    else:
        assert all(str(s).startswith("hint:parent/branch:") for s in out["sessions"])  # type: ignore[attr-defined]


def test_without_branch_routing_the_branches_stack_on_the_home_rank() -> None:
    """The check above could fail: with branch routing off every turn under the session key
    goes to the parent's home rank (the behaviour this replaces)."""
    out = asyncio.run(_fan_out(True, branch_routing=False))
    assert out["first_ranks"] == [0, 0, 0, 0]
    assert out["peak"][0] > 1  # type: ignore[index]


def test_shared_prefix_is_copied_through_l1_to_a_branch_on_another_rank() -> None:
    """With a copy worth making (copy_min_tokens 0) and L1 not already holding the parent's
    turn (write-through only on a full pool), a branch placed on a rank without the parent's
    system prompt gets it through one copy to L1 instead of a prefill."""
    out = asyncio.run(_fan_out(True, copy_min_tokens=0, l1_write_watermark=1.0))
    assert out["first_ranks"] == [0, 1, 2, 3]
    # The four branches route at once, before the first copy lands (it runs in a task of its
    # own): the first of the three off the parent's rank copies the shared prefix, the other two
    # join that copy instead of writing the same chain to L1 again (three copies before).
    assert out["copies"] == 1
    assert out["joined"] == 2
    # the three branches off the parent's rank restored the shared 96-token prefix from L1
    # (its 6 blocks but the replayed last one)
    assert out["l1_tokens"] >= 3 * (SYSTEM // 16 - 1) * 16  # type: ignore[operator]


def test_written_through_prefix_needs_no_copy() -> None:
    """With every finished turn written through to L1 (the default), the parent's prefix is
    already in L1 when its branches arrive: no copy, and the branches off its rank restore it."""
    out = asyncio.run(_fan_out(True, copy_min_tokens=0))
    assert out["first_ranks"] == [0, 1, 2, 3]
    assert not out["copies"]
    # the three branches off the parent's rank restored the shared 96-token prefix from L1
    # (its 6 blocks but the replayed last one)
    assert out["l1_tokens"] >= 3 * (SYSTEM // 16 - 1) * 16  # type: ignore[operator]
