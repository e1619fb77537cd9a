"""Connections bounded in time and memory, slots kept for clients with the key, browsers kept out
(server/http_limits.py, server/http_gate.py), over raw sockets on 127.0.0.1 against the real
``Runtime`` (uvicorn + httptools, in-process rank group, API key set).

Waits are liveness bounds ("answered within 60 s"), never measurements. Before these limits:
slow unauthenticated connections held every slot (an authenticated client got 503), a refused
request's connection stayed open while its body kept coming, a socket that never read had
thousands of pipelined requests parsed ahead, bodies had no timeout or global budget, any
``Host``/``Origin``/``text/plain`` body was served, and a stream nobody read kept its engine
request running to ``max_tokens``.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.runtime_thread import RuntimeThread

KEY = "k-connections-test"
CAP = 32
MAX_TOKENS = 100_000
BASE = {"engine": "reference", "reference_model": "null", "ep": 1, "block_size": 128,
        "reference_num_blocks": 1024, "max_model_len": 131_072, "l1_cache": False, "port": 0,
        "request_timeout_secs": 600, "api_key": KEY, "http_max_connections": CAP,
        "http_header_timeout_secs": 30, "http_body_timeout_secs": 1, "http_body_min_bytes_per_sec": 1 << 30,
        "http_max_buffered_body_bytes": 4 << 20, "http_write_stall_secs": 1}
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rt() -> Iterator[RuntimeThread]:
    with RuntimeThread(BASE, rank_mode="local") as handle:
        yield handle


def _port(rt: RuntimeThread) -> int:
    return int(rt.runtime.port)


def _connect(rt: RuntimeThread, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", _port(rt)))
    return s


def _post(path: str, body: bytes, *, key: bool = True, host: str = "127.0.0.1",
          content_type: str = "application/json", extra: str = "", length: int | None = None) -> bytes:
    auth = f"x-api-key: {KEY}\r\n" if key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\ncontent-type: {content_type}\r\n{auth}{extra}"
            f"content-length: {len(body) if length is None else length}\r\n\r\n")
    return head.encode() + body


def _get(path: str, *, key: bool = True, host: str = "127.0.0.1", extra: str = "") -> bytes:
    auth = f"x-api-key: {KEY}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}{extra}\r\n".encode()


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _until_closed(s: socket.socket, deadline_s: float = 60.0, keep_sending: bytes = b"") -> bytes:
    """Everything the server sends until it closes the connection (sending ``keep_sending`` now
    and then meanwhile, as an attacker would); fails if it stays open past ``deadline_s``."""
    received = b""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        ready, _, _ = select.select([s], [], [], 0.2)
        if ready:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return received
            received += chunk
        elif keep_sending:
            try:
                s.send(keep_sending)
            except OSError:
                pass
    raise AssertionError(f"the server kept the connection open past {deadline_s} s: {received[:200]!r}")


def _chat(max_tokens: int, stream: bool = False) -> bytes:
    return json.dumps({"model": "default", "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()


def _connections(rt: RuntimeThread) -> list[object]:
    async def read() -> list[object]:
        return list(rt.runtime._server.server_state.connections)

    return rt.call(read)


def test_unauthenticated_connections_cannot_lock_out_a_client_with_the_key(rt: RuntimeThread) -> None:
    """A full cap of slow-header connections plus bodies trickled without a key: the client with
    the key is still served (before: 503 until the attackers' connections timed out)."""
    slow = [_connect(rt) for _ in range(CAP)]
    for s in slow:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never end
    bodies = [_connect(rt) for _ in range(8)]
    for s in bodies:
        s.sendall(_post("/nope", b"x", key=False, length=10_000_000))
    for s in bodies:  # refused at its headers and closed, however the bytes keep coming
        assert _status(_until_closed(s, keep_sending=b"x")) == 401
        s.close()
    try:
        good = _connect(rt)
        good.sendall(_get("/healthz"))
        assert _status(good.recv(65536)) == 200
        good.sendall(_post("/v1/messages", _chat(4)))
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += good.recv(65536)
        assert _status(raw) == 200, raw[:300]
        good.close()
    finally:
        for s in slow:
            s.close()


def test_error_responses_close_the_connection(rt: RuntimeThread) -> None:
    for request, status in ((_get("/nope"), 404), (_post("/v1/models", b"{}"), 405),
                            (_post("/v1/messages", b"x", length=64 << 20), 413)):
        s = _connect(rt)
        s.sendall(request)
        raw = _until_closed(s, keep_sending=b"GET /healthz HTTP/1.1\r\n\r\n")
        assert _status(raw) == status and raw.count(b"HTTP/1.1") == 1, raw[:300]
        assert b"connection: close" in raw.lower()
        s.close()


def test_pipelined_requests_are_not_read_far_ahead(rt: RuntimeThread) -> None:
    """One socket pipelines up to 20,000 requests and reads nothing: the server parses at most a
    few ahead of its answer, then stops reading and closes (before: every one parsed and queued)."""
    s = _connect(rt, rcvbuf=4096)
    s.setblocking(False)
    data = _get("/healthz") * 20_000
    sent, end = 0, time.monotonic() + 5
    while sent < len(data) and time.monotonic() < end:
        try:
            sent += s.send(data[sent:sent + 65536])
        except BlockingIOError:
            time.sleep(0.01)
        except (ConnectionResetError, BrokenPipeError):
            break  # the server stopped reading and closed already: what the test wants to see
    queued = [len(c.pipeline) for c in _connections(rt)]  # type: ignore[attr-defined]
    assert max(queued, default=0) <= 8, queued
    end = time.monotonic() + 60
    while _connections(rt) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _connections(rt), "the server kept the pipelining connection open"
    s.close()


def test_body_memory_budget_and_body_timeout(rt: RuntimeThread) -> None:
    """Bodies share one budget (4 MiB here): a declared body that does not fit is refused 503
    at once; a body that stops arriving is answered 408 and closed."""
    first = _connect(rt)
    first.sendall(_post("/v1/messages", b"{", length=3 << 20))
    time.sleep(0.2)
    second = _connect(rt)
    second.sendall(_post("/v1/messages", b"{", length=3 << 20))
    raw = _until_closed(second)
    assert _status(raw) == 503 and b"overloaded_error" in raw, raw[:300]
    assert _status(_until_closed(first)) == 408  # 1 s body timeout here
    for s in (first, second):
        s.close()


@pytest.mark.parametrize("request_bytes", [
    _post("/v1/messages", _chat(4), content_type="text/plain"),
    _post("/v1/messages", _chat(4), extra="origin: http://evil.example\r\n"),
    _get("/healthz", host="evil.example:8080"),
    _get("/healthz", key=False, host="rebound.example"),
], ids=["text-plain", "origin", "host", "host-no-key"])
def test_browser_requests_are_refused(rt: RuntimeThread, request_bytes: bytes) -> None:
    s = _connect(rt)
    s.sendall(request_bytes)
    raw = _until_closed(s)
    assert _status(raw) in (403, 415), raw[:300]
    s.close()


def test_loopback_names_are_served(rt: RuntimeThread) -> None:
    for host in (f"localhost:{_port(rt)}", f"127.0.0.1:{_port(rt)}", "[::1]"):
        s = _connect(rt)
        s.sendall(_get("/healthz", host=host))
        assert _status(s.recv(65536)) == 200
        s.close()


def test_a_client_that_reads_nothing_ends_its_engine_request(rt: RuntimeThread) -> None:
    """A stream whose client reads nothing: its connection is closed once its output has stalled
    for http_write_stall_secs (1 s here), and the engine request aborted, its KV freed (before:
    the engine ran on, the output piling up in server memory)."""
    registry = rt.runtime.metrics.registry
    tokens_before = registry.get_sample_value("deepinfer_output_tokens_total") or 0.0
    s = _connect(rt, rcvbuf=4096)
    s.sendall(_post("/v1/messages", _chat(MAX_TOKENS, stream=True)))
    try:
        deadline = time.monotonic() + 60
        while sum(rt.cache_sizes()["running"]) == 0:
            assert time.monotonic() < deadline, "the engine never started the request"
            time.sleep(0.01)
        sizes = rt.settle(timeout_s=120)  # every engine idle, every block balanced
    finally:
        s.close()
    assert sizes["running"] == [0] and sizes["open_admissions"] == 0
    generated = (registry.get_sample_value("deepinfer_output_tokens_total") or 0.0) - tokens_before
    assert 0 < generated < MAX_TOKENS // 2, generated
