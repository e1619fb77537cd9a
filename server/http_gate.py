"""What a request must show in its headers before the server reads its body or runs it.

``RequestGate.check`` runs in the HTTP protocol as soon as a request's headers are complete
(``server/http_limits.py``), so a refused request costs no body read: it is answered and its
connection closed at once.

* ``Host`` (DNS rebinding: a web page whose name now resolves to 127.0.0.1 still sends its own
  name): when the server is bound to loopback, only loopback names (``localhost``,
  ``127.0.0.1``, ``::1``) plus ``http_allowed_hosts``; bound elsewhere, ``http_allowed_hosts``
  when set, else any. ``*`` in the list allows any. Refused: 403. A request without ``Host``
  (HTTP/1.0 tools; never a browser) passes.
* ``Origin`` (sent by browsers, not by API clients): a request carrying one is refused (403)
  unless it is listed in ``http_allowed_origins`` (empty by default).
* ``Content-Type`` of a ``POST``: ``application/json`` (parameters such as ``charset`` allowed);
  anything else is 415. A page can send ``text/plain`` or a typeless body cross-origin without a
  CORS preflight, never ``application/json``.
* The API key, when one is set: a request other than ``GET``/``HEAD`` without the right key is
  refused (401) before its body is read. A connection whose request showed the right key is
  *trusted*: the connection cap never evicts it (see ``server/http_limits.py``).
* A declared ``Content-Length`` over ``max_body_bytes``: 413 before any of it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import PermissionDenied, ProtocolError, RequestTooLarge, UnsupportedMediaType
from server.auth import ApiKeyCheck

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
LOOPBACK_BINDS = frozenset({"127.0.0.1", "::1", "localhost"})
JSON_TYPE = b"application/json"


def host_name(value: str) -> str:
    """``Host`` header -> its name, lower case, without port or IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def allowed_hosts(bind_host: str, configured: list[str]) -> frozenset[str] | None:
    """The ``Host`` names served (``None``: any), per the module docstring."""
    names = {host_name(h) if h != "*" else "*" for h in configured}
    if "*" in names:
        return None
    if bind_host in LOOPBACK_BINDS or bind_host.startswith("127."):
        return frozenset(LOOPBACK_HOSTS | names)
    return frozenset(names) if names else None


@dataclass(frozen=True, slots=True)
class GateResult:
    refusal: ProtocolError | None
    trusted: bool


class RequestGate:
    """The checks of the module docstring over a request's method and raw header list."""

    __slots__ = ("_hosts", "_origins", "_auth", "_max_body_bytes")

    def __init__(self, hosts: frozenset[str] | None, origins: list[str], api_key: str | None,
                 max_body_bytes: int) -> None:
        self._hosts = hosts
        self._origins = frozenset(o.strip().rstrip("/").lower() for o in origins)
        self._auth = ApiKeyCheck(api_key)
        self._max_body_bytes = max_body_bytes

    def check(self, method: str, headers: list[tuple[bytes, bytes]]) -> GateResult:
        host = origin = content_type = x_api_key = authorization = length = None
        for name, value in headers:  # names are lower case (uvicorn lowers them)
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
            elif name == b"content-type":
                content_type = value
            elif name == b"x-api-key":
                x_api_key = value
            elif name == b"authorization":
                authorization = value
            elif name == b"content-length":
                length = value
        # No Host at all is no browser (every browser sends one): HTTP/1.0 tools, raw probes.
        hosts = self._hosts
        if hosts is not None and host is not None and host_name(host.decode("latin-1")) not in hosts:
            return GateResult(PermissionDenied("this server does not serve that Host (http_allowed_hosts)"),
                              False)
        if origin is not None and origin.decode("latin-1").strip().rstrip("/").lower() not in self._origins:
            return GateResult(PermissionDenied("requests from web pages are refused (http_allowed_origins)"),
                              False)
        trusted = False
        if self._auth.enabled:
            try:
                self._auth.check(_text(x_api_key), _text(authorization))
                trusted = True
            except ProtocolError as exc:
                if method not in ("GET", "HEAD"):
                    return GateResult(exc, False)
        if method == "POST" and (content_type is None
                                 or content_type.split(b";", 1)[0].strip().lower() != JSON_TYPE):
            return GateResult(UnsupportedMediaType("the request body must be JSON (Content-Type: "
                                                   "application/json)"), trusted)
        if length is not None and length.strip().isdigit() and int(length) > self._max_body_bytes:
            return GateResult(RequestTooLarge(f"request body is {int(length)} bytes; the limit is "
                                              f"{self._max_body_bytes}"), trusted)
        return GateResult(None, trusted)


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None
