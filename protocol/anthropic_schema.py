"""Anthropic Messages API wire models (requests; responses are built as plain dicts by the
emitter for speed, with ``MessageResponse`` documenting and validating their shape in tests).

Unknown fields are tolerated everywhere (real clients send betas we do not know); invalid
values are rejected. Unknown content block types are kept as ``OtherBlock`` and rendered as
``[Unsupported <type>]``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from protocol import sampling as S


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


class CacheControl(_Wire):
    type: str = "ephemeral"
    ttl: str | None = None


class TextBlock(_Wire):
    type: Literal["text"] = "text"
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Wire):
    type: Literal["image"] = "image"
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Wire):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str = Field(min_length=1)
    input: Any = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class OtherBlock(_Wire):
    """Any block type we do not interpret (document, search_result, server_tool_use, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str


class ToolReferenceBlock(_Wire):
    """A tool search result: loads the named (deferred) tool's definition at this point of the
    conversation (Anthropic's ``advanced-tool-use`` beta; docs/protocol.md, deferred tools)."""

    type: Literal["tool_reference"] = "tool_reference"
    tool_name: str = Field(min_length=1, max_length=256)


def _tool_result_part_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in ("text", "image", "tool_reference") else "other"


ToolResultPart = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[ToolReferenceBlock, Tag("tool_reference")],
        Annotated[OtherBlock, Tag("other")],
    ],
    Discriminator(_tool_result_part_tag),
]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Wire):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str


_KNOWN_BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if t is None:
        return "missing"
    return t if t in _KNOWN_BLOCKS else "other"


class _MissingType(_Wire):
    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]


ContentBlock = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[ToolUseBlock, Tag("tool_use")],
        Annotated[ToolResultBlock, Tag("tool_result")],
        Annotated[ThinkingBlock, Tag("thinking")],
        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
        Annotated[OtherBlock, Tag("other")],
        Annotated[_MissingType, Tag("missing")],
    ],
    Discriminator(_block_tag),
]


class Message(_Wire):
    # "ctx"/"msg" are Claude Code's extra roles for context text; treated as user text.
    role: Literal["user", "assistant", "system", "ctx", "msg"]
    content: str | list[ContentBlock]


class Tool(_Wire):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; server tools (web_search_...) are not served
    cache_control: CacheControl | None = None
    # Left out of the prompt's tools block until a tool_reference loads it (docs/protocol.md).
    defer_loading: bool | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_nonempty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("tool name must not be empty")
        return v


class ThinkingConfig(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)
    # "summarized" (default) | "omitted" | "updates": the last two send thinking blocks without
    # their text (V4.1 writes no separate progress updates). Other values are treated as
    # "summarized", so a newer client's display mode never costs it a 400.
    display: str | None = None


class OutputConfig(_Wire):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class _RequestBase(_Wire):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)  # Anthropic refuses an empty list too
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(_RequestBase):
    max_tokens: int = Field(ge=1)
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # sampling: ranges and their meaning in protocol/sampling.py
    temperature: float | None = Field(default=None, ge=0.0, le=S.TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=S.TOP_K_MIN_ANTHROPIC)
    context_management: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        S.check_stop_sequences(v or [], S.MAX_STOP_SEQUENCES_ANTHROPIC)
        return v


class CountTokensRequest(_RequestBase):
    pass


class Usage(_Wire):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class MessageResponse(_Wire):
    """Shape of a non-streaming response (used to validate our bodies in tests)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn",
                         "refusal"] | None
    stop_sequence: str | None = None
    usage: Usage
