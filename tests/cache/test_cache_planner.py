"""The admission planner on a tiny pool, exact state: ``ask`` changes nothing and says what a turn
takes; ``commit`` pins, evicts in a fixed order, names the chains that go to L1, and reserves.

One rank of 12 usable blocks of 4 tokens. Session ``a`` ended its last turn with an answer (a
person reads it: expected back in ~120 s, evicted first), session ``b`` with a tool call
(expected back in ~9 s: protected for ``protect_s`` = 30 s unless the level is FORCE).
"""

from __future__ import annotations

import asyncio

import pytest

from cache.admission import AdmitLevel
from cache.config import CacheConfig
from cache.hashing import BlockHash
from cache.l1_writes import L1Writes
from cache.planner import AdmitPlan, AdmitPlanner, known_prefix_blocks
from cache.retire import ChainExport, Retirer
from cache.sessions import StopKind, session_id_for_hint
from cache.state import CacheState
from rank.ids import Rank
from tests.cache.cache_harness import SizesOnlyClient

BS = SizesOnlyClient.block_size
NOW = 1.0


A = [BlockHash(0xA0 + i) for i in range(4)]  # session a's chain: block ids 1..4
B = [BlockHash(0xB0 + i) for i in range(3)]  # session b's chain: block ids 5..7
C = [BlockHash(0xC0 + i) for i in range(8)]  # a new prompt nobody has seen


def _setup(l1: bool = False) -> tuple[CacheState, AdmitPlanner, SizesOnlyClient]:
    client = SizesOnlyClient(num_blocks=13)
    config = CacheConfig(reserve_blocks=0, usable_fraction=1.0, protect_s=30.0, l1_min_headroom_blocks=0)
    state = CacheState(client, config, None, clock=lambda: NOW)  # type: ignore[arg-type]
    if l1:
        state.l1_on(64, client.bytes_per_block)
    idx = state.l0[0]
    for name, chain, first_id, stop in (("a", A, 1, StopKind.END_TURN), ("b", B, 5, StopKind.TOOL_USE)):
        session = state.sessions.create(name, 0.0)
        state.sessions.set_home(session, Rank(0), 0.0)
        idx.insert(chain, list(range(first_id, first_id + len(chain))), session.session_id, 0.0)
        state.sessions.record_finish(session, stop, chain[-1], len(chain) * BS, 0.0)
    return state, AdmitPlanner(state, Retirer(state, L1Writes(state))), client


def _ids(nodes: tuple[object, ...]) -> list[int]:
    return [n.block_id for n in nodes]  # type: ignore[attr-defined]


def _uses(state: CacheState) -> dict[int, int]:
    return {n.block_id: n.use_count for n in state.l0[0].nodes.values() if n.use_count}


def test_ask_reads_the_resident_prefix_and_changes_nothing() -> None:
    state, planner, _ = _setup()
    # 18 prompt tokens = a's 4 blocks + 2; the last matched block is replayed: 3 usable.
    plan = planner.ask(0, A, num_prompt_tokens=18, total_blocks=5)
    assert plan == AdmitPlan(rank=0, num_l0=3, num_restore=0, need=2, num_free=5)
    assert plan.num_evict == 0
    assert len(state.l0[0]) == 7 and not _uses(state) and state.ledgers[0].reserved_blocks == 0


def test_commit_without_eviction_pins_the_prefix_and_reserves() -> None:
    state, planner, _ = _setup()
    plan = planner.ask(0, A, 18, 5)
    res = planner.commit(plan, A, session_id_for_hint("a"), AdmitLevel.NORMAL)
    assert res is not None and res.plan is plan and res.victims == () and res.exports == ()
    assert _uses(state) == {3: 1}  # one use on the deepest prefix block (a2) pins a0..a2
    assert state.ledgers[0].reserved_blocks == 2
    planner.undo(res, A)
    assert not _uses(state) and state.ledgers[0].reserved_blocks == 0


def test_normal_level_evicts_the_answer_session_tail_first_and_spares_the_tool_session() -> None:
    state, planner, _ = _setup()
    plan = planner.ask(0, C, num_prompt_tokens=28, total_blocks=8)
    assert plan == AdmitPlan(rank=0, num_l0=0, num_restore=0, need=8, num_free=5)
    res = planner.commit(plan, C, session_id_for_hint("c"), AdmitLevel.NORMAL)
    assert res is not None
    assert _ids(res.victims) == [4, 3, 2]  # a3, a2, a1: a's tail towards its root; b untouched
    assert res.exports == ()  # L1 off: nothing to copy first
    assert sorted(n.block_id for n in state.l0[0].nodes.values()) == [1, 5, 6, 7]
    assert state.releases.pending(0) == 3  # out of the index, not free until the release lands
    assert state.ledgers[0].reserved_blocks == 8
    assert state.ledgers[0].free_blocks() == 12 - 4 - 8 - 3


