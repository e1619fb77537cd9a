"""When the rank group's supervisor stops restarting and gives up (``GroupState.FAILED``).

Two limits: ``max_start_failures`` starts in a row that never got ready (a bad config, a broken
driver: trying again will not help), and more than ``max_restarts`` restarts of ready epochs within
``window_s`` (a crash loop: each restart costs a weight load and every turn in flight). Given up,
the group stays FAILED and the backend exits non-zero (``server/runtime.py``), so the worker's
supervisor restarts the whole process, warm from L2.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RestartBudget:
    def __init__(self, max_start_failures: int, max_restarts: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_start_failures = max_start_failures
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._failed_starts = 0
        self._restarts: deque[float] = deque()  # times of restarts after a ready epoch

    def give_up(self, was_ready: bool) -> str | None:
        """Count an epoch's failure; the reason to give up, or None to restart."""
        if not was_ready:
            self._failed_starts += 1
            if self._failed_starts >= self.max_start_failures:
                return f"{self._failed_starts} failed starts in a row"
            return None
        self._failed_starts = 0
        now = self._clock()
        self._restarts.append(now)
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        if len(self._restarts) <= self.max_restarts:
            return None
        return (f"restart budget spent: {len(self._restarts)} failures within {self.window_s:g} s "
                f"(max_restarts={self.max_restarts})")
