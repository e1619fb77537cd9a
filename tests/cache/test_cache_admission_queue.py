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
