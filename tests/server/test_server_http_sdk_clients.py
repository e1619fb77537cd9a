"""The whole server through real HTTP, driven by the official ``anthropic`` and ``openai`` SDKs.

Runtime: the scripted stand-in model (``engine: scripted``) on 2 in-process ranks
(``LocalRankGroup``), 16-token blocks, so replies (text, tool calls) are known and prompts of a
few hundred tokens span many blocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rank.client import GroupState
from server.config import load_config
from server.runtime import Runtime
from tests.server.server_test_helpers import run_runtime

KEY = "sk-test-server-0123456789"
LONG_TEXT = " ".join(f"word{i}" for i in range(1500))

SCRIPT = {
    "description": "server tests",
    "tokens_per_step": 4,
    "step_delay_s": 0.002,
    "replies": [
        {"name": "tool", "match": "Please read the README",
         "tool_calls": [{"name": "Read", "arguments": {"file_path": "/tmp/README.md"}}]},
        {"name": "long", "match": "LONG REPLY", "text": LONG_TEXT},
        {"name": "stop", "match": "STOP TEST", "text": "alpha beta gamma STOPHERE delta epsilon"},
        {"name": "think", "match": "THINK THEN ANSWER", "reasoning": "Private chain of thought.",
         "text": "Answer after thinking."},
        {"name": "hello", "text": "Hello from the scripted model."},
    ],
}
READ_TOOL = {"name": "Read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                              "required": ["file_path"]}}
OPENAI_READ_TOOL = {"type": "function", "function": {"name": "Read", "description": "Read a file",
                                                     "parameters": READ_TOOL["input_schema"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Runtime, Any, str]]:
    tmp = tmp_path_factory.mktemp("script")
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = load_config({
        "engine": "scripted", "script_file": str(script), "ep": 2, "block_size": 16,
        "reference_num_blocks": 1024, "max_num_seqs": 16, "max_model_len": 4096, "l1_cache": False,
        "api_key": KEY, "port": 0, "request_timeout_secs": 60, "max_body_bytes": 256 * 1024,
    })
    runtime = Runtime(config, rank_mode="local")
    with run_runtime(runtime) as loop:
        yield runtime, loop, runtime.url


@pytest.fixture()
def claude(server: tuple[Runtime, Any, str]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server[2], api_key=KEY, max_retries=0, timeout=30) as client:
        yield client


@pytest.fixture()
def oai(server: tuple[Runtime, Any, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[2] + "/v1", api_key=KEY, max_retries=0, timeout=30) as client:
        yield client


def _no_leaks(runtime: Runtime, loop: Any, timeout_s: float = 60.0) -> None:
    """Every engine idle and consistent, and no cache use-ref left (after the request ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [runtime.group.stats(r) for r in range(runtime.group.num_ranks)]
        if all(s.num_running == 0 and s.num_waiting == 0 for s in stats) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(s.num_running == 0 and s.num_waiting == 0 for s in stats), stats

    async def check() -> None:
        await runtime.cache.drain()
        for engine in runtime.group.engines:
            engine.check_accounting()
        runtime.cache.check_balance()

    loop.call(check(), 10)


# -- Anthropic ----------------------------------------------------------------------------------
def test_anthropic_non_streaming_text(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model="deepseek-v4.1-flash", max_tokens=64,
                                 messages=[{"role": "user", "content": "Say hello."}])
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello from the scripted model."
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0


def test_anthropic_streaming_tool_call(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="default", max_tokens=128, tools=[READ_TOOL],
                                messages=[{"role": "user", "content": "Please read the README"}]) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and "content_block_delta" in events
    tool_uses = [b for b in final.content if b.type == "tool_use"]
    assert tool_uses and tool_uses[0].name == "Read" and tool_uses[0].input == {"file_path": "/tmp/README.md"}
    assert final.stop_reason == "tool_use"


def test_anthropic_second_turn_reports_cached_tokens(claude: anthropic.Anthropic) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "Context: " + " ".join(
        f"fact{i} is {i * 7}" for i in range(120)) + ". Say hello."}]
    headers = {"x-claude-code-session-id": "cache-test-session"}
    first = claude.messages.create(model="default", max_tokens=32, messages=history, extra_headers=headers)
    assert first.usage.cache_read_input_tokens in (0, None)
    history += [{"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "And again, say hello."}]
    with claude.messages.stream(model="default", max_tokens=32, messages=history,
                                extra_headers=headers) as stream:
        second = stream.get_final_message()
    assert second.usage.cache_read_input_tokens and second.usage.cache_read_input_tokens >= 16 * 10
    assert (second.usage.cache_read_input_tokens < second.usage.input_tokens
            + second.usage.cache_read_input_tokens)


def test_anthropic_stop_sequence_ends_stream_and_aborts_engine(
    server: tuple[Runtime, Any, str], claude: anthropic.Anthropic
) -> None:
    msg = claude.messages.create(model="default", max_tokens=64, stop_sequences=["STOPHERE"],
                                 messages=[{"role": "user", "content": "STOP TEST"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOPHERE"
    assert "STOPHERE" not in msg.content[0].text and "delta" not in msg.content[0].text
    _no_leaks(server[0], server[1])


# What Claude Code 2.1.332 sends in stream-json mode (Claude Code's captured traffic, ``docs/claude-code.md``)
BETAS_2_1_332 = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                 "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,"
                 "advanced-tool-use-2025-11-20,effort-2025-11-24,thinking-display-updates-2026-08-18")


@pytest.mark.parametrize("display", ["omitted", "updates"])
def test_anthropic_new_betas_and_hidden_thinking_display(server: tuple[Runtime, Any, str],
                                                         display: str) -> None:
    body = {"model": "default", "max_tokens": 64, "stream": True,
            "thinking": {"type": "adaptive", "display": display},
            "messages": [{"role": "user", "content": "THINK THEN ANSWER"}]}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": BETAS_2_1_332}
    resp = httpx.post(server[2] + "/v1/messages?beta=true", json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    assert "Answer after thinking." in "".join(json.loads(line[6:]).get("delta", {}).get("text", "")
                                               for line in resp.text.splitlines()
                                               if line.startswith("data: "))
    assert "Private chain of thought" not in resp.text  # no reasoning text on the wire
    assert '"type":"signature_delta"' in resp.text
    whole = httpx.post(server[2] + "/v1/messages", json={**body, "stream": False}, headers=headers,
                       timeout=30).json()
    assert whole["content"][0]["type"] == "thinking" and whole["content"][0]["thinking"] == ""
    assert whole["content"][0]["signature"] and whole["content"][1]["text"] == "Answer after thinking."


# -- OpenAI ---------------------------------------------------------------------------------------
def test_openai_non_streaming_tool_call(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(model="deepinfer-v41-flash", max_tokens=128, tools=[OPENAI_READ_TOOL],
                                       messages=[{"role": "user", "content": "Please read the README"}])
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "Read" and json.loads(call.function.arguments) == {
        "file_path": "/tmp/README.md"}
    assert resp.choices[0].finish_reason == "tool_calls"


def test_openai_streaming_text_with_usage(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(
        model="default", max_tokens=64, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say hello."}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the scripted model."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_openai_second_turn_reports_cached_tokens(oai: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Rules: " + " ".join(f"rule{i}" for i in range(200))},
        {"role": "user", "content": "Say hello."}]
    first = oai.chat.completions.create(model="default", max_tokens=32, messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again."}]
    second = oai.chat.completions.create(model="default", max_tokens=32, messages=messages)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 10


# -- errors, in each API's shape --------------------------------------------------------------------
def test_unknown_model_is_410_anthropic_400_openai(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    # Anthropic: 410, which Claude Code neither retries nor rewrites (a 400 costs it six requests)
    with pytest.raises(anthropic.APIStatusError) as a_err:
        claude.messages.create(model="claude-opus-4-8", max_tokens=8,
                               messages=[{"role": "user", "content": "x"}])
    assert a_err.value.status_code == 410
    assert a_err.value.body["error"]["message"] == "Model 'claude-opus-4-8' is not available on this endpoint"
    assert a_err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as o_err:
        oai.chat.completions.create(model="gpt-4o", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert o_err.value.body["message"] == "Model 'gpt-4o' is not available on this endpoint"


def test_prompt_too_long_is_400_with_both_numbers(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    huge = "lorem ipsum " * 3000
    with pytest.raises(anthropic.BadRequestError) as a_err:
        claude.messages.create(model="default", max_tokens=8, messages=[{"role": "user", "content": huge}])
    message = a_err.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" maximum")
    num, limit = [int(w) for w in message.replace(":", " ").split() if w.isdigit()]
    assert num > limit
    with pytest.raises(openai.BadRequestError) as o_err:
        oai.chat.completions.create(model="default", max_tokens=8,
                                    messages=[{"role": "user", "content": huge}])
    assert o_err.value.body["message"].startswith("prompt is too long: ")


def test_auth_errors_are_401(server: tuple[Runtime, Any, str]) -> None:
    url = server[2]
    with (anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as bad_claude,
          pytest.raises(anthropic.AuthenticationError)):
        bad_claude.messages.create(model="default", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    with (openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as bad_oai,
          pytest.raises(openai.AuthenticationError)):
        bad_oai.chat.completions.create(model="default", max_tokens=8,
                                        messages=[{"role": "user", "content": "x"}])
    # What Claude Code sends with ANTHROPIC_API_KEY and a different ANTHROPIC_AUTH_TOKEN.
    resp = httpx.post(url + "/v1/messages?beta=true",
                      json={"model": "default", "max_tokens": 8, "messages": []},
                      headers={"x-api-key": KEY, "authorization": "Bearer another-key"})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert "two different API keys" in resp.json()["error"]["message"]


def test_bad_json_and_bad_fields_are_400(server: tuple[Runtime, Any, str]) -> None:
    url = server[2]
    resp = httpx.post(url + "/v1/messages", content=b"{not json",
                      headers={"x-api-key": KEY, "content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(url + "/v1/chat/completions", json={"model": "default", "messages": "nope"},
                      headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in resp.text


def test_body_too_large_is_413(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as err:
        claude.messages.create(model="default", max_tokens=8,
                               messages=[{"role": "user", "content": "x" * 300_000}])
    assert err.value.status_code == 413 and err.value.body["error"]["type"] == "request_too_large"


def test_count_tokens_matches_usage(claude: anthropic.Anthropic) -> None:
    request = {"model": "default", "messages": [{"role": "user", "content": "Say hello, count me."}],
               "tools": [READ_TOOL]}
    counted = claude.messages.count_tokens(**request)
    msg = claude.messages.create(max_tokens=8, **request)
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


# -- ranks restarting, disconnects, timeouts -------------------------------------------------------
def test_new_requests_get_503_with_retry_after_while_ranks_restart(
    server: tuple[Runtime, Any, str], claude: anthropic.Anthropic
) -> None:
    runtime, loop, url = server
    group = runtime.group

    async def set_state(state: GroupState) -> None:
        group.state = state

    loop.call(set_state(GroupState.RESTARTING))
    try:
        resp = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, json={
            "model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "overloaded_error"
        assert int(resp.headers["retry-after"]) >= 1
        health = httpx.get(url + "/healthz", headers={"x-api-key": KEY}).json()
        assert health["status"] == "loading" and "rank group restarting" in health["reasons"]
    finally:
        loop.call(set_state(GroupState.READY))


def _stream_lines(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> Iterator[str]:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200
        yield from resp.iter_lines()


def test_inflight_streams_end_with_error_event_when_ranks_restart(server: tuple[Runtime, Any, str]) -> None:
    runtime, loop, url = server
    body = {"model": "default", "max_tokens": 2000, "stream": True,
            "messages": [{"role": "user", "content": "LONG REPLY please"}]}
    lines: list[str] = []
    for line in _stream_lines(url, "/v1/messages", body, {"x-api-key": KEY}):
        lines.append(line)
        if len(lines) == 12:
            loop.call(runtime.group.restart("test: simulated rank failure"))
    text = "\n".join(lines)
    assert "event: error" in text and "overloaded_error" in text
    assert "event: message_stop" not in text
    lines = []
    for line in _stream_lines(url, "/v1/chat/completions", {**body, "stream": True},
                              {"authorization": f"Bearer {KEY}"}):
        lines.append(line)
        if len(lines) == 12:
            loop.call(runtime.group.restart("test: simulated rank failure"))
    error_frames = [json.loads(l[6:]) for l in lines if l.startswith("data: {\"error\"")]
    assert error_frames and error_frames[0]["error"]["type"] == "server_error"
    _no_leaks(runtime, loop)


def test_client_disconnect_aborts_engine_request(server: tuple[Runtime, Any, str]) -> None:
    runtime, loop, url = server
    body = {"model": "default", "max_tokens": 2000, "stream": True,
            "messages": [{"role": "user", "content": "LONG REPLY now"}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 10:
                break  # leaving the block closes the connection mid-stream
    _no_leaks(runtime, loop)
    metrics = httpx.get(url + "/metrics").text
    disconnects = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("deepinfer_client_disconnects_total ")]
    assert disconnects and disconnects[0] >= 1.0


def test_metrics_and_healthz_after_traffic(server: tuple[Runtime, Any, str]) -> None:
    url = server[2]
    health = httpx.get(url + "/healthz", headers={"authorization": f"Bearer {KEY}"})
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and any("L1" in r for r in health.json()["reasons"])
    text = httpx.get(url + "/metrics").text
    for name in ("deepinfer_requests_total", "deepinfer_output_tokens_total",
                 "deepinfer_time_to_first_token_seconds_bucket", "deepinfer_inter_token_seconds_bucket",
                 "deepinfer_queue_time_seconds_bucket", 'deepinfer_rank_group_state{state="ready"} 1.0',
                 'deepinfer_cached_tokens_total{tier="l0"}'):
        assert name in text, name
    # every request that entered the service left it, whichever way it ended
    assert "deepinfer_requests_in_flight 0.0" in text
    assert 'deepinfer_requests_finished_total{reason="cancelled"}' in text
