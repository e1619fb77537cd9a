"""The protocol facade the server calls: request bytes -> prompt ids; token ids -> SSE bytes.

Use::

    proto = Protocol(PromptTokenizer.load(model_dir), OutputLedger(), served_model_names,
                     max_model_len)
    prepared = proto.prepare_anthropic(body_bytes, request.headers)   # raises ProtocolError
    stream = proto.new_stream(prepared, request_id)
    yield stream.start(num_cached_tokens)            # message_start / role chunk (streaming)
    for out in engine_outputs:
        data = stream.feed(out.token_ids)            # SSE bytes, may be b""
        if data: yield data
        if stream.stop_hit: abort the engine request; break
    yield stream.finish(reason, num_prompt, num_cached, num_output)  # also records the ledger
    # non-streaming: feed()/finish() return b""; then return stream.response_body()

Every method raises only ``ProtocolError`` subclasses for bad input. ``ResponseStream`` is not
thread-safe: one stream is driven by one task.

The ledger: ``ResponseStream.finish`` records the turn's output ids in the ``OutputLedger`` the
stream was created with (no call needed from the server). Anthropic thinking blocks carry the
ledger handle as their ``signature``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.errors import InternalError, ProtocolError

__all__ = ["PreparedRequest", "Protocol", "ResponseStream", "ProtocolError"]


@dataclass(slots=True)
class PreparedRequest:
    """One validated request, rendered and tokenized; everything the engine and stream need.

    Invariants: ``prompt_ids`` is a 1-D int32 array with ``len == num_prompt_tokens >= 1``;
    ``max_tokens >= 1`` and ``num_prompt_tokens + max_tokens <= max_model_len``.
    """

    api: str  # "openai" | "anthropic"
    model: str
    stream: bool
    prompt_ids: np.ndarray
    num_prompt_tokens: int
    session_key: str  # X-Claude-Code-Session-Id, else a hash of the conversation head
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    thinking: bool = False
    reasoning_effort: int | None = None  # 1..100 in thinking mode, None in chat mode
    tool_names: tuple[str, ...] = ()
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "named"
    tool_choice_name: str | None = None
    include_usage: bool = False  # OpenAI stream_options.include_usage
    num_ledger_hits: int = 0  # assistant turns rendered from the ledger
    num_ledger_divergences: int = 0  # turns whose client view differed from the ledger
    # internal, for the stream: tool name -> declared parameter names (wrapper collapse)
    tool_params: dict[str, frozenset[str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class ResponseStream:
    """Turns one request's generated token ids into SSE bytes (or a response body)."""

    output_ids: list[int]
    stop_hit: bool

    def start(self, num_cached_tokens: int = 0) -> bytes:
        """Opening frames (Anthropic message_start, OpenAI role chunk); b"" if not streaming.
        Idempotent; ``feed`` calls it implicitly."""
        raise InternalError("not implemented")

    def feed(self, token_ids: list[int]) -> bytes:
        """Consume newly generated ids; return SSE bytes to send now (may be b"")."""
        raise InternalError("not implemented")

    def finish(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_output_tokens: int,
    ) -> bytes:
        """Final SSE bytes (closing blocks, usage, stop). Records the turn in the ledger."""
        raise InternalError("not implemented")

    def error(self, exc: BaseException) -> bytes:
        """An error frame in this stream's format (after the stream started)."""
        raise InternalError("not implemented")

    def response_body(self) -> dict[str, Any]:
        """Non-streaming body; valid after ``finish``."""
        raise InternalError("not implemented")


class Protocol:
    """Stateless per request; holds the tokenizer (with its segment cache) and the ledger."""

    def __init__(
        self,
        tokenizer: Any,
        ledger: Any,
        served_model_names: Iterable[str],
        max_model_len: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.served_model_names = frozenset(served_model_names)
        self.max_model_len = max_model_len

    def prepare_anthropic(self, body: bytes | dict[str, Any], headers: Mapping[str, str]) -> PreparedRequest:
        raise InternalError("not implemented")

    def prepare_openai(self, body: bytes | dict[str, Any], headers: Mapping[str, str]) -> PreparedRequest:
        raise InternalError("not implemented")

    def count_tokens_anthropic(self, body: bytes | dict[str, Any], headers: Mapping[str, str] | None = None) -> int:
        raise InternalError("not implemented")

    def new_stream(self, prepared: PreparedRequest, request_id: str) -> ResponseStream:
        raise InternalError("not implemented")
