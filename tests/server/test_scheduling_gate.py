"""``SubmitGate``: which waiting turns are released, in which order, and when (virtual time)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from server.scheduling import SchedulingConfig, SubmitGate
from tests.support.virtual_time import virtual_time

CFG = SchedulingConfig(enabled=True, engine_budget_tokens=10_000, aging_tokens_per_s=0.0, max_hold_s=10.0)


@pytest.fixture(autouse=True)
def _virtual_time() -> Iterator[None]:
    with virtual_time():
        yield


class Recorder:
    def __init__(self, gate: SubmitGate) -> None:
        self.gate = gate
        self.released: list[tuple[str, float]] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def hold(self, rank: int, key: str, tokens: int) -> None:
        loop = asyncio.get_running_loop()

        async def one() -> None:
            await self.gate.hold(rank, key, tokens, loop.time())
            self.released.append((key, round(loop.time(), 3)))

        self.tasks[key] = loop.create_task(one())

    def keys(self) -> list[str]:
        return [k for k, _ in self.released]


def test_gate_releases_shortest_first_within_the_budget_and_on_first_output() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        gate = SubmitGate(CFG, clock=loop.time)
        rec = Recorder(gate)
        rec.hold(0, "a", 6_000)
        await asyncio.sleep(0)
        rec.hold(0, "b", 5_000)  # 11,000 > 10,000: waits
        await asyncio.sleep(0)
        rec.hold(0, "c", 3_000)  # shorter than b, and 9,000 fits: goes at once
        await asyncio.sleep(1.0)
        assert rec.keys() == ["a", "c"] and gate.queued_tokens(0) == 9_000 and gate.num_waiting(0) == 1
        gate.started(0, "a")  # a's first token: its prefill left the queue; b fits now (8,000)
        await asyncio.sleep(0)
        gate.started(0, "a")  # idempotent
        await asyncio.sleep(1.0)
        assert gate.queued_tokens(0) == 8_000
        return rec.released

    assert asyncio.run(main()) == [("a", 0.0), ("c", 0.0), ("b", 1.0)]


def test_gate_chunked_prefill_waits_for_an_empty_queue_then_blocks_the_rest() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        gate = SubmitGate(CFG, clock=loop.time)
        rec = Recorder(gate)
        rec.hold(0, "s", 2_000)
        await asyncio.sleep(0)
        rec.hold(0, "long", 40_000)
        rec.hold(1, "other-rank", 9_000)  # rank 1 has its own budget
        await asyncio.sleep(2.0)
        gate.done(0, "s")  # s ended: rank 0's queue is empty, long goes
        await asyncio.sleep(1.0)
        rec.hold(0, "after", 100)  # long is still prefilling: after waits
        await asyncio.sleep(2.0)
        gate.started(0, "long")
        await asyncio.sleep(0)
        return rec.released

    assert asyncio.run(main()) == [("s", 0.0), ("other-rank", 0.0), ("long", 2.0), ("after", 5.0)]


def test_gate_deadline_releases_a_turn_held_max_hold_s() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        gate = SubmitGate(CFG, clock=loop.time)
        rec = Recorder(gate)
        rec.hold(0, "first", 10_000)
        await asyncio.sleep(3.0)
        rec.hold(0, "late", 500)  # the queue is full and first never starts
        await asyncio.sleep(20.0)
        assert gate.queued_tokens(0) == 10_500 and gate.num_held == 1
        return rec.released

    released = asyncio.run(main())
    assert [k for k, _ in released] == ["first", "late"]
    assert 13.0 <= released[1][1] <= 13.01  # held 10 s (+ the 1 ms wake-up margin)


def test_gate_cancelled_waiter_is_dropped_and_does_not_block_the_others() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        aged = CFG.model_copy(update={"aging_tokens_per_s": 1_000.0})
        gate = SubmitGate(aged, clock=loop.time)
        rec = Recorder(gate)
        rec.hold(0, "running", 9_000)
        await asyncio.sleep(0)
        rec.hold(0, "big", 8_000)  # at t=8 its priority is 8,000 - 8 x 1,000 = 0
        await asyncio.sleep(8.0)
        rec.hold(0, "small", 900)  # priority 900: would fit (9,900) but must not pass big
        await asyncio.sleep(1.0)
        assert rec.keys() == ["running"]
        rec.tasks["big"].cancel()  # the client went away
        await asyncio.sleep(0.5)
        assert gate.num_waiting(0) == 0 and gate.queued_tokens(0) == 9_900
        return rec.released

    assert asyncio.run(main()) == [("running", 0.0), ("small", 9.0)]


def test_gate_off_releases_everything_at_once_and_tracks_nothing() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        gate = SubmitGate(SchedulingConfig(enabled=False), clock=loop.time)
        rec = Recorder(gate)
        for key, tokens in (("x", 50_000), ("y", 50_000), ("z", 1)):
            rec.hold(0, key, tokens)
        await asyncio.sleep(0.1)
        assert gate.queued_tokens(0) == 0
        gate.started(0, "x")
        gate.done(0, "y")
        return rec.released

    assert asyncio.run(main()) == [("x", 0.0), ("y", 0.0), ("z", 0.0)]
