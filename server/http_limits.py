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
* ``keep_alive_s``: uvicorn's own idle timeout between requests.

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

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from protocol.errors import HeadersTimeout, HeadersTooLarge, InvalidRequest, Overloaded, ProtocolError

log = logging.getLogger("deepinfer.http")

FD_RESERVE = 256  # fds kept for everything but client connections (rank pipes, zmq, files, logs)
CONNECTION_RETRY_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 20.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 2048
    keep_alive_s: float = 75.0


def effective_cap(max_connections: int) -> int:
    """``max_connections``, lowered to fit the process's fd limit (``RLIMIT_NOFILE`` minus a reserve)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(16, min(max_connections, soft - FD_RESERVE))


def error_bytes(perr: ProtocolError, path: bytes | None) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response carrying ``perr``."""
    if path is None:
        inner = perr.openai_body()["error"] | {"type": perr.anthropic_type}
        body = orjson.dumps({"type": "error", "error": inner})
    else:
        body = orjson.dumps(perr.body("anthropic" if path.startswith(b"/v1/messages") else "openai"))
    head = [STATUS_LINE[perr.http_status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in perr.headers().items()]
    return b"".join(head) + b"\r\n" + body


class _TooLarge(Exception):
    """Raised from a parser callback to stop httptools (it reports it as a parser error)."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module docstring (``limits`` is set
    on the subclass ``protocol_class`` makes)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    max_connections: ClassVar[int] = HttpLimits().max_connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = False
        self._header_bytes = 0  # bytes read since the current request began (while awaiting headers)
        self._parsed_header_bytes = 0  # request line + headers the parser handed over
        self._refusal: ProtocolError | None = None
        self._done = False  # answered and closing: ignore whatever else arrives

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._answer(Overloaded(f"the server holds its maximum of {self.max_connections} connections; "
                                    "retry shortly", retry_after_s=CONNECTION_RETRY_AFTER_S))
            return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)  # parser errors end in send_400_response below
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
        super().on_headers_complete()

    # -- answers -----------------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this for every parser error (ours included): answer in the API's shape."""
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
        path = bytes(self.url).split(b"?", 1)[0] if getattr(self, "url", b"") else None
        if not self.transport.is_closing():
            self.transport.write(error_bytes(perr, path))
            self.transport.close()

    # -- header timer ------------------------------------------------------------------------------
    def _await_headers(self) -> None:
        self._awaiting_headers = True
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
                {"limits": limits, "max_connections": cap})
