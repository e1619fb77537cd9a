"""When the cache's load gauges are refreshed: soon after a change, and on a timer.

The gauges (per-rank load, free and cached blocks, queue depth, L1 slots) are computed from the
manager's state. A change made by a request (admit, finish, a release landing) asks for a
refresh with ``changed()``: at most one every ``min_interval_s``, and the last change is always
shown once the interval has passed. State also changes with nobody asking: background releases
and L1 writes land, and idle sessions age out of their rank's load (``home_horizon_s``). So while
the loop runs, a refresh also happens every ``interval_s``; after a burst the gauges are at most
that old (they used to keep the burst's last values for as long as no request came).

Times are the event loop's (``loop.time()``: monotonic wall time in production, virtual time in
tests), whatever clock the cache policy uses.

``CacheGauges`` is what the manager holds: it notifies ``changed()``, and the refresh reads the
shared state (``cache/state.py``) and the router's loads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache.metrics import CacheMetrics
    from cache.router import RankLoad
    from cache.state import CacheState

MIN_INTERVAL_S = 0.1
INTERVAL_S = 1.0


class GaugeRefresher:
    """Calls ``refresh()`` soon after ``changed()`` and every ``interval_s`` (one event loop)."""

    def __init__(self, refresh: Callable[[], None], min_interval_s: float = MIN_INTERVAL_S,
                 interval_s: float = INTERVAL_S) -> None:
        self._refresh = refresh
        self.min_interval_s = min_interval_s
        self.interval_s = interval_s
        self._last_s = -float("inf")
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s = float("inf")

    def changed(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): refresh now, no timer
            self._refresh()
            return
        due_s = self._last_s + self.min_interval_s
        if due_s <= loop.time():
            self._fire()
        else:
            self._arm(loop, due_s)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at_s = None, float("inf")

    def _arm(self, loop: asyncio.AbstractEventLoop, at_s: float) -> None:
        if self._timer is not None and self._timer_at_s <= at_s:
            return  # an earlier refresh is already due
        self.cancel()
        self._timer, self._timer_at_s = loop.call_at(at_s, self._fire), at_s

    def _fire(self) -> None:
        self.cancel()
        loop = asyncio.get_running_loop()
        self._last_s = loop.time()
        self._refresh()
        self._arm(loop, self._last_s + self.interval_s)


class CacheGauges:
    """The cache's load gauges: per rank load, free and cached blocks and queue depth; L1 slots."""

    def __init__(self, metrics: CacheMetrics, state: CacheState, loads: Callable[[], list[RankLoad]]) -> None:
        self._metrics = metrics
        self._state = state
        self._loads = loads
        self._per_rank = [
            (metrics.rank_load_tokens.labels(str(r)), metrics.rank_free_blocks.labels(str(r)),
             metrics.rank_cached_blocks.labels(str(r)), metrics.queue_depth.labels(str(r)))
            for r in range(state.num_ranks)
        ]
        self._refresher = GaugeRefresher(self._refresh)

    def changed(self) -> None:
        """The state changed: show it in the gauges soon."""
        self._refresher.changed()

    def cancel(self) -> None:
        self._refresher.cancel()

    def _refresh(self) -> None:
        state, m = self._state, self._metrics
        for load, (load_g, free_g, cached_g, depth_g) in zip(self._loads(), self._per_rank):
            load_g.set(load.load_tokens)
            free_g.set(load.num_free_blocks)
            cached_g.set(len(state.l0[load.rank]))
            depth_g.set(state.queue.depth(load.rank))
        m.l1_slots.set(state.l1.num_slots)
        m.l1_used_slots.set(state.l1.alloc.num_used_slots)
        m.l1_enabled.set(1 if state.l1_enabled else 0)
