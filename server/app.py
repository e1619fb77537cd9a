"""The HTTP surface: Starlette routes served by uvicorn, orjson bodies, SSE streams.

Routes: ``POST /v1/messages`` (``?beta=true`` accepted), ``POST /v1/messages/count_tokens``,
``POST /v1/chat/completions``, ``POST /v1/responses`` (OpenAI Responses API), ``GET /v1/models``,
``GET /healthz``, ``GET /metrics`` and ``HEAD``/``GET /`` (Claude Code preconnects with ``HEAD /``).

Every error reaches the caller in its own API's shape (Anthropic for ``/v1/messages*``, OpenAI
otherwise), from ``protocol.errors``; nothing else escapes (an unexpected exception is logged
with its traceback and answered as a generic 500). Prompts and outputs are never logged.

Streams: the response headers go out with the first bytes the service writes, so an error that
happens before (auth, model, prompt too long, ranks restarting) is still a proper HTTP error.
Disconnects: streaming and non-streaming requests alike run under ``until_disconnect``, a watcher
that waits for ``http.disconnect`` and cancels the request's work, whose ``finally`` aborts the
engine request and releases its cache references (see ``server/service.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from protocol.api import session_hint
from protocol.api_types import ApiName
from protocol.errors import (
    InternalError,
    InvalidRequest,
    ModelNotAvailable,
    NotFound,
    Overloaded,
    PromptTooLong,
    ProtocolError,
    RequestTooLarge,
    error_from_exception,
    with_request_id,
)
from server.agent_hints import agent_hint
from server.auth import ApiKeyCheck, caller_scope
from server.config import WorkloadConfig
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from server.prepare import RequestPreparer

if TYPE_CHECKING:
    from protocol.api import Protocol
    from server.service import ChatService
    from server.symptoms import RuntimeSymptoms

log = logging.getLogger("deepinfer.server")

HealthStatus = Literal["ready", "loading", "degraded", "failed"]  # /healthz "status"

Write = Callable[[bytes], Awaitable[None]]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
LOADING_RETRY_AFTER_S = 5.0
T = TypeVar("T")


@dataclass(slots=True)
class HealthReport:
    status: HealthStatus
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def http_status(self) -> int:
        return 200 if self.status in ("ready", "degraded") else 503


@dataclass(slots=True)
class AppState:
    """What the routes need; the runtime fills ``protocol`` and ``service`` once they exist."""

    config: WorkloadConfig
    metrics: ServerMetrics
    health: Callable[[], HealthReport]
    protocol: Protocol | None = None
    service: ChatService | None = None
    symptoms: RuntimeSymptoms | None = None
    request_ids: Callable[[], str] = field(default_factory=lambda: RequestIds())
    preparer: RequestPreparer = field(default_factory=RequestPreparer)  # bodies -> prompts, off the loop


class RequestIds:
    """Request ids: 128 random bits each (``secrets``), never a counter. The id names the
    reply (``msg_``/``chatcmpl-``/``resp_`` + id) and a stored Responses conversation, so one
    caller's id must tell nothing about another's."""

    __slots__ = ()

    def __call__(self) -> str:
        return secrets.token_hex(16)


def api_of_path(path: str) -> ApiName:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    """An error status (>= 400) closes the connection: nothing more is read from that client."""
    if status >= 400:
        headers = {**(headers or {}), "connection": "close"}
    return Response(orjson.dumps(body), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(exc: ProtocolError, api: ApiName, request_id: str | None = None) -> Response:
    """The error in ``api``'s shape; with a request id, in the ``x-request-id`` header (and in
    the message of a 5xx, see ``with_request_id``)."""
    headers = exc.headers()
    if request_id is not None:
        exc = with_request_id(exc, request_id)
        headers["x-request-id"] = request_id
    return json_response(exc.status(api), exc.body(api), headers)


def check_declared_length(request: Request, limit_bytes: int) -> None:
    """Refuse (413) a body whose Content-Length is over ``limit_bytes`` without reading it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_bytes = int(declared)
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
        if declared_bytes > limit_bytes:
            raise RequestTooLarge(f"request body is {declared_bytes} bytes; the limit is {limit_bytes}")


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, refusing (413) anything over ``limit_bytes`` before buffering it all."""
    check_declared_length(request, limit_bytes)
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > limit_bytes:
                raise RequestTooLarge(f"request body exceeds the limit of {limit_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Normal for a client that gives up; no one reads the answer, and it is no server error.
        raise InvalidRequest("the client disconnected before the request body was complete") from None
    return b"".join(chunks)


class StreamResponse(Response):
    """Runs ``run(write)``; headers go out with the first write. Cancels ``run`` on disconnect.

    If ``run`` raises before writing anything, a JSON error in ``api``'s shape is sent instead.
    """

    def __init__(self, run: Callable[[Write], Awaitable[None]], api: ApiName, request_id: str,
                 on_disconnect: Callable[[], None]) -> None:
        self._run = run
        self._api = api
        self._request_id = request_id
        headers = [(b"x-request-id", request_id.encode())]
        self._start = {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers}
        self._on_disconnect = on_disconnect
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def write(data: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await send(self._start)
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            await until_disconnect(self._run(write), receive, self._on_disconnect)
        except ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - answered in the caller's shape
            perr = _log_unexpected(exc, self._request_id)
            if not started:
                self.status_code = perr.status(self._api)
                await error_response(perr, self._api, self._request_id)(scope, receive, send)
                return
            perr = with_request_id(perr, self._request_id)
            await send({"type": "http.response.body", "body": perr.sse(self._api), "more_body": True})
        if started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:  # nothing was produced at all: still answer
            await error_response(InternalError("empty response"), self._api,
                                 self._request_id)(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected while its request ran; the request's work was cancelled."""


