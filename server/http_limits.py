"""Connection-level limits of the HTTP server (uvicorn's httptools protocol, bounded).

uvicorn alone (0.30 - 0.54, httptools) has no header read timeout (a connection may send half a
request line and hold its socket forever; a fresh connection that sends nothing is never timed
out: the keep-alive timer only starts after a response), no bound on the request line + headers
(httptools accumulates one header value in memory until it ends: 1,000 MiB of header grew the
process by ~1 GiB), and its ``limit_concurrency`` still accepts every connection (an fd each)
and answers 503 in plain text. ``LimitedHttpToolsProtocol`` adds, per ``HttpLimits``:

* ``header_timeout_s``: from the connection's start, or a request's first byte, to the end of its
  headers; past it the server answers 408 and closes;
* ``max_header_bytes``: request line + headers; past it 431 and close (memory stays bounded by
  that plus one read, whatever is sent);
* ``max_connections``: a connection over the cap is answered 503 (``Retry-After``) and closed at
  once, so fds stay bounded by the cap (set well under ``ulimit -n``: see ``effective_cap``);
* ``keep_alive_s``: uvicorn's own idle timeout between requests;
* ``body_timeout_s`` and ``body_min_rate``: a request body must arrive within
  ``body_timeout_s`` plus one second per ``body_min_rate`` bytes received (Apache
  ``mod_reqtimeout``'s rule), else 408 and close;
* ``max_buffered_body_bytes``: all connections' request bodies being read or served (a declared
  ``Content-Length`` is reserved whole when its headers end, a chunked body as it arrives) stay
  under it; a body that does not fit is answered 503 and its connection closed;
* ``max_pipelined``: requests parsed ahead of the one being answered on a connection; past it
  the server reads nothing more from that connection, answers what it parsed, and closes it
  (the client resends the rest on a new connection, as RFC 9112 section 9.3.2 expects);
* ``write_stall_s``: a connection whose output stays over the transport's high-water mark (the
  client reads nothing) that long is aborted, which aborts its engine request (its KV freed): the
  output undelivered per connection is bounded by the high-water mark, the socket buffers and
  what the engine generates in that time;
* ``max_per_address``: connections from one client address (0: no limit);
* ``gate``: the header checks of ``server/http_gate.py`` (Host, Origin, JSON, API key, declared
  length), run before any body byte is read.

Slots for clients with the key: when the cap is reached, a new connection evicts the oldest
connection that has not shown the API key and is waiting for a request's headers (a slow-header
client, or an idle keep-alive one); only when there is none is the new one answered 503. Without
a key configured no connection is trusted and the cap treats all alike.

Every error response closes its connection (``Connection: close``): after a refusal nothing more
is read from that client.

Errors the server can still answer come in the API's shape: by the path when the request line
was read (Anthropic for ``/v1/messages*``, OpenAI otherwise), else in a body both SDKs parse
(``{"type": "error", "error": {"type", "message", "param", "code"}}``). This replaces uvicorn's
plain-text "Invalid HTTP request received." too.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from protocol.errors import (
    BodyTimeout,
    HeadersTimeout,
    HeadersTooLarge,
    InvalidRequest,
    Overloaded,
    ProtocolError,
)
from server.http_gate import RequestGate

log = logging.getLogger("deepinfer.http")

FD_RESERVE = 256  # fds kept for everything but client connections (rank pipes, zmq, files, logs)
CONNECTION_RETRY_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 20.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 2048
    keep_alive_s: float = 75.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 64 * 1024
    max_buffered_body_bytes: int = 1024 * 1024 * 1024
    max_pipelined: int = 8
    write_stall_s: float = 30.0
    max_per_address: int = 0
    gate: RequestGate | None = None


class _Shared:
    """What the connections of one server share: the body budget and per-address counts."""

    def __init__(self) -> None:
        self.body_bytes = 0
        self.per_address: dict[str, int] = {}


def effective_cap(max_connections: int) -> int:
    """``max_connections``, lowered to fit the process's fd limit (``RLIMIT_NOFILE`` minus a reserve)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(16, min(max_connections, soft - FD_RESERVE))


OPENAI_BODY_ROUTES = (b"/v1/chat/completions", b"/v1/responses")


