"""Admission: a turn starts only when its blocks fit on its rank; otherwise it waits its turn.

Every running sequence must be on the GPU (the engines cannot swap a running sequence out), so
a turn is admitted only when ``resident + restored + new prompt blocks + expected output
blocks`` fit in the rank's pool without evicting a session that is about to return (see
``cache/eviction.py``). If they do not fit, the turn waits in its rank's FIFO queue:

* Only the head of a rank's queue may evict to make room (FIFO-fair). A new turn may overtake
  a waiting head only if it fits in the blocks that are free right now without evicting
  anything (typically a returning session whose prefix is resident: resident turns first), and
  only while the head has waited less than ``force_after_s``, so a stream of small turns
  cannot starve a big one. Queued turns hold no pins, so a waiting turn never blocks the
  eviction the head needs (that would deadlock).
* The head is retried whenever blocks are freed on the rank (``notify``) and every
  ``recheck_s`` (sessions lose their protection as time passes).
* After ``force_after_s`` in the queue the head may evict protected sessions too (bounded
  wait; thrashing is avoided because this is rare and ordered by value).
* After ``fail_after_s`` (or if the queue already holds ``max_queue_depth`` turns) the turn
  fails with ``Overloaded`` (HTTP 503, retryable) instead of hanging.
* An auxiliary turn (``yields``: titles, memory passes) is never the head while a session's turn
  waits: the first turn in the queue that does not yield is (``_head``). An auxiliary turn
  evicts no session's blocks (``cache/eviction.py``), so at the head it would block the queue.
* A session's main thread is not starved by its own branches (subagents, auxiliary requests):
  its turn queues ahead of its family's waiting branch turns on each rank (``family``/``main``;
  the parent waits for its subagents, so its turn is what the client waits on), never ahead of
  other sessions' turns.
* A turn that may run on several ranks (``enter_any``; ``cache/router.py`` rule 4, late binding)
  holds one ticket in each of their queues and is admitted by whichever rank first has room for
  it while it is that rank's head; it then leaves every queue. FIFO order holds on each rank.

The fit test itself (``try_admit(level) -> bool``) belongs to the caller (the cache manager),
which knows the ledgers; this module only orders the waiters and keeps the queue metrics.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protocol.errors import Overloaded


class AdmitLevel(enum.Enum):
    """What ``try_admit`` may do to make room."""

    FREE_ONLY = 0  # use free blocks only (a turn overtaking the queue)
    NORMAL = 1  # may evict sessions that are not about to return
    FORCE = 2  # may evict any unused block (the head after ``force_after_s``)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    force_after_s: float = 5.0
    fail_after_s: float = 120.0
    recheck_s: float = 0.25
    max_queue_depth: int = 1024


@dataclass(slots=True, eq=False)
class _Ticket:
    num_tokens: int
    enqueued_s: float
    family: str | None = None
    main: bool = False
    yields: bool = False  # an auxiliary turn: never the head while a session's turn waits
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class AdmissionQueue:
    """Per-rank FIFO queues of turns waiting for room (one event loop; not thread-safe)."""

    def __init__(
        self, num_ranks: int, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._queues: list[deque[_Ticket]] = [deque() for _ in range(num_ranks)]
        self._waiting_tokens = [0] * num_ranks  # sum of num_tokens over each queue (the router asks per turn)
        self.num_forced = 0
        self.num_rejected = 0
        self.num_queued = 0
        self.num_overtaken = 0

    def depth(self, rank: int) -> int:
        return len(self._queues[rank])

    def waiting_tokens(self, rank: int) -> int:
        return self._waiting_tokens[rank]

    async def enter(self, rank: int, num_tokens: int, try_admit: Callable[[AdmitLevel], bool]) -> float:
        """Return once ``try_admit`` said yes for this turn on ``rank``; the result is the time
        queued (s). See ``enter_any``."""
        _rank, waited_s = await self.enter_any((rank,), num_tokens, lambda _r, level: try_admit(level))
        return waited_s

    async def enter_any(
        self, ranks: Sequence[int], num_tokens: int, try_admit: Callable[[int, AdmitLevel], bool],
        order: Callable[[], Sequence[int]] | None = None, *, family: str | None = None, main: bool = False,
        yields: bool = False,
    ) -> tuple[int, float]:
        """Return ``(rank, time queued)`` once ``try_admit(rank, level)`` said yes for this turn
        on one of ``ranks``, tried in the given order (re-read from ``order()`` at each retry
        while the turn waits) when several could take it at once.

        ``try_admit`` must be synchronous and, when it returns True, must have reserved the
        turn's blocks on that rank. A turn that may run on several ranks waits in each of their
        queues with one ticket and is admitted by whichever rank first has room for it while it
        is that rank's head (late binding: one queue for the node instead of one per rank picked
        on arrival). Raises ``Overloaded`` when the turn cannot be admitted in time."""
        if not ranks:
            raise ValueError("enter_any needs at least one rank")
        now = self._clock()
        for rank in ranks:
            if not self._queues[rank] and try_admit(rank, AdmitLevel.NORMAL):
                return rank, 0.0
        for rank in ranks:
            queue = self._queues[rank]
            within_force = bool(queue) and now - _head(queue).enqueued_s < self.config.force_after_s
            if within_force and try_admit(rank, AdmitLevel.FREE_ONLY):
                self.num_overtaken += 1
                return rank, 0.0
        if all(len(self._queues[r]) >= self.config.max_queue_depth for r in ranks):
            self.num_rejected += 1
            raise Overloaded(
                f"rank {ranks[0]} has {len(self._queues[ranks[0]])} turns waiting for KV cache room; "
                "retry later" if len(ranks) == 1 else
                f"{len(ranks)} ranks each have {self.config.max_queue_depth} turns waiting for KV cache "
                "room; retry later",
                retry_after_s=self.config.recheck_s * 8,
            )
        ticket = _Ticket(num_tokens, now, family, main, yields)
        joined = [r for r in ranks if len(self._queues[r]) < self.config.max_queue_depth]
        share = num_tokens // len(joined)  # the router's per-rank waiting tokens: split, not counted twice
        for r in joined:
            queue = self._queues[r]
            at = len(queue)
            if main and family is not None:  # ahead of its own branches' waiting turns
                at = next((i for i, t in enumerate(queue) if t.family == family and not t.main), at)
            queue.insert(at, ticket)
            self._waiting_tokens[r] += share
        self.num_queued += 1
        try:
            while True:
                waited_s = self._clock() - ticket.enqueued_s
                force = waited_s >= self.config.force_after_s
                level = AdmitLevel.FORCE if force else AdmitLevel.NORMAL
                for r in (order() if order is not None and len(joined) > 1 else joined):
                    if r in joined and _head(self._queues[r]) is ticket and try_admit(r, level):
                        if force:
                            self.num_forced += 1
                        return r, waited_s
                if waited_s >= self.config.fail_after_s:
                    self.num_rejected += 1
                    raise Overloaded(
                        f"no KV cache room on rank {joined[0]} after {waited_s:.1f} s; retry later"
                        if len(joined) == 1 else
                        f"no KV cache room on any of {len(joined)} ranks after {waited_s:.1f} s; retry later",
                        retry_after_s=5.0,
                    )
                ticket.wake.clear()
                try:
                    await asyncio.wait_for(ticket.wake.wait(), self.config.recheck_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            # Exactly one removal path (admitted, rejected, or the caller was cancelled), then
            # each queue's next head gets its chance at once.
            for r in joined:
                self._queues[r].remove(ticket)
                self._waiting_tokens[r] -= share
                self.notify(r)

    def notify(self, rank: int) -> None:
        """Blocks were freed on ``rank`` (or a turn left the queue): retry its head now."""
        queue = self._queues[rank]
        if queue:
            _head(queue).wake.set()

    def notify_all(self) -> None:
        for rank in range(len(self._queues)):
            self.notify(rank)


def _head(queue: deque[_Ticket]) -> _Ticket:
    """The turn a rank admits next: the first that does not yield, else the first."""
    return next((t for t in queue if not t.yields), queue[0])
