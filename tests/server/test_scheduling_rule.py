"""The submission rule (``server/scheduling.py: to_submit``): exact orders on small fixtures.

Budget 10,000 tokens per rank unless a test says otherwise; aging off unless a test is about it.
"""

from __future__ import annotations

from server.scheduling import Pending, SchedulingConfig, submit_order, to_submit

CFG = SchedulingConfig(enabled=True, engine_budget_tokens=10_000, aging_tokens_per_s=0.0, max_hold_s=10.0)


def p(key: str, tokens: int, arrival: float = 0.0, held: float | None = None) -> Pending:
    return Pending(key, tokens, arrival, arrival if held is None else held)


def test_off_submits_everything_in_arrival_order_at_the_gate() -> None:
    off = SchedulingConfig(enabled=False)
    pending = [p("c", 50_000, 2.0), p("a", 9_000, 0.0), p("b", 10, 1.0)]
    assert to_submit(pending, queued_tokens=10**9, now_s=2.0, cfg=off) == ["a", "b", "c"]


def test_shortest_uncached_work_first_within_the_budget() -> None:
    pending = [p("long", 8_000, 0.0), p("short", 2_000, 1.0), p("mid", 5_000, 2.0)]
    assert [x.key for x in submit_order(pending, 2.0, CFG)] == ["short", "mid", "long"]
    # short + mid = 7,000 fit; long would make 15,000 > 10,000 with work queued: it waits
    assert to_submit(pending, queued_tokens=0, now_s=2.0, cfg=CFG) == ["short", "mid"]
    # 4,000 already in the engine's queue: short fits (6,000), mid would not (11,000)
    assert to_submit(pending, queued_tokens=4_000, now_s=2.0, cfg=CFG) == ["short"]
    # a full queue takes nothing
    assert to_submit(pending, queued_tokens=10_000, now_s=2.0, cfg=CFG) == []


def test_ties_go_to_the_earlier_arrival_then_the_key() -> None:
    pending = [p("y", 1_000, 5.0), p("x", 1_000, 5.0), p("w", 1_000, 4.0)]
    assert to_submit(pending, 0, 5.0, CFG) == ["w", "x", "y"]


def test_a_chunked_prefill_goes_only_into_an_empty_queue_and_alone() -> None:
    pending = [p("chunked", 40_000, 0.0), p("s1", 1_000, 1.0), p("s2", 2_000, 2.0)]
    # the short turns go first; the chunked one waits for the queue to empty
    assert to_submit(pending, 0, 2.0, CFG) == ["s1", "s2"]
    assert to_submit([pending[0]], 3_000, 3.0, CFG) == []
    # a shorter turn still goes before it, even into an empty queue
    assert to_submit([pending[0], p("s3", 500, 3.0)], 0, 3.0, CFG) == ["s3"]
    # an empty queue and nothing shorter: it goes, and nothing goes behind it until it starts
    assert to_submit([pending[0]], 0, 4.0, CFG) == ["chunked"]
    assert to_submit([p("s4", 500, 4.0)], 40_000, 4.0, CFG) == []


def test_aging_lets_a_long_turn_overtake_and_nothing_backfills_past_it() -> None:
    aged = CFG.model_copy(update={"aging_tokens_per_s": 1_000.0})
    long_turn = p("long", 8_000, arrival=0.0, held=9.5)
    short = p("short", 3_000, arrival=10.0)
    # at t=10: long = 8,000 - 10,000 = -2,000 < short = 3,000, so long is first
    assert [x.key for x in submit_order([short, long_turn], 10.0, aged)] == ["long", "short"]
    # 5,000 queued: long does not fit (13,000); short would (8,000) but does not pass it
    assert to_submit([short, long_turn], 5_000, 10.0, aged) == []
    assert to_submit([short, long_turn], 0, 10.0, aged) == ["long"]
    # without aging the short one goes first and the long one waits
    assert to_submit([short, long_turn], 5_000, 10.0, CFG) == ["short"]


def test_turns_held_past_the_deadline_go_first_oldest_first_whatever_the_budget() -> None:
    pending = [
        p("fresh", 100, arrival=10.5),
        p("late-b", 30_000, arrival=0.0, held=1.0),
        p("late-a", 9_000, arrival=2.0, held=0.5),
        p("waiting", 9_500, arrival=5.0, held=5.0),
    ]
    # at t=12 late-a (11.5 s) and late-b (11 s) are overdue: they go, oldest hold first, and
    # their 39,000 tokens fill the queue, so the others wait
    assert to_submit(pending, 10_000, 12.0, CFG) == ["late-a", "late-b"]
    # at t=10.9 only late-a is overdue (10.4 s); after its 9,000 tokens fresh (100) fits and
    # waiting (9,500) does not, so late-b (30,000, later in the order) waits too
    assert to_submit(pending, 0, 10.9, CFG) == ["late-a", "fresh"]
