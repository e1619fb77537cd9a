"""OpenAI Responses API wire models (``POST /v1/responses`` requests).

Unknown fields are tolerated; invalid values are rejected with a 400 naming the field. Input
items are validated one by one (``input_item``) so an error names ``input.N``. What each field
does here is in docs/responses.md; fields this server cannot honour (``background``,
``conversation``, stored ``prompt`` templates, logprobs) are refused rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol import sampling as S

MAX_KEY_CHARS = 512


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class ImagePart(_Wire):
    type: Literal["input_image"]


class OtherPart(_Wire):
    model_config = ConfigDict(extra="allow")
    type: str


Part = Union[TextPart, ImagePart, OtherPart]


class MessageItem(_Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None


class FunctionCallItem(_Wire):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = ""
    namespace: str | None = None
    id: str | None = None


class CustomToolCallItem(_Wire):
    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str = ""
    id: str | None = None


class CallOutputItem(_Wire):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Part]


class ReasoningItem(_Wire):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None
    encrypted_content: str | None = None


class ItemReference(_Wire):
    type: Literal["item_reference"]
    id: str = Field(min_length=1)


InputItem = Union[MessageItem, FunctionCallItem, CustomToolCallItem, CallOutputItem, ReasoningItem,
                  ItemReference]
ITEM_MODELS: dict[str, type[_Wire]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "custom_tool_call": CustomToolCallItem,
    "function_call_output": CallOutputItem,
    "custom_tool_call_output": CallOutputItem,
    "reasoning": ReasoningItem,
    "item_reference": ItemReference,
}


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(_Wire):
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    format: dict[str, Any] | None = None


class NamespaceTool(_Wire):
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    tools: list[FunctionTool | CustomTool] = Field(default_factory=list)


# hosted tools this server cannot run; a request may carry them, the model is not told of them
IGNORED_TOOL_TYPES = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                                "web_search_2025_08_26"})


class Reasoning(_Wire):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


class TextFormat(_Wire):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Wire):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=S.TEMPERATURE_MAX)  # protocol/sampling.py
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_CHARS)
    include: list[str] | None = None
    text: TextConfig | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_KEY_CHARS)
    metadata: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("auto", "none", "required"):
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or an object")
        if isinstance(v, dict) and not isinstance(v.get("type"), str):
            raise ValueError("tool_choice objects need a 'type'")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background responses are not supported by this server")
        return v

    @field_validator("conversation", "prompt")
    @classmethod
    def _no_server_state(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("server-side conversations and stored prompt templates are not supported; "
                             "send input")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported by this endpoint")
        return v
