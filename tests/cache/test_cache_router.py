"""Router: sticky sessions, balanced new sessions, deterministic ties, guarded moves."""

from __future__ import annotations

from cache.router import RankLoad, Router, RouterConfig
from cache.sessions import SessionTable

BS = 128


def loads(*tokens: int, free: tuple[int, ...] | None = None) -> list[RankLoad]:
    free = free or tuple(1000 for _ in tokens)
    return [RankLoad(r, t, 0, 0, f) for r, (t, f) in enumerate(zip(tokens, free))]


def test_router_new_sessions_go_to_least_loaded_with_deterministic_ties() -> None:
    router = Router(RouterConfig(), BS)
    table = SessionTable()
    s = table.create(None, 0.0)
    assert router.route(s, [0, 0, 0, 0], 1000, loads(0, 0, 0, 0), True, 0.0).rank == 0
    assert router.route(s, [0, 0, 0, 0], 1000, loads(5, 0, 0, 7), True, 0.0).rank == 1
    # equal cost: more free blocks wins, then the lowest rank
    assert router.route(s, [0] * 4, 1000, loads(0, 0, 0, 0, free=(5, 9, 9, 1)), True, 0.0).rank == 1


def test_router_new_session_prefers_rank_holding_its_prefix() -> None:
    router = Router(RouterConfig(), BS)
    s = SessionTable().create(None, 0.0)
    # a resumed 100K-token conversation is resident on rank 2; rank 2 is busier but not by 100K:
    # without L1 (no copy) it runs there
    d = router.route(s, [0, 0, 780, 0], 100_000, loads(0, 0, 40_000, 0), False, 0.0)
    assert d.rank == 2 and d.reason == "new" and d.copy_from is None
    # with L1, one copy of its 99,840 held tokens (at l1_copy_cost 0.1: ~10K) beats 40K of load
    d = router.route(s, [0, 0, 780, 0], 100_000, loads(0, 0, 40_000, 0), True, 0.0)
    assert (d.rank, d.copy_from, d.copy_blocks) == (0, 2, 780)
    # ... but not beats 5K of load: it runs where the prefix is
    d = router.route(s, [0, 0, 780, 0], 100_000, loads(0, 0, 5_000, 0), True, 0.0)
    assert (d.rank, d.copy_from) == (2, None)


def test_router_known_session_is_sticky_even_when_others_are_lighter() -> None:
    router = Router(RouterConfig(), BS)
    table = SessionTable()
    s = table.create("x", 0.0)
    s.home_rank = 3
    s.context_tokens = 50_000
    for _ in range(5):  # its prefix is resident at home (10 blocks)
        d = router.route(s, [0, 0, 0, 10], 60_000, loads(0, 0, 0, 100_000), True, 1000.0)
        assert (d.rank, d.reason) == (3, "home")  # 100K vs 0: gap < 2 x session tokens


def test_router_moves_idle_session_off_overloaded_rank_once() -> None:
    cfg = RouterConfig(overload_ratio=1.5, move_min_tokens=10_000, move_cooldown_s=60.0)
    router = Router(cfg, BS)
    s = SessionTable().create("x", 0.0)
    s.home_rank = 0
    s.context_tokens = 20_000
    heavy = loads(400_000, 50_000, 100_000, 60_000)
    resident = [150, 0, 0, 0]  # its 150 blocks are on its home rank
    d = router.route(s, resident, 21_000, heavy, True, 100.0)
    assert (d.rank, d.reason, d.move_from) == (1, "move", 0)
    assert router.route(s, resident, 21_000, heavy, False, 100.0).rank == 0  # no L1: stay
    s.num_in_flight = 1
    assert router.route(s, resident, 21_000, heavy, True, 100.0).rank == 0  # busy: stay
    s.num_in_flight = 0
    s.moved_at_s = 90.0
    assert router.route(s, resident, 21_000, heavy, True, 100.0).rank == 0  # cooldown


def test_router_late_binds_a_homeless_session_rule_4() -> None:
    """Nothing on its home rank that L1 lacks, no turn in flight, L1 on, no move within the
    cooldown: every rank is a candidate (late binding), the least work in flight first (running
    + queued tokens + prompt tokens not resident there; idle sessions do not count). With a
    prefix on home that L1 does not hold, a turn in flight, without L1, just after a move or
    with the rule off, it stays home."""
    router = Router(RouterConfig(place_homeless=True), BS)
    s = SessionTable().create("x", 0.0)
    s.home_rank = 2
    s.context_tokens = 250_000  # home's 410K over the lightest is < 2 x this: no move from home
    s.moved_at_s = 40.0  # a move 60 s ago: the cooldown is over
    busy = loads(300_000, 120_000, 500_000, 90_000)
    d = router.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0)
    assert (d.rank, d.reason, d.move_from) == (3, "homeless", None)
    assert d.candidates == (3, 1, 0, 2)
    # idle sessions homed on a rank do not decode there: only running + queued tokens count
    idle_heavy = [RankLoad(0, 0, 10_000, 900_000, 1000), RankLoad(1, 50_000, 0, 0, 1000),
                  RankLoad(2, 60_000, 0, 0, 1000), RankLoad(3, 70_000, 0, 0, 1000)]
    assert router.route(s, [0, 0, 0, 0], 201_000, idle_heavy, True, 100.0).candidates == (0, 1, 2, 3)
    # part of its prefix on another rank counts as tokens not to restore: rank 1 with 100 blocks
    # costs 120,000 + 188,200 = 308,200 > rank 3's 291,000; with 400 blocks 269,800 < 291,000
    assert router.route(s, [0, 100, 0, 0], 201_000, busy, True, 100.0).candidates[:2] == (3, 1)
    assert router.route(s, [0, 400, 0, 0], 201_000, busy, True, 100.0).candidates[:2] == (1, 3)
    # resident on home but L1 holds as much: still free to run anywhere, home first unless it
    # is busier by more than the prompt (here 500K + 0 vs 90K + 201K: rank 3 first)
    d = router.route(s, [0, 0, 1570, 0], 201_000, busy, True, 100.0, l1_blocks=1570)
    assert d.reason == "homeless" and d.candidates[0] == 3
    light_home = loads(300_000, 120_000, 100_000, 90_000)
    d = router.route(s, [0, 0, 1570, 0], 201_000, light_home, True, 100.0, l1_blocks=1570)
    assert d.reason == "homeless" and d.candidates[0] == 2
    # home holds more than L1 does: moving would cost a prefill, it stays
    assert router.route(s, [0, 0, 1570, 0], 201_000, busy, True, 100.0, l1_blocks=1000).reason == "home"
    assert router.route(s, [0, 0, 1, 0], 201_000, busy, True, 100.0).reason == "home"
    assert router.route(s, [0, 0, 0, 0], 201_000, busy, False, 100.0).reason == "home"
    s.num_in_flight = 1
    assert router.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0).reason == "home"
    s.num_in_flight = 0
    s.moved_at_s = 99.0  # moved here 1 s ago (rebalance, move_session): its next turn restores here
    assert router.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0).reason == "home"
    s.moved_at_s = 40.0
    assert Router(RouterConfig(), BS).route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0).reason == "homeless"
    off = Router(RouterConfig(place_homeless=False), BS)  # the rule off
    d = off.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0)
    assert (d.rank, d.reason, d.candidates) == (2, "home", (2,))
