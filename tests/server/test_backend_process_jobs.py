"""``/process`` as a first-class way in, through the SDK's own ``python -m inferencekey.backend.serve``
(scripted engine, real rank process): bodies built by the ``anthropic`` and ``openai`` client
libraries (``tests/support/process_bridge.py``), answered in their API's own shape with what the
native route answers for the same request; the system prompt kept; tools -> tool calls; a
session's second turn cached; errors in the API's shape (the SDK's 400)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.ports import free_port
from tests.support.process_bridge import anthropic_client, openai_client
from tests.support.sdk_serve import wait_healthz

REPO = Path(__file__).resolve().parents[2]
SYSTEM_MARK = "SYSTEM-MARKER-7"
SCRIPT = {"replies": [
    {"name": "system", "prompt_match": SYSTEM_MARK, "text": "The system prompt reached the model."},
    {"name": "read", "match": "What is in README.md", "reasoning": "I should read it.",
     "tool_calls": [{"name": "Read", "arguments": {"file_path": "README.md"}}]},
], "default": {"text": "Hello from the scripted model."}}
READ_TOOL = {"name": "Read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                              "required": ["file_path"]}}
OPENAI_READ_TOOL = {"type": "function", "function": {"name": "Read", "description": "Read a file",
                                                     "parameters": READ_TOOL["input_schema"]}}
ASK = [{"role": "user", "content": "What is in README.md?"}]
LONG = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(SDK serve URL, native URL) of one backend process."""
    tmp = tmp_path_factory.mktemp("process")
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    sdk_port, native_port = free_port(), free_port()
    config = {"engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
              "reference_num_blocks": 1024, "max_num_seqs": 8, "max_model_len": 8192, "l1_cache": False,
              "ready_timeout_secs": 120, "port": native_port}
    log_path = tmp / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferencekey.backend.serve", "--port", str(sdk_port),
             "--backend", "deepinfer_backend:DeepInferBackend", "--config-json", json.dumps(config)],
            cwd=tmp, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT)
    sdk_url = f"http://127.0.0.1:{sdk_port}"
    try:
        wait_healthz(sdk_url, proc, log_path, 180)
        yield sdk_url, f"http://127.0.0.1:{native_port}"
    finally:
        proc.kill()
        proc.wait(30)


def _native_anthropic(native_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=native_url, api_key="unused", max_retries=0)


def _native_openai(native_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=native_url + "/v1", api_key="unused", max_retries=0)


def _without_ids(blocks: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.model_dump().items() if k not in ("id", "signature")} for b in blocks]


def test_anthropic_body_recognised_answers_as_the_native_route(servers: tuple[str, str]) -> None:
    """An Anthropic body (no ``api``: recognised by its tools' input_schema) -> an Anthropic
    ``message`` with the tool call, stop reason and usage the native route answers."""
    sdk_url, native_url = servers
    request = {"model": "default", "max_tokens": 64, "tools": [READ_TOOL], "messages": ASK}
    client, bridge = anthropic_client(sdk_url, name_api=False)
    via_process = client.messages.create(**request)  # type: ignore[arg-type]
    assert "api" not in bridge.jobs[0]["input"] and bridge.outputs[0]["api"] == "anthropic"
    assert isinstance(via_process, anthropic.types.Message)
    calls = [b for b in via_process.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("Read", {"file_path": "README.md"})]
    assert via_process.stop_reason == "tool_use" and bridge.outputs[0]["finish_reason"] == "tool_use"
    native = _native_anthropic(native_url).messages.create(**request)  # type: ignore[arg-type]
    assert _without_ids(via_process.content) == _without_ids(native.content)
    assert native.stop_reason == via_process.stop_reason
    assert native.usage.output_tokens == via_process.usage.output_tokens
    assert (native.usage.input_tokens + (native.usage.cache_read_input_tokens or 0)
            == via_process.usage.input_tokens + (via_process.usage.cache_read_input_tokens or 0))


