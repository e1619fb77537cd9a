"""A request that is a one-off beside its session (``PreparedRequest.one_off``): a structured
output offering no tools, as Claude Code's session titles are (``docs/claude-code.md``). The
service makes such an unlabelled request auxiliary (``server/agent_hints.with_body_class``)."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.api import Protocol
from tests.protocol.conftest import MODEL

TITLE_FORMAT = {"type": "json_schema",
                "schema": {"type": "object", "properties": {"title": {"type": "string"}},
                           "required": ["title"], "additionalProperties": False}}
READ_TOOL = {"name": "Read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "Generate a concise, sentence-case title (3-7 words)."}],
            "messages": [{"role": "user", "content": "<session>\nsay hello\n</session>"}], **extra}


@pytest.mark.parametrize(("extra", "one_off"), [
    ({"output_config": {"format": TITLE_FORMAT}}, True),  # Claude Code's session title
    ({"output_format": TITLE_FORMAT}, True),  # the older field
    ({"output_config": {"effort": "low"}}, False),  # output settings, no format
    ({"output_config": {"format": TITLE_FORMAT}, "tools": [READ_TOOL]}, False),
    ({"output_format": TITLE_FORMAT, "tools": [READ_TOOL]}, False),  # tools offered: a turn
    ({}, False),  # plain text, no tools: a chat turn like any other
    ({"tools": [READ_TOOL]}, False),
])
def test_a_structured_output_without_tools_is_a_one_off(proto: Protocol, extra: dict[str, Any],
                                                        one_off: bool) -> None:
    assert proto.prepare_anthropic(_body(**extra)).one_off is one_off
