"""OpenAI chat-completions wire models (requests; responses are emitted as plain dicts, with
``ChatCompletionResponse`` / ``ChatCompletionChunk`` validating their shape in tests).

Unknown fields are tolerated; invalid values are rejected. DeepSeek/vLLM extensions accepted:
``reasoning_content`` / ``reasoning`` on assistant messages, ``top_k``,
``chat_template_kwargs.{thinking,enable_thinking,reasoning_effort}``, ``thinking`` object.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from protocol import sampling as S


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    type: Literal["text", "input_text"]
    text: str


class ImagePart(_Wire):
    type: Literal["image_url", "input_image"]
    image_url: Any = None


class OtherPart(_Wire):
    model_config = ConfigDict(extra="allow")
    type: str


ContentPart = Union[TextPart, ImagePart, OtherPart]


class FunctionCall(_Wire):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""


class ToolCall(_Wire):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool messages need tool_call_id")
        if self.role in ("user", "system", "developer") and self.content is None:
            raise ValueError(f"{self.role} messages need content")
        return self


class FunctionDef(_Wire):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if not v.get("name"):
            raise ValueError("tool_choice.function.name is required")
        return v


class StreamOptions(_Wire):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Wire):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # sampling: ranges and their meaning in protocol/sampling.py
    temperature: float | None = Field(default=None, ge=0.0, le=S.TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=S.TOP_K_MIN_OPENAI)
    seed: int | None = Field(default=None, ge=S.SEED_WIRE_MIN, le=S.SEED_WIRE_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    presence_penalty: float | None = Field(default=None, ge=S.PENALTY_MIN, le=S.PENALTY_MAX)
    frequency_penalty: float | None = Field(default=None, ge=S.PENALTY_MIN, le=S.PENALTY_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        S.check_stop_sequences([v] if isinstance(v, str) else (v or []), S.MAX_STOP_SEQUENCES_OPENAI)
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(f"{info.field_name} are not supported by this endpoint (no engine returns them)")
        return v


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ResponseMessage(_Wire):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(_Wire):
    index: int
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None


class ChatCompletionResponse(_Wire):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ChunkChoice(_Wire):
    index: int
    delta: dict[str, Any]
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