def error_bytes(perr: ProtocolError, path: bytes | None, anthropic_client: bool = False) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response carrying ``perr``, in the API the
    routes would answer in: Anthropic's on ``/v1/messages``, OpenAI's on the OpenAI routes, and
    elsewhere Anthropic's for a client that sends ``anthropic-version`` (as ``server/app.py``)."""
    if path is None:
        inner = perr.openai_body()["error"] | {"type": perr.anthropic_type}
        body = orjson.dumps({"type": "error", "error": inner})
    else:
        anthropic = path.startswith(b"/v1/messages") or (
            anthropic_client and not path.startswith(OPENAI_BODY_ROUTES))
        body = orjson.dumps(perr.body("anthropic" if anthropic else "openai"))
    head = [STATUS_LINE[perr.http_status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in perr.headers().items()]
    return b"".join(head) + b"\r\n" + body


class _TooLarge(Exception):
    """Raised from a parser callback to stop httptools (it reports it as a parser error)."""


class _Stop(Exception):
    """Raised from a parser callback after the connection was answered or told to stop reading."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module docstring (``limits`` and
    ``shared`` are set on the subclass ``protocol_class`` makes)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    max_connections: ClassVar[int] = HttpLimits().max_connections
    shared: ClassVar[_Shared] = _Shared()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = False
        self._header_bytes = 0  # bytes read since the current request began (while awaiting headers)
        self._parsed_header_bytes = 0  # request line + headers the parser handed over
        self._refusal: ProtocolError | None = None
        self._done = False  # answered and closing: ignore whatever else arrives
        self._stopped = False  # reads nothing more; closes once the parsed requests are answered
        self._final: ProtocolError | None = None  # answered when the parsed requests are (then close)
        self._trusted = False  # a request on it showed the API key
        self._address: str | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_received = 0
        self._body_declared = -1  # Content-Length of the body being read; -1 chunked / none
        self._reserved = 0  # bytes of this connection's bodies counted in shared.body_bytes
        self._stall_timer: asyncio.TimerHandle | None = None
        self._since = 0.0  # when it began waiting for a request (eviction picks the oldest)

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._count_address()
        if len(self.connections) > self.max_connections and not self._evict_one():
            self._answer(Overloaded(f"the server holds its maximum of {self.max_connections} connections; "
                                    "retry shortly", retry_after_s=CONNECTION_RETRY_AFTER_S))
            return
        limit = self.limits.max_per_address
        if limit and self._address is not None and self.shared.per_address[self._address] > limit:
            self._answer(Overloaded(f"this address holds its maximum of {limit} connections",
                                    retry_after_s=CONNECTION_RETRY_AFTER_S))
            return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self._stop_body_timer()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._release_body()
        if self._address is not None:
            left = self.shared.per_address.pop(self._address) - 1
            if left > 0:
                self.shared.per_address[self._address] = left
            self._address = None
        super().connection_lost(exc)

    def _count_address(self) -> None:
        if self.client is not None:
            self._address = self.client[0]
            self.shared.per_address[self._address] = self.shared.per_address.get(self._address, 0) + 1

    def _evict_one(self) -> bool:
        """Close the oldest untrusted connection waiting for headers (not this one)."""
        victim: LimitedHttpToolsProtocol | None = None
        for conn in self.connections:
            if (conn is not self and isinstance(conn, LimitedHttpToolsProtocol) and conn._evictable()
                    and (victim is None or conn._since < victim._since)):
                victim = conn
        if victim is None:
            return False
        victim._answer(Overloaded("the server needed this idle connection's slot",
                                       retry_after_s=CONNECTION_RETRY_AFTER_S))
        self.connections.discard(victim)
        return True

    def _evictable(self) -> bool:
        """Untrusted and waiting for a request: mid-headers, or idle after a response."""
        idle = self.cycle is not None and self.cycle.response_complete and not self.pipeline
        return not self._trusted and not self._done and not self._stopped and (self._awaiting_headers or idle)

    def data_received(self, data: bytes) -> None:
        if self._done or self._stopped:
            return
        if self._awaiting_headers:
            self._header_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if not (self._done or self._stopped):  # one of ours answered already, else a bug
                self.send_400_response("invalid HTTP request")
        except httptools.HttpParserError as exc:
            self.send_400_response(str(exc) or "invalid HTTP request")
        except httptools.HttpParserUpgrade:  # no WebSocket routes: served as a plain request (uvicorn too)
            pass
        if self._awaiting_headers and not self._done and self._header_bytes > self.limits.max_header_bytes:
            self._answer(self._too_large())

    # -- parser callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = self._parsed_header_bytes = 0
        self._await_headers()

    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_parsed(self, num_bytes: int) -> None:
        """Also bounds what one read can carry (a read may hold more than the limit)."""
        self._parsed_header_bytes += num_bytes
        if self._parsed_header_bytes > self.limits.max_header_bytes:
            self._too_large()
            raise _TooLarge

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._stop_header_timer()
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if in_flight and len(self.pipeline) >= self.limits.max_pipelined:
            self._stop_reading(None)  # answer what was parsed, then close
            raise _Stop
        gate = self.limits.gate
        if gate is not None:
            verdict = gate.check(self.parser.get_method().decode("ascii", "replace"), self.headers)
            self._trusted = self._trusted or verdict.trusted
            if verdict.refusal is not None:
                self._refuse(verdict.refusal, in_flight)
        if self.parser.get_method() not in (b"GET", b"HEAD") or self._has_body_headers():
            self._begin_body()
        super().on_headers_complete()

    def _has_body_headers(self) -> bool:
        return any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    def _refuse(self, perr: ProtocolError, in_flight: bool) -> None:
        if in_flight:
            self._stop_reading(perr)
        else:
            self._answer(perr)
        raise _Stop

    def on_body(self, body: bytes) -> None:
        if self._body_timer is not None:
            self._body_received += len(body)
            if self._body_declared < 0 and not self._reserve(len(body)):
                raise _Stop
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._stop_body_timer()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._since = self.loop.time()
        if not self.pipeline:
            self._release_body()
        if self._stopped:
            self.flow.pause_reading()
            if not self.pipeline and self.cycle.response_complete and not self._done:
                if self._final is not None:
                    self._answer(self._final)
                else:
                    self._done = True
                    self.transport.close()

    def _stop_reading(self, final: ProtocolError | None) -> None:
        """Read nothing more; once the requests already parsed are answered, answer ``final``
        (if any) and close."""
        self._stopped = True
        self._final = final
        self.flow.pause_reading()

    # -- request bodies: time and memory -------------------------------------------------------------
    def _begin_body(self) -> None:
        self._body_started = self.loop.time()
        self._body_received = 0
        self._body_declared = -1
        for name, value in self.headers:
            if name == b"content-length" and value.strip().isdigit():
                self._body_declared = int(value)
        if self._body_declared > 0 and not self._reserve(self._body_declared):
            raise _Stop
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._check_body)

    def _reserve(self, num_bytes: int) -> bool:
        shared = self.shared
        if shared.body_bytes + num_bytes > self.limits.max_buffered_body_bytes:
            self._answer(Overloaded("the server holds its maximum of request bodies in memory; retry shortly",
                                    retry_after_s=CONNECTION_RETRY_AFTER_S))
            return False
        shared.body_bytes += num_bytes
        self._reserved += num_bytes
        return True

    def _release_body(self) -> None:
        self.shared.body_bytes -= self._reserved
        self._reserved = 0

    def _check_body(self) -> None:
        self._body_timer = None
        limits = self.limits
        deadline = self._body_started + limits.body_timeout_s + self._body_received / limits.body_min_rate
        now = self.loop.time()
        if now < deadline:
            self._body_timer = self.loop.call_later(deadline - now, self._check_body)
            return
        cycle = self.cycle
        if cycle is not None:  # the app reading it sees a disconnect; its writes go nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self._answer(BodyTimeout(f"the request body did not arrive in time ({limits.body_timeout_s:g} s plus "
                                 f"1 s per {limits.body_min_rate} bytes)"))

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    # -- output the client does not read -------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        log.info("http: aborting a connection that read none of its output for %g s",
                 self.limits.write_stall_s)
        self._done = True
        self.transport.abort()  # connection_lost follows: the request sees a disconnect

    # -- answers -----------------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this for every parser error (ours included): answer in the API's shape."""
        if self._stopped:
            return
        self._answer(self._refusal or InvalidRequest(f"invalid HTTP request: {msg}"))

    def _too_large(self) -> ProtocolError:
        self._refusal = HeadersTooLarge(f"the request line and headers exceed {self.limits.max_header_bytes} "
                                        "bytes")
        return self._refusal

    def _answer(self, perr: ProtocolError) -> None:
        if self._done:
            return
        self._done = True
        self._awaiting_headers = False
        self._stop_header_timer()
        self._stop_body_timer()
        path = bytes(self.url).split(b"?", 1)[0] if getattr(self, "url", b"") else None
        if not self.transport.is_closing():
            anthropic_client = any(name == b"anthropic-version" for name, _ in self.headers or ())
            self.transport.write(error_bytes(perr, path, anthropic_client))
            self.transport.close()

    # -- header timer ------------------------------------------------------------------------------
    def _await_headers(self) -> None:
        self._awaiting_headers = True
        self._since = self.loop.time()
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers or self._done:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._await_headers()  # a pipelined request behind a response still being sent: later
            return
        self._answer(HeadersTimeout("the request headers did not arrive within "
                                    f"{self.limits.header_timeout_s:g} s"))


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``."""
    cap = effective_cap(limits.max_connections)
    if cap < limits.max_connections:
        log.warning("http: max_connections lowered from %d to %d to fit the fd limit (ulimit -n)",
                    limits.max_connections, cap)
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,),
                {"limits": limits, "max_connections": cap, "shared": _Shared()})