def test_with_l1_the_victims_chain_is_pinned_for_its_export() -> None:
    state, planner, _ = _setup(l1=True)
    plan = planner.ask(0, C, 28, 8)
    res = planner.commit(plan, C, session_id_for_hint("c"), AdmitLevel.NORMAL)
    assert res is not None and _ids(res.victims) == [4, 3, 2]
    (export,) = res.exports
    assert isinstance(export, ChainExport)
    assert export.owner == session_id_for_hint("a")
    assert _ids(export.chain_nodes) == [1, 2, 3, 4]  # the whole chain, root first
    assert export.pinned == (A[0],)  # the part still filed: held until the export is done
    assert _uses(state) == {1: 1}


def test_no_export_when_l1_already_holds_the_chain() -> None:
    state, planner, _ = _setup(l1=True)
    write = state.l1.plan_write(session_id_for_hint("a"), A, NOW)
    assert write is not None
    state.l1.commit(write, NOW)
    res = planner.commit(planner.ask(0, C, 28, 8), C, session_id_for_hint("c"), AdmitLevel.NORMAL)
    assert res is not None and _ids(res.victims) == [4, 3, 2] and res.exports == ()
    assert not _uses(state)


def test_l1_longer_than_l0_plans_a_restore() -> None:
    state, planner, _ = _setup(l1=True)
    write = state.l1.plan_write(session_id_for_hint("a"), A, NOW)
    assert write is not None
    state.l1.commit(write, NOW)
    evicted = state.l0[0].evict(2, lambda owner: 1.0 if owner == session_id_for_hint("a") else 0.0,
                                lambda owner: True)
    assert _ids(tuple(evicted)) == [4, 3]
    plan = planner.ask(0, A, 18, 5)  # L0 holds a0..a1, L1 a0..a3: 3 usable, 2 resident
    assert plan == AdmitPlan(rank=0, num_l0=2, num_restore=1, need=3, num_free=7)


def test_free_only_never_evicts_and_holds_nothing_when_it_does_not_fit() -> None:
    state, planner, _ = _setup()
    assert planner.commit(planner.ask(0, C, 28, 8), C, session_id_for_hint("c"), AdmitLevel.FREE_ONLY) is None
    assert len(state.l0[0]) == 7 and not _uses(state)
    assert state.ledgers[0].reserved_blocks == 0 and state.releases.pending(0) == 0
    res = planner.commit(planner.ask(0, C, 16, 5), C, session_id_for_hint("c"), AdmitLevel.FREE_ONLY)
    assert res is not None and res.victims == () and state.ledgers[0].reserved_blocks == 5


def test_force_takes_the_protected_session_after_the_others() -> None:
    state, planner, _ = _setup()
    plan = planner.ask(0, C, 36, 10)
    assert plan.num_evict == 5
    res = planner.commit(plan, C, session_id_for_hint("c"), AdmitLevel.FORCE)
    assert res is not None and _ids(res.victims) == [4, 3, 2, 1, 7]  # all of a, then b's tail
    assert sorted(n.block_id for n in state.l0[0].nodes.values()) == [5, 6]


def test_a_turn_never_evicts_its_own_prefix() -> None:
    state, planner, _ = _setup()
    # a's next turn wants 12 blocks: 3 resident, 9 to reserve, 5 free -> 4 to evict.
    plan = planner.ask(0, A, 18, 12)
    assert plan == AdmitPlan(rank=0, num_l0=3, num_restore=0, need=9, num_free=5)
    res = planner.commit(plan, A, session_id_for_hint("a"), AdmitLevel.FORCE)
    assert res is not None and _ids(res.victims) == [4, 7, 6, 5]  # a3 (past the prefix), then b
    assert _uses(state) == {3: 1}


def test_a_short_eviction_releases_what_it_took_and_admits_nothing() -> None:
    async def main() -> None:
        state, planner, client = _setup()
        # 10 blocks: NORMAL may take only a's 4 of the 5 it needs.
        plan = planner.ask(0, C, 36, 10)
        assert planner.commit(plan, C, session_id_for_hint("c"), AdmitLevel.NORMAL) is None
        assert state.releases.pending(0) == 4 and state.ledgers[0].reserved_blocks == 0 and not _uses(state)
        await state.tasks.drain()
        assert client.released == [[4, 3, 2, 1]] and state.releases.pending(0) == 0
        assert sorted(n.block_id for n in state.l0[0].nodes.values()) == [5, 6, 7]

    asyncio.run(main())


@pytest.mark.parametrize(("tails", "expected"), [([], 0), ([C[2]], 3), ([C[1], C[5]], 6), ([A[3]], 0)])
def test_known_prefix_is_the_deepest_finished_chain_the_prompt_extends(
    tails: list[BlockHash], expected: int
) -> None:
    assert known_prefix_blocks(tails, C) == expected
