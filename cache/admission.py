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

The fit test itself (``try_admit(level) -> bool``) belongs to the caller (the cache manager),
which knows the ledgers; this module only orders the waiters and keeps the queue metrics.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable
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
        """Return once ``try_admit`` said yes for this turn; the result is the time queued (s).

        ``try_admit(level)`` must be synchronous and, when it returns True, must have reserved
        the turn's blocks. Raises ``Overloaded`` when the turn cannot be admitted in time."""
        queue = self._queues[rank]
        if not queue and try_admit(AdmitLevel.NORMAL):
            return 0.0
        within_force = bool(queue) and self._clock() - queue[0].enqueued_s < self.config.force_after_s
        if within_force and try_admit(AdmitLevel.FREE_ONLY):
            self.num_overtaken += 1
            return 0.0
        if len(queue) >= self.config.max_queue_depth:
            self.num_rejected += 1
            raise Overloaded(
                f"rank {rank} has {len(queue)} turns waiting for KV cache room; retry later",
                retry_after_s=self.config.recheck_s * 8,
            )
        ticket = _Ticket(num_tokens, self._clock())
        queue.append(ticket)
        self._waiting_tokens[rank] += num_tokens
        self.num_queued += 1
        try:
            while True:
                waited_s = self._clock() - ticket.enqueued_s
                if queue[0] is ticket:
                    force = waited_s >= self.config.force_after_s
                    if try_admit(AdmitLevel.FORCE if force else AdmitLevel.NORMAL):
                        if force:
                            self.num_forced += 1
                        return waited_s
                if waited_s >= self.config.fail_after_s:
                    self.num_rejected += 1
                    raise Overloaded(
                        f"no KV cache room on rank {rank} after {waited_s:.1f} s; retry later",
                        retry_after_s=5.0,
                    )
                ticket.wake.clear()
                try:
                    await asyncio.wait_for(ticket.wake.wait(), self.config.recheck_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            # Exactly one removal path (admitted, rejected, or the caller was cancelled), then
            # the next head gets its chance at once.
            queue.remove(ticket)
            self._waiting_tokens[rank] -= num_tokens
            self.notify(rank)

    def notify(self, rank: int) -> None:
        """Blocks were freed on ``rank`` (or a turn left the queue): retry its head now."""
        queue = self._queues[rank]
        if queue:
            queue[0].wake.set()

    def notify_all(self) -> None:
        for rank in range(len(self._queues)):
            self.notify(rank)