async def until_disconnect(coro: Awaitable[T], receive: Receive, on_disconnect: Callable[[], None]) -> T:
    """Run ``coro`` (the request's whole engine work) while watching the connection: when the
    client disconnects first, cancel it (its ``finally`` aborts the engine request and releases
    the cache references, see ``server/service.py``), call ``on_disconnect`` and raise
    ``ClientGone``. Streaming and non-streaming requests both run under this, so no engine
    request outlives its client (a non-streaming one used to run to ``max_tokens``)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():  # the client went away (or we are being cancelled)
            work.cancel()
            on_disconnect()
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.cancelled() or not watcher.done():
            raise  # we are being cancelled ourselves
        raise ClientGone() from None


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _log_unexpected(exc: BaseException, request_id: str | None = None) -> ProtocolError:
    perr = error_from_exception(exc)
    if not isinstance(exc, ProtocolError):
        log.error("request %s: unexpected error", request_id or "-", exc_info=exc)
    return perr


class Routes:
    """The route handlers, bound to one ``AppState`` (no module-level state)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.auth = ApiKeyCheck(state.config.resolved_api_key())

    # -- helpers ---------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> bytes:
        """Raise unless authorised; the caller's scope (``server/auth.caller_scope``)."""
        headers = request.headers
        x_api_key, authorization = headers.get("x-api-key"), headers.get("authorization")
        self.auth.check(x_api_key, authorization)
        return caller_scope(x_api_key, authorization)

    def _ready_parts(self) -> tuple[Protocol, ChatService]:
        protocol, service = self.state.protocol, self.state.service
        if protocol is None or service is None:
            raise Overloaded("the model is still loading", retry_after_s=LOADING_RETRY_AFTER_S)
        return protocol, service

    # -- chat routes -----------------------------------------------------------------------------
    async def messages(self, request: Request) -> Response:
        return await self._chat(request, "anthropic", "messages")

    async def chat_completions(self, request: Request) -> Response:
        return await self._chat(request, "openai", "chat_completions")

    async def responses(self, request: Request) -> Response:
        return await self._chat(request, "responses", "responses")

    async def _chat(self, request: Request, api: ApiName, route: str) -> Response:
        arrival_s = time.perf_counter()
        metrics = self.state.metrics
        request_id = self.state.request_ids()
        try:
            scope = self._check_auth(request)
            check_declared_length(request, self.state.config.max_body_bytes)
            protocol, service = self._ready_parts()
            headers = request.headers
            # Start a known session's L1 restore from the headers alone: it overlaps reading,
            # parsing and tokenizing a body that can be megabytes long.
            service.prefetch(session_hint(headers))
            hint = agent_hint(headers)  # Claude Code's agent/request-class headers (server/agent_hints.py)
            body = await read_body(request, self.state.config.max_body_bytes)
            prepare = {"anthropic": protocol.prepare_anthropic, "responses": protocol.prepare_responses}
            prepared = await self.state.preparer.run(prepare.get(api, protocol.prepare_openai), body, headers,
                                                     scope=scope)
            if prepared.stream:
                async def run(write: Write) -> None:
                    await service.stream(prepared, request_id, write, arrival_s, hint)

                metrics.count_request(route, 200)
                return StreamResponse(run, api, request_id, metrics.disconnects.inc)
            try:
                result = await until_disconnect(service.complete(prepared, request_id, arrival_s, hint),
                                                request.receive, metrics.disconnects.inc)
            except ClientGone:
                metrics.count_request(route, 499)
                return Response(b"", status_code=499)  # nobody reads it
            metrics.count_request(route, 200)
            return Response(orjson.dumps(result), media_type="application/json",
                            headers={"x-request-id": request_id})
        except Exception as exc:  # noqa: BLE001 - every error in the caller's shape
            perr = _log_unexpected(exc, request_id)
            metrics.count_request(route, perr.status(api))
            self._observe_refusal(perr)
            return error_response(perr, api, request_id)

    def _observe_refusal(self, perr: ProtocolError) -> None:
        symptoms = self.state.symptoms
        if symptoms is None:
            return
        if isinstance(perr, ModelNotAvailable):
            symptoms.observe_unknown_model(perr.model)
        elif isinstance(perr, PromptTooLong):
            symptoms.observe_prompt_too_long(perr.num_prompt_tokens, perr.max_prompt_tokens)

    async def count_tokens(self, request: Request) -> Response:
        request_id = self.state.request_ids()
        try:
            scope = self._check_auth(request)
            body = await read_body(request, self.state.config.max_body_bytes)
            protocol, _ = self._ready_parts()
            num_tokens = await self.state.preparer.run(protocol.count_tokens_anthropic, body, request.headers,
                                                       scope=scope)
            self.state.metrics.count_request("count_tokens", 200)
            return json_response(200, {"input_tokens": int(num_tokens)}, {"x-request-id": request_id})
        except Exception as exc:  # noqa: BLE001
            perr = _log_unexpected(exc, request_id)
            self.state.metrics.count_request("count_tokens", perr.status("anthropic"))
            return error_response(perr, "anthropic", request_id)

    # -- metadata routes -------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        is_anthropic = "anthropic-version" in request.headers
        api: ApiName = "anthropic" if is_anthropic else "openai"
        try:
            self._check_auth(request)
        except ProtocolError as exc:
            return error_response(exc, api)
        cfg = self.state.config
        names = [cfg.model_name, cfg.slug, "default"]
        if is_anthropic:
            data: list[dict[str, Any]] = [
                {"type": "model", "id": n, "display_name": n, "created_at": "2026-10-17T00:00:00Z"}
                for n in names]
            return json_response(200, {"data": data, "has_more": False, "first_id": names[0],
                                       "last_id": names[-1]})
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "deepinfer",
                 "max_model_len": cfg.max_model_len} for n in names]
        return json_response(200, {"object": "list", "data": data})

    def _authenticated(self, request: Request) -> bool:
        try:
            self._check_auth(request)
        except ProtocolError:
            return False
        return True

    async def healthz(self, request: Request) -> Response:
        """The status for everyone (load balancers, probes); reasons, warnings and the rank
        details (pids, failure texts) only with the API key, when one is set."""
        report = self.state.health()
        if not self._authenticated(request):
            return json_response(report.http_status, {"status": report.status})
        body = {"status": report.status, "reasons": report.reasons, "warnings": report.warnings,
                **report.details}
        return json_response(report.http_status, body)

    async def metrics(self, request: Request) -> Response:
        if self.state.config.metrics_require_key:
            try:
                self._check_auth(request)
            except ProtocolError as exc:
                return error_response(exc, "openai")
        return Response(self.state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def root(self, request: Request) -> Response:
        if request.method == "HEAD":
            return Response(b"", status_code=200)
        return json_response(200, {"service": "deepinfer-backend", "model": self.state.config.model_name,
                                   "status": self.state.health().status})


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    api = api_of_path(request.url.path)
    if exc.status_code == 405:
        perr: ProtocolError = InvalidRequest(f"method {request.method} is not allowed on {request.url.path}")
        return json_response(405, perr.body(api),
                             {"allow": exc.headers.get("allow", "") if exc.headers else ""})
    if exc.status_code == 404:
        perr = NotFound(f"no route {request.method} {request.url.path}")
    else:
        perr = InternalError(str(exc.detail))
    return json_response(exc.status_code, perr.body(api))


class ServerApp:
    """The ASGI app: the chat routes directly (the streaming hot path skips Starlette's
    middleware, whose ``send`` wrappers would add two coroutine calls to every SSE write), every
    other route through Starlette. The chat handlers answer every error themselves."""

    def __init__(self, routes: Routes, fallback: Starlette) -> None:
        self._fast = {
            "/v1/messages": routes.messages,
            "/v1/chat/completions": routes.chat_completions,
            "/v1/responses": routes.responses,
        }
        self._fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._fast.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self._fallback(scope, receive, send)


def create_app(state: AppState) -> ServerApp:
    r = Routes(state)
    routes = [
        Route("/v1/messages", r.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", r.count_tokens, methods=["POST"]),
        Route("/v1/chat/completions", r.chat_completions, methods=["POST"]),
        Route("/v1/responses", r.responses, methods=["POST"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/healthz", r.healthz, methods=["GET"]),
        Route("/metrics", r.metrics, methods=["GET"]),
        Route("/", r.root, methods=["GET", "HEAD"]),
    ]
    fallback = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
    # no 307 to the path without its trailing slash: Starlette builds that redirect from the
    # client's Host header (a reflected, attacker-chosen URL); a 404 in the API's shape instead
    fallback.router.redirect_slashes = False
    return ServerApp(r, fallback)
