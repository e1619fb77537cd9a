"""What the cache manager's parts share: the indexes, the sessions, the per-rank ledgers, the
epoch and the background tasks.

``CacheManager`` (``cache/manager.py``) is a facade over parts with one job each: the admission
planner (``planner.py``), the L1 transfers (``l1_transfers.py``), the release ledger
(``releases.py``), the output room (``output_room.py``) and the restart sync (``restart.py``).
They all plan on the same state, held here; none of them reads another's private fields.

A rank restart (new epoch) replaces the ledgers and empties the L0 index (``reset``): every
block id of the old epoch is gone; L1's committed entries stay (the host pool outlives the
ranks). Work of the old epoch checks ``epoch`` after each await before it touches the state.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from cache.admission import AdmissionQueue
from cache.config import CacheConfig
from cache.eviction import EvictionPolicy
from cache.idle_load import IdleLoad
from cache.kv_tier import TierLink
from cache.l0_index import L0Index, RankIndex
from cache.l1_index import L1Index
from cache.metrics import CacheMetrics
from cache.releases import ReleaseLedger
from cache.sessions import SessionId, SessionTable
from rank.client import RankClient
from rank.ids import Epoch

log = logging.getLogger("cache.manager")


@dataclass(slots=True)
class RankLedger:
    """What the planners may plan on per rank, besides the L0 index and the releases in flight:
    free = capacity - indexed - reserved - releasing (``CacheState.free_blocks``)."""

    capacity_blocks: int  # num_blocks - 1 (block 0 is scratch)
    reserved_blocks: int = 0  # blocks open admissions (and prefetches) may still allocate
    running_tokens: int = 0  # context tokens of admitted, unfinished turns (the router's load)
    num_in_flight: int = 0  # open admissions
    worst_blocks: int = 0  # open admissions' prompt + max_tokens, blocks (cache/output_room.py)


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
        clock: Callable[[], float],
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.block_size = client.block_size
        self.num_ranks = client.num_ranks
        self.sessions = SessionTable()
        # The router's idle-token term, kept incrementally: call idle.update(session, now) after
        # every change of a session's home_rank, num_in_flight, last finish/stop, gaps or
        # context_tokens (check_balance asserts it equals the walk over all sessions).
        self.idle = IdleLoad(client.num_ranks, config.home_horizon_s, self.sessions)
        self.l0 = L0Index(client.num_ranks)
        self.l1 = L1Index(0, config.l1_headroom_fraction, config.l1_min_headroom_blocks)
        self.l1_off_reason: str | None = "not started"  # None: L1 on (``restart.py`` decides)
        self.l1_geometry = (0, 0)  # (host slots, bytes per block) L1 was adopted with
        self.l2: TierLink | None = None  # L1 <-> the disk tier, when configured (``kv_tier.py``)
        self.policy = EvictionPolicy(self.sessions, self._is_l1_backed, config.protect_s)
        self.queue = AdmissionQueue(client.num_ranks, config.admission(), clock)
        self.epoch = client.epoch
        self.ledgers = self._new_ledgers()
        self.tasks = BackgroundTasks()
        self.releases = ReleaseLedger(self)
        self.on_change: Callable[[], None] = lambda: None  # the gauges' "refresh soon"

    @property
    def l1_enabled(self) -> bool:
        return self.l1_off_reason is None

    def index(self, rank: int) -> RankIndex:
        return self.l0[rank]

    def free_blocks(self, rank: int) -> int:
        """Blocks of ``rank`` nobody holds or plans on. A block whose release is still in flight
        is held by the engine until the release lands, so it is not free yet (planning on it made
        imports fail with CapacityExhausted)."""
        ledger = self.ledgers[rank]
        return (ledger.capacity_blocks - len(self.l0[rank]) - ledger.reserved_blocks
                - self.releases.pending(rank))

    def keep_out_blocks(self, rank: int = 0) -> int:
        """Blocks of a rank's pool that admission never plans on: ``reserve_blocks`` of slack
        plus the share above ``usable_fraction`` (DeepInfer's prefill watermark counts cached
        blocks as used, so cached + reserved must stay under it)."""
        cap = self.ledgers[rank].capacity_blocks
        usable = math.floor(cap * self.config.usable_fraction + 1e-9)
        return self.config.reserve_blocks + (cap - usable)

    def plannable_free_blocks(self, rank: int) -> int:
        """Free blocks any planner may take on ``rank`` (negative when running replies' growth
        overcommitted the pool)."""
        return self.free_blocks(rank) - self.keep_out_blocks(rank)

    def usable_blocks(self, rank: int = 0) -> int:
        """The most blocks one turn may hold on a rank: capacity less the keep-out."""
        return self.ledgers[rank].capacity_blocks - self.keep_out_blocks(rank)

    def pool_usage(self, rank: int) -> float:
        """Cached + reserved blocks over the blocks the cache may use (``usable_fraction``)."""
        ledger = self.ledgers[rank]
        usable = math.floor(ledger.capacity_blocks * self.config.usable_fraction + 1e-9)
        if usable <= 0:
            return 1.0
        return (len(self.l0[rank]) + ledger.reserved_blocks) / usable

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
        if self.l1_enabled and (self.client.num_host_slots, self.client.bytes_per_block) == self.l1_geometry:
            kept = self.l1.keep_across_restart()
        else:
            self.l1.clear()
        self.sessions.clear_placement()
        self.idle.clear()
        self.ledgers = self._new_ledgers()
        self.releases.reset()
        return kept

    def _new_ledgers(self) -> list[RankLedger]:
        return [RankLedger(max(0, self.client.num_blocks - 1)) for _ in range(self.num_ranks)]

    def _is_l1_backed(self, sid: SessionId) -> bool:
        return self.l1.backed_blocks(sid) > 0
