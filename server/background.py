"""Run the asyncio runtime on its own thread, for callers that are synchronous.

The SDK's ``serve`` calls ``setup()`` and ``process()`` from plain threads (a stdlib
``ThreadingHTTPServer``); the runtime (rank group, cache, HTTP server) lives on one event loop.
``LoopThread`` owns that loop: ``start()`` blocks until the runtime is ready (or raises what
start-up raised), ``call()`` runs a coroutine there and waits, ``iterate()`` turns an async
iterator into a blocking one, and ``stop()`` shuts the runtime down and joins the thread.

Invariant: every coroutine of the runtime runs on ``self.loop``; this class never touches
runtime state from the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_END = object()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed (faster sockets and timers), else the stdlib loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    def __init__(self, name: str = "deepinfer-runtime") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Drain what is left (cancelled tasks' cleanup) before closing.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def start(self, main: Callable[[], Coroutine[Any, Any, None]], timeout_s: float | None = None,
              abort: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Start the loop and run ``main()`` (the runtime's start) to completion.

        If it fails, times out or this thread is interrupted (a signal handler raising), ``abort()``
        (the runtime's stop) runs on the loop before the loop stops: cancelling ``main()`` alone
        would cancel what it started half-way (rank processes, their sockets, /dev/shm)."""
        assert not self._started, "LoopThread started twice"
        self._started = True
        self._thread.start()
        try:
            self.call(main(), timeout_s)
        except BaseException:
            self.stop(abort)
            raise

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before 3.11
            future.cancel()
            raise TimeoutError(f"no result within {timeout_s} s") from None

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Consume ``agen`` on the loop and yield its items here; closing the iterator cancels it.

        The hand-over queue is unbounded: the producer is a model stream (tokens/s, not GB/s),
        and a bounded queue could leave the loop blocked on a consumer that went away.
        """
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async for item in agen:
                    items.put(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer thread
                items.put(exc)
                return
            items.put(_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item = items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def stop(self, shutdown: Callable[[], Coroutine[Any, Any, None]] | None, timeout_s: float = 30.0) -> None:
        if shutdown is not None and self._thread.is_alive():
            try:
                self.call(shutdown(), timeout_s)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
        elif self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
