"""Deferred tools (``defer_loading``) and tool search (``tool_reference``), as Claude Code
>= 2.1.328 sends them: the tools block holds only the tools that are not deferred, a reference
expands into the tool's definition where it appears, and loading a tool only appends to the
prompt (the prefix cache survives a ToolSearch)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from protocol.api import Protocol
from protocol.errors import InvalidRequest
from protocol.render import to_json
from protocol.tokenize import PromptTokenizer
from tests.protocol.stream_helpers import EOS, MODEL, D, echo_assistant, run_stream

PLACEHOLDER = {"name": "DeferredToolPlaceholder",
               "description": ("Reserved placeholder that keeps deferred tool loading active; "
                               "never call this tool."),
               "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
NOTEBOOK_EDIT = {"name": "NotebookEdit",
                 "description": "Replaces, inserts, or deletes a single cell in a Jupyter notebook.",
                 "input_schema": {"type": "object", "properties": {"notebook_path": {"type": "string"},
                                                                   "new_source": {"type": "string"}},
                                  "required": ["notebook_path", "new_source"]},
                 "defer_loading": True}
WEB_FETCH = {"name": "WebFetch", "description": "Fetches a URL.", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}}}


def _tool(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                             "required": ["query"]}}


def request_332(extra_tools: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """The shape of Claude Code 2.1.332's first request: 12 tools, one of them the deferred
    placeholder, the deferred tools listed by name in the system-role message."""
    tools = [_tool(n, f"{n} tool. " * 20) for n in ("Agent", "Bash", "Edit", "ListAgents", "Read")]
    tools += [*extra_tools, _tool("ToolSearch", "Fetches full schema definitions for deferred tools."),
              PLACEHOLDER, _tool("Write", "Writes a file.")]
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the notebook, please."}]},
            {"role": "system",
             "content": [{"type": "text", "text": "The following deferred tools are now available "
                                            "via ToolSearch:\nNotebookEdit\nWebFetch",
                          "cache_control": {"type": "ephemeral"}}]},
        ],
        "system": [{"type": "text",
                    "text": "x-anthropic-billing-header: cc_version=2.1.332.fc0; cc_entrypoint=sdk-cli;"},
                   {"type": "text", "text": "You are a Claude agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def schema_line(tool: dict[str, Any]) -> str:
    """How the tools block prints a tool (OpenAI function object, the encoder's JSON)."""
    return to_json({"name": tool["name"], "description": tool["description"],
                    "parameters": tool["input_schema"]})


def prompt_text(proto: Protocol, body: dict[str, Any]) -> str:
    return proto.tokenizer.decode(proto.prepare_anthropic(body, {}).prompt_ids.tolist())


TOOL_SEARCH_OUT = (f"I need the notebook tool.</think>\n\n<{D} calls>\n<{D} invoke name=\"ToolSearch\">\n"
                   f"<{D} parameter name=\"query\" string=\"true\">select:NotebookEdit</{D} parameter>\n"
                   f"</{D} invoke>\n</{D} calls>{EOS}")


def tool_search_round(proto: Protocol, tok: PromptTokenizer) -> tuple[Any, list[int], dict[str, Any]]:
    """Request 1, the model's ToolSearch call, and request 2 as Claude Code builds it: the
    assistant turn echoed back, a tool_result holding the reference, NotebookEdit now declared
    (deferred) in the middle of ``tools``."""
    body1 = request_332()
    p1 = proto.prepare_anthropic(body1, {})
    _, data, out_ids = run_stream(proto, p1, TOOL_SEARCH_OUT, tok)
    assistant = echo_assistant(data)
    call_id = assistant["content"][-1]["id"]
    body2 = request_332((NOTEBOOK_EDIT,))
    # no longer last: a plain string
    body2["messages"][1]["content"] = body2["messages"][1]["content"][0]["text"]
    body2["messages"] += [assistant, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call_id,
         "content": [{"type": "tool_reference", "tool_name": "NotebookEdit"}],
         "cache_control": {"type": "ephemeral"}}]}]
    return p1, p1.prompt_ids.tolist() + out_ids, body2


def test_deferred_tools_stay_out_of_the_tools_block(proto: Protocol) -> None:
    body = request_332((WEB_FETCH,))
    p = proto.prepare_anthropic(body, {})
    text = proto.tokenizer.decode(p.prompt_ids.tolist())
    assert schema_line(body["tools"][0]) in text  # a tool that is not deferred is in the block
    assert "DeferredToolPlaceholder" not in text and '"name": "WebFetch"' not in text
    # never offered: not among the names the parser accepts, nor declared for recovery
    assert "DeferredToolPlaceholder" not in p.tool_names and "DeferredToolPlaceholder" not in p.tool_params
    assert "WebFetch" not in p.tool_names
    assert set(p.tool_names) == {"Agent", "Bash", "Edit", "ListAgents", "Read", "ToolSearch", "Write"}
    # declaring one more deferred tool changes nothing in the prompt
    assert proto.prepare_anthropic(request_332(), {}).prompt_ids.tolist() == p.prompt_ids.tolist()


