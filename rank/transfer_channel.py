"""A Unix stream socket between the backend and a rank's transfer thread, for ``release``,
``export`` and ``import`` and their replies; and the command numbering that keeps every command
in the order the backend sent it, whichever way it travelled.

Why: after restores stopped waiting for step boundaries, a small restore's
round trip was mostly messaging. zmq moves each message through an I/O thread on both ends, so
a command wakes three threads (the backend's I/O thread, the rank's, then the rank's transfer
thread) and its reply three more. Measured on the H200 host (``python -m bench.ipc_latency``,
1,000 pings spaced 1-9 ms, the receiving process launching small torch ops on the GPU): a round
trip p50 of 0.46 ms over zmq against 0.15 ms over a Unix socket (idle: 0.36 against 0.13). In
the serving run a 4-block import (a 0.29 ms copy) took 1.64 ms, 0.97 ms of it messaging.

Order. Commands are numbered per rank (header ``sq``, from 0 for each rank process): adds,
aborts and shutdowns keep to zmq (an add carries its prompt as a frame), transfers take this
channel once the rank has connected, and zmq before that or after the channel is lost. The
transfer thread takes commands in ``sq`` order from both (``Reorder``), so everything it relies
on (``rank/transfers.py``: a release behind an unapplied add that names its blocks, imports in
order) holds as if one socket carried them. A command without ``sq`` (tests that drive a rank
by hand) is taken as it comes.

Wire: each message is a 4-byte little-endian length and an orjson header (transfers and their
replies have no further frames). The backend's end is non-blocking, driven by its event loop
(``ChannelWriter``: what the socket does not take at once is written when it is writable); the
rank's end is the transfer thread's, which blocks on its replies' writes.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20  # a header this large is a broken stream, not a command
CHANNEL_OPS = frozenset({"import", "export", "release"})  # what the backend sends on the channel

T = TypeVar("T")


class ChannelError(RuntimeError):
    """A broken command stream (a length or a number that cannot be). Not a ValueError: a command
    refused for bad arguments is one, and is answered; this one fails the rank."""


def encode(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Bytes from a stream socket -> whole messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        messages = []
        start = 0
        while len(buf) - start >= LENGTH.size:
            (n,) = LENGTH.unpack_from(buf, start)
            if n > MAX_MESSAGE:
                raise ChannelError(f"transfer channel: a {n}-byte message")
            if len(buf) - start - LENGTH.size < n:
                break
            messages.append(bytes(buf[start + LENGTH.size : start + LENGTH.size + n]))
            start += LENGTH.size + n
        del buf[:start]
        return messages


class Reorder(Generic[T]):
    """Items numbered 0, 1, 2, ... arriving in any order, handed out in number order; an item
    without a number is handed out at once (module docstring)."""

    def __init__(self) -> None:
        self.expected = 0
        self._early: dict[int, T] = {}

    def push(self, seq: int | None, item: T) -> Iterator[T]:
        if seq is None:
            yield item
            return
        if seq != self.expected:
            if seq < self.expected or seq in self._early:
                raise ChannelError(f"command {seq} arrived twice (expected {self.expected})")
            self._early[seq] = item
            return
        yield item
        self.expected += 1
        while self.expected in self._early:
            yield self._early.pop(self.expected)
            self.expected += 1

    @property
    def num_waiting(self) -> int:
        return len(self._early)


class ChannelWriter:
    """The backend's end: sends without blocking the event loop, reads replies on it.

    ``send`` returns False once the channel is closed: the caller sends another way. When the
    channel is lost (the rank closed it, or a write failed), ``on_lost`` gets the messages not
    fully written, oldest first, to send another way too (they carry their ``sq``, so the rank
    still takes them in order)."""

    def __init__(self, sock: socket.socket, on_message: Callable[[bytes], None],
                 on_lost: Callable[[list[bytes]], None]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._on_message, self._on_lost = on_message, on_lost
        self._reader = FrameReader()
        self._pending: deque[bytes] = deque()  # whole messages not fully written, oldest first
        self._offset = 0  # bytes of ``_pending[0]`` already written
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._readable)

    def send(self, payload: bytes) -> bool:
        """Queue ``payload``; False (and nothing queued) when the channel is closed."""
        if self.closed:
            return False
        self._pending.append(encode(payload))
        if len(self._pending) == 1:
            self._flush()
        return True

    def _flush(self) -> None:
        while self._pending:
            head = self._pending[0]
            try:
                n = self.sock.send(memoryview(head)[self._offset :])
            except BlockingIOError:
                n = 0
            except OSError:
                self._lose()
                return
            self._offset += n
            if self._offset < len(head):
                self._loop.add_writer(self.sock.fileno(), self._writable)
                return
            self._pending.popleft()
            self._offset = 0

    def _writable(self) -> None:
        self._loop.remove_writer(self.sock.fileno())
        self._flush()

    def _readable(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lose()
            return
        for message in self._reader.feed(data):
            self._on_message(message)

    def _lose(self) -> None:
        if self.closed:
            return
        # A message partly written is sent again whole: the rank drops a partial one at EOF.
        lost = [m[LENGTH.size :] for m in self._pending]
        self._pending.clear()
        self.close()
        if lost:
            self._on_lost(lost)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fd = self.sock.fileno()
        if fd >= 0:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
        self.sock.close()


def listen(path: str) -> socket.socket:
    """The backend's listening socket for one rank (bound before the rank starts)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(1)
    sock.setblocking(False)
    return sock


def connect(path: str) -> socket.socket:
    """The rank's end (blocking; the transfer thread polls it before reading)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def header_seq(header: dict[str, Any]) -> int | None:
    seq = header.get("sq")
    return seq if isinstance(seq, int) else None
