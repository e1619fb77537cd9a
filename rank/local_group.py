"""``LocalRankGroup``: the ``RankClient`` protocol over engines in this process.

For cache tests and the capacity simulator: same semantics as ``RankGroup`` (streams, epochs,
restart listeners, block ids per rank) without processes or sockets. One asyncio task steps
every engine that has work, round-robin, and yields to the event loop after each round (or
sleeps ``step_s``: tests on virtual time give a step a duration, ``bench/simulator/vclock.py``); it
sleeps on an event while all engines are idle. Engines run on the event-loop thread (they are
not thread-safe), so with a compute model a step blocks the loop for its duration.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rank.client import GroupState, RequestStream
from rank.config import RankConfig
from rank.engine import CapacityExhausted, Engine, EngineMisuse, EngineRequest, EngineStats, RequestOutput
from rank.engines import make_engine
from rank.errors import RankFailed, RankUnavailable
from rank.host_budget import host_pool_path, unlink_host_pool
from rank.host_pool import HostPool
from rank.ids import BlockId, Epoch, HostSlot, Rank

log = logging.getLogger(__name__)


class LocalRankGroup:
    """In-process rank group. Invariant: ``_streams[rank]`` holds exactly the requests submitted
    to that rank in this epoch whose terminal output has not been delivered yet."""

    folds_imports = True  # submit runs an EngineRequest.fold before the add

    def __init__(
        self, engine_factory: Callable[[int], Engine], num_ranks: int, *, host_pool: HostPool | None = None,
        host_pool_path: str | None = None, step_s: float = 0.0,
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self._factory = engine_factory
        self.step_s = step_s  # how long a round of steps takes (0: just yield)
        self.num_ranks = num_ranks
        self.host_pool = host_pool
        self._host_pool_path = host_pool_path  # unlinked on close when we created the file
        self.engines: list[Engine] = []
        self.block_size = 0
        self.num_blocks = 0
        self.bytes_per_block = 0
        self.num_host_slots = 0
        self.epoch = Epoch(0)
        self.state = GroupState.STOPPED
        self.restarts = 0
        self.last_failure: str | None = None
        self.prefix_cache_supported = True
        self.prefix_cache_reason: str | None = None
        self._streams: list[dict[str, RequestStream]] = []
        self._listeners: list[Callable[[Epoch], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(
        cls, config: RankConfig, *, num_ranks: int | None = None, host_pool_bytes: int = 0,
        name: str | None = None,
        step_s: float = 0.0,
    ) -> LocalRankGroup:
        """Engines from ``make_engine``; a shared host pool of ``host_pool_bytes`` if > 0."""
        host_pool = None
        path = None
        if host_pool_bytes > 0:
            path = host_pool_path(name or f"local-{os.getpid()}-{id(config):x}")
            unlink_host_pool(path)
            host_pool = HostPool(path, host_pool_bytes)
        n = num_ranks if num_ranks is not None else config.ep
        return cls(lambda rank: make_engine(config, rank, host_pool), n, host_pool=host_pool,
                   host_pool_path=path,
                   step_s=step_s)

    @property
    def host_pool_path(self) -> str | None:
        """The pool's file (``RankGroup`` has the same attribute); it outlives ``restart``."""
        return self.host_pool.path if self.host_pool is not None else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.state == GroupState.READY:
            return
        self.state = GroupState.STARTING
        self._build()
        self._task = asyncio.create_task(self._run(), name="local-rank-group")

    def _build(self) -> None:
        self.engines = [self._factory(rank) for rank in range(self.num_ranks)]
        first = self.engines[0]
        self.block_size, self.num_blocks = first.block_size, first.num_blocks
        self.bytes_per_block = first.bytes_per_block
        off = [(rank, e) for rank, e in enumerate(self.engines) if not e.prefix_cache_supported]
        self.prefix_cache_supported = not off
        if off:
            rank, engine = off[0]
            reason = engine.prefix_cache_reason or "not supported by the engine"
            self.prefix_cache_reason = f"rank {rank}: {reason}"
        else:
            self.prefix_cache_reason = first.prefix_cache_reason
        pool = self.host_pool
        if pool is not None and not pool.is_open and self.bytes_per_block:
            pool.open(self.bytes_per_block)
        self.num_host_slots = pool.num_slots if pool is not None and pool.is_open else 0
        self._streams = [{} for _ in range(self.num_ranks)]
        self.epoch = Epoch(self.epoch + 1)
        self.state = GroupState.READY

    async def restart(self, reason: str) -> None:
        """Simulate a group failure: fail in-flight work, drop every engine, start fresh."""
        self.state = GroupState.RESTARTING
        self.last_failure = reason
        self.restarts += 1
        self._fail_all(reason)
        for engine in self.engines:
            engine.close()
        self._build()
        for fn in list(self._listeners):
            fn(self.epoch)

    async def close(self) -> None:
        self.state = GroupState.STOPPED
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_all("rank group closed")
        for engine in self.engines:
            engine.close()
        self.engines = []
        if self.host_pool is not None:
            self.host_pool.close()
        if self._host_pool_path is not None:
            unlink_host_pool(self._host_pool_path)

    def _fail_all(self, reason: str) -> None:
        for streams in self._streams:
            for stream in streams.values():
                stream.fail(RankFailed(f"rank group epoch {self.epoch} failed: {reason}"))
            streams.clear()

    # ------------------------------------------------------------------ RankClient

    def _check(self, rank: Rank) -> Engine:
        if self.state != GroupState.READY:
            raise RankUnavailable(f"rank group is {self.state.value}")
        if not 0 <= rank < self.num_ranks:
            raise EngineMisuse(f"rank {rank} outside 0..{self.num_ranks - 1}")
        return self.engines[rank]

    def submit(self, rank: Rank, request: EngineRequest) -> RequestStream:
        engine = self._check(rank)
        if request.fold is not None:
            request = self._run_fold(engine, request)
        engine.add(request)  # raises EngineMisuse with nothing changed
        stream = RequestStream(request.request_id, rank, self.epoch,
                               lambda: self.abort(rank, request.request_id))
        self._streams[rank][request.request_id] = stream
        self._wake.set()
        return stream

    @staticmethod
    def _run_fold(engine: Engine, request: EngineRequest) -> EngineRequest:
        """The request's folded L1 import, as a rank process runs it just before the add
        (``rank/transfers.py``); its reply future is settled now, before any step of the request."""
        fold = request.fold
        assert fold is not None
        fold.sent = True
        prefix = list(request.prefix_blocks)
        try:
            ids = engine.import_blocks(fold.host_slot, fold.num_blocks)
        except (EngineMisuse, CapacityExhausted, ValueError) as exc:
            if not fold.reply.done():
                fold.reply.set_exception(exc)
            return replace(request, prefix_blocks=prefix[: fold.fallback_blocks],
                           num_cached_tokens=fold.fallback_tokens, fold=None)
        if not fold.reply.done():
            fold.reply.set_result(list(ids))
        return replace(request, prefix_blocks=prefix + list(ids), fold=None)

    def abort(self, rank: Rank, request_id: str) -> None:
        if self.state == GroupState.READY and 0 <= rank < self.num_ranks:
            self.engines[rank].abort([request_id])
            self._wake.set()

    async def release(self, rank: Rank, block_ids: list[BlockId]) -> None:
        self._check(rank).release(block_ids)

    async def export_blocks(self, rank: Rank, block_ids: list[BlockId], host_slot: HostSlot) -> None:
        self._check(rank).export_blocks(block_ids, host_slot)

    async def import_blocks(self, rank: Rank, host_slot: HostSlot, num_blocks: int) -> list[BlockId]:
        return self._check(rank).import_blocks(host_slot, num_blocks)

    def stats(self, rank: Rank) -> EngineStats:
        return self.engines[rank].stats()

    def add_restart_listener(self, fn: Callable[[Epoch], None]) -> None:
        self._listeners.append(fn)

    def health(self) -> dict[str, Any]:
        """Group state for /healthz (the engines run in this process: no pids or heartbeats)."""
        return {
            "state": self.state.value, "epoch": self.epoch, "num_ranks": self.num_ranks,
            "restarts": self.restarts, "last_failure": self.last_failure,
            "prefix_cache_supported": self.prefix_cache_supported,
            "prefix_cache_reason": self.prefix_cache_reason,
        }

    def check_accounting(self) -> None:
        for engine in self.engines:
            engine.check_accounting()

    # ------------------------------------------------------------------ stepping

    async def _run(self) -> None:
        while True:
            busy = False
            for rank, engine in enumerate(self.engines):
                if engine.has_work():
                    busy = True
                    self._dispatch(rank, engine.step())
            if busy:
                await asyncio.sleep(self.step_s)
            else:
                self._wake.clear()
                await self._wake.wait()

    def _dispatch(self, rank: int, outputs: list[RequestOutput]) -> None:
        streams = self._streams[rank]
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del streams[out.request_id]
            stream.push(out)