def test_openai_body_answers_as_the_native_route(servers: tuple[str, str]) -> None:
    sdk_url, native_url = servers
    request = {"model": "default", "max_tokens": 64, "tools": [OPENAI_READ_TOOL], "messages": ASK}
    client, bridge = openai_client(sdk_url, name_api=False)
    via_process = client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert bridge.outputs[0]["api"] == "openai"
    assert isinstance(via_process, openai.types.chat.ChatCompletion)
    choice = via_process.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()] == [
        ("Read", {"file_path": "README.md"})]
    native = _native_openai(native_url).chat.completions.create(**request)  # type: ignore[call-overload]
    assert native.choices[0].message.content == choice.message.content
    assert [(c.function.name, c.function.arguments) for c in native.choices[0].message.tool_calls or ()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    assert native.usage is not None and via_process.usage is not None
    assert native.usage.prompt_tokens == via_process.usage.prompt_tokens


def test_system_prompt_reaches_the_model(servers: tuple[str, str]) -> None:
    """Anthropic ``system`` and an OpenAI system message both reach the prompt: the scripted model
    answers from the system text, and count_tokens through /process counts it (as natively).
    Red before: process() took the OpenAI shape only and dropped ``system``."""
    sdk_url, native_url = servers
    client, _ = anthropic_client(sdk_url)
    system = f"{SYSTEM_MARK}: answer briefly."
    msg = client.messages.create(model="default", max_tokens=32, system=system,
                                 messages=[{"role": "user", "content": "Hi"}])
    assert msg.content[0].type == "text" and msg.content[0].text == "The system prompt reached the model."
    hi: list[Any] = [{"role": "user", "content": "Hi"}]
    plain = client.messages.create(model="default", max_tokens=32, messages=hi)
    assert plain.content[0].type == "text" and plain.content[0].text == "Hello from the scripted model."
    counted = client.messages.count_tokens(model="default", system=system,
                                           messages=[{"role": "user", "content": "Hi"}])
    counted_plain = client.messages.count_tokens(model="default", messages=hi)
    native = _native_anthropic(native_url).messages.count_tokens(
        model="default", system=system, messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens == native.input_tokens > counted_plain.input_tokens
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    oclient, _ = openai_client(sdk_url)
    done = oclient.chat.completions.create(model="default", max_tokens=32, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    assert done.choices[0].message.content == "The system prompt reached the model."


def test_anthropic_session_second_turn_is_cached(servers: tuple[str, str]) -> None:
    """Claude Code's session (metadata.user_id's session_id): the second turn starts from the first's
    blocks."""
    client, bridge = anthropic_client(servers[0])
    metadata = {"user_id": json.dumps({"device_id": "d", "session_id": "proc-session-1"})}
    turn1: list[Any] = [{"role": "user", "content": LONG}]
    first = client.messages.create(model="default", max_tokens=32, metadata=metadata,  # type: ignore[arg-type]
                                   messages=turn1)
    turn2 = [*turn1, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": "And then?"}]
    second = client.messages.create(model="default", max_tokens=32, metadata=metadata,  # type: ignore[arg-type]
                                    messages=turn2)
    prompt1 = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) >= prompt1 // 2, (first.usage, second.usage)
    assert bridge.outputs[1]["usage"]["cache_read_input_tokens"] == second.usage.cache_read_input_tokens


def test_openai_session_second_turn_is_cached(servers: tuple[str, str]) -> None:
    client, _ = openai_client(servers[0])
    turn1: list[Any] = [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": LONG + " (o)"}]
    first = client.chat.completions.create(model="default", max_tokens=32, messages=turn1,
                                           prompt_cache_key="proc-session-2")
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="default", max_tokens=32, messages=turn2,
                                            prompt_cache_key="proc-session-2")
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= first.usage.prompt_tokens // 2


def test_errors_come_back_in_the_api_shape(servers: tuple[str, str]) -> None:
    """A 4xx of the protocol is the SDK's 400 whose error text is the API's own error body."""
    sdk_url = servers[0]
    client, _ = anthropic_client(sdk_url)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="claude-opus-4-8", max_tokens=8,
                               messages=[{"role": "user", "content": "x"}])
    assert caught.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "Model 'claude-opus-4-8' is not available on this endpoint"}}
    oclient, _ = openai_client(sdk_url)
    with pytest.raises(openai.BadRequestError) as ocaught:
        oclient.chat.completions.create(model="default", max_tokens=8, messages=[], n=1)
    assert isinstance(ocaught.value.body, dict) and ocaught.value.body["param"] == "messages"
    for job_input, want in (
            ({"api": "grpc", "prompt": "x"}, "'api' must be 'anthropic' or 'openai'"),
            ({"system": "s", "stop": ["x"], "messages": ASK}, "set input.api"),
            ({"api": "openai", "count_tokens": True, "messages": ASK}, "Anthropic Messages operation")):
        resp = httpx.post(sdk_url + "/process", json={"id": "bad", "input": job_input}, timeout=60)
        assert resp.status_code == 400
        error = json.loads(resp.json()["error"])
        assert want in error["error"]["message"] and error["error"]["type"] == "invalid_request_error"


def test_smoke_through_process(servers: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """``smoke --process``: every check through the SDK's /process; streaming is SKIP there."""
    import deepinfer_backend

    code = deepinfer_backend.main(["smoke", "--url", servers[0], "--process"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, "\n".join(lines)
    assert [line.split(" ")[0] for line in lines[:-1]] == [
        "PASS", "PASS", "SKIP", "SKIP", "PASS", "PASS", "PASS"]
    assert lines[-1] == f"smoke: 5 passed, 0 failed, 2 skipped against {servers[0]}/process"
