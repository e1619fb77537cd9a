"""A rank never outlives its backend: after the backend dies (SIGKILL, crash, a shutdown that
closed its sockets first) the rank processes exit by themselves, so they free their GPU memory and
ports. Seen in development: rank processes orphaned for 80 minutes after their backend died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from rank import worker
from rank.rank_setup import RankStatus

ROOT = Path(__file__).resolve().parents[2]


class _FlakySocket:
    """A PUSH socket with no peer for its first sends (zmq.Again), as when the backend is gone."""

    def __init__(self, stop: threading.Event, again: int) -> None:
        self.stop, self.again, self.num_sends = stop, again, 0

    def setsockopt(self, *_: Any) -> None: ...
    def connect(self, _: str) -> None: ...
    def close(self, *_: Any) -> None: ...

    def send(self, _: bytes, __: int = 0) -> None:
        self.num_sends += 1
        if self.num_sends <= self.again:
            raise zmq.Again()
        self.stop.set()


class _Ctx:
    def __init__(self, sock: _FlakySocket) -> None:
        self.sock = sock

    def socket(self, _: int) -> _FlakySocket:
        return self.sock


def test_rank_heartbeat_survives_sends_without_a_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Red before: the first zmq.Again ended the heartbeat thread (and with it the only orphan
    check), so a rank whose backend went away kept running."""
    monkeypatch.setattr(worker, "HEARTBEAT_S", 0.001)
    stop = threading.Event()
    sock = _FlakySocket(stop, again=2)
    t = threading.Thread(target=worker._heartbeat_loop,
                         args=(_Ctx(sock), "ipc:///nowhere", 0, RankStatus(), stop))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert sock.num_sends == 3, "the loop must keep sending after a send found no peer"


_BACKEND = textwrap.dedent("""
    import asyncio, sys, time
    from rank.group import RankGroup
    from server.config import WorkloadConfig

    async def main():
        group = RankGroup(WorkloadConfig(reference_model="null", ep=2, block_size=16, reference_num_blocks=64,
                                         max_num_batched_tokens=256, l1_host_gb=0).rank_config())
        await group.start()
        print("PIDS", *[r.proc.pid for r in group.links], flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (already exited, not yet reaped by init) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(180)
def test_rank_processes_exit_when_their_backend_is_sigkilled() -> None:
    backend = subprocess.Popen([sys.executable, "-c", _BACKEND], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = backend.stdout.readline() if backend.stdout else ""
            assert line or backend.poll() is None, "the backend exited before its ranks were ready"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        backend.send_signal(signal.SIGKILL)
        backend.wait()
        deadline = time.monotonic() + 60  # a liveness bound, not a measurement
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"rank processes {left} outlived their backend"
    finally:
        if backend.poll() is None:
            backend.kill()
            backend.wait()
        if backend.stdout is not None:
            backend.stdout.close()
