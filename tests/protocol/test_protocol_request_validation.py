"""Validation as the APIs do it. Anthropic refuses an empty ``messages``; a
``tool_choice`` that forces a tool call without tools, or names an undeclared tool, is a 400 on
all three APIs; count_tokens checks the model name.

Red before: every case below was accepted (a forced or named tool the model could not call).
"""

from __future__ import annotations

from typing import Any

import pytest

from protocol.api import Protocol
from protocol.errors import InvalidRequest, ModelNotAvailable

MODEL = "deepseek-v4.1-flash"
HI = [{"role": "user", "content": "hi"}]
A_TOOL = {"name": "Read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
O_TOOL = {"type": "function",
          "function": {"name": "Read", "parameters": {"type": "object", "properties": {}}}}
R_TOOL = {"type": "function", "name": "Read", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("route", ["prepare_anthropic", "count_tokens_anthropic"])
def test_anthropic_refuses_empty_messages(proto: Protocol, route: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": []}
    if route == "prepare_anthropic":
        body["max_tokens"] = 8
    with pytest.raises(InvalidRequest) as err:
        getattr(proto, route)(body, {})
    assert err.value.param == "messages"


def test_count_tokens_checks_the_model_name(proto: Protocol) -> None:
    with pytest.raises(ModelNotAvailable):
        proto.count_tokens_anthropic({"model": "claude-opus-4-8", "messages": HI}, {})
    assert proto.count_tokens_anthropic({"model": MODEL, "messages": HI}, {}) > 0


REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("prepare_anthropic", {"max_tokens": 8, "messages": HI, "tool_choice": {"type": "any"}}),
    ("prepare_anthropic", {"max_tokens": 8, "messages": HI, "tool_choice": {"type": "tool", "name": "Read"}}),
    ("prepare_anthropic", {"max_tokens": 8, "messages": HI, "tools": [A_TOOL],
                           "tool_choice": {"type": "tool", "name": "Write"}}),
    ("prepare_openai", {"messages": HI, "tool_choice": "required"}),
    ("prepare_openai", {"messages": HI, "tool_choice": {"type": "function", "function": {"name": "Read"}}}),
    ("prepare_openai", {"messages": HI, "tools": [O_TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "Write"}}}),
    ("prepare_responses", {"input": "hi", "tool_choice": "required"}),
    ("prepare_responses",
     {"input": "hi", "tools": [R_TOOL], "tool_choice": {"type": "function", "name": "Write"}}),
]
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("prepare_anthropic",
     {"max_tokens": 8, "messages": HI, "tools": [A_TOOL], "tool_choice": {"type": "any"}}),
    ("prepare_anthropic", {"max_tokens": 8, "messages": HI, "tools": [A_TOOL],
                           "tool_choice": {"type": "tool", "name": "Read"}}),
    ("prepare_anthropic", {"max_tokens": 8, "messages": HI, "tools": [A_TOOL, {**A_TOOL, "name": "Late",
                                                                             "defer_loading": True}],
                           "tool_choice": {"type": "tool", "name": "Late"}}),  # deferred: still declared
    ("prepare_anthropic", {"max_tokens": 8, "messages": HI, "tool_choice": {"type": "none"}}),
    ("prepare_openai", {"messages": HI, "tools": [O_TOOL], "tool_choice": "required"}),
    ("prepare_openai", {"messages": HI, "tool_choice": "auto"}),
    ("prepare_openai", {"messages": HI, "tools": [O_TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "Read"}}}),
    ("prepare_responses",
     {"input": "hi", "tools": [R_TOOL], "tool_choice": {"type": "function", "name": "Read"}}),
    ("prepare_responses",
     {"input": "hi", "tools": [{"type": "namespace", "name": "fs", "description": "files",
                                                    "tools": [R_TOOL]}],
                           "tool_choice": {"type": "function", "name": "Read"}}),
]


@pytest.mark.parametrize("route, body", REFUSED)
def test_tool_choice_the_model_cannot_satisfy_is_a_400(proto: Protocol, route: str,
                                                       body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as err:
        getattr(proto, route)({"model": MODEL, **body}, {})
    assert err.value.param == "tool_choice" and err.value.http_status == 400


@pytest.mark.parametrize("route, body", ACCEPTED)
def test_satisfiable_tool_choice_is_accepted(proto: Protocol, route: str, body: dict[str, Any]) -> None:
    assert getattr(proto, route)({"model": MODEL, **body}, {}).num_prompt_tokens > 0
