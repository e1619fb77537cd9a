"""JSON nested deeper than ``MAX_JSON_DEPTH`` is a 400 naming the field on every
route and in every place (tool schemas, tool_use.input, response_format, metadata, argument
strings, double-encoded argument strings), never RecursionError -> 500.

Red before: depth ~1,000 raised RecursionError in render (json.dumps), the ledger (repr) or
json.loads of argument strings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from protocol.api import Protocol
from protocol.depth import MAX_JSON_DEPTH, check_json_depth, json_text_depth
from protocol.errors import InvalidRequest

MODEL = "deepseek-v4.1-flash"
HI = {"role": "user", "content": "hi"}


def nested(depth: int) -> Any:
    value: Any = "x"
    for k in range(depth):
        value = {"a": value} if k % 2 else [value]
    return value


def nested_text(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _anthropic_schema(v: Any) -> tuple[str, dict[str, Any]]:
    return "prepare_anthropic", {"model": MODEL, "max_tokens": 8, "messages": [HI], "tools": [
        {"name": "t", "input_schema": {"type": "object", "properties": {"p": v}}}]}


def _anthropic_input(v: Any) -> tuple[str, dict[str, Any]]:
    return "prepare_anthropic", {"model": MODEL, "max_tokens": 8, "messages": [
        HI,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "t", "input": {"v": v}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}


def _count_tokens_schema(v: Any) -> tuple[str, dict[str, Any]]:
    return "count_tokens_anthropic", {"model": MODEL, "messages": [HI], "tools": [
        {"name": "t", "input_schema": {"type": "object", "properties": {"p": v}}}]}


def _openai_response_format(v: Any) -> tuple[str, dict[str, Any]]:
    return "prepare_openai", {"model": MODEL, "messages": [HI], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"p": v}}}}


def _openai_tool_parameters(v: Any) -> tuple[str, dict[str, Any]]:
    return "prepare_openai", {"model": MODEL, "messages": [HI], "tools": [
        {"type": "function", "function": {"name": "t", "parameters": {"p": v}}}]}


def _openai_arguments(text: str) -> tuple[str, dict[str, Any]]:
    return "prepare_openai", {"model": MODEL, "messages": [
        HI, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "t", "arguments": text}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def _responses_arguments(text: str) -> tuple[str, dict[str, Any]]:
    return "prepare_responses", {"model": MODEL, "input": [
        HI, {"type": "function_call", "call_id": "c1", "name": "t", "arguments": text},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}


VALUE_CASES: list[tuple[Callable[[Any], tuple[str, dict[str, Any]]], str]] = [
    (_anthropic_schema, "tools"), (_anthropic_input, "messages"), (_count_tokens_schema, "tools"),
    (_openai_response_format, "response_format"), (_openai_tool_parameters, "tools"),
]
TEXT_CASES: list[tuple[Callable[[str], tuple[str, dict[str, Any]]], Callable[[int], str]]] = [
    (_openai_arguments, lambda d: '{"a": ' + nested_text(d) + "}"),
    (_openai_arguments, lambda d: json.dumps('{"a": ' + nested_text(d) + "}")),  # double-encoded
    (_responses_arguments, lambda d: '{"a": ' + nested_text(d) + "}"),
]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 5000])
@pytest.mark.parametrize("case, param", VALUE_CASES, ids=[c.__name__ for c, _ in VALUE_CASES])
def test_deep_values_are_a_400(proto: Protocol, case: Any, param: str, depth: int) -> None:
    route, body = case(nested(depth))
    with pytest.raises(InvalidRequest) as err:
        getattr(proto, route)(body, {})
    assert err.value.param == param and "nested deeper than" in err.value.message


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
@pytest.mark.parametrize("case, text", TEXT_CASES, ids=["openai", "openai-double-encoded", "responses"])
def test_deep_argument_strings_are_a_400(proto: Protocol, case: Any, text: Any, depth: int) -> None:
    route, body = case(text(depth))
    with pytest.raises(InvalidRequest) as err:
        getattr(proto, route)(body, {})
    assert err.value.param == "arguments" and err.value.http_status == 400


def test_depth_within_the_limit_is_served(proto: Protocol) -> None:
    # the body adds its own levels above the schema, the arguments add one ({"a": ...})
    route, body = _anthropic_schema(nested(MAX_JSON_DEPTH - 8))
    assert getattr(proto, route)(body, {}).num_prompt_tokens > 0
    route, body = _openai_arguments('{"a": ' + nested_text(MAX_JSON_DEPTH - 1) + "}")
    assert getattr(proto, route)(body, {}).num_prompt_tokens > 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab,:'),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=3),
                                                                       children, max_size=3),
    max_leaves=30,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(value=json_values)
def test_text_depth_and_value_depth_agree(value: Any) -> None:
    """Brackets inside strings (escaped quotes included) do not count; both checks agree."""
    depth = _depth(value)
    assert json_text_depth(json.dumps(value)) == depth
    if depth > 2:
        with pytest.raises(InvalidRequest):
            check_json_depth(value, limit=depth - 1)
    check_json_depth(value, limit=max(depth, 1))
