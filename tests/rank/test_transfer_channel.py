"""The transfer channel's parts (rank/transfer_channel.py): framing, the command order across two
sockets, and the backend's non-blocking writer (partial writes, a peer that goes away)."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from rank.transfer_channel import (
    LENGTH,
    MAX_MESSAGE,
    ChannelError,
    ChannelWriter,
    FrameReader,
    Reorder,
    encode,
)


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    messages = [b"a", b"", b"x" * 70_000, b'{"op":"import"}']
    stream = b"".join(encode(m) for m in messages)
    for cut in (1, 3, 4, 5, 7, 1000, len(stream) - 1):
        reader = FrameReader()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == messages
    reader = FrameReader()
    assert [m for i in range(len(stream)) for m in reader.feed(stream[i : i + 1])] == messages


def test_an_impossible_length_is_an_error_not_a_wait() -> None:
    with pytest.raises(ChannelError, match="message"):
        FrameReader().feed(LENGTH.pack(MAX_MESSAGE + 1) + b"x")


def test_commands_come_out_in_number_order_and_unnumbered_ones_at_once() -> None:
    order: Reorder[str] = Reorder()
    out: list[str] = []
    for seq, item in [(2, "c"), (None, "free"), (1, "b"), (0, "a"), (4, "e"), (3, "d")]:
        out += order.push(seq, item)
    assert out == ["free", "a", "b", "c", "d", "e"]
    assert order.expected == 5 and order.num_waiting == 0
    assert list(order.push(6, "g")) == [] and order.num_waiting == 1
    with pytest.raises(ChannelError, match="twice"):
        list(order.push(6, "g again"))
    with pytest.raises(ChannelError, match="twice"):
        list(order.push(1, "b again"))


def test_the_writer_keeps_what_the_socket_does_not_take_and_writes_it_in_order() -> None:
    async def scenario() -> None:
        backend, rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        backend.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        replies: list[bytes] = []
        lost: list[list[bytes]] = []
        writer = ChannelWriter(backend, replies.append, lost.append)
        payloads = [bytes([i]) * 10_000 for i in range(40)]  # 400 KB: far more than the buffer
        for p in payloads:
            assert writer.send(p)  # never blocks the loop
        rank.setblocking(False)
        reader, got = FrameReader(), []
        while len(got) < len(payloads):
            await asyncio.sleep(0.001)  # the loop writes the rest as the socket drains
            try:
                got += reader.feed(rank.recv(1 << 16))
            except BlockingIOError:
                pass
        assert got == payloads
        rank.sendall(encode(b"r1") + encode(b"r2")[:3])
        rank.sendall(encode(b"r2")[3:])
        for _ in range(1000):
            if len(replies) == 2:
                break
            await asyncio.sleep(0.001)
        assert replies == [b"r1", b"r2"] and not lost
        rank.close()
        writer.close()

    asyncio.run(scenario())


def test_a_lost_channel_hands_back_every_message_not_fully_written() -> None:
    async def scenario() -> None:
        backend, rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        backend.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        lost: list[list[bytes]] = []
        writer = ChannelWriter(backend, lambda m: None, lost.append)
        payloads = [bytes([i]) * 10_000 for i in range(40)]
        for p in payloads:
            writer.send(p)
        rank.close()  # the rank goes away with most of them unread
        for _ in range(1000):
            if writer.closed:
                break
            await asyncio.sleep(0.001)
        assert writer.closed and len(lost) == 1
        # The tail of what was sent, whole (a partly written one included), oldest first.
        assert lost[0] and lost[0] == payloads[len(payloads) - len(lost[0]) :]
        assert not writer.send(b"later")  # the caller sends it another way

    asyncio.run(scenario())


def test_a_reply_the_channel_cannot_take_leaves_the_poll_and_goes_by_zmq() -> None:
    """rank/transfers.py: once the backend has closed its end, the reply's write fails; the
    thread takes the channel's fd out of its poll (a closed fd would make every poll return at
    once: a busy loop) and sends the reply on its zmq output."""
    import zmq

    from rank.transfers import TransferThread

    ctx = zmq.Context()
    try:
        cmd = ctx.socket(zmq.PULL)
        backend_out = ctx.socket(zmq.PULL)
        backend_out.bind("inproc://replies")
        thread = TransferThread(ctx, cmd, "inproc://replies", engine=None, last_stats=None)  # type: ignore[arg-type]
        thread._out = ctx.socket(zmq.PUSH)
        thread._out.connect("inproc://replies")
        ours, backend = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        thread._channel = ours
        thread._poller = zmq.Poller()
        thread._poller.register(cmd, zmq.POLLIN)
        thread._poller.register(ours.fileno(), zmq.POLLIN)
        backend.close()
        thread._reply({"t": "reply", "cid": 7, "ok": True})
        assert thread._channel is None
        assert [s for s, _ in thread._poller.sockets] == [cmd]
        assert backend_out.poll(5000)
        assert orjson.loads(backend_out.recv_multipart()[0])["cid"] == 7
        for sock in (cmd, backend_out, thread._out):
            sock.close(0)
    finally:
        ctx.term()
