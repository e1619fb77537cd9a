"""Sessions and eviction value: tool-waiting sessions are worth more than human-waiting ones."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np

from cache.eviction import EvictionPolicy
from cache.hashing import ChainHasher
from cache.sessions import SessionTable, StopKind
from rank.host_budget import GIB, plan_l1_budget


def test_sessions_found_by_hint_and_by_tail() -> None:
    table = SessionTable()
    h = ChainHasher(4).hashes(np.arange(40, dtype=np.int32))
    s = table.create(None, 0.0)
    table.record_finish(s, StopKind.TOOL_USE, h[5], 24, 1.0)
    assert table.find(None, h) is s  # the new prompt extends its last turn
    assert table.find(None, h[:5]) is None  # a prompt that stops short is not that session
    named = table.create("abc", 0.0)
    assert table.find("abc", []) is named
    assert table.find("other", h) is None  # an explicit new header is a new session


def test_sessions_learn_gaps_per_stop_kind() -> None:
    table = SessionTable()
    s = table.create("x", 0.0)
    for t in range(5):
        table.record_finish(s, StopKind.TOOL_USE, None, 10, 100.0 * t)
        table.record_arrival(s, 100.0 * t + 2.0)  # tool results come back in 2 s
    assert s.gaps.tool_gap_s < 4.0
    assert s.gaps.human_gap_s == 120.0
    assert table.fleet_gaps.num_samples == 5


def test_eviction_value_tool_vs_human_and_protection() -> None:
    table = SessionTable()
    tool = table.create("tool", 0.0)
    human = table.create("human", 0.0)
    for s, kind in ((tool, StopKind.TOOL_USE), (human, StopKind.END_TURN)):
        s.home_rank = 0
        table.record_finish(s, kind, None, 1000, 10.0)
    policy = EvictionPolicy(table, lambda sid: False, protect_s=30.0)
    assert policy.score(0, human.session_id, 12.0) > policy.score(0, tool.session_id, 12.0)
    assert policy.is_protected(0, tool.session_id, 12.0)
    assert not policy.is_protected(0, human.session_id, 12.0)
    assert not policy.is_protected(0, tool.session_id, 60.0)  # overdue: no longer "about to return"
    assert policy.score(1, tool.session_id, 12.0) == math.inf  # blocks left on a rank it moved off
    assert policy.score(0, None, 12.0) == math.inf
    backed = EvictionPolicy(table, lambda sid: True, protect_s=30.0)
    assert backed.score(0, tool.session_id, 12.0) > policy.score(0, tool.session_id, 12.0)


def test_l1_budget_lowered_and_logged_when_ram_is_short(caplog: object) -> None:
    def small_box() -> SimpleNamespace:
        return SimpleNamespace(total=64 * GIB, available=40 * GIB)

    with caplog.at_level(logging.INFO, logger="rank.host_budget"):  # type: ignore[attr-defined]
        b = plan_l1_budget(l1_cache=True, l1_host_gb=128, num_ranks=4, bytes_per_block=114_048,
                           virtual_memory=small_box)
    assert b.requested_bytes == 512 * GIB
    assert b.pool_bytes <= 32 * GIB and b.num_slots == (32 * GIB) // 114_048
    assert "lowered" in b.reason
    text = caplog.text  # type: ignore[attr-defined]
    assert "L1 host pool" in text and "lowered" in text and "40.0 GiB available" in text


def test_l1_budget_kept_when_ram_allows_and_off_when_disabled() -> None:
    def big_box() -> SimpleNamespace:
        return SimpleNamespace(total=2048 * GIB, available=1800 * GIB)

    b = plan_l1_budget(l1_cache=True, l1_host_gb=128, num_ranks=4, bytes_per_block=1 << 20,
                       virtual_memory=big_box)
    assert b.pool_bytes == 512 * GIB and "lowered" not in b.reason
    off = plan_l1_budget(l1_cache=False, l1_host_gb=128, num_ranks=4, bytes_per_block=1 << 20,
                         virtual_memory=big_box)
    assert not off.enabled and "l1_cache is false" in off.reason
    none = plan_l1_budget(l1_cache=True, l1_host_gb=128, num_ranks=4, bytes_per_block=1 << 20,
                          virtual_memory=lambda: SimpleNamespace(total=16 * GIB, available=6 * GIB))
    assert not none.enabled and "no RAM to spare" in none.reason


def test_a_subagent_that_answered_is_done() -> None:
    """A branch whose turn ended with an answer has reported to its parent: it is not expected
    back (its blocks go before a person-waiting session's), while one waiting on a tool is."""
    from cache.sessions import RequestClass, SessionHint

    table = SessionTable()
    main = table.create("p", 0.0)
    done = table.create(SessionHint(key="p", agent_id="a1", request_class=RequestClass.SUBAGENT), 0.0)
    working = table.create(SessionHint(key="p", agent_id="a2", request_class=RequestClass.SUBAGENT), 0.0)
    assert done.family == main.session_id and done.request_class is RequestClass.SUBAGENT
    for s, kind in ((main, StopKind.END_TURN), (done, StopKind.END_TURN), (working, StopKind.TOOL_USE)):
        s.home_rank = 0
        table.record_finish(s, kind, None, 1000, 10.0)
    policy = EvictionPolicy(table, lambda sid: False, protect_s=30.0)
    assert policy.score(0, done.session_id, 12.0) > policy.score(0, main.session_id, 12.0)
    assert policy.score(0, main.session_id, 12.0) > policy.score(0, working.session_id, 12.0)
    assert done.expected_wait_s(12.0) > 3600.0 > main.expected_wait_s(12.0)
