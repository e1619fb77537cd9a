"""Facade: schema acceptance/rejection, errors, SSE emitters, usage, stop sequences, ledger."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import orjson
import pytest

from protocol import anthropic_schema as A, openai_schema as O
from protocol.api import Protocol
from protocol.errors import (
    AuthenticationError,
    InvalidRequest,
    ModelNotAvailable,
    Overloaded,
    PromptTooLong,
    RequestTimeout,
)
from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer
from tests.protocol.stream_helpers import (
    EOS,
    MODEL,
    TOOL_OUT,
    D,
    claude_code_request,
    echo_assistant,
    run_stream,
    sse_events,
)


# --- schemas -----------------------------------------------------------------------------------------
def test_claude_code_request_accepted(proto: Protocol, tok: PromptTokenizer) -> None:
    body = claude_code_request()
    p = proto.prepare_anthropic(orjson.dumps(body), {})
    assert p.api == "anthropic" and p.stream and p.thinking and p.reasoning_effort == 75
    assert p.session_key == "sess-1"
    assert len(p.tool_names) == 24 and p.max_tokens == 32000
    assert p.prompt_ids.dtype == np.int32 and p.num_prompt_tokens == len(p.prompt_ids)
    text = tok.decode(p.prompt_ids.tolist())
    assert "x-anthropic-billing-header" not in text
    assert text.endswith("What is in README.md?<｜System｜>Available agents: general-purpose. Skills: "
                         "none.<｜Assistant｜><think>")
    # the billing nonce does not change the prompt
    body2 = copy.deepcopy(body)
    body2["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=sdk-cli;"
    assert np.array_equal(proto.prepare_anthropic(body2, {"X-Claude-Code-Session-Id": "s2"}).prompt_ids,
                          p.prompt_ids)
    assert proto.count_tokens_anthropic({k: body[k]
                                         for k in ("model", "messages", "system",
                                                   "tools")}) < p.num_prompt_tokens + 1


def test_claude_code_history_blocks_accepted(proto: Protocol) -> None:
    body = claude_code_request(3)
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "foreign-signature"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a"}},
            {"type": "tool_use", "id": "call_2", "name": "Read", "input": {"file_path": "/b"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_2", "content": "B", "is_error": False},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "File does not exist."},
                         {"type": "image",
                          "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]},
        ]},
    ]
    p = proto.prepare_anthropic(body, {})
    assert p.num_ledger_hits == 0
    assert proto.ledger.stats.num_bad_signatures == 1
    text = proto.tokenizer.decode(p.prompt_ids.tolist())
    assert ("<tool_result>File does not exist.\n\n[Unsupported "
            "image]</tool_result>\n\n<tool_result>B</tool_result>" in text)


@pytest.mark.parametrize(
    "mutate,param",
    [
        (lambda b: b.pop("max_tokens"), "max_tokens"),
        (lambda b: b.update(max_tokens=0), "max_tokens"),
        (lambda b: b["messages"].append({"role": "robot", "content": "x"}), "messages.2.role"),
        (lambda b: b["messages"][0]["content"].append({"text": "no type"}), "messages.0.content.2"),
        (lambda b: b.update(thinking={"type": "sometimes"}), "thinking.type"),
        (lambda b: b.update(temperature=7), "temperature"),
        (lambda b: b.update(stop_sequences=[""]), "stop_sequences"),
        (lambda b: b["tools"][0].update(name=""), "tools.0.name"),
    ],
)
def test_anthropic_rejections_name_the_field(proto: Protocol, mutate: Any, param: str) -> None:
    body = claude_code_request(2)
    mutate(body)
    with pytest.raises(InvalidRequest) as ei:
        proto.prepare_anthropic(body, {})
    assert ei.value.param is not None and ei.value.param.startswith(param), ei.value.message
    shaped = ei.value.anthropic_body()
    assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"


def test_bad_json_and_unknown_model(proto: Protocol) -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        proto.prepare_anthropic(b"{nope", {})
    with pytest.raises(InvalidRequest, match="JSON object"):
        proto.prepare_openai(b"[1]", {})
    body = claude_code_request(1)
    body["model"] = "claude-opus-4-8"
    with pytest.raises(ModelNotAvailable) as ei:
        proto.prepare_anthropic(body, {})
    assert ei.value.message == "Model 'claude-opus-4-8' is not available on this endpoint"
    assert (ei.value.status("openai"), ei.value.status("anthropic")) == (400, 410)
    assert ei.value.anthropic_body()["error"]["type"] == "not_found_error"


def test_prompt_too_long_message(tok: PromptTokenizer) -> None:
    small = Protocol(tok, OutputLedger(), [MODEL], max_model_len=50)
    with pytest.raises(PromptTooLong) as ei:
        small.prepare_openai({"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]}, {})
    assert ei.value.message.startswith("prompt is too long: ") and ei.value.message.endswith(" tokens > 49 "
                                                                                             "maximum")


def test_openai_request_variants(proto: Protocol) -> None:
    base = {"model": MODEL,
            "messages": [{"role": "developer", "content": "S"},
                         {"role": "user",
                          "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    p = proto.prepare_openai(base, {})
    assert p.thinking and p.reasoning_effort == 75 and not p.stream and p.include_usage
    text = proto.tokenizer.decode(p.prompt_ids.tolist())
    assert text.endswith("<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more "
                         "thorough the reasoning)\n\nS<｜User｜>a\n\nb<｜Assistant｜><think>")
    for effort, value in [("minimal", 25), ("low", 50), ("medium", 62), ("high", 75), ("xhigh", 88),
                          ("max", 100)]:
        assert proto.prepare_openai({**base, "reasoning_effort": effort}, {}).reasoning_effort == value
    off = proto.prepare_openai({**base, "reasoning_effort": "none"}, {})
    assert (not off.thinking
            and proto.tokenizer.decode(off.prompt_ids[-2:].tolist()) == "<｜Assistant｜></think>")
    assert not proto.prepare_openai({**base, "chat_template_kwargs": {"thinking": False}}, {}).thinking
    with pytest.raises(InvalidRequest):
        proto.prepare_openai({**base, "reasoning_effort": "extreme"}, {})
    with pytest.raises(InvalidRequest):
        proto.prepare_openai({**base, "n": 2}, {})
    with pytest.raises(InvalidRequest):
        proto.prepare_openai({**base, "messages": [{"role": "tool", "content": "x"}]}, {})


@pytest.mark.parametrize("effort,value", [("low", 50), ("medium", 62), ("high", 75), ("max", 100)])
def test_anthropic_effort_mapping(proto: Protocol, effort: str, value: int) -> None:
    body = claude_code_request(1)
    body["output_config"] = {"effort": effort}
    assert proto.prepare_anthropic(body, {}).reasoning_effort == value
    body["thinking"] = {"type": "disabled"}
    assert not proto.prepare_anthropic(body, {}).thinking


def test_error_shapes() -> None:
    err = Overloaded("busy", retry_after_s=5)
    assert err.http_status == 503 and err.headers()["retry-after"] == "5"
    assert err.anthropic_body() == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert err.openai_body()["error"]["message"] == "busy"
    assert err.anthropic_sse().startswith(b"event: error\ndata: ")
    assert orjson.loads(err.openai_sse()[6:])["error"]["type"] == "server_error"
    assert AuthenticationError("bad key").anthropic_body()["error"]["type"] == "authentication_error"
    assert RequestTimeout("slow").http_status == 504


# --- streams -------------------------------------------------------------------------------------------
def test_anthropic_stream_sequence_and_usage(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_anthropic(claude_code_request(2), {})
    stream, data, ids = run_stream(proto, p, TOOL_OUT, tok, cached=256)
    ev = sse_events(data)
    names = [n for n, _ in ev]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for n, e in ev if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [e["delta"] for n, e in ev if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user wants the README."
    assert "".join(d.get("text", "") for d in deltas) == "I'll read it."
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == [stream.signature]
    assert orjson.loads("".join(d["partial_json"]
                                for d in deltas
                                if d["type"] == "input_json_delta")) == {"file_path": "/p/README.md"}
    md = ev[-2][1]
    assert md["delta"]["stop_reason"] == "tool_use"
    assert md["usage"] == {"input_tokens": p.num_prompt_tokens - 256, "output_tokens": len(ids),
                           "cache_read_input_tokens": 256, "cache_creation_input_tokens": 0}
    assert ev[0][1]["message"]["usage"]["cache_read_input_tokens"] == 256
    body = stream.response_body()
    A.MessageResponse.model_validate(body)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]


def test_openai_stream_chunks(proto: Protocol, tok: PromptTokenizer) -> None:
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "tools": [{"type": "function",
                       "function": {"name": "Read",
                                    "parameters": {"type": "object",
                                                   "properties": {"file_path": {"type": "string"}}}}}],
            "messages": [{"role": "user", "content": "read it"}]}
    p = proto.prepare_openai(body, {})
    stream, data, ids = run_stream(proto, p, TOOL_OUT, tok, chunk=3, cached=128)
    ev = sse_events(data)
    assert ev[-1] == (None, "[DONE]")
    chunks = [e for _, e in ev[:-1]]
    for c in chunks:
        O.ChatCompletionChunk.model_validate(c)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the README."
    assert "".join(d.get("content", "") for d in deltas) == "I'll read it."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    # the call opens with id and name, then its arguments arrive in pieces as generated
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_") and calls[0]["function"] == {
        "name": "Read", "arguments": ""}
    assert len(calls) > 2 and all(tc == {"index": 0, "function": {"arguments": tc["function"]["arguments"]}}
                                  for tc in calls[1:])
    joined = "".join(tc["function"]["arguments"] for tc in calls)
    assert joined == stream.response_body()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert orjson.loads(joined) == {"file_path": "/p/README.md"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128 and usage["completion_tokens"] == len(ids)
    O.ChatCompletionResponse.model_validate(stream.response_body())


def test_stop_sequence_truncates_and_signals(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_anthropic({**claude_code_request(1), "stop_sequences": ["STOP", "never"],
                                 "thinking": {"type": "disabled"}}, {})
    stream, data, _ = run_stream(proto, p, "Hello there STOP and more text" + EOS, tok)
    assert stream.stop_hit
    ev = sse_events(data)
    text = "".join(e["delta"].get("text", "") for n, e in ev if n == "content_block_delta")
    assert text == "Hello there "
    md = next(e for n, e in ev if n == "message_delta")
    assert md["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    # a partial match that does not complete is released
    p2 = proto.prepare_openai({"model": MODEL, "stop": "STOP!", "reasoning_effort": "none",
                               "messages": [{"role": "user", "content": "x"}]}, {})
    s2, _, _ = run_stream(proto, p2, "ends with STOP" + EOS, tok)
    assert not s2.stop_hit and s2.response_body()["choices"][0]["message"]["content"] == "ends with STOP"


def test_error_frame_in_stream_format(proto: Protocol) -> None:
    p = proto.prepare_anthropic(claude_code_request(1), {})
    frame = proto.new_stream(p, "r").error(Overloaded("engine restarting"))
    assert sse_events(frame) == [("error",
                                  {"type": "error",
                                   "error": {"type": "overloaded_error", "message": "engine restarting"}})]
    p2 = proto.prepare_openai({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                               "stream": True}, {})
    frame2 = proto.new_stream(p2, "r").error(RuntimeError("boom"))
    assert sse_events(frame2)[0][1]["error"]["message"] == "internal server error"


# --- ledger ---------------------------------------------------------------------------------------------
def test_ledger_round_trip_gives_exact_prefix(proto: Protocol, tok: PromptTokenizer) -> None:
    body = claude_code_request(2)
    p1 = proto.prepare_anthropic(body, {})
    # a non-canonical output: compact JSON in a string="false" parameter, two "\n" tokens
    out = ("Plan.</think>Reading." f"\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n"
           f"<{D} parameter name=\"file_path\" string=\"true\">/p/a</{D} parameter>\n"
           f"<{D} parameter name=\"limit\" string=\"false\">10</{D} parameter>\n</{D} invoke>\n</{D} "
           f"calls>{EOS}")
    _, data, out_ids = run_stream(proto, p1, out, tok)
    assistant = echo_assistant(data)
    tool_id = assistant["content"][-1]["id"]
    body2 = copy.deepcopy(body)
    body2["messages"] += [assistant,
                          {"role": "user",
                           "content": [{"type": "tool_result", "tool_use_id": tool_id,
                                        "content": "</think> tricky"}]}]
    p2 = proto.prepare_anthropic(body2, {})
    assert p2.num_ledger_hits == 1 and p2.num_ledger_divergences == 0
    full = p1.prompt_ids.tolist() + out_ids
    assert p2.prompt_ids[: len(full)].tolist() == full
    # a client that edits the turn falls back to rendering and is counted
    body3 = copy.deepcopy(body2)
    body3["messages"][2]["content"][1]["text"] = "Reading!"
    before = proto.ledger.stats.num_divergences
    p3 = proto.prepare_anthropic(body3, {})
    assert p3.num_ledger_hits == 0 and proto.ledger.stats.num_divergences == before + 1
    # a forged signature is rejected, and the turn is matched by content instead
    body4 = copy.deepcopy(body2)
    sig = body4["messages"][2]["content"][0]["signature"]
    body4["messages"][2]["content"][0]["signature"] = sig[:-4] + ("AAA="
                                                                  if not sig.endswith("AAA=") else "BBB=")
    bad_before = proto.ledger.stats.num_bad_signatures
    p4 = proto.prepare_anthropic(body4, {})
    assert proto.ledger.stats.num_bad_signatures == bad_before + 1
    assert p4.prompt_ids[: len(full)].tolist() == full


def test_openai_ledger_matched_by_content(proto: Protocol, tok: PromptTokenizer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function",
                       "function": {"name": "Read",
                                    "parameters": {"type": "object",
                                                   "properties": {"file_path": {"type": "string"}}}}}]}
    p1 = proto.prepare_openai(body, {})
    out = (f"R</think>ok\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n<{D} parameter name=\"file_path\" "
           f"string=\"true\">/x</{D} parameter>\n</{D} invoke>\n</{D} calls>{EOS}")
    stream, _, out_ids = run_stream(proto, p1, out, tok)
    msg = stream.response_body()["choices"][0]["message"]
    hist = {"role": "assistant", "content": msg["content"],
            "tool_calls": msg["tool_calls"]}  # reasoning dropped by the client
    body2 = {**body,
             "messages": body["messages"]
             + [hist, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "data"}]}
    p2 = proto.prepare_openai(body2, {})
    assert p2.num_ledger_hits == 1
    full = p1.prompt_ids.tolist() + out_ids
    assert p2.prompt_ids[: len(full)].tolist() == full


CUT_OUT = ("R</think>" f"\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n"
           f"<{D} parameter name=\"file_path\" string=\"true\">/p/README.md</{D} parameter>\n</{D} invoke>\n"
           f"<{D} invoke name=\"Read\">\n<{D} parameter name=\"file_path\" string=\"true\">/p/oth")


def test_cut_output_reports_length_and_keeps_complete_calls(proto: Protocol, tok: PromptTokenizer) -> None:
    """max_tokens cut the second call: both APIs say so, the first (complete) call is kept."""
    p = proto.prepare_anthropic(claude_code_request(2), {})
    stream, data, _ = run_stream(proto, p, CUT_OUT, tok, finish="length")
    ev = sse_events(data)
    assert next(e for n, e in ev if n == "message_delta")["delta"]["stop_reason"] == "max_tokens"
    starts = [e["content_block"]["type"] for n, e in ev if n == "content_block_start"]
    stops = [n for n, _ in ev if n == "content_block_stop"]
    assert starts == ["thinking", "tool_use", "tool_use"] and len(stops) == 3  # the cut call is closed
    body = stream.response_body()
    assert body["stop_reason"] == "max_tokens"
    assert [b.get("input")
            for b in body["content"] if b["type"] == "tool_use"] == [{"file_path": "/p/README.md"}]

    o = proto.prepare_openai({"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function",
                                         "function": {"name": "Read", "parameters": {}}}]}, {})
    stream, _, _ = run_stream(proto, o, CUT_OUT, tok, finish="length")
    choice = stream.response_body()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [orjson.loads(c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == [{"file_path": "/p/README.md"}]


def test_session_key_precedence(proto: Protocol) -> None:
    """X-Claude-Code-Session-Id > x-session-affinity > session-id > prompt_cache_key > head hash."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "pck"}
    headers = {"X-Claude-Code-Session-Id": "cc", "x-session-affinity": "aff", "Session-Id": "codex"}
    assert proto.prepare_openai(body, headers).session_key == "cc"
    headers.pop("X-Claude-Code-Session-Id")
    assert proto.prepare_openai(body, headers).session_key == "aff"
    headers.pop("x-session-affinity")
    assert proto.prepare_openai(body, headers).session_key == "codex"
    assert proto.prepare_openai(body, {}).session_key == "pck"
    no_key = {k: v for k, v in body.items() if k != "prompt_cache_key"}
    assert proto.prepare_openai(no_key, {}).session_key.startswith("h:")
    assert proto.prepare_openai({**body, "prompt_cache_key": "x" * 600},
                                {}).session_key.startswith("h:")  # too long: ignored


def test_openai_user_scopes_the_head_hash_below_prompt_cache_key(proto: Protocol) -> None:
    """``user`` names an end user: two users whose conversations open alike are two sessions, the
    same user's next turn stays in its session, and a prompt_cache_key still wins."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    anon = proto.prepare_openai(body, {}).session_key
    alice = proto.prepare_openai({**body, "user": "alice"}, {}).session_key
    bob = proto.prepare_openai({**body, "user": "bob"}, {}).session_key
    assert len({anon, alice, bob}) == 3 and alice.startswith("h:")
    turn2 = {**body, "user": "alice", "messages": body["messages"] + [
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]}
    assert proto.prepare_openai(turn2, {}).session_key == alice
    assert proto.prepare_openai({**body, "user": "alice", "prompt_cache_key": "pck"}, {}).session_key == "pck"
