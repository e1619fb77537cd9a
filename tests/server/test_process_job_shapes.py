"""How ``/process`` reads a job's input (``server/process_jobs.py``): an explicit ``api`` wins,
else the shape is recognised from keys and types; the bodies the ``anthropic`` and ``openai``
client libraries build are recognised as theirs; the old ``prompt``/``messages`` conveniences
still work; the session hint is the native routes' (same ``Protocol``)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from protocol.api import Protocol
from protocol.errors import InvalidRequest
from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer
from server.process_jobs import parse_input, recognise, shape_output

READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}}


def _captured(make_client: Any, call: Any) -> dict[str, Any]:
    """The JSON body a client library sends for ``call(client)`` (answered with a 400, unread)."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        bodies.append(json.loads(request.content))
        return httpx2.Response(400, json={"error": {"message": "captured", "type": "invalid_request_error"}})

    client = make_client(httpx2.Client(transport=httpx2.MockTransport(handler)))
    with pytest.raises((anthropic.BadRequestError, openai.BadRequestError)):
        call(client)
    return bodies[0]


def _anthropic(http: httpx2.Client) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://x.invalid", api_key="k", max_retries=0, http_client=http)


def _openai(http: httpx2.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://x.invalid/v1", api_key="k", max_retries=0, http_client=http)


ANTHROPIC_CALLS = {
    "system+tools": lambda c: c.messages.create(
        model="m", max_tokens=8, system="be brief", messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "Read", "input_schema": READ_SCHEMA}]),
    "tool_result turn": lambda c: c.messages.create(model="m", max_tokens=8, messages=[
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "text"}]}]),
    "stop_sequences": lambda c: c.messages.create(model="m", max_tokens=8, stop_sequences=["x"],
                                                  messages=[{"role": "user", "content": "hi"}]),
    "tool_choice any": lambda c: c.messages.create(
        model="m", max_tokens=8, tool_choice={"type": "any"}, messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "Read", "input_schema": READ_SCHEMA}]),
}
OPENAI_CALLS = {
    "system message+tools": lambda c: c.chat.completions.create(
        model="m", max_tokens=8, messages=[{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "Read", "parameters": READ_SCHEMA}}]),
    "tool turn": lambda c: c.chat.completions.create(model="m", max_tokens=8, messages=[
        {"role": "user", "content": "read it"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "Read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "text"}]),
    "max_completion_tokens": lambda c: c.chat.completions.create(
        model="m", max_completion_tokens=8, messages=[{"role": "user", "content": "hi"}]),
    "prompt_cache_key": lambda c: c.chat.completions.create(
        model="m", max_tokens=8, prompt_cache_key="s", messages=[{"role": "user", "content": "hi"}]),
}


@pytest.mark.parametrize("name", sorted(ANTHROPIC_CALLS))
def test_bodies_the_anthropic_library_builds_are_anthropic(name: str) -> None:
    body = _captured(_anthropic, ANTHROPIC_CALLS[name])
    assert recognise(body) == "anthropic"
    assert parse_input(body).api == "anthropic"


@pytest.mark.parametrize("name", sorted(OPENAI_CALLS))
def test_bodies_the_openai_library_builds_are_openai(name: str) -> None:
    body = _captured(_openai, OPENAI_CALLS[name])
    assert recognise(body) == "openai"


def test_explicit_api_wins_and_the_shared_shape_is_openai() -> None:
    plain = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert recognise(plain) == "openai"
    request = parse_input({**plain, "api": "anthropic", "stream": True})
    assert request.api == "anthropic" and request.body == {**plain, "stream": False}
    mixed = {**plain, "system": "s", "stop": ["x"]}
    with pytest.raises(InvalidRequest, match=r"Anthropic Messages shape \(system\).*\(stop\); set input.api"):
        parse_input(mixed)
    assert parse_input({**mixed, "api": "openai"}).api == "openai"


def test_old_conveniences_and_envelope_keys() -> None:
    request = parse_input({"prompt": "hi", "max_tokens": 7, "platform_envelope": 1})
    assert request.api == "openai" and request.body["messages"] == [{"role": "user", "content": "hi"}]
    assert request.body["model"] == "default" and request.body["stream"] is False
    counted = parse_input({"api": "anthropic", "count_tokens": True, "max_tokens": 5, "prompt": "x",
                           "headers": {"X-Claude-Code-Session-Id": "s"}})
    assert counted.count_tokens and "max_tokens" not in counted.body and "stream" not in counted.body
    assert counted.headers == {"x-claude-code-session-id": "s"}
    for bad, param in (({}, "messages"), ({"prompt": ""}, "messages"),
                       ({"api": "responses", "prompt": "x"}, "api"),
                       ({"prompt": "x", "headers": {"a": 1}}, "headers"),
                       ({"prompt": "x", "count_tokens": True}, "count_tokens")):
        with pytest.raises(InvalidRequest) as caught:
            parse_input(bad)
        assert caught.value.param == param


def test_session_hint_is_the_native_routes() -> None:
    """metadata.user_id (Claude Code), prompt_cache_key and forwarded headers name the session
    through the same Protocol.session_key the native routes use."""
    proto = Protocol(PromptTokenizer.load(), OutputLedger(), ["default"], 1_064_960)
    uid = json.dumps({"device_id": "d", "session_id": "cc-session"})
    job = parse_input({"model": "default", "max_tokens": 8, "system": "s", "metadata": {"user_id": uid},
                       "messages": [{"role": "user", "content": "hi"}]})
    assert proto.prepare_anthropic(job.body, job.headers).session_key == "cc-session"
    job = parse_input({"model": "default", "prompt_cache_key": "codex-1", "prompt": "hi"})
    assert proto.prepare_openai(job.body, job.headers).session_key == "codex-1"
    job = parse_input({"model": "default", "prompt": "hi", "headers": {"X-Claude-Code-Session-Id": "hdr"}})
    assert proto.prepare_openai(job.body, job.headers).session_key == "hdr"


def test_output_keeps_the_text2text_keys_beside_the_api_body() -> None:
    message = {"type": "message", "content": [{"type": "thinking", "thinking": "t"},
                                              {"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
               "stop_reason": "end_turn", "usage": {"input_tokens": 3}}
    out = shape_output("anthropic", message)
    assert out == {"api": "anthropic", "text": "ab", "finish_reason": "end_turn",
                   "usage": {"input_tokens": 3}, "response": message}
    completion = {"object": "chat.completion", "usage": {"prompt_tokens": 3}, "choices": [{
        "finish_reason": "tool_calls", "message": {"content": None, "reasoning_content": "r",
                                                   "tool_calls": [{"id": "c"}]}}]}
    out = shape_output("openai", completion)
    assert out["text"] == "" and out["tool_calls"] == [{"id": "c"}] and out["reasoning"] == "r"
