"""A ``server.runtime.Runtime`` on its own event-loop thread, for drivers that run their own loop.

The fault and soak drivers (and the reliability tests) talk to the server over real HTTP from
the main thread's loop, and inspect the runtime (rank group, cache) by running small coroutines
on the runtime's loop with ``call``: the runtime's objects are only touched from their loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from server.background import LoopThread
from server.config import WorkloadConfig, load_config
from server.runtime import Runtime

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

T = TypeVar("T")


class RuntimeThread:
    def __init__(self, config: WorkloadConfig | dict[str, Any], rank_mode: str = "process") -> None:
        self.config = config if isinstance(config, WorkloadConfig) else load_config(config)
        self.runtime = Runtime(self.config, rank_mode=rank_mode)
        self.loop = LoopThread("reliability-runtime")
        self._started = False

    def start(self, timeout_s: float = 600.0) -> RuntimeThread:
        self.loop.start(self.runtime.start, timeout_s=timeout_s)
        self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self._started = False
            self.loop.stop(self.runtime.stop, timeout_s=60.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.runtime.url

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float | None = 120.0) -> T:
        """Run ``fn()`` on the runtime's loop and wait for its result (from another thread)."""
        return self.loop.call(fn(), timeout_s)

    async def acall(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``call`` from a coroutine on another loop, without blocking that loop."""
        fut = asyncio.run_coroutine_threadsafe(fn(), self.loop.loop)  # type: ignore[arg-type]
        return await asyncio.wrap_future(fut)

    # -- inspection helpers (run on the runtime loop) ---------------------------------------------
    def cache_sizes(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            return cache_sizes(self.runtime)

        return self.call(read)

    def settle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until no engine runs or queues a request and the cache has no background work,
        then check every balance (raises AssertionError on a leak). Returns the sizes."""

        async def run() -> dict[str, Any]:
            return await settle(self.runtime, timeout_s)

        return self.call(run, timeout_s + 30)


def cache_sizes(runtime: Runtime) -> dict[str, Any]:
    cache, group = runtime.cache, runtime.group
    stats = [group.stats(r) for r in range(group.num_ranks)]
    return {
        "epoch": group.epoch,
        "cache_epoch": cache.epoch,
        "l0_blocks": [len(cache.l0[r]) for r in range(group.num_ranks)],
        "engine_cached_blocks": [s.num_cached_blocks for s in stats],
        "engine_free_blocks": [s.num_free_blocks for s in stats],
        "num_blocks": group.num_blocks,
        "running": [s.num_running for s in stats],
        "waiting": [s.num_waiting for s in stats],
        "l1_entries": len(cache.l1.entries),
        "l1_used_slots": cache.l1.alloc.num_used_slots,
        "l1_slots": cache.l1.num_slots,
        "open_admissions": cache.num_open_turns,
    }


async def settle(runtime: Runtime, timeout_s: float = 60.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    group, cache = runtime.group, runtime.cache
    while True:
        await cache.drain()
        stats = [group.stats(r) for r in range(group.num_ranks)]
        idle = all(s.num_running == 0 and s.num_waiting == 0 for s in stats)
        # Process ranks report stats every 100 ms: wait for a report newer than the last release.
        if idle and not cache.num_open_turns and not cache.num_background_tasks:
            await asyncio.sleep(0.3 if hasattr(group, "pids") else 0)
            await cache.drain()
            stats = [group.stats(r) for r in range(group.num_ranks)]
            if all(s.num_running == 0 and s.num_waiting == 0
                   for s in stats) and not cache.num_background_tasks:
                break
        if loop.time() > deadline:
            raise AssertionError(f"engines not idle after {timeout_s} s: {cache_sizes(runtime)}")
        await asyncio.sleep(0.05)
    cache.check_balance()
    check = getattr(group, "check_accounting", None)
    if check is not None:
        check()
    sizes = cache_sizes(runtime)
    for rank, s in enumerate(stats):
        held = s.num_blocks - 1 - s.num_free_blocks  # block 0 is scratch
        assert held == s.num_cached_blocks, (
            f"rank {rank}: {held} blocks not free but only {s.num_cached_blocks} cache-held (leak)")
    return sizes
