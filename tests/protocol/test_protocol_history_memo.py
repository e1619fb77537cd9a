"""A session's next turn validates, converts and renders only its new messages
(protocol/history_memo.py), and what it reuses never changes a prompt: on random histories of
both chat APIs (thinking, tool calls and results, deferred tools, inline system messages,
cache_control moved or text edited in the middle), every turn prepared after earlier turns equals
the same request prepared by a protocol that kept nothing. The walk test was red before the memo:
every turn validated and converted the whole history."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import protocol.api as api_module
from protocol.api import Protocol
from protocol.detokenize import TokenTable
from protocol.errors import InvalidRequest
from protocol.history_memo import HistoryMemo
from protocol.ledger import OutputLedger
from protocol.render import Segment
from protocol.tokenize import PromptTokenizer
from tests.protocol.conftest import MODEL

READ = {"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}
DEFERRED = {"name": "Grep", "description": "Searches.", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}}}
OPENAI_READ = {"type": "function", "function": {"name": "Read", "parameters": READ["input_schema"]}}
WORDS = st.sampled_from(["def", "x", "return", "\n", "  ", "｜DSML｜", "</think>", "é", "42", "{", "}"])
TEXT = st.lists(WORDS, min_size=0, max_size=6).map(" ".join)
CACHE = st.sampled_from([None, {"type": "ephemeral"}])


def _with_cache(block: dict[str, Any], cache: dict[str, Any] | None) -> dict[str, Any]:
    return dict(block, cache_control=cache) if cache else block


def _with_replies(kinds: list[str]) -> st.SearchStrategy[list[str]]:
    """Each client turn kind, most followed by an assistant turn (some by none, some by two)."""
    counts = st.lists(st.sampled_from([0, 1, 1, 1, 2]), min_size=len(kinds), max_size=len(kinds))
    return counts.map(lambda n: [k for kind, c in zip(kinds, n) for k in [kind] + ["assistant"] * c])


@st.composite
def anthropic_history(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    call = 0
    open_calls: list[str] = []
    for kind in draw(st.lists(st.sampled_from(["user", "results", "results", "system", "string"]), min_size=2,
                              max_size=7).flatmap(_with_replies)):
        if kind == "assistant":
            blocks: list[dict[str, Any]] = []
            if draw(st.booleans()):
                blocks.append({"type": "thinking", "thinking": draw(TEXT), "signature": "x"})
            if draw(st.booleans()):
                blocks.append(_with_cache({"type": "text", "text": draw(TEXT)}, draw(CACHE)))
            for _ in range(draw(st.integers(0, 2))):
                call += 1
                open_calls.append(f"toolu_{call}")
                blocks.append({"type": "tool_use", "id": f"toolu_{call}", "name": "Read",
                               "input": {"file_path": draw(TEXT)}})
            messages.append({"role": "assistant", "content": blocks or draw(TEXT)})
        elif kind == "results" and open_calls:
            blocks = []
            for tool_id in reversed(open_calls):  # out of order: rendering re-sorts them
                content: Any = draw(st.sampled_from(["text", "list", "reference"]))
                if content == "text":
                    content = draw(TEXT)
                elif content == "list":
                    content = [{"type": "text", "text": draw(TEXT)}]
                else:
                    content = [{"type": "tool_reference", "tool_name": "Grep"}]
                blocks.append(_with_cache({"type": "tool_result", "tool_use_id": tool_id, "content": content},
                                          draw(CACHE)))
            open_calls = []
            messages.append({"role": "user", "content": blocks})
        elif kind == "system":
            messages.append({"role": "system", "content": draw(TEXT)})
        elif kind == "string":
            messages.append({"role": "user", "content": draw(TEXT)})
        else:
            messages.append({"role": "user", "content": [_with_cache({"type": "text", "text": draw(TEXT)},
                                                                     draw(CACHE))]})
    return messages


@st.composite
def openai_history(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    call = 0
    for kind in draw(st.lists(st.sampled_from(["user", "user", "tool", "system", "developer"]), min_size=2,
                              max_size=7).flatmap(_with_replies)):
        if kind == "assistant":
            m: dict[str, Any] = {"role": "assistant", "content": draw(TEXT)}
            if draw(st.booleans()):
                m["reasoning_content"] = draw(TEXT)
            calls = []
            for _ in range(draw(st.integers(0, 2))):
                call += 1
                calls.append({"id": f"call_{call}", "type": "function",
                              "function": {"name": "Read", "arguments": draw(st.sampled_from(
                                  ['{"file_path": "a"}', '"{\\"k\\": 1}"', "not json", "{}"]))}})
            if calls:
                m["tool_calls"] = calls
            messages.append(m)
        elif kind == "tool":
            messages.append({"role": "tool", "tool_call_id": f"call_{call}", "content": draw(TEXT)})
        else:
            messages.append({"role": kind, "content": draw(TEXT)})
    return messages


def _anthropic_body(messages: list[dict[str, Any]], tools: bool, thinking: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64,
                            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                                       {"type": "text", "text": "You are an agent."}],
                            "messages": messages}
    if tools:
        body["tools"] = [READ, DEFERRED]
    if thinking:
        body["thinking"] = {"type": "adaptive"}
    return body


def _openai_body(messages: list[dict[str, Any]], tools: bool, thinking: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if tools:
        body["tools"] = [OPENAI_READ]
    if not thinking:
        body["reasoning_effort"] = "none"
    return body


def _fresh(tok: PromptTokenizer, table: TokenTable, ledger: OutputLedger) -> Protocol:
    """A protocol that records the segments of each prompt it encodes (``rendered``)."""
    proto = Protocol(tok, ledger, [MODEL], 1_064_960, table=table)
    encode = proto._encode_segments
    rendered: list[list[Segment]] = []

    def recording(segments: list[Segment], *args: Any) -> Any:
        rendered.append(list(segments))
        return encode(segments, *args)

    proto._encode_segments = recording  # type: ignore[method-assign]
    proto.rendered = rendered  # type: ignore[attr-defined]
    return proto


def _same_as_fresh(api: str, proto: Protocol, fresh: Protocol, body: dict[str, Any]) -> None:
    prepare = proto.prepare_anthropic if api == "anthropic" else proto.prepare_openai
    fresh_prepare = fresh.prepare_anthropic if api == "anthropic" else fresh.prepare_openai
    fresh.history.clear()
    try:
        want = fresh_prepare(copy.deepcopy(body), {})
    except InvalidRequest as exc:
        with pytest.raises(InvalidRequest) as got:
            prepare(copy.deepcopy(body), {})
        assert str(got.value) == str(exc)
        return
    got_req = prepare(copy.deepcopy(body), {})
    assert np.array_equal(got_req.prompt_ids, want.prompt_ids)
    assert got_req.tool_names == want.tool_names  # tools loaded by references included
    assert proto.rendered[-1] == fresh.rendered[-1]  # type: ignore[attr-defined]


def _edit(messages: list[dict[str, Any]], at: int, how: str) -> list[dict[str, Any]]:
    """A deep copy with message ``at`` changed: its cache_control moved, or its text changed."""
    out = copy.deepcopy(messages)
    m = out[at]
    if isinstance(m.get("content"), list) and m["content"]:
        block = m["content"][-1]
        if how == "cache" and m["role"] in ("user", "assistant"):
            if "cache_control" in block:
                del block["cache_control"]
            else:
                block["cache_control"] = {"type": "ephemeral"}
            return out
        for key in ("text", "thinking"):
            if key in block:
                block[key] += " edited"
                return out
    if isinstance(m.get("content"), str):
        m["content"] += " edited"
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(api=st.sampled_from(["anthropic", "openai"]), data=st.data(), tools=st.booleans(),
       thinking=st.booleans())
def test_incremental_equals_whole(tok: PromptTokenizer, table: TokenTable, api: str, data: st.DataObject,
                                  tools: bool, thinking: bool) -> None:
    history = data.draw(anthropic_history() if api == "anthropic" else openai_history())
    make = _anthropic_body if api == "anthropic" else _openai_body
    ledger = OutputLedger(key=b"k" * 32)
    proto, fresh = _fresh(tok, table, ledger), _fresh(tok, table, ledger)
    lengths = data.draw(st.lists(st.integers(1, len(history)), min_size=2, max_size=5))
    if data.draw(st.booleans()):
        lengths.sort()  # a session that grows; else one that also goes back (a rewind, a retry)
    for n in lengths:
        _same_as_fresh(api, proto, fresh, make(history[:n], tools, thinking))
    at = data.draw(st.integers(0, len(history) - 1))
    edited = _edit(history, at, data.draw(st.sampled_from(["cache", "text"])))
    _same_as_fresh(api, proto, fresh, make(edited, tools, thinking))  # an edit in the middle invalidates
    event(f"{api}: resumed {min(proto.history.num_reused, 2)} times")


def _session(rounds: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Refactor the module."}]
    for k in range(rounds):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"Step {k}.", "signature": "x"},
            {"type": "tool_use", "id": f"toolu_{k:04d}", "name": "Read",
             "input": {"file_path": f"/m{k}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k:04d}", "content": f"def f{k}(): pass\n" * 5}]})
    return _anthropic_body(messages, tools=True, thinking=True)


def test_next_turn_walks_only_its_new_messages(proto: Protocol, monkeypatch: pytest.MonkeyPatch) -> None:
    body = _session(30)
    proto.prepare_anthropic(dict(body, messages=body["messages"][:-2]), {})
    converted: list[int] = []
    convert = api_module.anthropic_messages

    def counting(messages: list[Any], *args: Any) -> Any:
        converted.append(len(messages))
        return convert(messages, *args)

    monkeypatch.setattr(api_module, "anthropic_messages", counting)
    got = proto.prepare_anthropic(copy.deepcopy(body), {})
    monkeypatch.undo()
    assert converted == [4]  # the last kept assistant turn and tool result, and the two new ones
    assert proto.history.num_reused == 1 and proto.history.reused_messages == len(body["messages"]) - 4
    fresh = Protocol(proto.tokenizer, proto.ledger, [MODEL], proto.max_model_len, table=proto.table)
    assert np.array_equal(got.prompt_ids, fresh.prepare_anthropic(copy.deepcopy(body), {}).prompt_ids)


def test_one_callers_history_is_not_found_by_another(proto: Protocol) -> None:
    body = _session(8)
    proto.prepare_anthropic(copy.deepcopy(body), {}, scope=b"caller-a")
    proto.prepare_anthropic(copy.deepcopy(body), {}, scope=b"caller-b")
    assert proto.history.num_reused == 0
    proto.prepare_anthropic(copy.deepcopy(body), {"x-claude-code-session-id": "s1"}, scope=b"caller-a")
    assert proto.history.num_reused == 0  # another session of the same caller: its own key
    proto.prepare_anthropic(copy.deepcopy(body), {}, scope=b"caller-a")
    assert proto.history.num_reused == 1


def test_a_message_changed_in_place_is_not_reused(proto: Protocol) -> None:
    """A dict body is the caller's: a message object sent again after being changed in place is
    prepared anew, not taken from the kept history that holds the same object."""
    body = _session(6)
    proto.prepare_anthropic(body, {})
    body["messages"][3]["content"][0]["thinking"] = "Changed."
    got = proto.prepare_anthropic(body, {})
    fresh = Protocol(proto.tokenizer, proto.ledger, [MODEL], proto.max_model_len, table=proto.table)
    assert np.array_equal(got.prompt_ids, fresh.prepare_anthropic(copy.deepcopy(body), {}).prompt_ids)


@pytest.mark.parametrize("bad", ["invalid", "deep"])
def test_errors_in_new_messages_name_their_index(proto: Protocol, bad: str) -> None:
    """A bad new message after a kept history is refused with the error a whole preparation gives
    (its index in the request, the depth limit), not a traceback."""
    body = _session(6)
    proto.prepare_anthropic(copy.deepcopy(body), {})
    nested: Any = "x"
    for _ in range(200):
        nested = {"k": nested}
    block = ({"type": "tool_result"} if bad == "invalid"
             else {"type": "tool_result", "tool_use_id": "t", "content": "x", "extra": nested})
    body["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [block]}]
    with pytest.raises(InvalidRequest) as got:
        proto.prepare_anthropic(copy.deepcopy(body), {})
    with pytest.raises(InvalidRequest) as want:
        Protocol(proto.tokenizer, proto.ledger, [MODEL], proto.max_model_len,
                 table=proto.table).prepare_anthropic(copy.deepcopy(body), {})
    assert str(got.value) == str(want.value)
    assert ("messages.14" in str(got.value)) if bad == "invalid" else ("nested deeper" in str(got.value))


def test_changed_tools_or_system_reuse_nothing(proto: Protocol) -> None:
    body = _session(6)
    proto.prepare_anthropic(copy.deepcopy(body), {})
    for change in ({"system": "Another system prompt."}, {"tools": [READ]},
                   {"thinking": {"type": "disabled"}}):
        changed = dict(copy.deepcopy(body), **change)
        got = proto.prepare_anthropic(copy.deepcopy(changed), {})
        fresh = Protocol(proto.tokenizer, proto.ledger, [MODEL], proto.max_model_len, table=proto.table)
        assert np.array_equal(got.prompt_ids, fresh.prepare_anthropic(copy.deepcopy(changed), {}).prompt_ids)
    assert proto.history.num_reused == 0


def test_history_memo_bounds() -> None:
    with pytest.raises(ValueError):
        HistoryMemo(per_key=0)
    memo = HistoryMemo(max_bytes=0)
    assert memo.find(("anthropic", b"", None), [{"role": "user", "content": "x"}]) is None
