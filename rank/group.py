"""``RankGroup``: supervisor and client of N rank processes (backend process, asyncio).

Supervision: the group starts N ``rank.worker`` processes (one per GPU, N = ``config.ep``) with
only the environment a rank needs, logs their load progress, and waits for all of them to be
ready within ``load_timeout_seconds``. Then it watches: a rank process exiting, a rank missing
heartbeats for ``heartbeat_timeout_s`` (stalled, e.g. SIGSTOP or a wedged driver), a rank stuck in
one step/collective for ``step_timeout_s``, or a rank reporting a fatal error, fails the *group*:
lockstep ranks cannot continue without every peer. Every in-flight request of the group ends
with ``RankFailed`` naming the cause, every pending command fails the same way, the remaining
ranks are killed, ``epoch`` goes up by one, restart listeners hear the new epoch (caches drop
the dead one's GPU block ids; the L1 pool file is kept: ``rank/shm_claim.py``), and a fresh group
is started. It gives up (``FAILED``) when ``rank/restart_budget.py`` says so.

Client: one PUSH socket per rank for commands (sent without blocking from the event loop), one
PULL socket per rank read by one task per rank, and transfers on ``rank/transfer_channel.py``'s
Unix socket once the rank connects. A step message carries all of that rank's outputs for the
step, pushed into the requests' ``RequestStream``s (``rank/wire.py``, ``rank/link.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
import zmq

from rank import wire
from rank.client import GroupState, RequestStream
from rank.config import RankConfig
from rank.engine import CapacityExhausted, EngineMisuse, EngineRequest, EngineStats
from rank.errors import RankFailed, RankUnavailable
from rank.host_budget import host_pool_path, plan_host_pool_bytes, unlink_host_pool
from rank.ids import BlockId, Epoch, HostSlot, Rank
from rank.launch import BACKEND_ROOT, make_run_dir, master_port_for, rank_env, rank_python, worker_argv
from rank.link import RankLink, Tracked, TransferTiming, describe_exit, prefix_cache_support
from rank.restart_budget import RestartBudget
from rank.shm_claim import claim_host_pool, release_host_pool

log = logging.getLogger(__name__)

WATCHDOG_EVERY_S = 0.25
SHUTDOWN_GRACE_S = 5.0
# A rank's fatal report is often a peer's death seen through a collective ("connection reset by
# peer"); for this long a process exit seen meanwhile is named as the cause instead.
FATAL_GRACE_S = 0.5


def _settle(failure: asyncio.Future[str], reason: str) -> None:
    if not failure.done():
        failure.set_result(reason)


class RankGroup:
    """Supervisor + ``RankClient`` of N rank processes (module docstring has the life cycle).

    Invariants: ``state == READY`` exactly while every rank of ``epoch`` has announced itself and
    no failure was seen; every request and command of an epoch is answered or failed before
    ``epoch`` changes; restart listeners run before the next epoch accepts work.
    """

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
        if python is None:
            python = rank_python(config)
        self.python = python
        self.name = name or f"g{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # While a rank loads, one C call (dlopen of libtorch, a weight read, a JIT build) can hold
        # the GIL and delay its heartbeat thread; only a loaded rank is held to the tight bound.
        self.loading_heartbeat_timeout_s = max(loading_heartbeat_timeout_s, heartbeat_timeout_s)
        self.step_timeout_s = step_timeout_s
        self.budget = budget or RestartBudget(max_start_failures=3, max_restarts=5, window_s=600.0)
        self.restart_backoff_s = restart_backoff_s
        self._base_env = dict(os.environ) if base_env is None else dict(base_env)
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
        self._ranks: list[RankLink] = []
        self._listeners: list[Callable[[Epoch], None]] = []
        self._pending: dict[int, tuple[int, asyncio.Future[Any]]] = {}
        self._cids = itertools.count(1)
        self.transfer_log: deque[TransferTiming] = deque(maxlen=4096)  # the latest round trips
        self._failure: asyncio.Future[str] | None = None
        self._state_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self._tmpdir: str | None = None
        self._run_lock = -1
        self._pool_lock = -1  # flock on the host pool file while this group runs (rank/shm_claim.py)
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self.host_pool_path = host_pool_path(self.name)
        if config.l1_cache and config.l1_host_gb > 0:
            self.host_pool_bytes, reason = plan_host_pool_bytes(config.l1_host_gb, self.num_ranks)
            log.info("%s", reason)
        else:
            self.host_pool_bytes = 0

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
        self._tmpdir, self._run_lock = make_run_dir()  # the lock: rank/launch.py
        self._sync_ctx = zmq.Context()
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
            for r in self._ranks:
                with contextlib.suppress(zmq.ZMQError):
                    r.send({"op": "shutdown"})
            procs = [r.proc for r in self._ranks if r.proc is not None]
            started = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), SHUTDOWN_GRACE_S)
            num_exited = sum(p.returncode is not None for p in procs)
            log.info("rank group %s: %d of %d ranks exited on shutdown within %.1fs%s", self.name, num_exited,
                     len(procs), time.monotonic() - started,
                     "" if num_exited == len(procs) else "; killing the rest")
        self._fail_epoch("rank group closed")
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._sync_ctx is not None:
            self._sync_ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            os.close(self._run_lock)
        self._pool_lock = release_host_pool(self.host_pool_path, self._pool_lock)  # after FAILED too
        self._set_state(GroupState.STOPPED)

    def _set_state(self, state: GroupState) -> None:
        self.state = state
        self._state_event.set()

    def _fail_epoch(self, reason: str) -> None:
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(reason)

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
        loop = asyncio.get_running_loop()
        self._failure = failure = loop.create_future()
        if self._closing:  # close() came during a restart's backoff
            return "rank group closed", False
        started = time.monotonic()
        try:
            await self._launch()
        except Exception as exc:  # noqa: BLE001 - e.g. exec failure; reported as the reason
            return f"could not launch ranks: {type(exc).__name__}: {exc}", False
        timeout = self.config.load_timeout_seconds
        while not failure.done() and not all(r.ready for r in self._ranks):
            if time.monotonic() - started > timeout:
                phases = ", ".join(f"rank {r.rank}: {r.phase} {r.progress}".strip() for r in self._ranks)
                return f"ranks not ready within load_timeout_seconds={timeout:g} ({phases})", False
            await asyncio.wait([failure], timeout=0.1)
        if failure.done():
            return failure.result(), False
        infos = [r.ready for r in self._ranks]
        geometry = {(i["block_size"], i["num_blocks"], i["bytes_per_block"], i["num_host_slots"])
                    for i in infos if i}
        if len(geometry) != 1:
            return f"ranks disagree on KV geometry: {sorted(geometry)}", False
        self.block_size, self.num_blocks, self.bytes_per_block, self.num_host_slots = geometry.pop()
        self.prefix_cache_supported, self.prefix_cache_reason = prefix_cache_support(self._ranks)
        if not self.prefix_cache_supported:
            log.warning("rank group %s: prefix cache NOT supported (%s)", self.name, self.prefix_cache_reason)
        log.info(
            "rank group %s epoch %d ready in %.1fs: %d ranks, %d blocks x %d tokens per rank, %d host slots",
            self.name, self.epoch, time.monotonic() - started, self.num_ranks, self.num_blocks,
            self.block_size, self.num_host_slots,
        )
        self._set_state(GroupState.READY)
        return await failure, True

    async def _launch(self) -> None:
        assert self._tmpdir is not None and self._sync_ctx is not None
        config_path = os.path.join(self._tmpdir, f"config-{self.epoch}.json")
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(self.config.to_json()))
        master_port = master_port_for(self.config)
        self._ranks = []
        now = time.monotonic()
        for rank in range(self.num_ranks):
            prefix = f"{self._tmpdir}/e{self.epoch}-r{rank}"
            r = RankLink.bind(self._sync_ctx, rank, f"ipc://{prefix}-cmd", f"ipc://{prefix}-out", now,
                              channel_path=f"{prefix}-x")
            self._ranks.append(r)
            args = worker_argv(self.python, self.config, rank, self.num_ranks, config_path=config_path,
                               cmd_addr=f"ipc://{prefix}-cmd", out_addr=f"ipc://{prefix}-out",
                               channel_addr=f"{prefix}-x", master_port=master_port,
                               host_pool_path=self.host_pool_path, host_pool_bytes=self.host_pool_bytes,
                               parent_pid=os.getpid())
            env = rank_env(self.config, self.num_ranks, rank, master_port, self._base_env)
            r.proc = await asyncio.create_subprocess_exec(
                *args, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, cwd=BACKEND_ROOT,
            )
            log.info("rank group %s epoch %d: started rank %d (pid %d)", self.name, self.epoch, rank,
                     r.proc.pid)
            self._tasks += [
                asyncio.create_task(r.receive(self._on_message)),
                asyncio.create_task(r.accept_channel(self._on_message)),
                asyncio.create_task(self._wait_exit(r)),
                asyncio.create_task(self._forward_stderr(r)),
            ]
        self._tasks.append(asyncio.create_task(self._watchdog()))

    async def _teardown(self, reason: str) -> None:
        detected = time.monotonic()
        if self.state == GroupState.READY or self.state == GroupState.STARTING:
            self._set_state(GroupState.RESTARTING if not self._closing else GroupState.STOPPED)
        error = RankFailed(f"rank group epoch {self.epoch} failed: {reason}")
        num_failed = 0
        for r in self._ranks:
            for req in r.requests.values():
                req.stream.fail(error)
                num_failed += 1
            r.requests.clear()
        for _, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        self.last_detection_s = time.monotonic() - detected
        if num_failed:
            log.warning("rank group %s: failed %d in-flight requests: %s", self.name, num_failed, reason)
        for r in self._ranks:
            if r.proc is not None and r.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.kill()
        for r in self._ranks:
            if r.proc is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.proc.wait(), 10)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for r in self._ranks:
            r.close_sockets()
        if self._closing:  # a restart keeps it: the next epoch's ranks re-map it, never zeroed
            unlink_host_pool(self.host_pool_path)

    # ------------------------------------------------------------------ monitors

    async def _wait_exit(self, r: RankLink) -> None:
        assert r.proc is not None
        code = await r.proc.wait()
        r.exit_code = code
        if not self._closing:
            if r.fatal is not None:  # it said why before it exited
                self._fail_epoch(r.fatal)
                return
            tail = f"; last output: {r.stderr_tail[-1]}" if r.stderr_tail else ""
            self._fail_epoch(f"rank {r.rank} (pid {r.proc.pid}) {describe_exit(code)}{tail}")

    async def _forward_stderr(self, r: RankLink) -> None:
        assert r.proc is not None and r.proc.stderr is not None
        while True:
            line = await r.proc.stderr.readline()
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            r.stderr_tail.append(text)
            log.info("[rank %d] %s", r.rank, text)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_EVERY_S)
            if self._closing:  # close() bounds the shutdown itself; ranks that exited send no heartbeats
                continue
            now = time.monotonic()
            for r in self._ranks:
                silent_s = now - r.last_seen
                limit = self.heartbeat_timeout_s if r.ready else self.loading_heartbeat_timeout_s
                if silent_s > limit:
                    self._fail_epoch(
                        f"rank {r.rank} (pid {r.proc.pid if r.proc else '?'}) stalled: no heartbeat for "
                        f"{silent_s:.1f}s"
                    )
                elif r.busy_s > self.step_timeout_s:
                    self._fail_epoch(f"rank {r.rank} stuck in one step for {r.busy_s:.0f}s (step_timeout_s)")

    def _on_message(self, r: RankLink, frames: list[bytes]) -> None:
        header = orjson.loads(frames[0])
        kind = header["t"]
        if kind == "step":
            r.stats = header["stats"]
            if len(frames) == 4 and frames[1]:
                self._dispatch(r, header, frames)
        elif kind == "hb":
            r.busy_s = header["busy_s"]
            if header["phase"] != r.phase or header["progress"] != r.progress:
                r.phase, r.progress = header["phase"], header["progress"]
                if r.phase != "ready":
                    log.info("rank %d: %s %s", r.rank, r.phase, r.progress)
        elif kind == "reply":
            self._on_reply(r, header)
        elif kind == "reject":
            req = r.requests.pop(header["h"], None)
            if req is not None:
                req.stream.fail(EngineMisuse(header["msg"]))
        elif kind == "ready":
            r.ready, r.stats, r.phase = header, header["stats"], "ready"
        elif kind == "fatal":
            r.fatal = header["msg"]
            failure = self._failure  # this epoch's: the timer must not fail the next one
            if failure is not None and not failure.done():
                asyncio.get_running_loop().call_later(FATAL_GRACE_S, _settle, failure, r.fatal)

    def _dispatch(self, r: RankLink, header: dict[str, Any], frames: list[bytes]) -> None:
        r.dispatch(header, frames)  # a method of its own: bench/reliability/storm.py wraps it

    def _on_reply(self, r: RankLink, header: dict[str, Any]) -> None:
        if "stats" in header:
            r.stats = header["stats"]
        entry = self._pending.pop(header["cid"], None)
        if entry is None or entry[1].done():
            return
        fut = entry[1]
        if header["ok"]:
            header["read"] = time.monotonic()
            fut.set_result(header)
        else:
            exc_type = CapacityExhausted if header["etype"] == "CapacityExhausted" else EngineMisuse
            fut.set_exception(exc_type(header["msg"]))

    # ------------------------------------------------------------------ RankClient

    def _ready_rank(self, rank: int) -> RankLink:
        if self.state != GroupState.READY:
            raise RankUnavailable(f"rank group is {self.state.value}"
                                  + (f" ({self.last_failure})" if self.last_failure else ""))
        if not 0 <= rank < self.num_ranks:
            raise EngineMisuse(f"rank {rank} outside 0..{self.num_ranks - 1}")
        return self._ranks[rank]

    def _send(self, r: RankLink, header: dict[str, Any], *frames: bytes) -> None:
        try:
            r.send(header, *frames)
        except zmq.ZMQError as exc:
            raise RankUnavailable(f"rank {r.rank} is not reachable: {exc}") from None

    def submit(self, rank: Rank, request: EngineRequest) -> RequestStream:
        r = self._ready_rank(rank)
        handle = r.next_handle
        r.next_handle = (handle + 1) & 0x7FFFFFFF
        self._send(r, *wire.encode_add(request, handle))
        stream = RequestStream(request.request_id, rank, self.epoch,
                               lambda: self.abort(rank, request.request_id),
                               num_prompt_tokens=len(request.prompt_ids),
                               num_cached_tokens=request.num_cached_tokens)
        r.requests[handle] = Tracked(stream, request.request_id, stream.push_tokens)
        return stream

    def abort(self, rank: Rank, request_id: str) -> None:
        if self.state != GroupState.READY or not 0 <= rank < self.num_ranks:
            return  # nothing to abort: the epoch's requests are already failed
        with contextlib.suppress(RankUnavailable):
            self._send(self._ranks[rank], {"op": "abort", "rids": [request_id]})

    async def _command(self, rank: int, header: dict[str, Any]) -> Any:
        r = self._ready_rank(rank)
        cid = header["cid"] = next(self._cids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[cid] = (rank, fut)
        sent = time.monotonic()
        try:
            self._send(r, header)
        except RankUnavailable:
            self._pending.pop(cid, None)
            raise
        reply = await fut
        if (timing := TransferTiming.of(header["op"], rank, sent, reply, time.monotonic())) is not None:
            self.transfer_log.append(timing)
        return reply["result"]

    async def release(self, rank: Rank, block_ids: list[BlockId]) -> None:
        await self._command(rank, {"op": "release", "ids": [int(b) for b in block_ids]})

    async def export_blocks(self, rank: Rank, block_ids: list[BlockId], host_slot: HostSlot) -> None:
        await self._command(rank,
                            {"op": "export", "ids": [int(b) for b in block_ids], "slot": int(host_slot)})

    async def import_blocks(self, rank: Rank, host_slot: HostSlot, num_blocks: int) -> list[BlockId]:
        return list(await self._command(rank, {"op": "import", "slot": int(host_slot), "n": int(num_blocks)}))

    def stats(self, rank: Rank) -> EngineStats:
        values = self._ranks[rank].stats if 0 <= rank < len(self._ranks) else None
        if values is None:
            return EngineStats(self.num_blocks, max(0, self.num_blocks - 1), 0, 0, 0, 0, 0, 0, 0)
        return wire.stats_from_list(values)

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
            "ranks": [r.health(now) for r in self._ranks],
        }

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks if r.proc is not None]
