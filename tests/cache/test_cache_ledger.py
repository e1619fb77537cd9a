"""``RankLedger`` (cache/ledger.py): the one place a rank's reservations and load change, and the
invariants its methods keep: no counter below zero, a planned reservation within the pool, and
reserved == what plans hold + the open admissions' shares at every instant."""

from __future__ import annotations

import numpy as np
import pytest

from cache.config import CacheConfig
from cache.hashing import BlockHash
from cache.state import CacheState
from cache.turns import Admission, TierTokens
from rank.ids import Epoch, Rank, SessionId
from tests.cache.cache_harness import SizesOnlyClient


def _state() -> CacheState:
    client = SizesOnlyClient(num_blocks=13)  # 12 usable blocks
    config = CacheConfig(reserve_blocks=2, usable_fraction=1.0, l1_min_headroom_blocks=0)
    return CacheState(client, config, None, clock=lambda: 0.0)  # type: ignore[arg-type]


def _admission() -> Admission:
    return Admission(rank=Rank(0), prefix_blocks=[], num_cached_tokens=0, cached_tokens_by_tier=TierTokens(),
                     queue_time_s=0.0, restore_s=0.0, session_id=SessionId("s"), epoch=Epoch(0),
                     keep_blocks=True, num_prompt_tokens=8, hashes=[])


def test_a_plan_becomes_an_admission_and_gives_everything_back() -> None:
    state = _state()
    ledger = state.ledgers[0]
    assert (ledger.free_blocks(), ledger.plannable_free_blocks(), ledger.usable_blocks()) == (12, 10, 10)
    ledger.reserve(6)  # a committed plan
    ledger.count_running(24)
    assert ledger.free_blocks() == 6 and ledger.running_tokens == 24
    with pytest.raises(AssertionError, match="with no admission"):
        ledger.check([], quiet=True)  # the plan's hold is not an admission's yet
    adm = _admission()
    ledger.open(adm, 6, 24, 9)
    assert (adm.reserved_blocks, adm.running_tokens, adm.worst_blocks) == (6, 24, 9)
    assert ledger.num_open == 1 and ledger.worst_blocks == 9 and not ledger.worst_fits(2)
    ledger.check([adm], quiet=True)
    ledger.restored(adm, 2)  # imported and filed: reserved -> indexed
    ledger.grow(adm, 3, 12)  # the reply's room
    assert (ledger.reserved_blocks, adm.reserved_blocks, ledger.running_tokens) == (7, 7, 36)
    ledger.check([adm], quiet=True)
    ledger.close(adm)
    assert (ledger.reserved_blocks, ledger.running_tokens, ledger.num_open, ledger.worst_blocks) == (0,) * 4
    ledger.check([], quiet=True)


def test_a_planned_reservation_never_exceeds_the_pool() -> None:
    state = _state()
    state.l0[0].insert([BlockHash(i) for i in range(1, 5)], [1, 2, 3, 4], SessionId("s"), 0.0)
    ledger = state.ledgers[0]
    ledger.reserve(8)  # 4 indexed + 8 reserved == capacity: allowed
    with pytest.raises(AssertionError, match="capacity"):
        ledger.reserve(1)


def test_a_grown_reply_may_overcommit_the_pool_and_free_goes_negative() -> None:
    state = _state()
    ledger = state.ledgers[0]
    ledger.reserve(10)
    adm = _admission()
    ledger.open(adm, 10, 0, 10)
    ledger.grow(adm, 5)  # eviction could not cover it: the output room's short case
    assert ledger.free_blocks() == -3 and ledger.plannable_free_blocks() == -5
    ledger.check([adm], quiet=True)


def test_what_no_plan_held_cannot_be_taken_over_or_given_back() -> None:
    ledger = _state().ledgers[0]
    ledger.reserve(2)
    with pytest.raises(AssertionError, match="no plan held"):
        ledger.open(_admission(), 3, 0, 0)
    ledger = _state().ledgers[0]
    with pytest.raises(AssertionError):
        ledger.unreserve(1)
    ledger = _state().ledgers[0]
    with pytest.raises(AssertionError):
        ledger.uncount_running(1)


def test_the_check_sees_an_admission_share_out_of_step() -> None:
    ledger = _state().ledgers[0]
    ledger.reserve(4)
    ledger.count_running(16)
    adm = _admission()
    ledger.open(adm, 4, 16, 4)
    adm.reserved_blocks = 3  # what the structure check forbids outside cache/ledger.py
    with pytest.raises(AssertionError, match="open admissions"):
        ledger.check([adm], quiet=True)


def test_a_restart_gives_every_rank_a_fresh_ledger() -> None:
    state = _state()
    state.ledgers[0].reserve(5)
    old = state.ledgers[0]
    state.reset(Epoch(1))
    assert state.ledgers[0] is not old and state.ledgers[0].reserved_blocks == 0
    assert np.isclose(state.ledgers[0].pool_usage(), 0.0)
