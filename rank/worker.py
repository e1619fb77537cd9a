"""Rank process main: ``python -m rank.worker --rank R --world-size N ...``.

Started by ``RankGroup`` (``rank/launch.py`` builds the command line and environment) with the
engine's interpreter (``<deepinfer_venv>/bin/python`` whenever one is configured, else the
backend's own) and the backend's code on PYTHONPATH.

The process: check the interpreter's version (``--min-python``; 3.12 for DeepInfer, lifted for
the test stand-in named by ``DIB_DEEPINFER_MODULE``, ``rank/rank_setup.py``), start a thread that
exits the process once the backend is gone and one that sends heartbeats from its own socket
every ``HEARTBEAT_S`` (also while the engine loads, with the load phase), build the rank's parts
(``rank/rank_setup.py``: config, host pool, engine, lockstep group, transfer thread), announce
ready and run the loop (``rank/rank_loop.py``) until the group votes to shut down. An exception
anywhere is reported to the supervisor as ``fatal`` before the process exits non-zero; the
process ends with ``os._exit`` once everything is closed (see the end of this module).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from rank.rank_loop import RankLoop
from rank.rank_setup import TEST_DEEPINFER_MODULE_ENV, RankStatus, build_rank

if TYPE_CHECKING:
    import zmq

    Context = zmq.Context[zmq.Socket[bytes]]

MIN_PYTHON = (3, 10)
HEARTBEAT_S = 0.5

log = logging.getLogger("rank.worker")


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the backend that started this rank is gone (SIGKILL, crash, a shutdown
    that never reached us): an orphaned rank would keep its GPU memory and its port. Its own
    thread, independent of the heartbeat socket, so nothing that fails there can stop it."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(HEARTBEAT_S)


def _heartbeat_loop(ctx: Context, out_addr: str, rank: int, status: RankStatus,
                    stop: threading.Event) -> None:
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
    status = RankStatus()
    stop = threading.Event()
    hb = threading.Thread(target=_heartbeat_loop, args=(ctx, args.out_addr, args.rank, status, stop),
                          daemon=True)
    hb.start()
    loop: RankLoop | None = None
    try:
        loop = RankLoop(build_rank(args, ctx, status), status)
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
