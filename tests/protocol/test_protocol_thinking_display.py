"""Anthropic ``thinking.display``: "omitted" (Claude Code >= 2.1.328 with json output) and
"updates" (with stream-json) send thinking blocks without their text, ending in the signature;
the echoed empty block still finds the ledger entry, so the next prompt repeats the output ids."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from protocol import anthropic_schema as A
from protocol.api import Protocol
from protocol.tokenize import PromptTokenizer
from tests.protocol.stream_helpers import (
    TOOL_OUT,
    claude_code_request,
    echo_assistant,
    run_stream,
    sse_events,
)

REASONING = "The user wants the README."
BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
         "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,"
         "effort-2025-11-24,thinking-display-updates-2026-08-18")


def request(display: str | None, stream: bool = True) -> dict[str, Any]:
    body = claude_code_request(2)
    body["thinking"] = {"type": "adaptive"} if display is None else {"type": "adaptive", "display": display}
    body["stream"] = stream
    return body


def thinking_deltas(data: bytes) -> tuple[list[str], str, list[str]]:
    ev = sse_events(data)
    starts = [e["content_block"]["type"] for n, e in ev if n == "content_block_start"]
    deltas = [e["delta"] for n, e in ev if n == "content_block_delta"]
    thinking = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    return starts, thinking, [d["signature"] for d in deltas if d["type"] == "signature_delta"]


@pytest.mark.parametrize("display", ["omitted", "updates"])
def test_hidden_display_streams_an_empty_signed_thinking_block(proto: Protocol, tok: PromptTokenizer,
                                                               display: str) -> None:
    p = proto.prepare_anthropic(request(display), {"anthropic-beta": BETAS})
    assert not p.show_reasoning
    stream, data, _ = run_stream(proto, p, TOOL_OUT, tok)
    starts, thinking, signatures = thinking_deltas(data)
    assert starts == ["thinking", "text", "tool_use"]
    assert thinking == "" and REASONING not in data.decode()  # no reasoning text on the wire
    assert signatures == [stream.signature]
    assert REASONING in tok.decode(stream.output_ids)  # the model did reason (and the stream took it)


@pytest.mark.parametrize("display", [None, "summarized", "highlights"])
def test_other_displays_stream_the_reasoning(proto: Protocol, tok: PromptTokenizer,
                                             display: str | None) -> None:
    p = proto.prepare_anthropic(request(display), {})
    assert p.show_reasoning
    stream, data, _ = run_stream(proto, p, TOOL_OUT, tok)
    starts, thinking, signatures = thinking_deltas(data)
    assert starts == ["thinking", "text",
                      "tool_use"] and thinking == REASONING and signatures == [stream.signature]


@pytest.mark.parametrize("display", ["omitted", "updates"])
def test_hidden_display_whole_body(proto: Protocol, tok: PromptTokenizer, display: str) -> None:
    p = proto.prepare_anthropic(request(display, stream=False), {})
    stream, data, _ = run_stream(proto, p, TOOL_OUT, tok)
    assert data == b""
    body = stream.response_body()
    A.MessageResponse.model_validate(body)
    assert body["content"][0] == {"type": "thinking", "thinking": "", "signature": stream.signature}
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]


def test_no_reasoning_no_thinking_block(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_anthropic(request("omitted", stream=False), {})
    stream, _, _ = run_stream(proto, p, "</think>Just text.<｜end▁of▁sentence｜>", tok)
    assert [b["type"] for b in stream.response_body()["content"]] == ["text"]


@pytest.mark.parametrize("display", ["omitted", "updates"])
def test_echoed_empty_thinking_block_hits_the_ledger(proto: Protocol, tok: PromptTokenizer,
                                                     display: str) -> None:
    body = request(display)
    p1 = proto.prepare_anthropic(body, {})
    _, data, out_ids = run_stream(proto, p1, TOOL_OUT, tok)
    assistant = echo_assistant(data)
    assert assistant["content"][0]["type"] == "thinking" and assistant["content"][0]["thinking"] == ""
    body2 = copy.deepcopy(body)
    body2["messages"] += [assistant, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": assistant["content"][-1]["id"], "content": "# README"}]}]
    p2 = proto.prepare_anthropic(body2, {})
    assert p2.num_ledger_hits == 1 and p2.num_ledger_divergences == 0
    full = p1.prompt_ids.tolist() + out_ids
    assert p2.prompt_ids[: len(full)].tolist() == full  # the model's reasoning is back in its history
    assert "The user wants the README." in proto.tokenizer.decode(p2.prompt_ids.tolist())
    # a client that fills the hidden block in (or the ledger lost the turn) renders from its view
    body3 = copy.deepcopy(body2)
    body3["messages"][2]["content"][0]["thinking"] = "made up"
    assert proto.prepare_anthropic(body3, {}).num_ledger_hits == 0
