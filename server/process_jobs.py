"""The SDK's ``/process`` jobs: an Anthropic Messages or OpenAI chat body in, that API's own
non-streaming answer out, through the same prepare -> cache turn -> engine path as the native
routes (``Runtime.complete``).

A job's ``input`` is the API request body itself, plus optional envelope keys that are taken out
before the body is read:

* ``api``: ``"anthropic"`` or ``"openai"``: which API the body is; it wins over recognition.
* ``headers``: ``{name: value}``, request headers a forwarding caller saw; only the session
  headers are read (``protocol.api.SESSION_HEADERS``), as on the native routes.
* ``count_tokens``: ``true`` (Anthropic only): answer ``{"input_tokens": N}`` as
  ``POST /v1/messages/count_tokens`` does.

Conveniences: ``prompt`` (a non-empty string) stands for ``messages: [{"role": "user",
"content": prompt}]``; a missing ``model`` is ``"default"``; ``stream`` is always off (the SDK's
``/process`` cannot stream).

Recognition without ``api`` (deterministic, looks only at keys and types, never at text):
the body is Anthropic when it has an Anthropic-only mark and no OpenAI-only mark, OpenAI when
it has an OpenAI-only mark and no Anthropic-only mark, OpenAI when it has neither (the shapes
agree there, and OpenAI is what ``/process`` has always taken), and refused (400, "set
input.api") when it has both. The marks are listed in ``ANTHROPIC_KEYS``/``OPENAI_KEYS`` and
``_marks``: top-level keys (``system``, ``stop_sequences`` / ``stop``, ``max_completion_tokens``,
...), tool definitions (``input_schema`` / ``type: function``), ``tool_choice``'s form and the
messages' roles, fields and content block types.

Session hint: ``Protocol.session_key`` derives it from the body exactly as for the native
routes (``prompt_cache_key``, ``metadata.user_id``'s ``session_id``, ``user``, the conversation
head) and from ``headers`` when given; nothing here reads a session.

Output (``Result.output``): ``response`` is the body the native route answers for the same
request (an Anthropic ``message`` or an OpenAI ``chat.completion``, usage with cached tokens
included); beside it ``api``, ``text`` (the answer's text: the SDK's text2text convention),
``finish_reason`` (the API's own: ``stop_reason`` or ``finish_reason``) and ``usage``; an OpenAI
answer also keeps ``tool_calls`` and ``reasoning`` when present.

Errors: every ``ProtocolError`` carries its API-shaped body; ``error_text`` is that body as JSON
text, which ``deepinfer_backend`` hands the SDK (4xx -> ``InvalidInput``: the SDK answers 400;
5xx -> a 500). A job is bounded by ``request_timeout_secs`` from its arrival (the SDK gives no
cancellation signal): on expiry the turn is cancelled, which aborts the engine request and
releases its cache references (``server/service.py``), and the job answers the API's 504
``timeout_error``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.api_types import ApiName
from protocol.errors import InvalidRequest, ProtocolError, RequestTimeout

if TYPE_CHECKING:
    from server.runtime import Runtime

ProcessApi = ApiName  # "anthropic" | "openai" here; "responses" is not taken by /process
PROCESS_APIS = ("anthropic", "openai")
ENVELOPE_KEYS = ("api", "headers", "count_tokens")

# Top-level keys only one of the two APIs has (the Messages API / the Chat Completions API).
ANTHROPIC_KEYS = frozenset({"system", "stop_sequences", "anthropic_version", "context_management",
                            "output_config", "mcp_servers", "container"})
OPENAI_KEYS = frozenset({"stop", "max_completion_tokens", "n", "stream_options", "response_format",
                         "prompt_cache_key", "reasoning_effort", "presence_penalty", "frequency_penalty",
                         "logprobs", "top_logprobs", "logit_bias", "parallel_tool_calls", "seed", "user",
                         "safety_identifier", "functions", "function_call", "chat_template_kwargs",
                         "modalities", "prediction", "audio", "web_search_options", "verbosity"})
_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "document",
                               "search_result", "server_tool_use", "web_search_tool_result"})
_OPENAI_PARTS = frozenset({"image_url", "input_audio", "file", "refusal"})
_OPENAI_ROLES = frozenset({"tool", "developer", "function"})
_ANTHROPIC_TOOL_CHOICES = frozenset({"auto", "any", "tool", "none"})


@dataclass(slots=True)
class ProcessRequest:
    """One job's input, recognised: the API, its body (envelope keys removed) and headers."""

    api: ProcessApi
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    count_tokens: bool = False


def error_text(exc: ProtocolError, api: ApiName) -> str:
    """The API-shaped error body as JSON text (what the SDK's ``{"error": ...}`` carries)."""
    return json.dumps(exc.body(api), separators=(",", ":"))


