"""PreparedRequest: the record passed from the facade to the engine side and the stream.

Every route builds it through ``PreparedRequest.build`` (``protocol/api.py``'s Anthropic and
chat completions, ``protocol/responses_api.py``'s Responses API), so the fields that come from
the tokenized prompt, the conversation and the sampling values are filled in one place.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from protocol.errors import InvalidRequest

if TYPE_CHECKING:
    from protocol.bound_prompt import BoundPrompt
    from protocol.conversation import Conversation
    from protocol.responses_convert import ResponsesOptions
    from protocol.sampling import EngineSampling


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
    # A one-off beside its session, not a turn of it: a structured output with no tools offered
    # (Claude Code's session titles, which carry no class header by default: docs/claude-code.md)
    one_off: bool = False

    @classmethod
    def build(cls, api: ApiName, model: str, stream: bool, *, prompt: BoundPrompt, conv: Conversation,
              session_key: str, max_tokens: int, sampling: EngineSampling, tool_choice: str,
              tool_choice_name: str | None, include_usage: bool, scope: bytes,
              max_tokens_is_default: bool = False, stop: tuple[str, ...] = (), show_reasoning: bool = True,
              responses: ResponsesOptions | None = None, one_off: bool = False) -> PreparedRequest:
        """The request of a validated body: ``prompt`` (``Protocol.encode_prompt``) gives the
        ids and their ledger binding, ``conv`` the thinking mode and the tools the model is
        offered, ``scope`` the caller's scope; the rest is the API's own reading of its body."""
        names: list[str] = []
        params: dict[str, frozenset[str]] = {}
        for tool in conv.callable_tools():
            name = str(tool.get("name", ""))
            names.append(name)
            declared = tool.get("parameters") or {}
            props = declared.get("properties") if isinstance(declared, dict) else None
            params[name] = frozenset(props) if isinstance(props, dict) else frozenset()
        ids = prompt.ids
        return cls(
            api=api,
            model=model,
            stream=stream,
            prompt_ids=ids,
            num_prompt_tokens=len(ids),
            session_key=session_key,
            max_tokens=max_tokens,
            max_tokens_is_default=max_tokens_is_default,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=stop,
            thinking=conv.thinking,
            reasoning_effort=conv.effort if conv.thinking else None,
            tool_names=tuple(names),
            tool_choice=tool_choice,
            tool_choice_name=tool_choice_name,
            include_usage=include_usage,
            show_reasoning=show_reasoning,
            num_ledger_hits=prompt.num_hits,
            num_ledger_divergences=prompt.num_divergences,
            tool_params=params,
            responses=responses,
            ledger_binding=prompt.binding,
            caller_scope=scope,
            one_off=one_off,
        )


def check_tool_choice(tool_choice: str, name: str | None, declared: Collection[str]) -> None:
    """As the APIs do: a forced tool call needs tools, and a named tool must be declared (a
    400 instead of a request the model cannot satisfy)."""
    if tool_choice == "required" and not declared:
        raise InvalidRequest("tool_choice requires a tool call, but the request declares no tools",
                             param="tool_choice")
    if tool_choice == "named" and name not in declared:
        raise InvalidRequest(f"tool_choice names the tool {name!r}, which is not in tools",
                             param="tool_choice")
