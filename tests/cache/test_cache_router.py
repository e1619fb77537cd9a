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
    # a resumed 100K-token conversation is resident on rank 2; rank 2 is busier but not by 100K
    d = router.route(s, [0, 0, 780, 0], 100_000, loads(0, 0, 40_000, 0), True, 0.0)
    assert d.rank == 2 and d.reason == "new"


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


def test_router_places_a_homeless_session_by_load_rule_4() -> None:
    """Nothing left on its home rank, no turn in flight, L1 on, no move within the cooldown:
    placed like a new session (nothing moves); with a resident prefix, a turn in flight, without
    L1, just after a move or with the rule off it stays home."""
    router = Router(RouterConfig(place_homeless=True), BS)
    s = SessionTable().create("x", 0.0)
    s.home_rank = 2
    s.context_tokens = 250_000  # home's 410K over the lightest is < 2 x this: no move from home
    s.moved_at_s = 40.0  # a move 60 s ago: the cooldown is over
    busy = loads(300_000, 120_000, 500_000, 90_000)
    d = router.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0)
    assert (d.rank, d.reason, d.move_from) == (3, "homeless", None)
    # part of its prefix on another rank (an earlier home) counts by the cost rule (load +
    # uncached tokens): rank 1 with 100 blocks costs 120,000 + 188,200 = 308,200 > rank 3's 291,000
    d = router.route(s, [0, 100, 0, 0], 201_000, busy, True, 100.0)
    assert (d.rank, d.reason) == (3, "homeless")
    d = router.route(s, [0, 400, 0, 0], 201_000, busy, True, 100.0)
    assert (d.rank, d.reason) == (1, "homeless")  # 120,000 + 149,800 = 269,800 < 291,000
    assert router.route(s, [0, 0, 1, 0], 201_000, busy, True, 100.0).reason == "home"
    assert router.route(s, [0, 0, 0, 0], 201_000, busy, False, 100.0).reason == "home"
    s.num_in_flight = 1
    assert router.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0).reason == "home"
    s.num_in_flight = 0
    s.moved_at_s = 99.0  # moved here 1 s ago (rebalance, move_session): its next turn restores here
    assert router.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0).reason == "home"
    s.moved_at_s = 40.0
    off = Router(RouterConfig(), BS)  # the default: off
    d = off.route(s, [0, 0, 0, 0], 201_000, busy, True, 100.0)
    assert (d.rank, d.reason) == (2, "home")
