"""Rank process main: ``python -m rank.worker --rank R --world-size N ...``.

Started by ``RankGroup`` with the engine's interpreter (``<deepinfer_venv>/bin/python`` for
DeepInfer, the backend's own for the reference engine) and the backend's code on PYTHONPATH.

The loop is lockstep, as DeepInfer's is: each iteration drains commands, then every rank joins a
collective vote (all_reduce MAX of [has_work, shutdown]) and, if any rank has work, every rank
steps: ``step()`` where there is work, ``placeholder_step()`` elsewhere (the reference engine
runs one tiny all_reduce in both, standing in for EP dispatch). A dead or stopped peer therefore
blocks the others in a collective, exactly like production; the supervisor sees the death (exit)
or the stall (no heartbeats) and replaces the whole group.

Engines that can (``concurrent_transfers``: both real engines) get a transfer thread
(``rank/transfers.py``): it takes the command socket, runs L1 imports, exports and releases while
the loop steps, and forwards every other command to the loop, which drains them at step boundaries.

When the whole group is idle, each rank waits up to ``IDLE_POLL_S`` for a command before voting,
so an idle group costs a few collectives per second, not a spinning core. Heartbeats come from a
thread with its own socket every ``HEARTBEAT_S``, also while the engine loads.

Engines that own their lockstep (``owns_lockstep``: DeepInfer) create torch.distributed's default
group themselves while loading, and vote with their own collective. For them the worker creates
no group of its own and runs DeepInfer's loop: ``lockstep_has_work()`` (DeepInfer's
``has_unfinished_requests`` all_reduce) then ``step()`` on every rank (DeepInfer's own placeholder
forward on a rank without work, or its rank-local flush when the group is idle). Shutdown cannot
ride in that vote, so the ranks agree on it with a separate 1-int gloo all_reduce on a group of
their own (``new_group`` over DeepInfer's default group, so it never interleaves with DeepInfer's
traffic), run only in iterations that the vote found idle group-wide (the vote's result is the
same on every rank, so every rank joins it; a busy group pays nothing). A ``shutdown`` command
aborts the rank's requests and mutes its outputs, so the group drains to idle within a few steps
and every rank leaves the loop in the same iteration, then DeepInfer's ``close()`` runs its
collective barriers on all ranks together. If that does not happen within the supervisor's grace
period (a wedged rank), the supervisor SIGKILLs the group, as it does on any failure.

TESTS ONLY: ``DIB_DEEPINFER_MODULE`` (see ``TEST_DEEPINFER_MODULE_ENV``) makes engine 'deepinfer'
import that module's ``deepinfer_api()`` instead of DeepInfer (``standins.fake_deepinfer_lockstep``:
the CI stand-in as a multi-process group), and lifts the Python 3.12 requirement DeepInfer has.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from rank import step_profile, transfers
from rank.config import RankConfig

if TYPE_CHECKING:
    import zmq
    from torch.distributed import ProcessGroup

    from rank.engine import EngineStats

    Context = zmq.Context[zmq.Socket[bytes]]

MIN_PYTHON = (3, 10)
TEST_DEEPINFER_MODULE_ENV = "DIB_DEEPINFER_MODULE"  # tests only: a stand-in for DeepInfer's Python API
HEARTBEAT_S = 0.5
IDLE_POLL_S = 0.02
STATS_EVERY_S = 0.1

log = logging.getLogger("rank.worker")


class _Status:
    """What the heartbeat thread reports (written by the main thread; reads are racy by design:
    a heartbeat only needs a recent value)."""

    __slots__ = ("phase", "progress", "step_started", "num_steps")

    def __init__(self) -> None:
        self.phase = "starting"
        self.progress = ""
        self.step_started = 0.0  # monotonic time the current step/vote began, 0 when not in one
        self.num_steps = 0


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the backend that started this rank is gone (SIGKILL, crash, a shutdown
    that never reached us): an orphaned rank would keep its GPU memory and its port. Its own
    thread, independent of the heartbeat socket, so nothing that fails there can stop it."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(HEARTBEAT_S)


def _heartbeat_loop(ctx: Context, out_addr: str, rank: int, status: _Status, stop: threading.Event) -> None:
    import orjson
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(out_addr)
    try:
        while not stop.wait(HEARTBEAT_S):
            started = status.step_started
            busy_s = time.monotonic() - started if started else 0.0
            msg = {"t": "hb", "rank": rank, "pid": os.getpid(), "phase": status.phase,
                   "progress": status.progress, "busy_s": busy_s, "steps": status.num_steps}
            try:
                sock.send(orjson.dumps(msg), zmq.NOBLOCK)
            except zmq.Again:  # no peer right now (the backend is reconnecting or going away)
                continue
    except zmq.ZMQError:  # the context is terminated under us at exit
        pass
    finally:
        sock.close(0)


def _load_config(path: str) -> RankConfig:
    """The ``RankConfig`` the supervisor wrote (validated by the backend, resolved there)."""
    import orjson

    with open(path, "rb") as f:
        return RankConfig.from_json(orjson.loads(f.read()))


class RankLoop:
    """One rank: engine + sockets + the lockstep loop. Not thread-safe (main thread only; the
    transfer thread, if any, shares only the engine and the counters it documents)."""

    def __init__(self, args: argparse.Namespace, ctx: Context, status: _Status) -> None:
        import torch
        import torch.distributed as dist
        import zmq

        self.args, self.status = args, status
        self.torch = torch
        self.rank = args.rank
        self.zmq = zmq
        self.cmd = ctx.socket(zmq.PULL)
        self.cmd.connect(args.cmd_addr)
        self.out = ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(args.out_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.cmd, zmq.POLLIN)
        config = _load_config(args.config)
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        host_pool = None
        if args.host_pool_path and args.host_pool_bytes > 0:
            from rank.host_pool import HostPool

            # Pinned in the background: a restart is ready in seconds, not minutes (rank/host_pool.py).
            host_pool = HostPool(args.host_pool_path, args.host_pool_bytes, background_pin=True)
        status.phase, status.progress = "loading", f"building {config.engine} engine"
        from rank import rendezvous
        from rank.engines import make_engine

        rendezvous.install()  # before DeepInfer builds its group: the store binds MASTER_ADDR only

        stand_in = None
        if config.engine == "deepinfer":
            stand_in = os.environ.get(TEST_DEEPINFER_MODULE_ENV) or None
        self.engine = make_engine(config, self.rank, host_pool, deepinfer_module=stand_in)
        bytes_per_block = self.engine.bytes_per_block
        if host_pool is not None and not host_pool.is_open and bytes_per_block:
            host_pool.open(bytes_per_block)
        self.host_pool = host_pool
        status.progress = "joining the rank group"
        self.dist = dist
        self.owns_lockstep = self.engine.owns_lockstep
        self.control_group: ProcessGroup | None = None
        if self.owns_lockstep:
            # DeepInfer built its default group while loading; ours would collide with it.
            if not dist.is_initialized():
                raise RuntimeError(f"engine {config.engine!r} owns the lockstep but created no "
                                   "torch.distributed group")
            if dist.get_world_size() != args.world_size:
                raise RuntimeError(f"engine's group has {dist.get_world_size()} ranks, the supervisor "
                                   f"started {args.world_size}")
            self.control_group = dist.new_group(backend="gloo")  # collective: every rank, same point
            self.engine.group_min = self._group_min
        else:
            # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): ranks that share GPUs
            # (fewer visible than ranks, e.g. bench.multi_gpu_run --gpus 1) vote over gloo.
            use_nccl = (config.engine == "reference" and config.uses_gpu
                        and torch.cuda.device_count() >= args.world_size)
            dist.init_process_group(
                "nccl" if use_nccl else "gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                rank=self.rank, world_size=args.world_size,
            )
            if use_nccl:
                torch.cuda.set_device(0)
        self.vote_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.vote = torch.zeros(2, dtype=torch.int32, device=self.vote_device)
        self._tick = torch.zeros(1, dtype=torch.int32, device=self.vote_device)
        if not self.owns_lockstep:
            self.engine.step_collective = lambda: dist.all_reduce(self._tick)
        self.handles: dict[str, int] = {}
        self.shutdown = False
        self.stats_sent_at = 0.0
        self.stats_last: list[int] = []
        self.transfers_seen = 0  # the transfer thread's replies counted at the last periodic stats
        from rank import wire

        self.wire = wire
        self.profile = step_profile.from_environment(self.rank)  # benchmarks only (DIB_RANK_PROFILE)
        self.profile.wrap_engine_step(self.engine)
        if os.environ.get(transfers.GATE_ENV):  # tests only
            self.engine.step = transfers.gated(self.engine.step)  # type: ignore[method-assign]
        # Restores and writes beside the step in progress (rank/transfers.py): the thread takes
        # the backend's command socket and forwards the rest to ``self.cmd``, now its inproc end.
        self.transfers: transfers.TransferThread | None = None
        if transfers.enabled(self.engine):
            forwarded = ctx.socket(zmq.PULL)
            forwarded.setsockopt(zmq.RCVHWM, 0)
            forwarded.bind(transfers.FORWARD_ADDR)
            self.transfers = transfers.TransferThread(ctx, self.cmd, args.out_addr, self.engine,
                                                      self.engine.stats(), args.channel_addr)
            self.poller.unregister(self.cmd)
            self.cmd = forwarded
            self.poller.register(self.cmd, zmq.POLLIN)

    def _group_min(self, values: list[int]) -> list[int]:
        """``Engine.group_min``: all_reduce MIN on the side group (engines that own the lockstep)."""
        t = self.torch.tensor(values, dtype=self.torch.int32)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.control_group)
        return [int(v) for v in t.tolist()]

    def send(self, frames: list[bytes]) -> None:
        self.out.send_multipart(frames)

    def announce_ready(self) -> None:
        e = self.engine
        pool = self.host_pool
        self.send(self.wire.pack({
            "t": "ready", "rank": self.rank, "pid": os.getpid(), "block_size": e.block_size,
            "num_blocks": e.num_blocks, "bytes_per_block": e.bytes_per_block,
            "num_host_slots": pool.num_slots if pool is not None and pool.is_open else 0,
            "python": sys.version.split()[0], "stats": self.wire.stats_list(e.stats()),
            "prefix_cache_supported": e.prefix_cache_supported,
            "prefix_cache_reason": e.prefix_cache_reason,
        }))
        self.status.phase, self.status.progress = "ready", ""

    def run(self) -> None:
        if self.owns_lockstep:
            self._run_engine_lockstep()
            return
        group_busy = False
        if self.transfers is not None:
            self.transfers.start()
        while True:
            if self.transfers is not None:
                self.transfers.check()
            self._drain(0.0 if group_busy or self.engine.has_work() else IDLE_POLL_S)
            has_work = self.engine.has_work()
            self.status.step_started = time.monotonic()
            self.vote[0] = int(has_work)
            self.vote[1] = int(self.shutdown)
            self.dist.all_reduce(self.vote, op=self.dist.ReduceOp.MAX)
            votes = self.vote.tolist()
            if votes[1]:
                return
            group_busy = votes[0] > 0
            if group_busy:
                if has_work:
                    outputs = self.engine.step()
                    self.status.num_steps += 1
                    if outputs:
                        self.send(self.wire.encode_step(outputs, self.handles, self._stats()))
                        self.stats_sent_at = time.monotonic()
                else:
                    self.engine.placeholder_step()
            self.status.step_started = 0.0
            self._maybe_send_stats()

    def _stats(self) -> EngineStats:
        """``engine.stats()``, also left for the transfer thread's replies."""
        stats = self.engine.stats()
        if self.transfers is not None:
            self.transfers.last_stats = stats
        return stats

    def _maybe_send_stats(self) -> None:
        if time.monotonic() - self.stats_sent_at > STATS_EVERY_S:
            current = self._stats()
            stats = self.wire.stats_list(current)
            # A transfer reply may overtake a step message sent before it (two sockets), leaving
            # the backend with older counts: resend after any, so they settle within an interval.
            num_transfers = self.transfers.num_transfers if self.transfers is not None else 0
            if stats != self.stats_last or num_transfers != self.transfers_seen:
                self.send(self.wire.encode_step([], self.handles, current))  # idle: else quiet
                self.stats_last = stats
                self.transfers_seen = num_transfers
            self.stats_sent_at = time.monotonic()

    def _run_engine_lockstep(self) -> None:
        """DeepInfer's loop (module docstring): the engine's vote, its step, our idle-time shutdown vote."""
        engine, prof = self.engine, self.profile
        flag = self.torch.zeros(1, dtype=self.torch.int32)
        busy = False
        if self.transfers is not None:
            self.transfers.start()
        while True:
            if self.transfers is not None:
                self.transfers.check()
            idle = not (busy or engine.has_work())
            if idle:
                self._drain(IDLE_POLL_S)
            prof.begin()  # (an idle wait is not part of a step)
            if not idle:
                self._drain(0.0)
            prof.lap(step_profile.DRAIN)
            self.status.step_started = time.monotonic()
            busy = engine.lockstep_has_work()  # the collective: every rank, every iteration
            prof.lap(step_profile.VOTE)
            outputs = engine.step()
            prof.lap(step_profile.ADAPTER)
            if busy:
                self.status.num_steps += 1
            if outputs and not self.shutdown:  # after shutdown the backend fails its streams itself
                stats = self._stats()
                prof.lap(step_profile.STATS)
                frames = self.wire.encode_step(outputs, self.handles, stats)
                prof.lap(step_profile.ENCODE)
                self.send(frames)
                prof.lap(step_profile.SEND)
                self.stats_sent_at = time.monotonic()
            if not engine.group_had_work:  # idle on every rank alike: all of them join this one
                flag[0] = int(self.shutdown)
                self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.control_group)
                if int(flag[0]):
                    return
            self.status.step_started = 0.0
            self._maybe_send_stats()
            prof.end(engine.group_had_work, outputs)

    def _drain(self, timeout_s: float) -> None:
        zmq, cmd = self.zmq, self.cmd
        if timeout_s > 0 and not self.poller.poll(int(timeout_s * 1000)):
            return
        # Ask zmq whether a message is queued (cheap) rather than let a recv raise zmq.Again: a
        # busy rank drains every step, nearly always finding nothing.
        while cmd.get(zmq.EVENTS) & zmq.POLLIN:
            reply = self._handle(cmd.recv_multipart(zmq.NOBLOCK), time.monotonic())
            if self.transfers is not None:  # before the reply: the backend may act on it at once
                self.transfers.applied += 1
            if reply is not None:
                self.send(self.wire.pack(reply))

    def _handle(self, frames: list[bytes], received: float) -> dict[str, Any] | None:
        """Apply one command (``received``: when it left the socket); the reply to send, if any."""
        from rank.engine import EngineMisuse

        header = self.wire.unpack_header(frames[0])
        op = header["op"]
        if op == "add":
            try:
                request = self.wire.decode_add(header, frames[1])
                self.engine.add(request)
                self.handles[request.request_id] = header["h"]
            except Exception as exc:  # noqa: BLE001 - one bad request is refused alone, never the rank
                etype = "EngineMisuse" if isinstance(exc, EngineMisuse) else "InvalidCommand"
                if etype != "EngineMisuse":
                    log.warning("rank %d: add refused: %s", self.rank, traceback.format_exc())
                return {"t": "reject", "h": header.get("h"), "etype": etype, "msg": str(exc)}
            return None
        if op == "abort":
            self.engine.abort(header["rids"])
            return None
        if op == "shutdown":
            self.shutdown = True
            if self.owns_lockstep:  # let the group drain to idle, where the ranks agree to stop
                self.engine.abort(list(self.handles))
            return None
        reply = transfers.run_command(self.engine, header, received)  # release, export, import
        reply["stats"] = self.wire.stats_list(self._stats())
        return reply

    def close(self) -> None:
        self.profile.write()
        if self.transfers is not None:
            self.transfers.stop()  # after the transfer in progress: the engine's pool goes next
        self.engine.close()
        if self.host_pool is not None:
            self.host_pool.close()
        with contextlib.suppress(Exception):  # best effort at exit
            self.dist.destroy_process_group()
        self.cmd.close(0)
        self.out.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rank.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--config", required=True, help="workload config JSON file")
    p.add_argument("--cmd-addr", required=True)
    p.add_argument("--out-addr", required=True)
    p.add_argument("--channel-addr", default="", help="the transfer channel's Unix socket path")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--host-pool-path", default="")
    p.add_argument("--host-pool-bytes", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--min-python", default="")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="the supervisor's pid: the rank exits when it is no longer its parent (default: the "
                        "parent at start)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent_pid = args.parent_pid or os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="exit-with-parent",
                     daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"rank{args.rank} %(levelname)s %(name)s: %(message)s")
    import zmq

    ctx = zmq.Context()
    need = MIN_PYTHON
    if args.min_python:
        need = tuple(int(x) for x in args.min_python.split("."))  # type: ignore[assignment]
    if os.environ.get(TEST_DEEPINFER_MODULE_ENV):  # the stand-in runs on any supported Python
        log.warning("rank %d: %s=%s: TEST stand-in, not DeepInfer", args.rank, TEST_DEEPINFER_MODULE_ENV,
                    os.environ[TEST_DEEPINFER_MODULE_ENV])
        need = MIN_PYTHON
    if sys.version_info[: len(need)] < need:
        msg = (f"rank {args.rank}: Python {sys.version.split()[0]} at {sys.executable} is too old; "
               f"need {'.'.join(map(str, need))}+")
        _send_fatal(ctx, args.out_addr, msg)
        return 2
    status = _Status()
    stop = threading.Event()
    hb = threading.Thread(target=_heartbeat_loop, args=(ctx, args.out_addr, args.rank, status, stop),
                          daemon=True)
    hb.start()
    loop: RankLoop | None = None
    try:
        loop = RankLoop(args, ctx, status)
        loop.announce_ready()
        loop.run()
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the supervisor, then exit non-zero
        log.error("rank %d failed: %s", args.rank, traceback.format_exc())
        _send_fatal(ctx, args.out_addr, f"rank {args.rank}: {type(exc).__name__}: {exc}")
        return 1
    finally:
        stop.set()
        if loop is not None:
            loop.close()
        hb.join(timeout=2)
        ctx.destroy(linger=1000)


def _send_fatal(ctx: Context, out_addr: str, msg: str) -> None:
    import orjson
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(out_addr)
    sock.send_multipart([orjson.dumps({"t": "fatal", "msg": msg})])
    sock.close()


if __name__ == "__main__":
    exit_code = main()
    # Everything that matters is closed by now (engine, group, sockets after their linger, the
    # L1 mapping). Skip the interpreter's teardown of torch & co: on a loaded host it took
    # seconds (measured 1.5-4 s), long enough to overrun the supervisor's shutdown grace.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
