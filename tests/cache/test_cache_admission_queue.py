"""Admission queue: FIFO order, forced admission after the bound, overload errors, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from cache.admission import AdmissionConfig, AdmissionQueue, AdmitLevel
from protocol.errors import Overloaded


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_admission_queue_fifo_and_notify() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, AdmissionConfig(recheck_s=10.0), FakeClock())
        room = {"free": 0}
        order: list[str] = []

        def want(name: str, n: int):
            def try_admit(level: AdmitLevel) -> bool:
                if room["free"] >= n:
                    room["free"] -= n
                    order.append(name)
                    return True
                return False
            return try_admit

        big = asyncio.create_task(q.enter(0, 100, want("big", 5)))
        await asyncio.sleep(0)
        small = asyncio.create_task(q.enter(0, 10, want("small", 1)))
        await asyncio.sleep(0)
        room["free"] = 1  # enough for small only: it must not overtake big
        q.notify(0)
        await asyncio.sleep(0.01)
        assert order == [] and q.depth(0) == 2 and q.waiting_tokens(0) == 110
        room["free"] = 6
        q.notify(0)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and q.depth(0) == 0

    asyncio.run(main())


def test_admission_queue_forces_then_fails() -> None:
    async def main() -> None:
        clock = FakeClock()
        q = AdmissionQueue(1, AdmissionConfig(force_after_s=1.0, fail_after_s=3.0, recheck_s=0.01), clock)
        seen: list[AdmitLevel] = []

        def try_admit(level: AdmitLevel) -> bool:
            seen.append(level)
            return level is AdmitLevel.FORCE

        task = asyncio.create_task(q.enter(0, 1, try_admit))
        await asyncio.sleep(0.03)
        clock.now = 1.5
        waited = await task
        assert waited == 1.5 and seen[0] is AdmitLevel.NORMAL and seen[-1] is AdmitLevel.FORCE
        assert q.num_forced == 1

        clock.now = 10.0
        task = asyncio.create_task(q.enter(0, 1, lambda level: False))
        await asyncio.sleep(0.03)
        clock.now = 14.0
        with pytest.raises(Overloaded):
            await task
        assert q.depth(0) == 0 and q.num_rejected == 1

    asyncio.run(main())


def test_admission_queue_cancelled_waiter_leaves_queue() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, AdmissionConfig(recheck_s=0.01), FakeClock())
        task = asyncio.create_task(q.enter(0, 1, lambda level: False))
        await asyncio.sleep(0.02)
        assert q.depth(0) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert q.depth(0) == 0

    asyncio.run(main())


def test_admission_queue_depth_limit() -> None:
    async def main() -> None:
        q = AdmissionQueue(1, AdmissionConfig(recheck_s=0.01, max_queue_depth=1), FakeClock())
        first = asyncio.create_task(q.enter(0, 1, lambda level: False))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            await q.enter(0, 1, lambda level: False)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())



def test_admission_queue_resident_turn_overtakes_only_with_free_blocks() -> None:
    async def main() -> None:
        clock = FakeClock()
        q = AdmissionQueue(1, AdmissionConfig(force_after_s=1.0, recheck_s=0.01), clock)
        head = asyncio.create_task(q.enter(0, 100, lambda level: False))
        await asyncio.sleep(0.01)
        levels: list[AdmitLevel] = []

        def small(level: AdmitLevel) -> bool:
            levels.append(level)
            return level is AdmitLevel.FREE_ONLY

        assert await q.enter(0, 5, small) == 0.0  # fits in free blocks: runs now
        assert levels == [AdmitLevel.FREE_ONLY] and q.num_overtaken == 1

        late_levels: list[AdmitLevel] = []

        def late_try(level: AdmitLevel) -> bool:
            late_levels.append(level)
            return True

        clock.now = 2.0  # the head is forced now: nobody overtakes it any more
        late = asyncio.create_task(q.enter(0, 5, late_try))
        await asyncio.sleep(0.02)
        assert not late.done() and q.depth(0) == 2 and late_levels == []
        head.cancel()
        with pytest.raises(asyncio.CancelledError):
            await head
        assert await late >= 0.0
        assert late_levels == [AdmitLevel.NORMAL]  # no FREE_ONLY shortcut: it queued behind the head

    asyncio.run(main())


def _room_admitter(room: list[int], order: list[tuple[str, int]]):
    """try_admit(rank, level) for a turn of one block: admitted on ``rank`` while it has room."""

    def want(name: str):
        def try_admit(rank: int, level: AdmitLevel) -> bool:
            if room[rank] >= 1:
                room[rank] -= 1
                order.append((name, rank))
                return True
            return False
        return try_admit

    return want


def test_admission_queue_late_binding_takes_the_first_rank_with_room() -> None:
    """A turn that may run on ranks 0 or 1 waits in both queues with one ticket. Rank 1 frees
    room for two turns: its head B goes, then the two-rank turn T (now rank 1's head) goes there
    and leaves rank 0's queue, then nobody else: C, queued on rank 1 behind T, waits for more
    room. Rank 0's own head A still waits. Exact order, and the per-rank waiting tokens add up."""

    async def main() -> None:
        q = AdmissionQueue(2, AdmissionConfig(recheck_s=10.0), FakeClock())
        room = [0, 0]
        order: list[tuple[str, int]] = []
        want = _room_admitter(room, order)
        a = asyncio.create_task(q.enter_any((0,), 100, want("A")))
        b = asyncio.create_task(q.enter_any((1,), 100, want("B")))
        await asyncio.sleep(0)
        t = asyncio.create_task(q.enter_any((0, 1), 60, want("T")))
        await asyncio.sleep(0)
        c = asyncio.create_task(q.enter_any((1,), 10, want("C")))
        await asyncio.sleep(0)
        assert (q.depth(0), q.depth(1)) == (2, 3)
        assert (q.waiting_tokens(0), q.waiting_tokens(1)) == (130, 140)  # T's 60 split over its two queues
        room[1] = 2
        q.notify(1)
        assert await b == (1, 0.0) and (await t)[0] == 1
        await asyncio.sleep(0.01)
        assert order == [("B", 1), ("T", 1)] and not c.done() and not a.done()
        assert (q.depth(0), q.depth(1)) == (1, 1)  # T left rank 0's queue too
        assert (q.waiting_tokens(0), q.waiting_tokens(1)) == (100, 10)
        room[0] = 1
        room[1] = 1
        q.notify(0)
        q.notify(1)
        await asyncio.gather(a, c)
        assert order[2:] in ([("A", 0), ("C", 1)], [("C", 1), ("A", 0)])
        assert (q.depth(0), q.depth(1), q.waiting_tokens(0), q.waiting_tokens(1)) == (0, 0, 0, 0)

    asyncio.run(main())


def test_admission_queue_late_binding_keeps_fifo_on_each_rank() -> None:
    """A two-rank turn T at the head of rank 0's queue is served before D, queued behind it on
    rank 0, even though D asked first at a retry: T goes to rank 0, then D."""

    async def main() -> None:
        q = AdmissionQueue(2, AdmissionConfig(recheck_s=10.0), FakeClock())
        room = [0, 0]
        order: list[tuple[str, int]] = []
        want = _room_admitter(room, order)
        t = asyncio.create_task(q.enter_any((0, 1), 50, want("T")))
        await asyncio.sleep(0)
        d = asyncio.create_task(q.enter_any((0,), 50, want("D")))
        await asyncio.sleep(0)
        room[0] = 1
        q.notify(0)
        await asyncio.sleep(0.01)
        assert order == [("T", 0)] and not d.done()
        room[0] = 1
        q.notify(0)
        await d
        assert order == [("T", 0), ("D", 0)] and await t == (0, 0.0)

    asyncio.run(main())


def test_admission_queue_late_binding_prefers_order_when_several_ranks_fit() -> None:
    """Both ranks get room at once for a waiting two-rank turn: ``order()`` decides (rank 1 here),
    and it is re-read at every retry (it said rank 0 when the turn arrived)."""

    async def main() -> None:
        q = AdmissionQueue(2, AdmissionConfig(recheck_s=10.0), FakeClock())
        room = [0, 0]
        order: list[tuple[str, int]] = []
        preferred = [0, 1]
        t = asyncio.create_task(q.enter_any((0, 1), 50, _room_admitter(room, order)("T"),
                                            order=lambda: preferred))
        await asyncio.sleep(0)
        assert (q.depth(0), q.depth(1)) == (1, 1)
        preferred[:] = [1, 0]
        room[0] = room[1] = 1
        q.notify(0)
        assert (await t)[0] == 1 and order == [("T", 1)] and room == [1, 0]

    asyncio.run(main())


def test_admission_queue_late_binding_cancel_leaves_every_queue() -> None:
    """A cancelled two-rank turn leaves both queues, gives back its waiting tokens, and the turn
    behind it on rank 1 is retried at once (it fits now)."""

    async def main() -> None:
        q = AdmissionQueue(2, AdmissionConfig(recheck_s=10.0), FakeClock())
        room = [0, 1]
        order: list[tuple[str, int]] = []
        want = _room_admitter(room, order)
        blocker = asyncio.create_task(q.enter_any((1,), 10, lambda rank, level: False))
        await asyncio.sleep(0)
        t = asyncio.create_task(q.enter_any((0, 1), 50, want("T")))
        await asyncio.sleep(0)
        e = asyncio.create_task(q.enter_any((1,), 10, want("E")))
        await asyncio.sleep(0)
        blocker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocker
        assert await t == (1, 0.0)  # T is rank 1's head now and fits there
        await asyncio.sleep(0.01)
        assert order == [("T", 1)] and not e.done()
        t2 = asyncio.create_task(q.enter_any((0, 1), 50, lambda rank, level: False))
        await asyncio.sleep(0)
        assert (q.depth(0), q.depth(1)) == (1, 2) and q.waiting_tokens(1) == 35
        t2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t2
        assert (q.depth(0), q.depth(1), q.waiting_tokens(0), q.waiting_tokens(1)) == (0, 1, 0, 10)
        room[1] = 1
        q.notify(1)
        await e
        assert order == [("T", 1), ("E", 1)]

    asyncio.run(main())


def test_admission_queue_late_binding_head_that_fits_nowhere() -> None:
    """A two-rank turn T that fits nowhere heads both queues: a later turn S overtakes it on rank 1
    only into free blocks (FREE_ONLY) while T has waited under ``force_after_s``; a turn arriving
    after that queues behind T; once T may force, it is tried at FORCE on its ranks, in order."""

    async def main() -> None:
        clock = FakeClock()
        q = AdmissionQueue(2, AdmissionConfig(force_after_s=1.0, recheck_s=0.01), clock)
        t_levels: list[tuple[int, AdmitLevel]] = []

        def t_try(rank: int, level: AdmitLevel) -> bool:
            t_levels.append((rank, level))
            return level is AdmitLevel.FORCE and rank == 1

        t = asyncio.create_task(q.enter_any((0, 1), 100, t_try))
        await asyncio.sleep(0.02)
        assert (q.depth(0), q.depth(1)) == (1, 1)
        s_levels: list[tuple[int, AdmitLevel]] = []

        def s_try(rank: int, level: AdmitLevel) -> bool:
            s_levels.append((rank, level))
            return level is AdmitLevel.FREE_ONLY

        assert await q.enter_any((1,), 5, s_try) == (1, 0.0)
        assert s_levels == [(1, AdmitLevel.FREE_ONLY)] and q.num_overtaken == 1
        clock.now = 2.0  # T may force now: nothing overtakes it any more
        late_levels: list[tuple[int, AdmitLevel]] = []
        late = asyncio.create_task(q.enter_any((1,), 5, lambda r, lv: late_levels.append((r, lv)) is None))
        assert await t == (1, 2.0)
        assert t_levels[-2:] == [(0, AdmitLevel.FORCE), (1, AdmitLevel.FORCE)]
        assert {lv for _, lv in t_levels[:-2]} == {AdmitLevel.NORMAL}
        assert await late == (1, 0.0)  # queued behind T, admitted once T left (the clock stood still)
        assert late_levels == [(1, AdmitLevel.NORMAL)]  # no FREE_ONLY shortcut past a forcing head

    asyncio.run(main())
