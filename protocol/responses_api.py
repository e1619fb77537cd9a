"""``Protocol.prepare_responses``: a Responses API body -> the PreparedRequest every route uses.

Same rendering, tokenizer, output ledger, session keys, limits (``max_model_len``) and model
check as chat completions; the Responses-specific parts (items, tools, the store) are in
responses_convert.py, the stream in responses_emit.py. ``tool_choice``: ``none`` suppresses
calls; ``auto``/``required``/a named tool are accepted but not enforced (no constrained
decoding, as on the other routes); ``parallel_tool_calls`` is echoed and not enforced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from protocol import responses_schema as R
from protocol.api_types import PreparedRequest
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
    try:
        req = R.ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc) from None
    from protocol.api import (
        _tool_params as tool_params,  # the facade's helpers (they import us)
        check_tool_choice,
    )

    proto._check_model(req.model)
    conv, opts = responses_conversation(req, proto.responses_store, proto.ledger.signature, scope)
    bound = proto._tokenize(conv, scope, strict_parts=False)
    ids = bound.ids
    tool_choice, tool_name = _tool_choice(req.tool_choice)
    check_tool_choice(tool_choice, tool_name,
                      {route.name for route in opts.routes.values()} | set(opts.routes))
    return PreparedRequest(
        api="responses",
        model=req.model,
        stream=req.stream,
        prompt_ids=ids,
        num_prompt_tokens=len(ids),
        session_key=proto._session_key(headers, conv, req.metadata, req.prompt_cache_key, req.user),
        max_tokens=proto._max_tokens(len(ids), req.max_output_tokens),
        max_tokens_is_default=not req.max_output_tokens,
        **proto._sampling(req.temperature, req.top_p, None, None),
        thinking=conv.thinking,
        reasoning_effort=conv.effort if conv.thinking else None,
        tool_names=tuple(t["name"] for t in conv.tools),
        tool_choice=tool_choice,
        tool_choice_name=tool_name,
        include_usage=True,
        num_ledger_hits=bound.num_hits,
        num_ledger_divergences=bound.num_divergences,
        tool_params=tool_params(conv),
        responses=opts,
        ledger_binding=bound.binding,
        caller_scope=scope,
    )

