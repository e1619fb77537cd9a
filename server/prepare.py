"""Request preparation off the event loop: JSON parsing, validation, rendering and tokenization.

A chat or count_tokens body goes from bytes to prompt ids in ``protocol.api.Protocol`` (plain,
synchronous code). Run on the event loop, a 20 MB body stalled every stream and ``/healthz`` for
as long as it took (tens of seconds). Here it runs on worker threads instead. That helps because
the expensive part, BPE encoding, releases the GIL (``protocol/tokenize.py`` encodes every piece
but the shortest through ``Tokenizer.encode_batch``); the parts that hold it (``orjson.loads``,
pydantic) cost tens of milliseconds for the largest body ``max_body_bytes`` admits.

Two lanes, so that a burst of huge bodies cannot queue in front of everyone else's turns:

* bodies under ``large_body_bytes`` go to a pool of ``threads`` workers;
* larger ones go to one worker of their own, with at most ``max_large_waiting`` of them accepted
  at a time (each holds its body in memory); the next one is answered 503 (retry later).

What still holds the GIL, and so still stalls the loop, is one C call per large body:
``orjson.loads`` (50-120 ms for 20 MB on the loaded 2-core development machine). Parsing in a
spawned child process was tried: in a flood of 20 MB bodies it lowered the /healthz p99 from
~240 to ~135 ms but doubled the time to refuse each body (pickling and pipe copies), and it needs
a process that re-imports the server's main module; not kept.

The cost of one request is bounded: the body by ``max_body_bytes``, the tokenization by the
tokenizer's early stop (prompt too long is known from a cheap lower bound on the count, or after
at most ``max_model_len`` tokens of encoding). A thread cannot be cancelled: a client that leaves
while its body is being prepared leaves the work to finish (bounded as above); the result is
dropped.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Concatenate, ParamSpec, TypeVar

from protocol.errors import Overloaded

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_THREADS = 2
DEFAULT_LARGE_BODY_BYTES = 1 << 20
DEFAULT_MAX_LARGE_WAITING = 4
LARGE_RETRY_AFTER_S = 5.0


class RequestPreparer:
    """Runs ``fn(body, *args)`` on a worker thread, in the lane the body's size picks."""

    def __init__(self, threads: int = DEFAULT_THREADS, large_body_bytes: int = DEFAULT_LARGE_BODY_BYTES,
                 max_large_waiting: int = DEFAULT_MAX_LARGE_WAITING) -> None:
        if threads < 1 or max_large_waiting < 1:
            raise ValueError("threads and max_large_waiting must be >= 1")
        self.large_body_bytes = large_body_bytes
        self.max_large_waiting = max_large_waiting
        self._small = ThreadPoolExecutor(threads, thread_name_prefix="prepare")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="prepare-large")
        self.num_large_waiting = 0  # accepted large bodies not finished yet (queued or running)
        self.num_large_refused = 0

    async def run(self, fn: Callable[Concatenate[bytes, P], T], body: bytes, *args: P.args,
                  **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        if len(body) < self.large_body_bytes:
            return await loop.run_in_executor(self._small, functools.partial(fn, body, *args, **kwargs))
        if self.num_large_waiting >= self.max_large_waiting:
            self.num_large_refused += 1
            raise Overloaded(f"{self.num_large_waiting} large requests are being prepared; retry shortly",
                             retry_after_s=LARGE_RETRY_AFTER_S)
        self.num_large_waiting += 1
        work = self._large.submit(fn, body, *args, **kwargs)
        # counted until the thread is done with it, even when the awaiting request went away
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._large_done))
        return await asyncio.wrap_future(work)

    def _large_done(self) -> None:
        self.num_large_waiting -= 1

    def close(self) -> None:
        """Stop the workers (queued work is dropped, running work finishes on its own)."""
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)