def parse_input(data: dict[str, Any]) -> ProcessRequest:
    """Recognise a job's input (module docstring); ``ProtocolError`` (400) for what cannot be."""
    explicit = data.get("api")
    if explicit is not None and explicit not in PROCESS_APIS:
        raise InvalidRequest(f"job input 'api' must be 'anthropic' or 'openai', got {explicit!r}",
                             param="api")
    body = {k: v for k, v in data.items() if k not in ENVELOPE_KEYS}
    api: ProcessApi = explicit if explicit is not None else recognise(body)
    headers = data.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise InvalidRequest("job input 'headers' must be an object of strings", param="headers")
    count_tokens = data.get("count_tokens") is True
    if count_tokens and api != "anthropic":
        raise InvalidRequest("job input 'count_tokens' is an Anthropic Messages operation; the body is "
                             "OpenAI-shaped (set input.api to 'anthropic')", param="count_tokens")
    if "messages" not in body:
        prompt = body.pop("prompt", None)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("job input needs 'messages' (a list) or 'prompt' (a non-empty string)",
                                 param="messages")
        body["messages"] = [{"role": "user", "content": prompt}]
    body.setdefault("model", "default")
    body["stream"] = False
    if count_tokens:
        body.pop("stream")
        body.pop("max_tokens", None)
    return ProcessRequest(api, body, {str(k).lower(): v for k, v in headers.items()}, count_tokens)


def recognise(body: dict[str, Any]) -> ProcessApi:
    """Which API ``body`` is when the job does not say (module docstring)."""
    anthropic, openai = _marks(body)
    if anthropic and openai:
        raise InvalidRequest(f"job input mixes the Anthropic Messages shape ({', '.join(anthropic)}) and the "
                             f"OpenAI chat shape ({', '.join(openai)}); set input.api", param="api")
    return "anthropic" if anthropic else "openai"


def _marks(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    anthropic = sorted(ANTHROPIC_KEYS & body.keys())
    openai = sorted(OPENAI_KEYS & body.keys())
    for tool in body.get("tools") or ():
        if isinstance(tool, dict) and "input_schema" in tool:
            anthropic.append("tools[].input_schema")
            break
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" in tool:
            openai.append("tools[].function")
            break
    choice = body.get("tool_choice")
    if isinstance(choice, str) or (isinstance(choice, dict) and choice.get("type") == "function"):
        openai.append("tool_choice")
    elif isinstance(choice, dict) and choice.get("type") in _ANTHROPIC_TOOL_CHOICES:
        anthropic.append("tool_choice")
    messages = body.get("messages")
    found: set[str] = set()
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        if message.get("role") in _OPENAI_ROLES or "tool_calls" in message or "tool_call_id" in message:
            found.add("openai:messages[].role/tool_calls")
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _ANTHROPIC_BLOCKS or (kind == "image" and "source" in part):
                found.add("anthropic:messages[].content blocks")
            elif kind in _OPENAI_PARTS:
                found.add("openai:messages[].content parts")
    for mark in sorted(found):
        side, _, name = mark.partition(":")
        (anthropic if side == "anthropic" else openai).append(name)
    return anthropic, openai


def shape_output(api: ApiName, response: dict[str, Any]) -> dict[str, Any]:
    """``Result.output`` for the API's response body (module docstring)."""
    if api == "anthropic":
        text = "".join(b.get("text", "") for b in response.get("content") or () if b.get("type") == "text")
        return {"api": api, "text": text, "finish_reason": response.get("stop_reason"),
                "usage": response.get("usage"), "response": response}
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = {"api": api, "text": message.get("content") or "", "finish_reason": choice.get("finish_reason"),
              "usage": response.get("usage"), "response": response}
    if message.get("tool_calls"):
        output["tool_calls"] = message["tool_calls"]
    if message.get("reasoning_content"):
        output["reasoning"] = message["reasoning_content"]
    return output


async def run(runtime: Runtime, request: ProcessRequest) -> dict[str, Any]:
    """Answer one job on the runtime's loop, bounded by ``request_timeout_secs``."""
    bound_s = runtime.config.request_timeout_secs
    try:
        async with asyncio.timeout(bound_s):
            if request.count_tokens:
                num_tokens = await runtime.count_tokens(request.body, request.headers)
                return {"api": request.api, "input_tokens": num_tokens,
                        "response": {"input_tokens": num_tokens}}
            response = await runtime.complete(request.api, request.body, request.headers)
    except TimeoutError:
        # The inner bound (ChatService) fires first when generation ran long; this one also
        # covers parsing and tokenizing. Either way the turn was cancelled and aborted.
        runtime.metrics.timeouts.inc()
        raise RequestTimeout(f"request exceeded request_timeout_secs ({bound_s:g} s)") from None
    return shape_output(request.api, response)
