"""``IdleLoad`` gives exactly the walk over every session, whatever happens between queries.

The sessions change only through their owner's methods (``SessionTable``: ``record_arrival``,
``set_home``, ``turn_started``/``turn_ended``, ``record_finish``, ``forget_idle``,
``clear_placement``), which keep the table's ``idle`` term; nothing here updates it by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from cache.sessions import SessionTable, StopKind, session_id_for_hint
from rank.ids import Rank

HORIZON_S = 900.0


def _walk(table: SessionTable, now_s: float, num_ranks: int) -> list[int]:
    out = [0] * num_ranks
    for s in table:
        if s.home_rank is not None and s.num_in_flight == 0 and s.expected_wait_s(now_s) < HORIZON_S:
            out[s.home_rank] += s.context_tokens
    return out


# One op: (kind, session index, value). Times advance by chosen steps, including the exact
# boundaries of the counting window (gap - horizon, horizon) where rounding could bite.
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "finish", "finish", "abort", "move", "forget", "advance",
                         "boundary",
                         "boundary", "boundary", "back", "restart"]),
        st.integers(0, 5),
        st.floats(0.0, 3000.0, allow_nan=False, allow_infinity=False),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, kinds=st.lists(st.sampled_from(list(StopKind)), min_size=6, max_size=6))
def test_idle_load_equals_the_walk(ops: list[tuple[str, int, float]], kinds: list[StopKind]) -> None:
    num_ranks = 3
    table = SessionTable(num_ranks=num_ranks, home_horizon_s=HORIZON_S)
    idle = table.idle
    now = [1000.0]

    def session(i: int):
        s = table.get(session_id_for_hint(f"s{i}"))
        return s if s is not None else table.create(f"s{i}", now[0])

    for kind, i, value in ops:
        s = session(i)
        if kind == "arrive":
            table.record_arrival(s, now[0])
            if s.home_rank is None:
                table.set_home(s, Rank(int(value) % num_ranks), now[0])
            table.turn_started(s, now[0])
        elif kind == "finish" and s.num_in_flight:
            table.turn_ended(s, now[0])
            # Learnt gaps beyond 2x the horizon exercise the "never counts" branch.
            s.gaps.human_gap_s = value
            table.record_finish(s, kinds[i], None, int(value * 10) + 1, now[0])
        elif kind == "abort" and s.num_in_flight:
            table.turn_ended(s, now[0])
        elif kind == "move" and s.home_rank is not None:
            table.moved(s, Rank((s.home_rank + 1) % num_ranks), now[0])
        elif kind == "forget" and s.num_in_flight == 0:
            table.forget_idle(now[0] + 1e9, 0.0, set())
        elif kind == "advance":
            now[0] += value
        elif kind == "boundary":
            # Jump to the exact instant an idle session's window opens or closes.
            idle_ones = [x for x in table if x.last_finish_s is not None and x.num_in_flight == 0]
            if idle_ones:
                x = idle_ones[i % len(idle_ones)]
                gap = x.gaps.expected_gap_s(x.last_stop)
                assert x.last_finish_s is not None
                now[0] = max(now[0], x.last_finish_s + (HORIZON_S if value < 1500 else gap - HORIZON_S))
        elif kind == "back":
            now[0] -= value / 10  # a fake clock may go back: the sums are rebuilt
        elif kind == "restart":
            table.clear_placement()
        assert idle.tokens(now[0]) == _walk(table, now[0], num_ranks), (kind, i, value, now[0])
        idle.check(now[0])


def test_idle_load_window_of_a_long_gap_session() -> None:
    """A session whose learnt gap exceeds the horizon starts counting only once it is expected
    back within it, and stops once it has been idle for the horizon."""
    table = SessionTable(num_ranks=2, home_horizon_s=HORIZON_S)
    idle = table.idle
    s = table.create("a", 0.0)
    table.set_home(s, Rank(1), 0.0)
    s.gaps.human_gap_s = 1500.0
    table.record_finish(s, StopKind.END_TURN, None, 4000, 100.0)
    assert idle.tokens(100.0) == [0, 0]  # expected back in 1500 s > 900 s
    assert idle.tokens(100.0 + 599.0) == [0, 0]
    assert idle.tokens(100.0 + 601.0) == [0, 4000]  # expected wait now 899 s
    assert idle.tokens(100.0 + 899.0) == [0, 4000]
    assert idle.tokens(100.0 + 900.0) == [0, 0]  # idle for the horizon: out for good
    assert idle.tokens(1e6) == [0, 0]
    table.turn_started(s, 1e6)
    assert idle.tokens(1e6 + 1) == [0, 0]


@pytest.mark.parametrize("num_sessions", [1, 200])
def test_idle_load_heap_stays_bounded(num_sessions: int) -> None:
    """Superseded re-checks are compacted: many updates of few sessions keep the heap small."""
    table = SessionTable(num_ranks=1, home_horizon_s=HORIZON_S)
    idle = table.idle
    sessions = [table.create(f"s{i}", 0.0) for i in range(num_sessions)]
    for s in sessions:
        table.set_home(s, Rank(0), 0.0)
    for step in range(5000):
        s = sessions[step % num_sessions]
        table.record_finish(s, StopKind.TOOL_USE, None, 10, float(step))
    assert len(idle._heap) <= max(64, 4 * num_sessions) + 1
    idle.check(5000.0)
