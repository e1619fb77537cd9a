"""The same agent flows over the OpenAI Responses API (``POST /v1/responses``) with the ``openai``
SDK: flat function tools, ``store: false`` with ``reasoning.encrypted_content`` echoed back (as
Codex CLI does), streaming and not, parallel calls, a multi-turn chain that must hit the prefix
cache because the ledger repeats the generated ids, and ``previous_response_id``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.e2e_harness import MODEL
from tests.e2e.test_openai_flows import backend, client, run_tool  # noqa: F401 - the same backend fixtures and tools

pytestmark = pytest.mark.timeout(300)

TOOLS = [
    {"type": "function", "name": "read_file", "description": "Read a text file of the project.",
     "strict": False,
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"type": "function", "name": "run_command",
     "description": "Run a shell command in the project directory.",
     "strict": False, "parameters": {"type": "object", "properties": {
         "command": {"type": "string"}, "timeout_s": {"type": "integer"}}, "required": ["command"]}},
    {"type": "web_search"},  # Codex sends it; accepted and not shown to the model
]


def respond(client, items: list[dict[str, Any]], stream: bool, **kw: Any) -> tuple[dict[str, Any], list[str]]:
    """One response as (response dict, event types seen)."""
    args = dict(model=MODEL, input=items, tools=TOOLS, store=False, include=["reasoning.encrypted_content"],
                reasoning={"summary": "auto"}, parallel_tool_calls=True, max_output_tokens=4096)
    args.update(kw)
    if not stream:
        return client.responses.create(**args).model_dump(exclude_none=True), []
    types, final, arg_text = [], None, {}
    for event in client.responses.create(stream=True, **args):
        types.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arg_text[event.item_id] = arg_text.get(event.item_id, "") + event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response.model_dump(exclude_none=True)
    assert final is not None, types
    for item in final["output"]:
        if item["type"] == "function_call":
            assert arg_text[item["id"]] == item["arguments"]  # the deltas join to the final arguments
    return final, types


def agent_loop(client, project: Path, prompt: str, stream: bool, max_turns: int = 8):
    items: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "input_text", "text": prompt}]}]
    usages, calls = [], []
    for _ in range(max_turns):
        resp, _ = respond(client, items, stream)
        usages.append(resp["usage"])
        assert resp["status"] == "completed"
        items += resp["output"]  # echoed as received: reasoning (encrypted_content), message, calls
        turn_calls = [i for i in resp["output"] if i["type"] == "function_call"]
        if not turn_calls:
            text = "".join(c["text"] for i in resp["output"] if i["type"] == "message" for c in i["content"])
            return text, calls, usages
        for call in turn_calls:
            args = json.loads(call["arguments"])
            calls.append((call["name"], args))
            items.append({"type": "function_call_output", "call_id": call["call_id"],
                          "output": run_tool(project, call["name"], args)})
    raise AssertionError("no final answer")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_read_file_and_answer(client, tmp_path: Path, stream: bool):
    (tmp_path / "README.md").write_text("The launch code is PURPLE-OTTER-42.\n")
    answer, calls, _ = agent_loop(client, tmp_path, "[flow:read] What is the launch code in README.md?",
                                  stream)
    assert calls == [("read_file", {"path": "README.md"})]
    assert answer == "The launch code is PURPLE-OTTER-42."


def test_parallel_calls_stream_events(client, tmp_path: Path):
    (tmp_path / "notes.txt").write_text("Note: the deploy window opens at 14:00\n")
    resp, types = respond(client,
                          [{"role": "user", "content": "[flow:parallel] Read notes.txt and compute 6*7."}],
                          True)
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [(i["name"], json.loads(i["arguments"]))
            for i in resp["output"] if i["type"] == "function_call"] == [
        ("read_file", {"path": "notes.txt"}), ("run_command", {"command": "echo $((6*7))", "timeout_s": 10})]
    answer, _, _ = agent_loop(client, tmp_path, "[flow:parallel] Read notes.txt and compute 6*7.", True)
    assert answer == "notes.txt says: the deploy window opens at 14:00. 6*7 = 42."


def test_multi_turn_chain_hits_prefix_cache(client, backend, tmp_path: Path):
    hits_before = backend.metric_sum("deepinfer_cached_tokens_total")
    answer, calls, usages = agent_loop(client, tmp_path, "[flow:chain] Log three lines, then count them.",
                                       True)
    assert [c[0] for c in calls] == ["run_command"] * 3 and answer == "log.txt has 3 lines."
    cached = [u["input_tokens_details"]["cached_tokens"] for u in usages]
    # every later turn reuses the whole previous prompt + output, rounded down to KV blocks
    for prev, cur, c in zip(usages, usages[1:], cached[1:]):
        assert c >= (prev["input_tokens"] + prev["output_tokens"]) // 128 * 128 - 128 > 0, cached
    assert backend.metric_sum("deepinfer_cached_tokens_total") - hits_before == sum(cached)


def test_previous_response_id_chain(client, tmp_path: Path):
    (tmp_path / "README.md").write_text("The launch code is PURPLE-OTTER-42.\n")
    first, _ = respond(client,
                       [{"role": "user", "content": "[flow:read] What is the launch code in README.md?"}],
                       False, store=True)
    call = next(i for i in first["output"] if i["type"] == "function_call")
    out = {"type": "function_call_output", "call_id": call["call_id"],
           "output": run_tool(tmp_path, "read_file", {"path": "README.md"})}
    second, _ = respond(client, [out], False, store=True, previous_response_id=first["id"])
    assert second["output"][-1]["content"][0]["text"] == "The launch code is PURPLE-OTTER-42."
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    with pytest.raises(openai.BadRequestError) as info:
        respond(client, [out], False, previous_response_id="resp_unknown")
    assert info.value.body["code"] == "previous_response_not_found"


def test_unknown_tool_type_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi",
                                tools=[{"type": "file_search", "vector_store_ids": ["x"]}])
    assert info.value.body["param"] == "tools.0.type" and "file_search" in info.value.body["message"]
