"""One rank process as the backend sees it (``RankLink``), and the receive path from it.

``RankProcesses`` (``rank/rank_processes.py``) keeps one ``RankLink`` per rank of the current
epoch: its two sockets and its transfer channel (all closed at teardown), its process, what it
last reported, and the requests in flight on it (``Tracked``, by the handle the backend gave the
request; ``rank/rank_messages.py`` adds and removes them).

Receive path (the backend's hottest loop: one message per rank per engine step, one output per
running request in it). The task sleeps until the socket's file descriptor is readable (one
``loop.add_reader`` wakeup), then takes every queued message with non-blocking ``recv`` calls
until ``zmq.Again``: no future, no await and no poller bookkeeping per message (an awaited
``zmq.asyncio`` ``recv_multipart`` per message cost 4-5x as much). After ``DRAIN_BATCH``
messages in a row it yields to the event loop once, so streams and the watchdog run even while
a rank floods it. The fd is zmq's notification fd (readable when the socket's state may have
changed, not per message), hence the ``zmq.EVENTS`` check before sleeping again. Dispatch: the
finished outputs of a step are taken out first (their requests popped), then one loop over the
step's handles and ids hands each running request its ids (``RequestStream.push_tokens``: no
object per request per step while the consumer is behind); a decode step, one id per request,
takes a loop without offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np
import orjson
import zmq

from rank import transfer_channel
from rank.client import RequestStream
from rank.engine import FinishReason, RequestOutput
from rank.transfer_channel import CHANNEL_OPS, ChannelWriter

OnMessage = Callable[["RankLink", list[bytes]], None]  # what the receive path hands each message to

DRAIN_BATCH = 32  # messages taken per wakeup before yielding to the event loop once


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """Where one ``release``/``export``/``import`` round trip's time went, in seconds. The ends
    are the backend's clock, the middle the rank's reply ``ts`` (``rank/transfers.py``); both are
    ``time.monotonic()``, which is system-wide on Linux. Kept by ``RankGroup.transfer_log`` for
    benchmarks and diagnosis (``bench/multi_gpu_run.py`` splits restores by these phases)."""

    op: str
    rank: int
    sent: float  # backend clock, when the command was handed to zmq
    to_rank_s: float  # -> the rank took it off its socket: zmq, its thread waking, commands ahead
    wait_s: float  # -> the engine call began on the rank (header decode, held back behind adds)
    engine_s: float  # the engine call: block allocation, the copy, its synchronize
    back_s: float  # -> the backend's receive task read the reply: stats, send, zmq, that task waking
    resume_s: float  # -> the awaiting coroutine ran again (the backend's event loop)
    num_blocks: int = 0  # a folded import's (op "fold": its add was ``sent``; the add left for the
    # loop thread at ``to_rank_s + wait_s + engine_s``, the turn's cost of the restore)

    PHASES: ClassVar[tuple[str, ...]] = ("to_rank_s", "wait_s", "engine_s", "back_s", "resume_s")

    @classmethod
    def of(cls, op: str, rank: int, sent: float, reply: dict[str, Any],
           resumed: float, num_blocks: int = 0) -> TransferTiming | None:
        ts, read = reply.get("ts"), reply.get("read")
        if not isinstance(ts, list) or len(ts) != 3 or not isinstance(read, float):
            return None
        received, started, done = (float(t) for t in ts)
        return cls(op, rank, sent, received - sent, started - received, done - started, read - done,
                   resumed - read, num_blocks)

    @property
    def total_s(self) -> float:
        return self.to_rank_s + self.wait_s + self.engine_s + self.back_s + self.resume_s


@dataclass(slots=True)
class Tracked:
    """A request in flight on a rank."""

    stream: RequestStream
    request_id: str
    push_tokens: Callable[[list[int]], None]  # stream.push_tokens, bound once


@dataclass(slots=True, eq=False)
class RankLink:
    """One rank process of the current epoch and its sockets (all closed at teardown)."""

    rank: int
    cmd: zmq.Socket[bytes]
    out: zmq.Socket[bytes]  # PULL, read without blocking by ``receive`` (readiness via loop.add_reader)
    proc: asyncio.subprocess.Process | None = None
    last_seen: float = 0.0
    phase: str = "starting"
    progress: str = ""
    busy_s: float = 0.0
    ready: dict[str, Any] | None = None
    stats: list[int] | None = None
    requests: dict[int, Tracked] = field(default_factory=dict)
    next_handle: int = 0
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    exit_code: int | None = None
    fatal: str | None = None  # the rank's own fatal report, if it sent one
    # The transfer channel (rank/transfer_channel.py): listening until the rank's transfer
    # thread connects (ranks without one never do), then ``channel``; ``next_seq`` numbers commands.
    listener: socket.socket | None = None
    channel: ChannelWriter | None = None
    next_seq: int = 0

    @classmethod
    def bind(cls, ctx: zmq.Context[zmq.Socket[bytes]], rank: int, cmd_addr: str, out_addr: str,
             now: float, channel_path: str | None = None) -> RankLink:
        """The backend's ends of a new rank's sockets: PUSH commands, PULL outputs (no HWM: the
        backend never blocks on a rank, and the rank's outputs are bounded by its requests), and
        the transfer channel's listener at ``channel_path``."""
        cmd = ctx.socket(zmq.PUSH)
        cmd.setsockopt(zmq.SNDHWM, 0)
        cmd.setsockopt(zmq.LINGER, 0)
        cmd.bind(cmd_addr)
        out = ctx.socket(zmq.PULL)
        out.setsockopt(zmq.RCVHWM, 0)
        out.setsockopt(zmq.LINGER, 0)
        out.bind(out_addr)
        listener = transfer_channel.listen(channel_path) if channel_path else None
        return cls(rank, cmd, out, last_seen=now, listener=listener)

    def send(self, header: dict[str, Any], *frames: bytes) -> None:
        """Number a command and send it: a transfer on the channel once the rank has connected,
        anything else (or everything, before that) on zmq. Raises ``zmq.ZMQError``."""
        header["sq"] = self.next_seq
        self.next_seq += 1
        payload = orjson.dumps(header)
        if self.channel is not None and header.get("op") in CHANNEL_OPS and self.channel.send(payload):
            return
        self.cmd.send_multipart([payload, *frames], zmq.NOBLOCK)

    def _resend(self, lost: list[bytes]) -> None:
        """The channel is gone (the rank closed it): what it had not written goes by zmq."""
        for payload in lost:
            with contextlib.suppress(zmq.ZMQError):
                self.cmd.send_multipart([payload], zmq.NOBLOCK)

    async def accept_channel(self, on_message: OnMessage) -> None:
        """Wait for the rank's transfer thread to connect; its replies then come in here."""
        if self.listener is None:
            return
        conn, _ = await asyncio.get_running_loop().sock_accept(self.listener)
        self.listener.close()
        self.listener = None
        self.channel = ChannelWriter(conn, lambda message: on_message(self, [message]), self._resend)

    def close_sockets(self) -> None:
        self.cmd.close(0)
        self.out.close(0)
        if self.listener is not None:
            self.listener.close()
        if self.channel is not None:
            self.channel.close()

    def health(self, now: float) -> dict[str, Any]:
        """This rank's entry in the group's /healthz ranks list."""
        return {
            "rank": self.rank,
            "pid": self.proc.pid if self.proc else None,
            "alive": self.proc is not None and self.proc.returncode is None,
            "phase": self.phase,
            "progress": self.progress,
            "last_heartbeat_s_ago": round(now - self.last_seen, 3),
            "in_flight": len(self.requests),
            "prefix_cache_supported": self.ready.get("prefix_cache_supported", True) if self.ready else None,
        }

    async def receive(self, on_message: OnMessage) -> None:
        """Wake on readiness, then drain every queued message (module docstring)."""
        loop = asyncio.get_running_loop()
        sock = self.out
        fd = cast(int, sock.getsockopt(zmq.FD))
        ready = asyncio.Event()
        loop.add_reader(fd, ready.set)
        recv = sock.recv_multipart
        try:
            while True:
                ready.clear()
                num_taken = 0
                while num_taken < DRAIN_BATCH:
                    try:
                        frames = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    num_taken += 1
                    on_message(self, frames)
                if num_taken:
                    self.last_seen = time.monotonic()
                    if num_taken == DRAIN_BATCH:
                        await asyncio.sleep(0)  # let the streams run; then take the rest
                        continue
                # The fd is edge-like (zmq resets it when it processes its commands, which recv
                # and this check do): sleep only when zmq itself says nothing is queued.
                if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    continue
                await ready.wait()
        finally:
            loop.remove_reader(fd)

    def dispatch(self, header: dict[str, Any], frames: list[bytes]) -> None:
        """Hand a step message's ids to the requests' streams (module docstring)."""
        handles = np.frombuffer(frames[1], dtype="<i4")
        counts = np.frombuffer(frames[2], dtype="<i4")
        tokens = np.frombuffer(frames[3], dtype="<i4").tolist()
        one_each = len(tokens) == len(handles) and bool((counts == 1).all())  # a decode step
        ends = None if one_each else np.cumsum(counts).tolist()
        requests = self.requests
        finished = []
        for entry in header["fin"]:  # out of requests first: the loop below skips them
            req = requests.pop(int(handles[entry[0]]), None)
            if req is not None:
                finished.append((req, entry))
        get = requests.get
        if ends is None:
            for handle, token in zip(handles.tolist(), tokens):
                req = get(handle)
                if req is not None:
                    req.push_tokens([token])
        else:
            start = 0
            for handle, end in zip(handles.tolist(), ends):
                req = get(handle)
                if req is not None:
                    req.push_tokens(tokens[start:end])
                start = end
        for req, (i, reason, n_prompt, n_cached, kept, error) in finished:
            ids = tokens[i : i + 1] if ends is None else tokens[(ends[i - 1] if i else 0) : ends[i]]
            req.stream.push(RequestOutput(req.request_id, ids, True, FinishReason(reason), n_prompt, n_cached,
                                          kept, error))


def prefix_cache_support(links: list[RankLink]) -> tuple[bool, str | None]:
    """Whether every rank's engine keeps a prefix cache (from their ready reports), and the reason
    the first one that does not gives (else any rank's remark)."""
    for r in links:
        if r.ready and not r.ready.get("prefix_cache_supported", True):
            reason = r.ready.get("prefix_cache_reason") or "not supported by the engine"
            return False, f"rank {r.rank}: {reason}"
    remarks = (r.ready.get("prefix_cache_reason") for r in links if r.ready)
    return True, next((remark for remark in remarks if remark), None)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
