"""Connection limits of the HTTP server (server/http_limits.py), over raw sockets
against the real ``Runtime`` (uvicorn + httptools, in-process rank group).

Waits are liveness bounds ("closed within 60 s"), never measurements. Red before: uvicorn
kept slow-header and idle connections open forever, accepted every connection, buffered a huge
header in memory and answered parser errors in plain text.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.support.runtime_thread import RuntimeThread

BASE = {"engine": "reference", "reference_model": "null", "ep": 1, "block_size": 16,
        "reference_num_blocks": 256, "l1_cache": False, "port": 0}
CAP = 64


@pytest.fixture(scope="module")
def rt_slow() -> Iterator[RuntimeThread]:
    with RuntimeThread({**BASE, "http_header_timeout_secs": 1, "http_keep_alive_secs": 1},
                       rank_mode="local") as rt:
        yield rt


@pytest.fixture(scope="module")
def rt_cap() -> Iterator[RuntimeThread]:
    with RuntimeThread({**BASE, "http_header_timeout_secs": 30, "http_max_connections": CAP},
                       rank_mode="local") as rt:
        yield rt


def _connect(rt: RuntimeThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", rt.runtime.port), timeout=30)


def _read_until_closed(socks: list[socket.socket], deadline_s: float = 60.0,
                       stop_after: int | None = None) -> dict[socket.socket, bytes]:
    """Read every socket until the server closes it; returns what each received (closed ones)."""
    received = {s: b"" for s in socks}
    open_ = set(socks)
    closed: dict[socket.socket, bytes] = {}
    end = time.monotonic() + deadline_s
    while open_ and time.monotonic() < end and (stop_after is None or len(closed) < stop_after):
        ready, _, _ = select.select(list(open_), [], [], 0.5)
        for s in ready:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                received[s] += chunk
            else:
                open_.discard(s)
                closed[s] = received[s]
    return closed


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, orjson.loads(body)


def _connections(rt: RuntimeThread) -> int:
    async def count() -> int:
        return len(rt.runtime._server.server_state.connections)

    return rt.call(count)


def test_slow_header_and_silent_connections_are_closed(rt_slow: RuntimeThread) -> None:
    slow = [_connect(rt_slow) for _ in range(40)]
    for s in slow:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")  # and never more
    silent = [_connect(rt_slow) for _ in range(40)]
    closed = _read_until_closed(slow + silent)
    assert len(closed) == 80, f"{80 - len(closed)} connections still open after 60 s"
    for s in slow:
        status, body = _json_error(closed[s])
        assert status == 408 and body["type"] == "error" and body["error"]["type"] == "timeout_error"
    for s in silent:
        status, body = _json_error(closed[s])  # no path known: the shape both SDKs read
        assert status == 408 and body["error"]["message"] and "param" in body["error"]
    for s in slow + silent:
        s.close()


def test_idle_keep_alive_connection_is_closed(rt_slow: RuntimeThread) -> None:
    s = _connect(rt_slow)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    closed = _read_until_closed([s])
    assert closed and closed[s].startswith(b"HTTP/1.1 200")
    s.close()


def test_connection_cap_bounds_open_sockets(rt_cap: RuntimeThread) -> None:
    socks = [_connect(rt_cap) for _ in range(4 * CAP)]
    closed = _read_until_closed(socks, stop_after=3 * CAP)
    assert len(closed) >= 3 * CAP, f"only {len(closed)} of {3 * CAP} connections over the cap were refused"
    assert _connections(rt_cap) <= CAP
    for raw in closed.values():
        status, body = _json_error(raw)
        assert status == 503 and body["error"]["type"] == "overloaded_error"
        assert b"retry-after: 5" in raw.lower()
    for s in socks:
        s.close()
    # the server still serves once the idle ones are gone
    for _ in range(200):
        if _connections(rt_cap) == 0:
            break
        time.sleep(0.05)
    s = _connect(rt_cap)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    reply = _read_until_closed([s])[s]
    assert reply.startswith(b"HTTP/1.1 200")
    s.close()


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("where", ["header", "url"])
def test_huge_headers_are_refused_without_memory_growth(rt_slow: RuntimeThread, where: str) -> None:
    before = _rss_kib()
    s = _connect(rt_slow)
    head = (b"GET /v1/messages/count_tokens HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
            if where == "header" else b"GET /v1/messages/")
    s.sendall(head)
    chunk = b"a" * (1 << 20)
    sent = 0
    try:
        for _ in range(200):  # up to 200 MiB
            s.sendall(chunk)
            sent += 1
    except (BrokenPipeError, ConnectionResetError):
        pass
    grown_mib = (_rss_kib() - before) / 1024
    reply = _read_until_closed([s]).get(s, b"")
    s.close()
    assert sent < 200, "the server read 200 MiB of headers without refusing"
    assert grown_mib < 32, f"RSS grew {grown_mib:.0f} MiB"
    status, body = _json_error(reply)
    assert status == 431
    if where == "header":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # Anthropic route
    print(f"\n{where}: refused after {sent} MiB sent; RSS grew {grown_mib:.1f} MiB")


@pytest.mark.parametrize("raw, shape", [
    (b"BLAH BLAH BLAH\r\n\r\n", "both"),
    (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n", "anthropic"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n", "openai"),
])
def test_parser_errors_come_in_the_api_shape(rt_slow: RuntimeThread, raw: bytes, shape: str) -> None:
    s = _connect(rt_slow)
    s.sendall(raw)
    reply = _read_until_closed([s])[s]
    s.close()
    status, body = _json_error(reply)
    assert status == 400 and body["error"]["message"].startswith("invalid HTTP request")
    if shape == "anthropic":
        assert body == {"type": "error",
                        "error": {"type": "invalid_request_error", "message": body["error"]["message"]}}
    elif shape == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"} and "type" not in body
    else:
        assert body["type"] == "error" and {"message", "type", "param", "code"} <= set(body["error"])
