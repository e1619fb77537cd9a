"""``RankProcesses``: the rank processes of a ``RankGroup``, one epoch at a time (supervision).

``launch`` starts ``num_ranks`` ``python -m rank.worker`` processes (``rank/launch.py``: only the
environment a rank needs, the config file without secrets, its sockets in a private run
directory) and binds the backend's end of each (``RankLink``, ``rank/link.py``). Then it
watches them and settles the epoch's ``failure`` future with the first cause it sees:

* a process exit (named by its signal or code and its last stderr line; a rank that reported a
  fatal error before it exited is failed with its own report);
* no heartbeat for ``heartbeat_timeout_s`` once loaded (``loading_heartbeat_timeout_s`` while it
  loads: one C call can hold the GIL for long then), e.g. SIGSTOP or a wedged driver;
* one step or collective running longer than ``step_timeout_s``;
* a rank's ``fatal`` report, after ``FATAL_GRACE_S`` unless a process exit is seen first: a
  survivor's "connection reset by peer" from gloo must not hide the peer's SIGKILL as the cause.

``stop`` asks the ranks to shut down together (their shutdown vote) and waits up to
``SHUTDOWN_GRACE_S``; ``reap`` SIGKILLs whatever is left, waits for every process and closes the
epoch's sockets. What the failure means for requests and the next epoch is ``RankGroup``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from typing import Any

import orjson
import zmq

from rank.config import RankConfig
from rank.ids import Epoch
from rank.launch import BACKEND_ROOT, make_run_dir, master_port_for, rank_env, worker_argv
from rank.link import OnMessage, RankLink, describe_exit, prefix_cache_support

log = logging.getLogger(__name__)

WATCHDOG_EVERY_S = 0.25
SHUTDOWN_GRACE_S = 5.0
# A rank's fatal report is often a peer's death seen through a collective ("connection reset by
# peer"); for this long a process exit seen meanwhile is named as the cause instead.
FATAL_GRACE_S = 0.5

Geometry = tuple[int, int, int, int]  # block_size, num_blocks, bytes_per_block, num_host_slots


def _settle(failure: asyncio.Future[str], reason: str) -> None:
    if not failure.done():
        failure.set_result(reason)


class RankProcesses:
    """Launches, watches and stops one epoch of rank processes at a time (module docstring).

    ``links`` are the current epoch's ranks; ``failure`` resolves with the epoch's first failure.
    ``closing`` (set by ``stop``) silences the watchers: ranks that exit on shutdown are no failure.
    """

    def __init__(self, config: RankConfig, num_ranks: int, *, python: str, name: str,
                 host_pool_path: str, host_pool_bytes: int, base_env: dict[str, str],
                 heartbeat_timeout_s: float, loading_heartbeat_timeout_s: float,
                 step_timeout_s: float) -> None:
        self.config = config
        self.num_ranks = num_ranks
        self.python = python
        self.name = name
        self.host_pool_path = host_pool_path
        self.host_pool_bytes = host_pool_bytes
        self.base_env = base_env
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.loading_heartbeat_timeout_s = loading_heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        self.links: list[RankLink] = []
        self.failure: asyncio.Future[str] | None = None
        self.closing = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._run_dir: str | None = None
        self._run_lock = -1
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None

    # ------------------------------------------------------------------ across epochs

    def open(self) -> None:
        """The run directory (sockets, config; locked: ``rank/launch.py``) and the zmq context."""
        self.closing = False
        self._run_dir, self._run_lock = make_run_dir()
        self._ctx = zmq.Context()

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            os.close(self._run_lock)
            self._run_dir = None

    def new_failure(self) -> asyncio.Future[str]:
        """The next epoch's failure future (before it launches: ``fail`` may come meanwhile)."""
        self.failure = asyncio.get_running_loop().create_future()
        return self.failure

    def fail(self, reason: str) -> None:
        """Fail the current epoch (the first reason wins)."""
        if self.failure is not None and not self.failure.done():
            self.failure.set_result(reason)

    # ------------------------------------------------------------------ one epoch

    async def launch(self, epoch: Epoch, on_message: OnMessage) -> None:
        """Start every rank of ``epoch`` and its watchers; ``on_message`` gets what they send."""
        assert self._run_dir is not None and self._ctx is not None
        config_path = os.path.join(self._run_dir, f"config-{epoch}.json")
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(self.config.to_json()))
        master_port = master_port_for(self.config)
        self.links = []
        now = time.monotonic()
        for rank in range(self.num_ranks):
            prefix = f"{self._run_dir}/e{epoch}-r{rank}"
            r = RankLink.bind(self._ctx, rank, f"ipc://{prefix}-cmd", f"ipc://{prefix}-out", now,
                              channel_path=f"{prefix}-x")
            self.links.append(r)
            args = worker_argv(self.python, self.config, rank, self.num_ranks, config_path=config_path,
                               cmd_addr=f"ipc://{prefix}-cmd", out_addr=f"ipc://{prefix}-out",
                               channel_addr=f"{prefix}-x", master_port=master_port,
                               host_pool_path=self.host_pool_path, host_pool_bytes=self.host_pool_bytes,
                               parent_pid=os.getpid())
            env = rank_env(self.config, self.num_ranks, rank, master_port, self.base_env)
            r.proc = await asyncio.create_subprocess_exec(
                *args, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, cwd=BACKEND_ROOT,
            )
            log.info("rank group %s epoch %d: started rank %d (pid %d)", self.name, epoch, rank, r.proc.pid)
            self._tasks += [
                asyncio.create_task(r.receive(on_message)),
                asyncio.create_task(r.accept_channel(on_message)),
                asyncio.create_task(self._wait_exit(r)),
                asyncio.create_task(self._forward_stderr(r)),
            ]
        self._tasks.append(asyncio.create_task(self._watchdog()))

    async def wait_loaded(self, started: float) -> str | None:
        """Wait until every rank is ready; the reason it never will be (a failure, the load
        timeout), or None."""
        failure = self.failure
        assert failure is not None
        timeout = self.config.load_timeout_seconds
        while not failure.done() and not all(r.ready for r in self.links):
            if time.monotonic() - started > timeout:
                phases = ", ".join(f"rank {r.rank}: {r.phase} {r.progress}".strip() for r in self.links)
                return f"ranks not ready within load_timeout_seconds={timeout:g} ({phases})"
            await asyncio.wait([failure], timeout=0.1)
        return failure.result() if failure.done() else None

    def geometry(self) -> Geometry | str:
        """The KV geometry every ready rank reported, or why there is none."""
        geometry = {(i["block_size"], i["num_blocks"], i["bytes_per_block"], i["num_host_slots"])
                    for i in (r.ready for r in self.links) if i}
        if len(geometry) != 1:
            return f"ranks disagree on KV geometry: {sorted(geometry)}"
        return geometry.pop()

    def prefix_cache_support(self) -> tuple[bool, str | None]:
        return prefix_cache_support(self.links)

    def on_status(self, r: RankLink, header: dict[str, Any]) -> None:
        """A rank's ``hb``, ``ready`` or ``fatal`` message."""
        kind = header["t"]
        if kind == "hb":
            r.busy_s = header["busy_s"]
            if header["phase"] != r.phase or header["progress"] != r.progress:
                r.phase, r.progress = header["phase"], header["progress"]
                if r.phase != "ready":
                    log.info("rank %d: %s %s", r.rank, r.phase, r.progress)
        elif kind == "ready":
            r.ready, r.stats, r.phase = header, header["stats"], "ready"
        elif kind == "fatal":
            r.fatal = header["msg"]
            failure = self.failure  # this epoch's: the timer must not fail the next one
            if failure is not None and not failure.done():
                asyncio.get_running_loop().call_later(FATAL_GRACE_S, _settle, failure, r.fatal)

    async def stop(self) -> None:
        """Ask every rank to shut down (they vote to leave together) and wait up to
        ``SHUTDOWN_GRACE_S``; from now on an exit is no failure."""
        self.closing = True
        for r in self.links:
            with contextlib.suppress(zmq.ZMQError):
                r.send({"op": "shutdown"})
        procs = [r.proc for r in self.links if r.proc is not None]
        started = time.monotonic()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), SHUTDOWN_GRACE_S)
        num_exited = sum(p.returncode is not None for p in procs)
        log.info("rank group %s: %d of %d ranks exited on shutdown within %.1fs%s", self.name, num_exited,
                 len(procs), time.monotonic() - started,
                 "" if num_exited == len(procs) else "; killing the rest")

    async def reap(self) -> None:
        """SIGKILL every rank still running, wait for all of them, stop the watchers, close the sockets."""
        for r in self.links:
            if r.proc is not None and r.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.kill()
        for r in self.links:
            if r.proc is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.proc.wait(), 10)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for r in self.links:
            r.close_sockets()

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.links if r.proc is not None]

    # ------------------------------------------------------------------ watchers

    async def _wait_exit(self, r: RankLink) -> None:
        assert r.proc is not None
        code = await r.proc.wait()
        r.exit_code = code
        if not self.closing:
            if r.fatal is not None:  # it said why before it exited
                self.fail(r.fatal)
                return
            tail = f"; last output: {r.stderr_tail[-1]}" if r.stderr_tail else ""
            self.fail(f"rank {r.rank} (pid {r.proc.pid}) {describe_exit(code)}{tail}")

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
            if self.closing:  # stop() bounds the shutdown itself; ranks that exited send no heartbeats
                continue
            now = time.monotonic()
            for r in self.links:
                silent_s = now - r.last_seen
                limit = self.heartbeat_timeout_s if r.ready else self.loading_heartbeat_timeout_s
                if silent_s > limit:
                    self.fail(
                        f"rank {r.rank} (pid {r.proc.pid if r.proc else '?'}) stalled: no heartbeat for "
                        f"{silent_s:.1f}s"
                    )
                elif r.busy_s > self.step_timeout_s:
                    self.fail(f"rank {r.rank} stuck in one step for {r.busy_s:.0f}s (step_timeout_s)")
