"""``RankLedger`` (cache/ledger.py): the one place a rank's reservations and load change, and the
invariants its methods keep: no counter below zero, a planned reservation within the pool, and
reserved == what plans hold + the open admissions' shares at every instant."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cache.config import CacheConfig
from cache.hashing import BlockHash
from cache.ledger import shared_blocks
from cache.state import CacheState
from cache.turns import Admission, TierTokens
from rank.ids import Epoch, Rank, SessionId
from tests.cache.cache_harness import SizesOnlyClient


def _state() -> CacheState:
    client = SizesOnlyClient(num_blocks=13)  # 12 usable blocks
    config = CacheConfig(reserve_blocks=2, usable_fraction=1.0, l1_min_headroom_blocks=0)
    return CacheState(client, config, None, clock=lambda: 0.0)  # type: ignore[arg-type]


def _admission(hashes: tuple[int, ...] = (), num_used: int = 0) -> Admission:
    return Admission(rank=Rank(0), prefix_blocks=[], num_cached_tokens=0, cached_tokens_by_tier=TierTokens(),
                     queue_time_s=0.0, restore_s=0.0, session_id=SessionId("s"), epoch=Epoch(0),
                     keep_blocks=True, num_prompt_tokens=8, hashes=[BlockHash(h) for h in hashes],
                     num_used_blocks=num_used)


def test_a_plan_becomes_an_admission_and_gives_everything_back() -> None:
    state = _state()
    ledger = state.ledgers[0]
    assert (ledger.free_blocks(), ledger.plannable_free_blocks(), ledger.usable_blocks()) == (12, 10, 10)
    ledger.reserve(6)  # a committed plan
    ledger.count_running(24, 9)
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


def test_a_committed_turns_worst_case_counts_before_its_admission_opens() -> None:
    """A turn that evicts for itself awaits its victims' release between its commit and its
    admission; a turn admitted meanwhile must see its worst case (else both replies may outgrow
    the pool together). It counts from ``count_running`` on, and ``open`` takes it over."""
    ledger = _state().ledgers[0]  # 10 usable blocks
    ledger.reserve(3)
    ledger.count_running(24, 7)  # committed, still evicting for itself
    assert ledger.worst_blocks == 7 and ledger.worst_fits(3) and not ledger.worst_fits(4)
    with pytest.raises(AssertionError, match="with no admission"):
        ledger.check([], quiet=True)
    adm = _admission()
    ledger.open(adm, 3, 24, 7)
    assert ledger.worst_blocks == 7 and adm.worst_blocks == 7
    ledger.check([adm], quiet=True)
    ledger.close(adm)
    ledger.reserve(2)
    ledger.count_running(8, 5)
    ledger.uncount_running(8, 5)  # the commit undone (client gone while it evicted)
    ledger.unreserve(2)
    assert ledger.worst_blocks == 0
    ledger.check([], quiet=True)
    with pytest.raises(AssertionError, match="no plan held"):
        _state().ledgers[0].open(_admission(), 0, 0, 1)  # a worst case no commit counted


def test_a_prefix_block_open_turns_share_counts_once_in_their_worst_case() -> None:
    """Two open turns pin the same 3-block head (a system prompt every subagent starts with): the
    engine holds those blocks once, so a third turn on that head fits where the plain sum of worst
    cases (5 + 5 + 3 > 10 usable) said it did not; the own part of each worst case still counts."""
    ledger = _state().ledgers[0]  # 10 usable blocks
    a, b = _admission((1, 2, 3, 4), 3), _admission((1, 2, 3, 5), 3)
    for adm in (a, b):
        ledger.count_running(0, 5)
        ledger.open(adm, 0, 0, 5)
    assert ledger.worst_blocks == 10 and ledger.worst_fits(0)
    head = [BlockHash(h) for h in (1, 2, 3, 6)]
    assert ledger.worst_fits(3, head, 3)  # 13 counted, 3 of a, b and this one's head counted once: 7
    assert not ledger.worst_fits(7, head, 3)  # 11 with the head once: still too many
    other = [BlockHash(h) for h in (7, 8)]
    assert ledger.worst_fits(3, other, 2) and not ledger.worst_fits(4, other, 2)  # only a and b share
    ledger.close(a)
    assert ledger.worst_fits(8, head, 3) and not ledger.worst_fits(9, head, 3)  # 5 + 8 - 3
    ledger.check([b], quiet=True)


def _chain(path: tuple[int, ...]) -> list[BlockHash]:
    """Chain hashes of a path of block contents: equal at i exactly where the heads are equal."""
    return [BlockHash(hash(path[: i + 1]) & ((1 << 62) - 1)) for i in range(len(path))]


def test_shared_blocks_counts_each_shared_head_block_once() -> None:
    def shared(*ps: tuple[tuple[int, ...], int]) -> int:
        return shared_blocks([(_chain(p), n) for p, n in ps])

    assert shared(((1, 2, 3), 3), ((1, 2, 4), 3), ((1, 5), 2), ((6,), 1), ((), 0)) == 3  # 9 counted, 6 exist
    assert shared(((1, 2), 2), ((1, 2), 2), ((1, 2, 3), 3)) == 4  # 7 counted, 3 exist
    assert shared(((9, 8, 7), 3), ((1, 2, 3), 3)) == 0
    assert shared(((1, 2, 3, 4), 2), ((1, 2, 3, 5), 4)) == 2  # only the pinned head counts
    # a short pin sorted between two chains that share more: (1, 2, 3) and (1, 2, 4) share 2
    assert shared(((1, 2, 3), 3), ((1, 2, 3, 9), 1), ((1, 2, 4), 3)) == 3
    assert shared_blocks([]) == 0


@given(st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=6).map(tuple), st.integers(0, 6)), max_size=8))
def test_shared_blocks_is_what_the_union_of_the_prefixes_saves(
        paths: list[tuple[tuple[int, ...], int]]) -> None:
    """Exactly what the union saves, with any pinned heads (a turn pinning fewer blocks than
    its chain's neighbours share included): never more, or a worst case would be under-counted."""
    chains = [(_chain(p), min(n, len(p))) for p, n in paths]
    union = {h for hashes, n in chains for h in hashes[:n]}
    assert shared_blocks(chains) == sum(n for _, n in chains) - len(union)


def test_a_grown_reply_may_overcommit_the_pool_and_free_goes_negative() -> None:
    state = _state()
    ledger = state.ledgers[0]
    ledger.reserve(10)
    ledger.count_running(0, 10)
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
    ledger.count_running(16, 4)
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
