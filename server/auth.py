"""API-key check for the HTTP routes (``x-api-key`` or ``Authorization: Bearer``).

Claude Code sends ``x-api-key`` (``ANTHROPIC_API_KEY``) or ``Authorization: Bearer``
(``ANTHROPIC_AUTH_TOKEN``); OpenAI clients send Bearer. A request that carries both, with
different values, is refused (401), as the hosted endpoint does: which one was meant cannot be
known. Comparison is constant-time, and the key never appears in a message or a log line.
"""

from __future__ import annotations

import hashlib
import hmac

from protocol.errors import AuthenticationError


class ApiKeyCheck:
    """Invariant: ``check`` returns only when the request carries exactly the configured key."""

    __slots__ = ("_key",)

    def __init__(self, api_key: str | None) -> None:
        self._key = api_key.encode() if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def check(self, x_api_key: str | None, authorization: str | None) -> None:
        """Raise ``AuthenticationError`` unless the request is authorised."""
        if self._key is None:
            return
        bearer: str | None = None
        if authorization is not None:
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise AuthenticationError("Authorization header must be 'Bearer <api key>'")
            bearer = value.strip()
        if x_api_key is not None and bearer is not None and not hmac.compare_digest(
            x_api_key.encode(), bearer.encode()
        ):
            raise AuthenticationError(
                "two different API keys were sent (x-api-key and Authorization: Bearer); send one"
            )
        presented = x_api_key if x_api_key is not None else bearer
        if presented is None:
            raise AuthenticationError(
                "missing API key: send it as x-api-key or Authorization: Bearer"
            )
        if not hmac.compare_digest(presented.encode(), self._key):
            raise AuthenticationError("invalid API key")


def caller_scope(x_api_key: str | None, authorization: str | None) -> bytes:
    """Who is calling, as far as the server can tell: 16 bytes of SHA-256 over the credential
    the request presented (``x-api-key``, else the ``Bearer`` value), b"" when it presented none.

    The output ledger and the Responses store serve stored state only to the scope that made it.
    With one configured key (or behind a platform that forwards its own key) every caller has the
    same scope, so the ledger's prefix binding must hold alone; with no key configured, callers
    that present different keys are still kept apart. The key itself is never kept."""
    presented = x_api_key
    if presented is None and authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        presented = value.strip() if scheme.lower() == "bearer" else None
    if not presented:
        return b""
    return hashlib.sha256(b"deepinfer-backend caller scope\x00" + presented.encode()).digest()[:16]
