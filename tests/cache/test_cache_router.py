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
    for _ in range(5):
        d = router.route(s, [0, 0, 0, 0], 60_000, loads(0, 0, 0, 100_000), True, 1000.0)
        assert (d.rank, d.reason) == (3, "home")  # 100K vs 0: gap < 2 x session tokens


def test_router_moves_idle_session_off_overloaded_rank_once() -> None:
    cfg = RouterConfig(overload_ratio=1.5, move_min_tokens=10_000, move_cooldown_s=60.0)
    router = Router(cfg, BS)
    s = SessionTable().create("x", 0.0)
    s.home_rank = 0
    s.context_tokens = 20_000
    heavy = loads(400_000, 50_000, 100_000, 60_000)
    d = router.route(s, [0] * 4, 21_000, heavy, True, 100.0)
    assert (d.rank, d.reason, d.move_from) == (1, "move", 0)
    assert router.route(s, [0] * 4, 21_000, heavy, False, 100.0).rank == 0  # no L1: stay
    s.num_in_flight = 1
    assert router.route(s, [0] * 4, 21_000, heavy, True, 100.0).rank == 0  # busy: stay
    s.num_in_flight = 0
    s.moved_at_s = 90.0
    assert router.route(s, [0] * 4, 21_000, heavy, True, 100.0).rank == 0  # cooldown
