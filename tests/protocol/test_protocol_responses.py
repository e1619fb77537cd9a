"""The OpenAI Responses API at the protocol layer: Codex-shaped requests, the event stream with
reasoning and streamed tool arguments, bodies, the encrypted-reasoning round trip through the
ledger (exact ids on the next turn), the store, and refusals."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import orjson
import pytest

from protocol.api import Protocol
from protocol.errors import InvalidRequest, Overloaded
from protocol.tokenize import PromptTokenizer
from tests.protocol.test_protocol_api_stream import EOS, MODEL, D, run_stream, sse_events

TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a shell command", "strict": False,
     "parameters": {"type": "object",
                    "properties": {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}},
                    "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
     "tools": [{"type": "function", "name": "spawn_agent",
                "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "web_search"},
]


def codex_request(**over: Any) -> dict[str, Any]:
    body = {
        "model": MODEL, "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "prompt_cache_key": "thread-1", "tools": TOOLS,
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "list the files"}]},
        ],
    }
    body.update(over)
    return body


CALL_OUT = (f"I will list them.</think>Listing." f"\n\n<{D} calls>\n<{D} invoke name=\"exec_command\">\n"
            f"<{D} parameter name=\"cmd\" string=\"true\">ls -la /tmp/some/where</{D} parameter>\n"
            f"<{D} parameter name=\"yield_time_ms\" string=\"false\">1000</{D} parameter>\n</{D} "
            f"invoke>\n</{D} calls>{EOS}")


def events_of(data: bytes) -> list[dict[str, Any]]:
    evs = sse_events(data)
    assert all(name == e["type"] for name, e in evs)  # the event line names the data's type
    return [e for _, e in evs]


def test_codex_shaped_request_accepted(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_responses(orjson.dumps(codex_request()), {"session-id": "sess-9"})
    assert p.api == "responses" and p.stream and p.thinking
    assert p.session_key == "sess-9"  # the header wins over prompt_cache_key
    assert proto.prepare_responses(codex_request(), {}).session_key == "thread-1"
    assert set(p.tool_names) == {"exec_command", "multi_agent_v1.spawn_agent",
                                 "apply_patch"}  # web_search not shown
    text = tok.decode(p.prompt_ids.tolist())
    assert "You are Codex." in text and "list the files" in text and "web_search" not in text
    assert '"input"' in text and "start: /.+/" in text  # the custom tool's one string parameter + grammar
    assert proto.prepare_responses(codex_request(reasoning={"effort": "none"}), {}).thinking is False
    assert proto.prepare_responses(codex_request(reasoning={"effort": "low"}), {}).reasoning_effort == 50
    assert proto.prepare_responses(codex_request(max_output_tokens=77), {}).max_tokens == 77


def test_stream_events_reasoning_text_and_streamed_arguments(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_responses(codex_request(), {})
    stream, data, ids = run_stream(proto, p, CALL_OUT, tok, chunk=1, cached=128)
    evs = events_of(data)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    types = [e["type"] for e in evs]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    summary = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_summary_text.delta")
    assert summary == "I will list them."
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == "Listing."
    arg_deltas = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert len(arg_deltas) > 3 and "".join(arg_deltas) == done["arguments"]
    assert orjson.loads(done["arguments"]) == {"cmd": "ls -la /tmp/some/where", "yield_time_ms": 1000}
    # deltas came before the call completed: all of them precede its done event
    assert types.index("response.function_call_arguments.done") > max(i
                                                                      for i, t in enumerate(types)
                                                                      if t.endswith("arguments.delta"))
    added = [e["item"]["type"] for e in evs if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    final = evs[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == added
    reasoning, message, call = final["output"]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "I will list them."}]
    assert reasoning["encrypted_content"] == stream.signature and reasoning["id"].startswith("rs_")
    assert (message["content"][0]["text"] == "Listing." and call["name"] == "exec_command"
            and call["call_id"].startswith("call_"))
    usage = final["usage"]
    assert (usage["input_tokens"] == p.num_prompt_tokens
            and usage["input_tokens_details"]["cached_tokens"] == 128)
    assert (usage["output_tokens"] == len(ids)
            and 0 < usage["output_tokens_details"]["reasoning_tokens"] < len(ids))


def test_non_streaming_body(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_responses(codex_request(stream=False, include=[]), {})
    stream, data, _ = run_stream(proto, p, CALL_OUT, tok)
    assert data == b""
    body = stream.response_body()
    assert body["object"] == "response" and body["status"] == "completed" and body["id"].startswith("resp_")
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    assert "encrypted_content" not in body["output"][0]  # not included unless asked for
    assert body["parallel_tool_calls"] is True and body["tool_choice"] == "auto" and body["store"] is False


def _echo(output: list[dict[str, Any]], drop_summary: bool = False,
          drop_encrypted: bool = False) -> list[dict[str, Any]]:
    """What Codex sends back: the output items as they came (optionally without parts)."""
    items = copy.deepcopy(output)
    for it in items:
        if it["type"] == "reasoning":
            if drop_summary:
                it["summary"] = []
            if drop_encrypted:
                it.pop("encrypted_content", None)
    return items


@pytest.mark.parametrize("variant", ["as_sent", "summary_dropped", "only_the_id"])
def test_encrypted_reasoning_round_trip_repeats_the_generated_ids(proto: Protocol, tok: PromptTokenizer,
                                                                  variant: str) -> None:
    """store:false: turn 2 echoes turn 1's items; the ledger puts back the exact generated ids,
    so turn 2's prompt starts with turn 1's prompt + output (a prefix-cache hit)."""
    first = codex_request()
    p1 = proto.prepare_responses(first, {})
    stream, _, ids = run_stream(proto, p1, CALL_OUT, tok, chunk=2)
    output = stream.response_body()["output"]
    call_id = output[-1]["call_id"]
    echoed = _echo(output, drop_summary=variant != "as_sent", drop_encrypted=variant == "only_the_id")
    second = codex_request(input=first["input"] + echoed + [
        {"type": "function_call_output", "call_id": call_id, "output": "a.txt\nb.txt"}])
    p2 = proto.prepare_responses(second, {})
    assert p2.num_ledger_hits == 1 and p2.num_ledger_divergences == 0
    prefix = np.concatenate([p1.prompt_ids, np.asarray(ids, dtype=np.int32)])
    assert np.array_equal(p2.prompt_ids[: len(prefix)], prefix)


def test_changed_history_is_rendered_not_spliced(proto: Protocol, tok: PromptTokenizer) -> None:
    first = codex_request()
    stream, _, _ = run_stream(proto, proto.prepare_responses(first, {}), CALL_OUT, tok)
    output = _echo(stream.response_body()["output"])
    output[1]["content"][0]["text"] = "Something else."
    p2 = proto.prepare_responses(codex_request(input=first["input"] + output), {})
    assert p2.num_ledger_hits == 0 and p2.num_ledger_divergences == 1


def test_custom_and_namespaced_calls(proto: Protocol, tok: PromptTokenizer) -> None:
    out = (f"</think>\n\n<{D} calls>\n<{D} invoke name=\"apply_patch\">\n<{D} parameter name=\"input\" "
           "string=\"true\">"
           f"*** Begin Patch\n+x\n*** End Patch</{D} parameter>\n</{D} invoke>\n<{D} invoke "
           "name=\"multi_agent_v1.spawn_agent\">\n"
           f"<{D} parameter name=\"task\" string=\"true\">review</{D} parameter>\n</{D} invoke>\n"
           f"<{D} invoke name=\"not_declared\">\n</{D} invoke>\n</{D} calls>{EOS}")
    stream, data, _ = run_stream(proto, proto.prepare_responses(codex_request(), {}), out, tok)
    items = stream.response_body()["output"]
    assert items[0] == {**items[0], "type": "custom_tool_call", "name": "apply_patch",
                        "input": "*** Begin Patch\n+x\n*** End Patch"}
    assert (items[1]["type"] == "function_call" and items[1]["name"] == "spawn_agent"
            and items[1]["namespace"] == "multi_agent_v1")
    assert items[2]["name"] == "not_declared" and items[2]["arguments"] == "{}"  # passed through (docs)
    evs = events_of(data)
    assert [e["input"]
            for e in evs if e["type"] == "response.custom_tool_call_input.done"] == [items[0]["input"]]
    # the next turn renders those calls back under their prompt names and hits the ledger
    follow = codex_request(input=codex_request()["input"] + _echo(items) + [
        {"type": "custom_tool_call_output", "call_id": items[0]["call_id"], "output": "ok"},
        {"type": "function_call_output", "call_id": items[1]["call_id"], "output": "ok"},
        {"type": "function_call_output", "call_id": items[2]["call_id"], "output": "unknown tool"}])
    assert proto.prepare_responses(follow, {}).num_ledger_hits == 1


def test_cut_by_max_output_tokens_is_incomplete(proto: Protocol, tok: PromptTokenizer) -> None:
    cut = CALL_OUT[: CALL_OUT.index("/tmp/some")]
    _, data, _ = run_stream(proto, proto.prepare_responses(codex_request(max_output_tokens=20), {}), cut,
                            tok, finish="length")
    evs = events_of(data)
    final = evs[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in final["response"]["output"]] == ["reasoning",
                                                                "message"]  # the cut call is left out
    cut_items = [e["item"]
                 for e in evs
                 if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert cut_items[0]["status"] == "incomplete"


def test_previous_response_id_and_item_reference(proto: Protocol, tok: PromptTokenizer) -> None:
    first = codex_request(store=True)
    p1 = proto.prepare_responses(first, {})
    stream, _, _ = run_stream(proto, p1, CALL_OUT, tok)
    body = stream.response_body()
    call_id = body["output"][-1]["call_id"]
    tool_out = {"type": "function_call_output", "call_id": call_id, "output": "a.txt"}
    full = proto.prepare_responses(codex_request(input=first["input"] + _echo(body["output"]) + [tool_out]),
                                   {})
    chained = proto.prepare_responses(codex_request(previous_response_id=body["id"], input=[tool_out]), {})
    refs = [{"type": "item_reference", "id": i["id"]} for i in body["output"]]
    referenced = proto.prepare_responses(codex_request(input=first["input"] + refs + [tool_out]), {})
    assert np.array_equal(chained.prompt_ids,
                          full.prompt_ids) and np.array_equal(referenced.prompt_ids, full.prompt_ids)
    assert chained.num_ledger_hits == 1
    with pytest.raises(InvalidRequest) as exc:
        proto.prepare_responses(codex_request(previous_response_id="resp_gone", input=[tool_out]), {})
    assert exc.value.param == "previous_response_id" and exc.value.code == "previous_response_not_found"
    assert exc.value.openai_body()["error"]["type"] == "invalid_request_error"
    with pytest.raises(InvalidRequest, match="item_reference"):
        proto.prepare_responses(codex_request(input=[{"type": "item_reference", "id": "msg_nope"}]), {})


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": [{"type": "computer_call_output"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"background": True}, "background"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"model": "gpt-5"}, "model"),
])
def test_refusals_name_the_field(proto: Protocol, change: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        proto.prepare_responses(codex_request(**change), {})
    assert exc.value.param == param and exc.value.http_status == 400


def test_error_after_start_is_response_failed(proto: Protocol, tok: PromptTokenizer) -> None:
    p = proto.prepare_responses(codex_request(), {})
    stream = proto.new_stream(p, "r1")
    head = stream.start(0) + stream.feed(tok.encode_text("Thinking hard").tolist())
    evs = events_of(head + stream.error(Overloaded("the engine restarted", retry_after_s=5)))
    assert evs[-1]["type"] == "response.failed"
    assert evs[-1]["response"]["status"] == "failed" and "restarted" in evs[-1]["response"]["error"][
        "message"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
