"""Request classes (Claude Code's x-claude-code-request-class and friends): what each means for
the admission queue, eviction and routing, each with the exact order on a small fixture."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache.admission import AdmissionConfig, AdmissionQueue, AdmitLevel
from cache.router import RankLoad, Router, RouterConfig, RouteReason
from cache.sessions import RequestClass, SessionHint, SessionTable, StopKind
from rank.ids import Rank, SessionId
from server.agent_hints import agent_hint, with_body_class
from tests.cache.cache_harness import (
    BLOCK_SIZE,
    TurnResult,
    make_group,
    make_manager,
    next_prompt,
    run_turn,
    settle,
    tokens,
)

pytestmark = pytest.mark.timeout(180)


def test_main_turn_queues_ahead_of_its_own_branches_and_auxiliary_turns_yield() -> None:
    """One rank, room for one turn at a time. Waiting, in arrival order: another session's turn
    x (the head), an auxiliary turn a, two branch turns of family f around another session's
    turn o, then f's main turn m. Admitted: x, m (ahead of its own branches, not of o... nor of
    x), b1, o, b2, and the auxiliary turn last (it never heads the queue while a session's turn
    waits)."""

    async def main() -> list[str]:
        queue = AdmissionQueue(1, AdmissionConfig(recheck_s=0.01, force_after_s=60.0, fail_after_s=600.0))
        room = [0]
        order: list[str] = []

        def try_admit(_rank: int, _level: AdmitLevel) -> bool:
            if room[0] > 0:
                room[0] -= 1
                return True
            return False

        async def enter(name: str, **kw: object) -> None:
            await queue.enter_any((0,), 10, try_admit, **kw)  # type: ignore[arg-type]
            order.append(name)

        tasks = []
        for name, kw in (("x", {"family": "x", "main": True}), ("a", {"family": "g", "yields": True}),
                         ("b1", {"family": "f"}), ("o", {"family": "o", "main": True}),
                         ("b2", {"family": "f"}), ("m", {"family": "f", "main": True})):
            tasks.append(asyncio.create_task(enter(name, **kw)))
            await asyncio.sleep(0.001)
        for _ in range(6):
            room[0] += 1
            queue.notify(0)
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["x", "m", "b1", "o", "b2", "a"]


def test_auxiliary_request_never_pins_or_follows_a_home_rank() -> None:
    table = SessionTable()
    hint = SessionHint(key="s", request_class=RequestClass.AUXILIARY, auxiliary_type="title")
    aux = table.create(hint, 0.0)
    assert aux.session_id == "hint:s/aux:title" and aux.request_class is RequestClass.AUXILIARY
    aux.home_rank = Rank(0)
    aux.num_in_flight = 0
    loads = [RankLoad(Rank(0), 50_000, 0, 0, 100), RankLoad(Rank(1), 0, 0, 0, 100)]
    d = Router(RouterConfig(), 16).route(aux, [40, 0], 1000, loads, True, 1000.0)
    # the rank holding 640 of its tokens is 50K busier: the auxiliary turn goes to the idle one, no copy
    assert (d.rank, d.reason, d.copy_from) == (1, RouteReason.AUXILIARY, None)


def _compaction_run(mode: str) -> tuple[int, int, int, int]:
    """Session c: two turns, a compaction request, then (unless ``mode`` is "pending") its first
    compacted turn, sharing only the system prompt; labelled by Claude Code's headers ("headers")
    or not ("detected"). Session o finished long before. A new turn z then needs blocks
    evicted. Returns (c's old chain blocks before z, after z, o's blocks before z, after z)."""

    async def main() -> tuple[int, int, int, int]:
        rng = np.random.default_rng(3)
        group = await make_group(num_blocks=40, num_ranks=1, host_slots=0)
        mgr, _ = make_manager(group, protect_s=0.0, l1_cache=False)
        headers = mode == "headers"
        try:
            o = await run_turn(mgr, group, tokens(rng, 160), "o", stop=StopKind.END_TURN)
            await asyncio.sleep(300.0)  # o waits on a person, long since
            system = tokens(rng, 64)
            c1 = await run_turn(mgr, group, np.concatenate([system, tokens(rng, 64)]), "c")
            c2 = await run_turn(mgr, group, next_prompt(c1, tokens(rng, 32)), "c", stop=StopKind.END_TURN)
            compaction = SessionHint(key="c", request_class=RequestClass.COMPACTION) if headers else "c"
            cc = await run_turn(mgr, group, next_prompt(c2, tokens(rng, 32)), compaction,
                                stop=StopKind.END_TURN)
            if mode != "pending":
                compacted = SessionHint(key="c", context_compacted=True) if headers else "c"
                await run_turn(mgr, group, np.concatenate([system, tokens(rng, 48)]), compacted,
                               stop=StopKind.END_TURN)
            old = mgr.hasher.hashes(cc.prompt)
            o_hashes = mgr.hasher.hashes(o.prompt)
            before = (mgr.l0[0].match(old), mgr.l0[0].match(o_hashes))
            z = await run_turn(mgr, group, tokens(rng, 240 if mode != "pending" else 200), "z",
                               stop=StopKind.END_TURN)
            assert z.admission.rank == 0
            after = (mgr.l0[0].match(old), mgr.l0[0].match(o_hashes))
            await settle(mgr, group)
            return before[0], after[0], before[1], after[1]
        finally:
            await group.close()

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["headers", "detected"])
def test_compaction_lets_the_old_prefix_go_first_once_the_compacted_turn_arrived(mode: str) -> None:
    """Labelled (x-claude-code-compaction, -context-compacted) or seen from the prompts (what
    Claude Code 2.1.197 and 2.1.332 send: no label), the same order."""
    old_before, old_after, o_before, o_after = _compaction_run(mode)
    assert o_after == o_before == 10  # the other session kept every block
    # the old prefix went first (the compacted turn's own room took one block of it already) down
    # to exactly the 4 blocks of system prompt the compacted context shares
    assert old_before > old_after == 4


def test_until_the_compacted_turn_arrives_the_old_prefix_is_kept() -> None:
    """The check above could fail: with the summary done but no compacted turn yet, the old
    prefix is an idle session like any other, and o (idle longest) loses blocks first."""
    old_before, old_after, o_before, o_after = _compaction_run("pending")
    assert old_after == old_before == 13
    assert o_after < o_before


def test_auxiliary_turn_never_evicts_a_session_and_yields_to_one() -> None:
    """One rank: session m (idle, unprotected) fills most of the pool. An auxiliary turn that
    needs room waits without evicting m; a new session's turn n behind it evicts m and runs
    first; the auxiliary turn runs once free room appears."""

    async def main() -> tuple[list[str], int, int]:
        rng = np.random.default_rng(5)
        group = await make_group(num_blocks=40, num_ranks=1, host_slots=0)
        mgr, _ = make_manager(group, protect_s=0.0, l1_cache=False)
        try:
            m = await run_turn(mgr, group, tokens(rng, 400), "m", stop=StopKind.END_TURN)
            m_hashes = mgr.hasher.hashes(m.prompt)
            order: list[str] = []
            aux_hint = SessionHint(key="m", request_class=RequestClass.AUXILIARY, auxiliary_type="title")

            async def admit(name: str, hint: SessionHint | str) -> None:
                adm = await mgr.admit(tokens(rng, 200), hint, 8)
                order.append(name)
                await asyncio.sleep(1.0)
                mgr.abort(adm)

            aux = asyncio.create_task(admit("aux", aux_hint))
            await asyncio.sleep(0.5)
            m_while_aux_waits = mgr.l0[0].match(m_hashes)
            n = asyncio.create_task(admit("n", "n"))
            await asyncio.gather(aux, n)
            await settle(mgr, group)
            return order, m_while_aux_waits, len(m_hashes)
        finally:
            await group.close()

    order, m_kept, m_blocks = asyncio.run(main())
    assert m_kept == m_blocks == 25  # the waiting auxiliary turn evicted nothing of m
    assert order == ["n", "aux"]


# ---- Claude Code's captured title requests (tests/e2e/captures/claude-*-auxiliary.json) --------

CAPTURES = Path(__file__).resolve().parents[1] / "e2e" / "captures"
SCALE = 8  # captured prompt tokens per token here: a 12.8K-token main turn becomes 100 blocks, a title 6


def _captured(version: str, run: str) -> list[dict[str, Any]]:
    """One captured interactive session: title, main turn, title, main turn (arrival order)."""
    data = json.loads((CAPTURES / f"claude-{version}-auxiliary.json").read_text())
    rows: list[dict[str, Any]] = data[run]
    return rows


def _replay(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[TurnResult]]:
    """The captured requests on 2 ranks, each with the hint its captured headers give (session
    key "s"), its prompt scaled down from the captured size and its prefix as captured: the
    main turns one growing conversation, the titles their own prompt (sharing nothing with it,
    the second sharing the first's instructions). Returns what the sessions looked like after
    each title and the turns."""

    async def main() -> tuple[dict[str, Any], list[TurnResult]]:
        rng = np.random.default_rng(11)
        group = await make_group(num_blocks=512, num_ranks=2, host_slots=0)
        mgr, _ = make_manager(group, protect_s=0.0, l1_cache=False)
        title_head = tokens(rng, rows[0]["prompt_tokens"] * 4 // (5 * SCALE))  # ~640 of 787 shared
        seen: dict[str, Any] = {"main_home_after_title": [], "aux_class": [], "tails_kept": []}
        turns: list[TurnResult] = []
        last_main: TurnResult | None = None
        try:
            for row in rows:
                # as the service does: the headers' hint, then the body's one-off class
                one_off = bool(row["output_format"]) and not row["tools"]
                hint = with_body_class(replace(agent_hint(row["claude_code_headers"]), key="s"), one_off)
                size = row["prompt_tokens"] // SCALE
                if row["tools"]:
                    prompt = (tokens(rng, size) if last_main is None else
                              next_prompt(last_main, tokens(rng, max(1, size - len(last_main.prompt) - 8))))
                    last_main = await run_turn(mgr, group, prompt, hint, stop=StopKind.END_TURN)
                    turns.append(last_main)
                    continue
                main_before = mgr.sessions.get(SessionId("hint:s"))
                tails = list(main_before.tail_hashes) if main_before is not None else []
                prompt = np.concatenate([title_head, tokens(rng, size - len(title_head))])
                turns.append(await run_turn(mgr, group, prompt, hint, stop=StopKind.END_TURN))
                main_after = mgr.sessions.get(SessionId("hint:s"))
                aux = mgr.sessions.get(SessionId(f"hint:s/aux:{hint.auxiliary_type or 'auxiliary'}"))
                seen["aux_class"].append(None if aux is None else aux.request_class)
                seen["main_home_after_title"].append(None if main_after is None else main_after.home_rank)
                kept = not tails if main_after is None else all(t in main_after.tail_hashes for t in tails)
                seen["tails_kept"].append(kept)
            seen["sessions"] = sorted(s.session_id for s in mgr.sessions)
            await settle(mgr, group)
            return seen, turns
        finally:
            await group.close()

    return asyncio.run(main())


def test_captured_titles_with_class_headers_never_pin_or_move_the_main_session() -> None:
    """Claude Code 2.1.332 with CLAUDE_CODE_GATEWAY_HINT_HEADERS=1: each title carries
    x-claude-code-request-class: auxiliary. Replayed as captured, both titles run as one
    auxiliary unit beside the session (routed by cost alone, never by a home:
    test_auxiliary_request_never_pins_or_follows_a_home_rank); the first title does not open
    the main session, the second leaves its home and tails alone, and the main thread's second
    turn is served from its own prefix on its first turn's rank."""
    rows = _captured("2.1.332", "tui_hint_headers")
    assert [bool(r["tools"]) for r in rows] == [False, True, False, True]
    seen, turns = _replay(rows)
    assert seen["sessions"] == ["hint:s", "hint:s/aux:auxiliary"]
    assert seen["aux_class"] == [RequestClass.AUXILIARY, RequestClass.AUXILIARY]
    main1, main2 = turns[1], turns[3]
    assert seen["main_home_after_title"] == [None, main1.admission.rank]
    assert seen["tails_kept"] == [True, True]
    assert main2.admission.rank == main1.admission.rank
    assert main2.admission.num_cached_tokens >= len(main1.prompt) - 2 * BLOCK_SIZE  # all but its last


@pytest.mark.parametrize("version", ["2.1.197", "2.1.332"])
def test_captured_titles_without_class_headers_are_told_from_their_body(version: str) -> None:
    """What both versions send by default: a title carries only the session id. Its body (a
    structured output, no tools) makes it a one-off (``server/agent_hints.with_body_class``), so
    it runs as an auxiliary unit: the first title (sent before the first main turn) does not open
    the main session, and the main thread's second turn is served from its own prefix."""
    rows = _captured(version, "tui")
    seen, turns = _replay(rows)
    assert seen["sessions"] == ["hint:s", "hint:s/aux:one-off"]
    assert seen["aux_class"] == [RequestClass.AUXILIARY, RequestClass.AUXILIARY]
    mains = [t for t, r in zip(turns, rows, strict=True) if r["tools"]]
    assert len(mains) == 2
    assert seen["main_home_after_title"] == [None, mains[0].admission.rank]
    assert mains[1].admission.rank == mains[0].admission.rank
    assert mains[1].admission.num_cached_tokens >= len(mains[0].prompt) - 2 * BLOCK_SIZE  # all but its last


@pytest.mark.parametrize("version", ["2.1.197", "2.1.332"])
def test_captured_title_without_class_header_is_not_a_compaction(version: str) -> None:
    """The rule an auxiliary turn keeps (it never evicts a main session): the second title
    leaves the main thread's prefix owned. Taken as main-session turns (before the body's
    one-off class), the first title opened the session, so its first prompt was a title's; the
    second shared half of it on the session's rank and extended none of its tails, which is how
    ``Branches.prefix_broken`` tells a compaction's first turn, and the main thread's chain was
    retired (its blocks go first; 2.1.197 logged it in sessions that never compacted)."""
    seen, _turns = _replay(_captured(version, "tui"))
    assert seen["tails_kept"] == [True, True]
