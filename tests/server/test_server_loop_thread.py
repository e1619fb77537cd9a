"""LoopThread: the bridge between the SDK's threads and the runtime's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from server.background import LoopThread


def test_call_timeout_raises_builtin_timeout_and_cancels() -> None:
    loop = LoopThread("t")
    cancelled = asyncio.Event()

    async def start() -> None:
        return None

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    loop.start(start, timeout_s=5)
    try:
        with pytest.raises(TimeoutError):
            loop.call(slow(), timeout_s=0.2)

        async def was_cancelled() -> bool:
            await asyncio.wait_for(cancelled.wait(), 5)
            return cancelled.is_set()

        assert loop.call(was_cancelled(), 10)
    finally:
        loop.stop(None)


def test_iterate_yields_items_and_closing_early_cancels_the_producer() -> None:
    loop = LoopThread("t")
    finished: list[str] = []

    async def start() -> None:
        return None

    async def numbers() -> AsyncIterator[int]:
        try:  # endless: "closed" can only come from the consumer closing it early
            i = 0
            while True:
                yield i
                i += 1
                await asyncio.sleep(0.001)
        finally:
            finished.append("closed")

    async def failing() -> AsyncIterator[int]:
        yield 1
        raise ValueError("boom")

    loop.start(start, timeout_s=5)
    try:
        it = loop.iterate(numbers())
        assert [next(it) for _ in range(3)] == [0, 1, 2]
        it.close()

        async def closed() -> list[str]:
            for _ in range(3000):  # up to 60 s on a loaded machine
                if finished:
                    break
                await asyncio.sleep(0.02)
            return finished

        assert loop.call(closed(), 70) == ["closed"]
        it2 = loop.iterate(failing())
        assert next(it2) == 1
        with pytest.raises(ValueError, match="boom"):
            next(it2)
    finally:
        loop.stop(None)


def test_start_failure_propagates_and_stops_the_thread() -> None:
    loop = LoopThread("t")

    async def broken() -> None:
        raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        loop.start(broken, timeout_s=5)
    assert not loop.is_running
