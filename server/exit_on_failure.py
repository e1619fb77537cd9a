"""Exit the process when the rank group cannot come back, so the worker's supervisor sees it.

The SDK's server (``python -m inferencekey.backend.serve``) has no health hook: its ``/healthz``
answers 200 for as long as the process lives, whatever ``setup()`` started. A rank group whose
restart budget is spent (``GroupState.FAILED``, ``rank/restart_budget.py``) would leave a process
that answers every job with an error and is never restarted. So, once ``Runtime.wait_failed``
returns, the backend stops the runtime (HTTP closed, the cache's graceful close: L1 writes and
their L2 spills in flight finish, what can still be written goes to disk; the ranks stopped; the
``/dev/shm`` pool file removed), bounded by ``STOP_BOUND_S``, prints one line on stderr and exits
with ``EXIT_RANK_GROUP_FAILED``. A stop that hangs past the bound is cut short by a timer thread
(the exit happens regardless). ``python -m deepinfer_backend serve`` does the same through
``stop_after_failure``, returning the status from ``main``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.background import LoopThread
    from server.runtime import Runtime

log = logging.getLogger("deepinfer.backend")

EXIT_RANK_GROUP_FAILED = 3
STOP_BOUND_S = 60.0  # the whole cleanup; the L2 flush inside it is bounded by CacheManager.close too
_HARD_EXIT_MARGIN_S = 10.0
_WATCHERS: set[asyncio.Task[None]] = set()


def failure_line(reason: str) -> str:
    """The one line on stderr (the supervisor's log shows it as the cause)."""
    return f"deepinfer-backend: exiting with status {EXIT_RANK_GROUP_FAILED}: {' '.join(reason.split())}"


async def stop_after_failure(runtime: Runtime, stop_bound_s: float = STOP_BOUND_S) -> str:
    """Wait until the rank group has failed for good, then stop the runtime (bounded; a stop
    that fails or overruns is logged, never raised). Returns the reason."""
    reason = await runtime.wait_failed()
    log.error("%s; stopping the backend", reason)
    timer = _hard_exit_timer(reason, stop_bound_s + _HARD_EXIT_MARGIN_S)
    try:
        await asyncio.wait_for(runtime.stop(), stop_bound_s)
    except Exception:
        log.exception("cleanup after the rank group failure did not finish")
    finally:
        timer.cancel()
    return reason


def exit_process_when_failed(runtime: Runtime, loop: LoopThread,
                             stop_bound_s: float = STOP_BOUND_S) -> None:
    """Under the SDK's serve: watch on the runtime's loop; on failure clean up and exit the
    process (``os._exit``: the SDK's main thread is blocked in its signal wait)."""

    async def watch() -> None:
        reason = await stop_after_failure(runtime, stop_bound_s)
        _exit_now(reason)

    def start() -> None:
        task = loop.loop.create_task(watch(), name="exit-on-rank-failure")
        _WATCHERS.add(task)  # the loop holds tasks weakly
        task.add_done_callback(_WATCHERS.discard)

    loop.loop.call_soon_threadsafe(start)


def _hard_exit_timer(reason: str, after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, _exit_now, args=(f"{reason} (cleanup cut short after {after_s:g} s)",))
    timer.daemon = True
    timer.start()
    return timer


def _exit_now(reason: str) -> None:
    sys.stdout.flush()
    print(failure_line(reason), file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_RANK_GROUP_FAILED)
