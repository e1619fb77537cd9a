"""The one error hierarchy of the project, rendered in each API's own shape.

Every package raises these (server, cache, rank adapters); the HTTP layer catches
``ProtocolError`` and answers with ``openai_body()`` / ``anthropic_body()`` and ``http_status``,
or, once a stream has started, with ``openai_sse()`` / ``anthropic_sse()``.

Invariant: each subclass fixes ``http_status`` (``status(api)``: the one API that answers
differently sets ``anthropic_http_status``) and the type names of both APIs; instances only
carry the message, the offending parameter and (for retryable errors) ``retry_after_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from pydantic import ValidationError

if TYPE_CHECKING:
    from protocol.api_types import ApiName


class ProtocolError(Exception):
    """Base class: an error a client gets to see, in its own API's format."""

    http_status: ClassVar[int] = 500
    anthropic_http_status: ClassVar[int | None] = None  # set where the Anthropic API answers differently
    anthropic_type: ClassVar[str] = "api_error"
    openai_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after_s = retry_after_s

    def status(self, api: ApiName) -> int:
        """The HTTP status for ``api`` ('openai' or 'anthropic')."""
        if api == "anthropic" and self.anthropic_http_status is not None:
            return self.anthropic_http_status
        return self.http_status

    # -- bodies -------------------------------------------------------------------------------
    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def body(self, api: ApiName) -> dict[str, Any]:
        """Body for ``api`` ('openai' or 'anthropic')."""
        return self.anthropic_body() if api == "anthropic" else self.openai_body()

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers: ``retry-after`` for retryable errors, ``x-should-retry``.

        Claude Code honours both (Claude Code's captured traffic, ``docs/claude-code.md``).
        """
        out: dict[str, str] = {"x-should-retry": "true" if self.retryable else "false"}
        if self.retry_after_s is not None:
            out["retry-after"] = str(max(1, round(self.retry_after_s)))
        return out

    # -- SSE frames (for errors after the stream started) --------------------------------------
    def openai_sse(self) -> bytes:
        return b"data: " + orjson.dumps(self.openai_body()) + b"\n\n"

    def anthropic_sse(self) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(self.anthropic_body()) + b"\n\n"

    def responses_sse(self) -> bytes:
        """The Responses API's stream ``error`` event (a stream with a response id uses
        ``response.failed``, protocol/responses_emit.py)."""
        data = {"type": "error", "code": self.code or self.openai_type, "message": self.message,
                "param": self.param}
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"

    def sse(self, api: ApiName) -> bytes:
        if api == "responses":
            return self.responses_sse()
        return self.anthropic_sse() if api == "anthropic" else self.openai_sse()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r})"


class InvalidRequest(ProtocolError):
    """400: the request is malformed or asks for something this endpoint cannot do."""

    http_status = 400
    anthropic_type = "invalid_request_error"
    openai_type = "invalid_request_error"

    @classmethod
    def from_validation(cls, exc: ValidationError, *, prefix: str = "") -> InvalidRequest:
        message, param = validation_error_message(exc)
        return cls(prefix + message, param=param)


class ModelNotAvailable(InvalidRequest):
    """The seed guide's text for a model name this endpoint does not serve: 400 on the OpenAI
    API, 410 ``not_found_error`` on the Anthropic API.

    Why 410: Claude Code >= 2.1.3xx resends any 400 or 422 up to six times, dropping a beta each
    time (six full requests of ~90-130 KB), and replaces a 404's message with its own generic
    text after a second request; 410 is answered once and its message shown verbatim, by
    2.1.197 as well (docs/claude-code.md). No HTTP client or SDK retries a 410.
    """

    default_code = "model_not_found"
    anthropic_http_status = 410
    anthropic_type = "not_found_error"

    def __init__(self, model: str) -> None:
        super().__init__(f"Model '{model}' is not available on this endpoint", param="model")
        self.model = model


class PromptTooLong(InvalidRequest):
    """400 ``prompt is too long: N tokens > M maximum``; Claude Code parses both numbers from
    this exact text to decide on reactive compaction."""

    default_code = "context_length_exceeded"

    def __init__(self, num_prompt_tokens: int, max_prompt_tokens: int) -> None:
        super().__init__(
            f"prompt is too long: {num_prompt_tokens} tokens > {max_prompt_tokens} maximum",
            param="messages",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_prompt_tokens = max_prompt_tokens


class ContextLimitExceeded(InvalidRequest):
    """400 ``input length and `max_tokens` exceed context limit: I + M > C, decrease input length
    or `max_tokens` and try again`` (the Anthropic API's text): the prompt fits, but not with
    ``max_tokens`` more. Claude Code (2.1.197 and 2.1.332 binaries) parses the three numbers and
    retries at once with ``max_tokens = C - I - 1000``, giving up when that is under 3000 or no
    smaller than before; OpenAI SDKs do not retry a 400. So a client never retries it for minutes,
    as it does an overloaded error."""

    default_code = "context_length_exceeded"

    def __init__(self, num_prompt_tokens: int, max_tokens: int, context_limit: int) -> None:
        super().__init__(
            f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} + {max_tokens} > "
            f"{context_limit}, decrease input length or `max_tokens` and try again",
            param="max_tokens",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.context_limit = context_limit


class AuthenticationError(ProtocolError):
    http_status = 401
    anthropic_type = "authentication_error"
    openai_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(ProtocolError):
    http_status = 403
    anthropic_type = "permission_error"
    openai_type = "permission_error"


class NotFound(ProtocolError):
    """404 for unknown routes and objects (model names get ``ModelNotAvailable``)."""

    http_status = 404
    anthropic_type = "not_found_error"
    openai_type = "not_found_error"


class RequestTooLarge(ProtocolError):
    """413: body over the size limit."""

    http_status = 413
    anthropic_type = "request_too_large"
    openai_type = "invalid_request_error"


class HeadersTimeout(ProtocolError):
    """408: the request line and headers did not arrive within the header timeout (slow client)."""

    http_status = 408
    anthropic_type = "timeout_error"
    openai_type = "timeout_error"
    retryable = True


class BodyTimeout(HeadersTimeout):
    """408: the request body did not arrive in time (its timeout plus the minimum rate)."""


class UnsupportedMediaType(ProtocolError):
    """415: a POST body that is not ``application/json`` (what a web page could send unasked)."""

    http_status = 415
    anthropic_type = "invalid_request_error"
    openai_type = "invalid_request_error"


class HeadersTooLarge(ProtocolError):
    """431: the request line and headers are over the server's bound."""

    http_status = 431
    anthropic_type = "invalid_request_error"
    openai_type = "invalid_request_error"


class InternalError(ProtocolError):
    http_status = 500
    anthropic_type = "api_error"
    openai_type = "server_error"
    retryable = True


class Overloaded(ProtocolError):
    """503: no capacity now (queue full, KV pool exhausted, ranks restarting); retry later."""

    http_status = 503
    anthropic_type = "overloaded_error"
    openai_type = "server_error"
    default_code = "overloaded"
    retryable = True


ServiceUnavailable = Overloaded


class RequestTimeout(ProtocolError):
    """504: the request did not finish (or start) in time."""

    http_status = 504
    anthropic_type = "timeout_error"
    openai_type = "timeout_error"
    retryable = True


def validation_error_message(exc: ValidationError, max_errors: int = 3) -> tuple[str, str | None]:
    """A short, human message naming the offending field(s), plus the first field's dotted path.

    pydantic's own ``str(exc)`` is multi-line and mentions internal union tags; clients get
    e.g. ``messages.2.content.0.type: Input should be 'text' ...``.
    """
    parts: list[str] = []
    first_param: str | None = None
    errors = exc.errors(include_url=False)
    locs = [tuple(str(p) for p in e.get("loc", ()) if not _is_union_tag(p)) for e in errors]
    # a union (str | list[...]) reports one error per branch; keep the deepest ones
    keep = [k
            for k, loc in enumerate(locs)
            if not any(len(o) > len(loc) and o[: len(loc)] == loc for o in locs)]
    for k in keep[:max_errors]:
        err = errors[k]
        loc = ".".join(locs[k])
        if first_param is None and loc:
            first_param = loc
        msg = err.get("msg", "invalid value")
        parts.append(f"{loc}: {msg}" if loc else msg)
    extra = len(keep) - len(parts)
    text = "; ".join(parts) if parts else "invalid request"
    if extra > 0:
        text += f" (and {extra} more error{'s' if extra > 1 else ''})"
    return text, first_param


def _is_union_tag(part: object) -> bool:
    # pydantic puts the chosen union member / discriminator tag into ``loc``; they mean nothing
    # to a client ("function-after[...]", "tagged-union[...]", "str", "list[...]").
    if not isinstance(part, str):
        return False
    return "[" in part or part in {"str", "int", "float", "bool", "dict", "list", "none", "missing"}


def error_from_exception(exc: BaseException) -> ProtocolError:
    """Map any exception to a ProtocolError (unknown ones become a generic 500, no traceback)."""
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, ValidationError):
        return InvalidRequest.from_validation(exc)
    return InternalError("internal server error")


def with_request_id(perr: ProtocolError, request_id: str) -> ProtocolError:
    """``perr`` naming the request id in its message when it is a server-side failure (5xx), so
    a report from the client finds the logged details; client errors (4xx) are left as they are."""
    if perr.http_status >= 500 and request_id not in perr.message:
        perr.message = f"{perr.message} (request id {request_id})"
    return perr


def lower_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """Case-insensitive view of request headers as a plain dict with lower-case keys."""
    if not headers:
        return {}
    return {str(k).lower(): v for k, v in headers.items()}
