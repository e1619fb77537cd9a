"""``RankGroup``: the ``RankClient`` of N supervised rank processes (backend process, asyncio).

A facade over three jobs, each with its own module:

* supervision, ``RankProcesses`` (``rank/rank_processes.py``): start one epoch's ``rank.worker``
  processes, watch them (exit, heartbeats, a stuck step, a fatal report) and stop or kill them;
* messaging, ``RankMessenger`` (``rank/rank_messages.py``): requests and commands to the ranks,
  step outputs into the requests' ``RequestStream``s, replies to their commands;
* restarts, here with ``RestartBudget`` (``rank/restart_budget.py``): the epochs' life cycle.

Life cycle: ``start`` launches epoch 1 and the group is READY once every rank has announced
itself with the same KV geometry. The first failure the supervision sees fails the *group*:
lockstep ranks cannot continue without every peer. Every in-flight request of the epoch ends
with ``RankFailed`` naming the cause, every pending command fails the same way, the remaining
ranks are killed, ``epoch`` goes up by one, restart listeners hear the new epoch (caches drop the
dead one's GPU block ids; the L1 pool file is kept: ``rank/shm_claim.py``), and a fresh group is
started (after ``restart_backoff_s`` when the failed epoch never got ready). It gives up
(``FAILED``) when the budget says so. ``close`` asks the ranks to shut down together, kills what
is left after the grace period and fails anything in flight with "rank group closed".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rank.client import GroupState, RequestStream
from rank.config import RankConfig
from rank.engine import EngineMisuse, EngineRequest, EngineStats
from rank.errors import RankFailed, RankUnavailable
from rank.host_budget import host_pool_path, plan_host_pool_bytes, unlink_host_pool
from rank.ids import BlockId, Epoch, HostSlot, Rank
from rank.launch import rank_python
from rank.link import RankLink, TransferTiming
from rank.rank_messages import RankMessenger
from rank.rank_processes import RankProcesses
from rank.restart_budget import RestartBudget
from rank.shm_claim import claim_host_pool, release_host_pool
from rank.wire import stats_from_list

log = logging.getLogger(__name__)


class RankGroup:
    """Supervised ``RankClient`` of N rank processes (module docstring has the life cycle).

    Invariants: ``state == READY`` exactly while every rank of ``epoch`` has announced itself and
    no failure was seen; every request and command of an epoch is answered or failed before
    ``epoch`` changes; restart listeners run before the next epoch accepts work.
    """

    folds_imports = True  # submit runs an EngineRequest.fold (rank/transfers.py)

    def __init__(
        self,
        config: RankConfig,
        *,
        num_ranks: int | None = None,
        python: str | None = None,
        name: str | None = None,
        heartbeat_timeout_s: float = 3.0,
        loading_heartbeat_timeout_s: float = 60.0,
        step_timeout_s: float = 600.0,
        budget: RestartBudget | None = None,
        restart_backoff_s: float = 1.0,
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.num_ranks = num_ranks if num_ranks is not None else config.ep
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        self.python = python if python is not None else rank_python(config)
        self.name = name or f"g{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self.budget = budget or RestartBudget(max_start_failures=3, max_restarts=5, window_s=600.0)
        self.restart_backoff_s = restart_backoff_s
        self.block_size = config.block_size
        self.num_blocks = 0
        self.bytes_per_block = 0
        self.num_host_slots = 0
        self.epoch = Epoch(0)
        self.state = GroupState.STOPPED
        self.restarts = 0
        self.last_failure: str | None = None
        self.last_detection_s: float | None = None  # failure seen -> in-flight requests failed
        # From the ranks' ready messages: False when any rank's engine cannot start from cached
        # blocks (DeepInfer without the prefix-cache patch); the cache then runs without L0/L1.
        self.prefix_cache_supported = True
        self.prefix_cache_reason: str | None = None
        self.host_pool_path = host_pool_path(self.name)
        if config.l1_cache and config.l1_host_gb > 0:
            self.host_pool_bytes, reason = plan_host_pool_bytes(config.l1_host_gb, self.num_ranks)
            log.info("%s", reason)
        else:
            self.host_pool_bytes = 0
        self.processes = RankProcesses(
            config, self.num_ranks, python=self.python, name=self.name, host_pool_path=self.host_pool_path,
            host_pool_bytes=self.host_pool_bytes,
            base_env=dict(os.environ) if base_env is None else dict(base_env),
            heartbeat_timeout_s=heartbeat_timeout_s,
            # While a rank loads, one C call (dlopen of libtorch, a weight read, a JIT build) can hold
            # the GIL and delay its heartbeat thread; only a loaded rank is held to the tight bound.
            loading_heartbeat_timeout_s=max(loading_heartbeat_timeout_s, heartbeat_timeout_s),
            step_timeout_s=step_timeout_s,
        )
        self.messages = RankMessenger(self.processes.on_status)
        self._listeners: list[Callable[[Epoch], None]] = []
        self._state_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._pool_lock = -1  # flock on the host pool file while this group runs (rank/shm_claim.py)

    @property
    def links(self) -> list[RankLink]:
        """The current epoch's ranks (their processes, sockets and requests in flight)."""
        return self.processes.links

    @property
    def transfer_log(self) -> deque[TransferTiming]:
        """The latest transfer round trips, by phase (benchmarks and diagnosis)."""
        return self.messages.transfer_log

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.processes.heartbeat_timeout_s

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, wait: bool = True) -> None:
        """Launch the ranks; with ``wait``, return once READY (raise RankFailed if it gives up)."""
        if self._task is not None:
            if wait:
                await self.wait_ready()
            return
        if not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            self.state = GroupState.FAILED
            self.last_failure = f"rank interpreter {self.python} does not exist or is not executable"
            raise RankFailed(self.last_failure)
        self._closing = False
        self._pool_lock = claim_host_pool(self.host_pool_path, self.host_pool_bytes)  # L1 starts empty
        self.processes.open()
        self.epoch = Epoch(1)
        self._set_state(GroupState.STARTING)
        self._task = asyncio.create_task(self._lifecycle(), name=f"rank-group-{self.name}")
        if wait:
            await self.wait_ready()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        async def wait() -> None:
            while self.state not in (GroupState.READY, GroupState.FAILED, GroupState.STOPPED):
                self._state_event.clear()
                await self._state_event.wait()

        await asyncio.wait_for(wait(), timeout_s)
        if self.state != GroupState.READY:
            raise RankFailed(f"rank group is {self.state.value}: {self.last_failure}")

    async def close(self) -> None:
        """Stop the ranks (graceful shutdown vote, then SIGKILL) and fail anything in flight."""
        if self._task is None:
            self.state = GroupState.STOPPED
            return
        self._closing = True
        if self.state == GroupState.READY:
            await self.processes.stop()
        else:
            self.processes.closing = True
        self.processes.fail("rank group closed")
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self.processes.close()
        self._pool_lock = release_host_pool(self.host_pool_path, self._pool_lock)  # after FAILED too
        self._set_state(GroupState.STOPPED)

    def _set_state(self, state: GroupState) -> None:
        self.state = state
        self._state_event.set()

    async def _lifecycle(self) -> None:
        while not self._closing:
            reason, was_ready = await self._run_epoch()
            await self._teardown(reason)
            if self._closing:
                return
            self.restarts += 1
            why = self.budget.give_up(was_ready)
            self.last_failure = reason if why is None else f"{why}; last failure: {reason}"
            if why is not None:
                log.error("rank group %s: giving up (%s)", self.name, self.last_failure)
                self._set_state(GroupState.FAILED)
                return
            self.epoch = Epoch(self.epoch + 1)
            self._set_state(GroupState.RESTARTING)
            log.warning("rank group %s: restarting as epoch %d after: %s", self.name, self.epoch, reason)
            for fn in list(self._listeners):
                try:
                    fn(self.epoch)
                except Exception:  # a listener bug must not stop the restart
                    log.exception("restart listener %r failed", fn)
            if not was_ready:
                await asyncio.sleep(self.restart_backoff_s)

    async def _run_epoch(self) -> tuple[str, bool]:
        """Launch every rank, wait for READY, then for the first failure. Returns (reason, was_ready)."""
        failure = self.processes.new_failure()
        if self._closing:  # close() came during a restart's backoff
            return "rank group closed", False
        started = time.monotonic()
        try:
            await self.processes.launch(self.epoch, self.messages.on_message)
        except Exception as exc:  # noqa: BLE001 - e.g. exec failure; reported as the reason
            # An exec failure's OSError names no file; the reason is the one line an operator sees.
            unnamed = isinstance(exc, OSError) and not exc.filename
            where = f" (rank interpreter {self.python})" if unnamed else ""
            return f"could not launch ranks: {type(exc).__name__}: {exc}{where}", False
        reason = await self.processes.wait_loaded(started)
        if reason is not None:
            return reason, False
        geometry = self.processes.geometry()
        if isinstance(geometry, str):
            return geometry, False
        self.block_size, self.num_blocks, self.bytes_per_block, self.num_host_slots = geometry
        self.prefix_cache_supported, self.prefix_cache_reason = self.processes.prefix_cache_support()
        if not self.prefix_cache_supported:
            log.warning("rank group %s: prefix cache NOT supported (%s)", self.name, self.prefix_cache_reason)
        log.info(
            "rank group %s epoch %d ready in %.1fs: %d ranks, %d blocks x %d tokens per rank, %d host slots",
            self.name, self.epoch, time.monotonic() - started, self.num_ranks, self.num_blocks,
            self.block_size, self.num_host_slots,
        )
        self._set_state(GroupState.READY)
        return await failure, True

    async def _teardown(self, reason: str) -> None:
        detected = time.monotonic()
        if self.state == GroupState.READY or self.state == GroupState.STARTING:
            self._set_state(GroupState.RESTARTING if not self._closing else GroupState.STOPPED)
        error = RankFailed(f"rank group epoch {self.epoch} failed: {reason}")
        num_failed = self.messages.fail_all(self.links, error)
        self.last_detection_s = time.monotonic() - detected
        if num_failed:
            log.warning("rank group %s: failed %d in-flight requests: %s", self.name, num_failed, reason)
        await self.processes.reap()
        if self._closing:  # a restart keeps it: the next epoch's ranks re-map it, never zeroed
            unlink_host_pool(self.host_pool_path)

    # ------------------------------------------------------------------ RankClient

    def _ready_rank(self, rank: int) -> RankLink:
        if self.state != GroupState.READY:
            raise RankUnavailable(f"rank group is {self.state.value}"
                                  + (f" ({self.last_failure})" if self.last_failure else ""))
        if not 0 <= rank < self.num_ranks:
            raise EngineMisuse(f"rank {rank} outside 0..{self.num_ranks - 1}")
        return self.links[rank]

    def submit(self, rank: Rank, request: EngineRequest) -> RequestStream:
        # ``self.abort`` looked up per call: a wrapper installed on the instance sees stream aborts too.
        return self.messages.submit(self._ready_rank(rank), request, self.epoch,
                                    lambda: self.abort(rank, request.request_id))

    def abort(self, rank: Rank, request_id: str) -> None:
        if self.state != GroupState.READY or not 0 <= rank < self.num_ranks:
            return  # nothing to abort: the epoch's requests are already failed
        with contextlib.suppress(RankUnavailable):
            self.messages.send(self.links[rank], {"op": "abort", "rids": [request_id]})

    async def release(self, rank: Rank, block_ids: list[BlockId]) -> None:
        header = {"op": "release", "ids": [int(b) for b in block_ids]}
        await self.messages.command(self._ready_rank(rank), header)

    async def export_blocks(self, rank: Rank, block_ids: list[BlockId], host_slot: HostSlot) -> None:
        header = {"op": "export", "ids": [int(b) for b in block_ids], "slot": int(host_slot)}
        await self.messages.command(self._ready_rank(rank), header)

    async def import_blocks(self, rank: Rank, host_slot: HostSlot, num_blocks: int) -> list[BlockId]:
        header = {"op": "import", "slot": int(host_slot), "n": int(num_blocks)}
        return list(await self.messages.command(self._ready_rank(rank), header))

    def stats(self, rank: Rank) -> EngineStats:
        links = self.links
        values = links[rank].stats if 0 <= rank < len(links) else None
        if values is None:
            return EngineStats(self.num_blocks, max(0, self.num_blocks - 1), 0, 0, 0, 0, 0, 0, 0)
        return stats_from_list(values)

    def add_restart_listener(self, fn: Callable[[Epoch], None]) -> None:
        self._listeners.append(fn)

    def health(self) -> dict[str, Any]:
        """Group state for /healthz: state, epoch, restarts, last failure, per-rank liveness."""
        now = time.monotonic()
        return {
            "state": self.state.value,
            "epoch": self.epoch,
            "num_ranks": self.num_ranks,
            "restarts": self.restarts,
            "last_failure": self.last_failure,
            "prefix_cache_supported": self.prefix_cache_supported,
            "prefix_cache_reason": self.prefix_cache_reason,
            "ranks": [r.health(now) for r in self.links],
        }

    def pids(self) -> list[int]:
        return self.processes.pids()
