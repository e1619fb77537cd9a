"""``Protocol.prepare_responses``: a Responses API body -> the PreparedRequest every route uses.

Same rendering, tokenizer, output ledger, session keys, limits (``max_model_len``) and model
check as chat completions: the steps are ``Protocol``'s public methods and the request is built by
``PreparedRequest.build``, as on the other routes (``protocol/api.py`` imports this module; this
module imports nothing of it at run time). The Responses-specific parts (items, tools, the store) are in
responses_convert.py, the stream in responses_emit.py. ``tool_choice``: ``none`` suppresses
calls; ``auto``/``required``/a named tool are accepted but not enforced (no constrained
decoding, as on the other routes); ``parallel_tool_calls`` is echoed and not enforced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from protocol import responses_schema as R
from protocol.api_types import PreparedRequest, check_tool_choice
from protocol.errors import InvalidRequest
from protocol.responses_convert import responses_conversation

if TYPE_CHECKING:
    from protocol.api import Protocol


def _tool_choice(choice: str | dict[str, Any] | None) -> tuple[str, str | None]:
    if choice is None or isinstance(choice, str):
        return choice or "auto", None
    name = choice.get("name")
    if choice.get("type") in ("function", "custom") and isinstance(name, str) and name:
        return "named", name
    if choice.get("type") == "allowed_tools":
        return ("required" if choice.get("mode") == "required" else "auto"), None
    return "auto", None  # a hosted tool type: nothing to force here


def prepare_responses(proto: Protocol, data: dict[str, Any],
                      headers: Mapping[str, str] | None, scope: bytes = b"") -> PreparedRequest:
    """``data``: the parsed body (``Protocol.prepare_responses`` reads it). The steps shared with
    the other routes are ``Protocol``'s public ones."""
    try:
        req = R.ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc) from None
    proto.check_model(req.model)
    conv, opts = responses_conversation(req, proto.responses_store, proto.ledger.signature, scope)
    bound = proto.encode_prompt(conv, scope, strict_parts=False)
    tool_choice, tool_name = _tool_choice(req.tool_choice)
    check_tool_choice(tool_choice, tool_name,
                      {route.name for route in opts.routes.values()} | set(opts.routes))
    return PreparedRequest.build(
        "responses", req.model, req.stream, prompt=bound, conv=conv,
        session_key=proto.session_key(headers, conv, req.metadata, req.prompt_cache_key, req.user),
        max_tokens=proto.max_tokens_for(len(bound.ids), req.max_output_tokens),
        max_tokens_is_default=not req.max_output_tokens,
        sampling=proto.engine_sampling(req.temperature, req.top_p, None, None),
        tool_choice=tool_choice, tool_choice_name=tool_name, include_usage=True, responses=opts, scope=scope,
    )