def test_tool_search_keeps_the_prefix_and_loads_the_schema(proto: Protocol, tok: PromptTokenizer) -> None:
    _, full, body2 = tool_search_round(proto, tok)
    p2 = proto.prepare_anthropic(body2, {})
    assert p2.num_ledger_hits == 1
    # request 1 plus the model's output is an exact prefix of request 2: nothing recomputed
    assert p2.prompt_ids[: len(full)].tolist() == full
    tail = proto.tokenizer.decode(p2.prompt_ids[len(full):].tolist())
    assert tail == ("<｜User｜><tool_result><functions>\n<function>" + schema_line(NOTEBOOK_EDIT)
                    + "</function>\n</functions></tool_result><｜Assistant｜><think>")
    # and the loaded tool is callable now (its parameters declared for the parser)
    assert "NotebookEdit" in p2.tool_names
    assert p2.tool_params["NotebookEdit"] == frozenset({"notebook_path", "new_source"})
    assert "DeferredToolPlaceholder" not in p2.tool_names


def test_next_turn_repeats_the_prompt_exactly(proto: Protocol, tok: PromptTokenizer) -> None:
    _, _, body2 = tool_search_round(proto, tok)
    p2 = proto.prepare_anthropic(body2, {})
    # deterministic: the same request renders to the same ids
    assert proto.prepare_anthropic(copy.deepcopy(body2), {}).prompt_ids.tolist() == p2.prompt_ids.tolist()
    out = (f"Now edit it.</think>\n\n<{D} calls>\n<{D} invoke name=\"NotebookEdit\">\n"
           f"<{D} parameter name=\"notebook_path\" string=\"true\">/p/a.ipynb</{D} parameter>\n"
           f"<{D} parameter name=\"new_source\" string=\"true\">print(1)</{D} parameter>\n</{D} "
           f"invoke>\n</{D} calls>{EOS}")
    stream, data, out_ids = run_stream(proto, p2, out, tok)
    assert [c.name for c in stream.calls] == ["NotebookEdit"]
    assistant = echo_assistant(data)
    body3 = copy.deepcopy(body2)
    body3["messages"][-1]["content"][0].pop("cache_control")
    body3["messages"] += [assistant, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": assistant["content"][-1]["id"],
         "content": "Updated cell 0."}]}]
    p3 = proto.prepare_anthropic(body3, {})
    full = p2.prompt_ids.tolist() + out_ids
    assert p3.num_ledger_hits == 2 and p3.prompt_ids[: len(full)].tolist() == full


def test_reference_runs_and_text_render_in_place(proto: Protocol) -> None:
    body = request_332((NOTEBOOK_EDIT, WEB_FETCH))
    body["messages"] += [
        {"role": "assistant",
         "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Found 2 tools."},
            {"type": "tool_reference", "tool_name": "WebFetch"},
            {"type": "tool_reference", "tool_name": "NotebookEdit"}]}]},
    ]
    text = prompt_text(proto, body)
    assert ("<tool_result>Found 2 tools.\n\n<functions>\n<function>" + schema_line(WEB_FETCH)
            + "</function>\n<function>"
            + schema_line(NOTEBOOK_EDIT) + "</function>\n</functions></tool_result>") in text
    # count_tokens renders the same prompt
    counted = proto.count_tokens_anthropic({k: body[k]
                                            for k in ("model", "messages", "system", "tools", "thinking")})
    assert counted == proto.prepare_anthropic(body, {}).num_prompt_tokens


def test_reference_to_an_undeclared_tool_is_a_400(proto: Protocol) -> None:
    body = request_332()
    body["messages"] += [
        {"role": "assistant",
         "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "tool_reference", "tool_name": "Nope"}]}]},
    ]
    with pytest.raises(InvalidRequest) as ei:
        proto.prepare_anthropic(body, {})
    assert ei.value.param == "messages.3.content.0" and "'Nope'" in ei.value.message
    body["messages"][-1]["content"][0]["content"][0]["tool_name"] = ""
    with pytest.raises(InvalidRequest) as ei:
        proto.prepare_anthropic(body, {})
    assert ei.value.param is not None and ei.value.param.startswith("messages.3.content.0")


def test_only_deferred_tools_still_renders_the_tool_instructions(proto: Protocol) -> None:
    body = request_332()
    body["tools"] = [PLACEHOLDER, NOTEBOOK_EDIT]
    text = prompt_text(proto, body)
    # the DSML instructions are there for the tools a reference will load; no schema is
    assert "## Tools" in text and "### Available Tool Schemas\n\n\n\nYou MUST strictly follow" in text
    assert '"name": "NotebookEdit"' not in text and "DeferredToolPlaceholder" not in text
