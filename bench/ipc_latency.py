"""Where a command round trip's fixed time goes: zmq (as the backend and a rank use it) against a
Unix socket, with the receiving process idle or busy (small restores).

    python -m bench.ipc_latency                          # both transports, child idle and busy
    python -m bench.ipc_latency --busy torch --pings 2000
    python -m bench.ipc_latency --quick                  # 20 pings, child idle and running Python

The parent plays the backend: an asyncio loop that sends a command, wakes on the reply's file
descriptor (``loop.add_reader``, as ``rank/link.py`` does) and resumes the awaiting coroutine.
The child plays a rank: a thread that waits for commands (``zmq.Poller`` with a 50 ms timeout, as
``rank/transfers.py``; or a blocking ``recv`` on the Unix socket) and replies at once with when
it took the command, while its main thread is idle, runs Python (holds the GIL, as the loop
thread's bookkeeping does) or launches small torch ops (``torch``: on CUDA when there is one).
Pings are spaced by a random 1-9 ms gap, so the cores go idle between them as between restores.

Printed, not asserted: per transport and busy mode, the p50 / p95 in ms of to the child (send to
the child's receive), back (the child's send to the parent's read) and resume (the read to the
coroutine running again), both ends on ``time.monotonic()`` (system-wide on Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench.multi_gpu.analysis import nearest_rank
from bench.support.quick import add_quick

PING = struct.Struct("<dd")  # (sent, child received); the child answers (received, replied)


# ------------------------------------------------------------------ child (the rank's side)

def _busy(kind: str, stop: threading.Event) -> None:
    if kind == "python":
        while not stop.is_set():
            sum(i * i for i in range(2000))
    elif kind == "torch":
        import torch

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        a = torch.randn(512, 512, device=dev)
        while not stop.is_set():
            for _ in range(50):
                a = torch.tanh(a @ a * 1e-3)
            a.sum().item()  # a sync, as a step's sampled ids are read back


def child(transport: str, addr: str, busy: str) -> None:
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(busy, stop), daemon=True)
    worker.start()
    if transport == "zmq":
        import zmq

        ctx = zmq.Context()
        cmd = ctx.socket(zmq.PULL)
        cmd.connect(f"ipc://{addr}-cmd")
        out = ctx.socket(zmq.PUSH)
        out.connect(f"ipc://{addr}-out")
        while True:
            if not cmd.poll(50):
                continue
            frame = cmd.recv()
            received = time.monotonic()
            if not frame:
                break
            out.send(PING.pack(received, time.monotonic()))
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(addr)
        while True:
            frame = sock.recv(64)
            received = time.monotonic()
            if not frame or frame == b"stop":
                break
            sock.send(PING.pack(received, time.monotonic()))
    stop.set()
    worker.join()


# ------------------------------------------------------------------ parent (the backend's side)

async def _pings(send: Any, read: Any, fd: int, pings: int) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    phases: dict[str, list[float]] = {"to": [], "back": [], "resume": []}
    waiter: asyncio.Future[tuple[bytes, float]] | None = None

    def on_readable() -> None:
        while True:
            frame = read()
            if frame is None:
                return
            if waiter is not None and not waiter.done():
                waiter.set_result((frame, time.monotonic()))

    loop.add_reader(fd, on_readable)
    try:
        for i in range(pings + 50):
            await asyncio.sleep(random.uniform(0.001, 0.009))
            waiter = loop.create_future()
            sent = time.monotonic()
            send(PING.pack(sent, 0.0))
            frame, got = await waiter
            resumed = time.monotonic()
            received, replied = PING.unpack(frame)
            if i >= 50:  # warm-up left out
                phases["to"].append(received - sent)
                phases["back"].append(got - replied)
                phases["resume"].append(resumed - got)
    finally:
        loop.remove_reader(fd)
    return phases


def parent(transport: str, busy: str, pings: int) -> dict[str, list[float]]:
    addr = os.path.join(tempfile.gettempdir(), f"dib-ipc-{os.getpid()}-{transport}-{busy}")
    cmd_args = [sys.executable, "-m", "bench.ipc_latency", "--child", transport, "--addr", addr,
                "--busy", busy]
    if transport == "zmq":
        import zmq

        ctx = zmq.Context()
        cmd = ctx.socket(zmq.PUSH)
        cmd.bind(f"ipc://{addr}-cmd")
        out = ctx.socket(zmq.PULL)
        out.bind(f"ipc://{addr}-out")
        proc = subprocess.Popen(cmd_args)

        def read_zmq() -> bytes | None:
            try:
                return out.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None

        try:
            return asyncio.run(_pings(cmd.send, read_zmq, out.getsockopt(zmq.FD), pings))
        finally:
            cmd.send(b"")
            proc.wait(10)
            ctx.destroy(0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(addr)
    listener.listen(1)
    proc = subprocess.Popen(cmd_args)
    conn, _ = listener.accept()
    conn.setblocking(False)

    def read_uds() -> bytes | None:
        try:
            return conn.recv(64)
        except BlockingIOError:
            return None

    try:
        return asyncio.run(_pings(conn.send, read_uds, conn.fileno(), pings))
    finally:
        conn.send(b"stop")
        proc.wait(10)
        conn.close()
        listener.close()
        os.unlink(addr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pings", type=int, default=1000)
    ap.add_argument("--transports", default="zmq,uds")
    ap.add_argument("--busy", default="none,python,torch",
                    help="the child's main thread: none, python, torch")
    ap.add_argument("--child", choices=["zmq", "uds"], help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    add_quick(ap, argv, pings=20, busy="none,python")
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.addr, args.busy)
        return
    print(f"{'transport':>9} {'child':>7} | ms p50 / p95:    to child          back        resume  sum p50")
    for busy in args.busy.split(","):
        for transport in args.transports.split(","):
            ph = parent(transport, busy, args.pings)
            cells = [f"{nearest_rank(ph[k], 0.5) * 1e3:5.3f} / {nearest_rank(ph[k], 0.95) * 1e3:5.3f}"
                     for k in ("to", "back", "resume")]
            total = sum(nearest_rank(ph[k], 0.5) for k in ph) * 1e3
            print(f"{transport:>9} {busy:>7} | {'':12}{cells[0]:>13} {cells[1]:>13} {cells[2]:>13} "
                  f"{total:8.3f}", flush=True)


if __name__ == "__main__":
    main()
