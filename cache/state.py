"""What the cache manager's parts share, and who owns each piece of it.

``CacheManager`` (``cache/manager.py``) is a facade over parts with one job each (the admission
planner, the rank admitter, the L1 copies, the output room, the release ledger, the restart
sync). They plan on the state held here; each counter and index has one owner, and every change
goes through that owner's methods (``tests/test_structure.py`` checks that no other module
assigns the owned fields):

* ``sessions`` (``cache/sessions.py``): every session's fields and the router's idle-load term;
* ``ledgers`` (``cache/ledger.py``, one ``RankLedger`` per rank): reservations, running tokens,
  open admissions and their worst cases, and the admissions' shares of them;
* ``releases`` (``cache/releases.py``): blocks out of the index whose release has not landed;
* ``l0`` / ``l1`` (``cache/l0_index.py``, ``cache/l1_index.py``): the indexes;
* this object: the epoch, the ledgers' lifetime and whether L1 is on (``l1_on``/``l1_off``,
  called by ``cache/restart.py``).

A rank restart (new epoch) replaces the ledgers and empties the L0 index (``reset``): every
block id of the old epoch is gone; L1's committed entries stay (the host pool outlives the
ranks). Work of the old epoch checks ``epoch`` after each await before it touches the state.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from cache.admission import AdmissionQueue
from cache.config import CacheConfig
from cache.eviction import EvictionPolicy
from cache.hashing import BlockHash
from cache.kv_tier import KVTier, TierLink
from cache.l0_index import L0Index, RankIndex
from cache.l1_index import L1Index
from cache.ledger import RankLedger
from cache.metrics import CacheMetrics
from cache.releases import ReleaseLedger
from cache.sessions import SessionId, SessionTable
from rank.client import RankClient
from rank.ids import Epoch

log = logging.getLogger("cache.manager")


class BackgroundTasks:
    """The cache's fire-and-forget work (releases, L1 writes, prefetches): kept referenced until
    done, failures logged, ``drain`` awaits them all."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cache background task failed", exc_info=task.exception())


class CacheState:
    """The shared state (see the module docstring). One event loop; not thread-safe."""

    def __init__(
        self, client: RankClient, config: CacheConfig, metrics: CacheMetrics | None,
        clock: Callable[[], float], *, tier: KVTier | None = None, root: BlockHash | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.block_size = client.block_size
        self.num_ranks = client.num_ranks
        self.sessions = SessionTable(num_ranks=client.num_ranks, home_horizon_s=config.home_horizon_s)
        self.l0 = L0Index(client.num_ranks)
        self.l1 = L1Index(0, config.l1_headroom_fraction, config.l1_min_headroom_blocks)
        self._l1_off_reason: str | None = "not started"  # None: L1 on (``restart.py`` decides)
        self._l1_geometry = (0, 0)  # (host slots, bytes per block) L1 was adopted with
        # L1 <-> the tier below it (``kv_tier.py``), when one is configured
        self.l2 = TierLink(self.l1, tier, root) if tier is not None and root is not None else None
        self.policy = EvictionPolicy(self.sessions, self._is_l1_backed, config.protect_s)
        self.queue = AdmissionQueue(client.num_ranks, config.admission(), clock)
        self.epoch = client.epoch
        self.tasks = BackgroundTasks()
        self.releases = ReleaseLedger(self)
        self.ledgers = self._new_ledgers()
        self._on_change: Callable[[], None] = lambda: None  # the gauges' "refresh soon"

    @property
    def l1_enabled(self) -> bool:
        return self._l1_off_reason is None

    @property
    def l1_off_reason(self) -> str | None:
        return self._l1_off_reason

    def l1_on(self, num_slots: int, bytes_per_block: int) -> None:
        """Adopt the host pool: L1 holds ``num_slots`` blocks of ``bytes_per_block``."""
        self.l1.resize(num_slots)
        self._l1_geometry = (num_slots, bytes_per_block)
        self._l1_off_reason = None

    def l1_off(self, reason: str) -> None:
        self._l1_off_reason = reason

    def notify_changes_to(self, callback: Callable[[], None]) -> None:
        """``callback`` (the gauges' "refresh soon") runs after changes (``on_change``)."""
        self._on_change = callback

    def on_change(self) -> None:
        self._on_change()

    def index(self, rank: int) -> RankIndex:
        return self.l0[rank]

    def l1_score(self, sid: SessionId) -> float:
        """L1's eviction value of a session: its expected wait (longest goes first)."""
        session = self.sessions.get(sid)
        return float("inf") if session is None else session.expected_wait_s(self.clock())

    def reset(self, new_epoch: Epoch) -> int:
        """The rank group restarted: forget every GPU block of the old epoch. The host pool
        outlives the ranks (``rank/group.py`` keeps its file), so L1's committed entries stay
        when the pool's geometry is unchanged (copies in flight are void). Returns them."""
        self.epoch = new_epoch
        for idx in self.l0.ranks:
            idx.remove_all()
        kept = 0
        if self.l1_enabled and (self.client.num_host_slots, self.client.bytes_per_block) == self._l1_geometry:
            kept = self.l1.keep_across_restart()
        else:
            self.l1.clear()
        self.sessions.clear_placement()  # and the idle load with it
        self.releases.reset()
        self.ledgers = self._new_ledgers()
        return kept

    def _new_ledgers(self) -> list[RankLedger]:
        capacity = max(0, self.client.num_blocks - 1)
        return [RankLedger(capacity, self.config, self.l0[r], functools.partial(self.releases.pending, r))
                for r in range(self.num_ranks)]

    def _is_l1_backed(self, sid: SessionId) -> bool:
        return self.l1.backed_blocks(sid) > 0
