"""The Claude Code flows through the ``openai`` SDK with function tools (OpenAI-style clients).

Same backend as the CLI suite (a subprocess on the scripted stand-in model, replies from
``scenarios/openai_tools.json``); the tools run here, on a temp project directory, and their
results go back as ``tool`` messages. Streaming and non-streaming, parallel calls, a multi-turn
chain that must hit the prefix cache, and a model name the backend does not serve.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.e2e_harness import API_KEY, MODEL, running_backend

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4096  # the no-max_tokens case has its own test at the end

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the project directory.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "integer"}}, "required": ["command"]}}},
]


@pytest.fixture(scope="module")
def backend():
    with running_backend("openai_tools.json", ranks=1) as b:
        yield b


@pytest.fixture()
def client(backend):
    # closed after the test: an unclosed client's keep-alive socket was collected later, in some
    # other test or at exit, and failed the run with an unraisable ResourceWarning
    with openai.OpenAI(base_url=f"{backend.base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def run_tool(project: Path, name: str, arguments: dict[str, Any]) -> str:
    if name == "read_file":
        return (project / arguments["path"]).read_text()
    if name == "run_command":
        done = subprocess.run(arguments["command"], shell=True, cwd=project, capture_output=True, text=True,
                              timeout=arguments.get("timeout_s", 30))
        return done.stdout
    raise AssertionError(f"unknown tool {name}")


def complete(client, messages: list[dict[str, Any]], stream: bool) -> tuple[dict[str, Any], str, Any]:
    """One chat completion as (assistant message dict, finish_reason, usage), streamed or not."""
    if not stream:
        resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              max_tokens=MAX_TOKENS)
        choice = resp.choices[0]
        msg = choice.message.model_dump(exclude_none=True)
        return msg, choice.finish_reason, resp.usage
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                max_tokens=MAX_TOKENS,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish, usage


def agent_loop(client, project: Path, prompt: str, stream: bool, max_turns: int = 8):
    """Drive the model like an agent: run every tool call, feed results back, until it answers."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    usages, all_calls = [], []
    for _ in range(max_turns):
        msg, finish, usage = complete(client, messages, stream)
        usages.append(usage)
        messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
        if finish != "tool_calls":
            assert not msg.get("tool_calls")
            return msg.get("content") or "", all_calls, usages
        assert msg["tool_calls"], "finish_reason tool_calls without calls"
        for call in msg["tool_calls"]:
            args = json.loads(call["function"]["arguments"])  # must be valid JSON, whole
            all_calls.append((call["function"]["name"], args))
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": run_tool(project, call["function"]["name"], args)})
    raise AssertionError("no final answer")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_read_file_and_answer(client, tmp_path: Path, stream: bool):
    (tmp_path / "README.md").write_text("The launch code is PURPLE-OTTER-42.\n")
    answer, calls, _ = agent_loop(client, tmp_path, "[flow:read] What is the launch code in README.md?",
                                  stream)
    assert calls == [("read_file", {"path": "README.md"})]
    assert answer == "The launch code is PURPLE-OTTER-42."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_parallel_tool_calls(client, tmp_path: Path, stream: bool):
    (tmp_path / "notes.txt").write_text("Note: the deploy window opens at 14:00\n")
    answer, calls, _ = agent_loop(client, tmp_path, "[flow:parallel] Read notes.txt and compute 6*7.", stream)
    # One reply, two calls; the integer parameter arrives as a JSON number.
    assert calls == [("read_file", {"path": "notes.txt"}),
                     ("run_command", {"command": "echo $((6*7))", "timeout_s": 10})]
    assert answer == "notes.txt says: the deploy window opens at 14:00. 6*7 = 42."


def test_multi_turn_chain_hits_prefix_cache(client, backend, tmp_path: Path):
    cached_before = backend.metric_sum("deepinfer_cached_tokens_total")
    answer, calls, usages = agent_loop(client, tmp_path, "[flow:chain] Log three lines, then count them.",
                                       True)
    assert [c[0] for c in calls] == ["run_command"] * 3
    assert (tmp_path / "log.txt").read_text() == "one\ntwo\nthree\n"
    assert answer == "log.txt has 3 lines."
    assert len(usages) == 4 and all(u is not None for u in usages)
    cached = [(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0) for u in usages]
    assert all(c > 0 for c in cached[1:]), cached  # every turn after the first reuses the prefix
    assert backend.metric_sum("deepinfer_cached_tokens_total") - cached_before == sum(cached)


def test_unknown_model_is_a_400_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                       tools=TOOLS)
    assert info.value.body["message"] == "Model 'gpt-4o' is not available on this endpoint"


def test_tool_call_ids_are_unique_and_echoed(client, tmp_path: Path):
    (tmp_path / "notes.txt").write_text("Note: x\n")
    msg, finish, _ = complete(client, [{"role": "user", "content": "[flow:parallel] go"}], stream=False)
    assert finish == "tool_calls"
    ids = [c["id"] for c in msg["tool_calls"]]
    assert len(set(ids)) == 2 and all(ids)


def test_no_max_tokens_with_a_cached_prefix_is_admitted(client, tmp_path: Path):
    """Regression (found by this suite): with max_tokens omitted the output estimate was capped at
    the whole pool, so a turn whose prefix was cached could never fit (its own pinned prefix
    counted against it): it waited the 120 s admission limit, then got a 503."""
    (tmp_path / "README.md").write_text("The launch code is PURPLE-OTTER-42.\n")
    messages = [{"role": "user", "content": "[flow:read] What is the launch code in README.md?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # no max_tokens
    assert first.choices[0].finish_reason == "tool_calls"
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # same prefix, cached
    assert again.choices[0].finish_reason == "tool_calls"


def test_the_harness_reads_the_rank_details_from_healthz(backend):
    """The CLI suite's rank-kill scenario (test_rank_killed_mid_turn, not in the default run) reads
    the epoch and the busy rank's pid from /healthz through the harness; the backend keeps those
    behind the API key. Regression: the harness sent no key, got ``{"status"}`` alone, and the
    scenario failed with KeyError 'epoch' in the CLI suite only, after the details went behind the key."""
    health = backend.health()
    assert health["status"] == "ready" and isinstance(health["epoch"], int), health
    pids = [info["pid"] for info in health["ranks"]["ranks"]]
    assert pids and set(pids) <= set(backend.rank_pids()), (health, backend.rank_pids())
