"""PreparedRequest: the record passed from the facade to the engine side and the stream."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from protocol.responses_convert import ResponsesOptions


# Which API a request came in on: its error shape, its stream format and its metric label.
ApiName = Literal["openai", "anthropic", "responses"]


class TurnFinish(str, enum.Enum):
    """How a response ended, in API-neutral words; each emitter maps it to its API's name
    (``STOP_REASONS`` / ``FINISH_REASONS``). The value is the OpenAI Chat spelling."""

    STOP = "stop"  # the model ended its answer
    LENGTH = "length"  # max_tokens (or the context) cut it
    TOOL_CALLS = "tool_calls"  # it ended in tool calls: the client comes back with results
    STOP_SEQUENCE = "stop_sequence"  # a client stop sequence matched


@dataclass(slots=True)
class PreparedRequest:
    """One validated request, rendered and tokenized; everything the engine and stream need.

    Invariants: ``prompt_ids`` is a 1-D int32 array with ``len == num_prompt_tokens >= 1``;
    ``max_tokens >= 1`` and ``num_prompt_tokens + max_tokens <= max_model_len``.
    """

    api: ApiName
    model: str
    stream: bool
    prompt_ids: np.ndarray
    num_prompt_tokens: int
    session_key: str  # X-Claude-Code-Session-Id, else a hash of the conversation head
    max_tokens: int
    # True when the client sent no max_tokens (it is the room left in max_model_len): the KV pool
    # may cut it shorter. A max_tokens the client sent is refused (400) when the pool cannot hold it.
    max_tokens_is_default: bool = False
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
    # False: Anthropic thinking.display "omitted"/"updates" (empty thinking blocks)
    show_reasoning: bool = True
    num_ledger_hits: int = 0  # assistant turns rendered from the ledger
    num_ledger_divergences: int = 0  # turns whose client view differed from the ledger
    # internal, for the stream: tool name -> declared parameter names (wrapper collapse)
    tool_params: dict[str, frozenset[str]] = field(default_factory=dict)
    responses: ResponsesOptions | None = None  # the Responses API's options (api == "responses")
    # the caller scope's and whole prompt's binding: the reply's ledger entry is bound to it
    # (protocol/ledger.py); b"" (a request built by hand): the reply is not recorded
    ledger_binding: bytes = b""
    caller_scope: bytes = b""  # the caller's scope (server/auth.caller_scope); b"": not told apart
