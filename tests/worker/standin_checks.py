"""What the worker stand-in checks against a running backend: each returns a one-line detail or
raises ``CheckFailed``. Real clients only: httpx on the SDK's port, the anthropic and openai SDKs
and the pinned Claude Code CLI on the native port."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil

from tests.support.process_bridge import anthropic_client, openai_client

MODEL = "deepseek-v4.1-flash"
API_KEY = "standin-any-key"  # MEASURED_CONFIG sets no api_key: any key is accepted
READ_TOOL = {"name": "Read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                              "required": ["file_path"]}}
OPENAI_READ_TOOL = {"type": "function", "function": {"name": "Read", "description": "Read a file",
                                                     "parameters": READ_TOOL["input_schema"]}}
ASK = [{"role": "user", "content": "What is in README.md?"}]
RUNTIME_MODULES = ("torch", "numpy", "orjson", "zmq", "tokenizers")
# The backend process always loads these; torch only where something in it asks for it (nothing
# does with CPU ranks on a machine like CI's: the ranks load torch, the backend need not). A
# module that is loaded must come from the DeepInfer venv either way.
REQUIRED_MODULES = ("numpy", "orjson", "zmq", "tokenizers")


class CheckFailed(AssertionError):
    pass


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


def sdk_healthz(sdk_url: str) -> str:
    resp = httpx.get(sdk_url + "/healthz", timeout=10)
    expect(resp.status_code == 200 and resp.json() == {"status": "ok"}, f"{resp.status_code} {resp.text}")
    meta = httpx.get(sdk_url + "/meta", timeout=10).json()
    expect(meta["name"] == "deepinfer-v41-flash", f"/meta {meta}")
    return f"200 {resp.json()}; /meta {meta['name']} {meta['version']}"


def sdk_process(sdk_url: str) -> str:
    details = []
    for job in ({"prompt": "Say hello."}, {"messages": ASK, "max_tokens": 16}):
        resp = httpx.post(sdk_url + "/process", json={"id": "standin", "input": {"max_tokens": 16, **job}},
                          timeout=300)
        expect(resp.status_code == 200, f"{resp.status_code} {resp.text[:500]}")
        out = resp.json()["output"]
        expect(isinstance(out["text"], str) and out["usage"]["completion_tokens"] > 0, f"output {out}")
        details.append(f"{next(iter(job))}: {out['usage']['completion_tokens']} tokens, "
                       f"{out['finish_reason']}")
    return "; ".join(details)


def process_anthropic(sdk_url: str) -> str:
    """An Anthropic body built by the anthropic library through /process (the shape recognised):
    an Anthropic message back; the system prompt counted (count_tokens with and without it, and
    the answer's own prompt size); tools accepted; a session's second turn cached."""
    client, bridge = anthropic_client(sdk_url, name_api=False)
    system = "You are a careful coding agent. Answer in one short paragraph."
    msg = client.messages.create(model=MODEL, max_tokens=16, system=system, tools=[READ_TOOL],
                                 messages=ASK)
    expect(msg.type == "message" and bridge.outputs[-1]["api"] == "anthropic", f"{bridge.outputs[-1]}")
    counted = client.messages.count_tokens(model=MODEL, system=system, tools=[READ_TOOL],
                                           messages=ASK).input_tokens
    without = client.messages.count_tokens(model=MODEL, tools=[READ_TOOL],
                                           messages=ASK).input_tokens
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    expect(counted == prompt > without, f"count_tokens {counted} (without system {without}), answer {prompt}")
    # A bare body (no system, no tools) is both APIs' shape, read as OpenAI: name the API.
    client, _ = anthropic_client(sdk_url)
    metadata = {"user_id": json.dumps({"device_id": "standin", "session_id": "standin-process-a"})}
    turn1: list[Any] = [{"role": "user", "content": _long_text("a")}]
    first = client.messages.create(model=MODEL, max_tokens=8, metadata=metadata,
                                   messages=turn1)
    turn2 = [*turn1, {"role": "assistant", "content": [b.model_dump() for b in first.content] or "."},
             {"role": "user", "content": "And the last line?"}]
    second = client.messages.create(model=MODEL, max_tokens=8, metadata=metadata,
                                    messages=turn2)
    cached = second.usage.cache_read_input_tokens or 0
    expect(cached >= 128, f"second turn cached {cached} of {second.usage.input_tokens + cached}")
    tools = [b.name for b in msg.content if b.type == "tool_use"]
    return (f"message, stop {msg.stop_reason}, tool_use {tools or 'none (model)'}; system kept: "
            f"{counted} tokens vs {without} without; turn 2 cached {cached} of "
            f"{second.usage.input_tokens + cached}")


def process_openai(sdk_url: str) -> str:
    """An OpenAI body built by the openai library through /process: a chat.completion back, the
    system message counted in the prompt, tools accepted, a prompt_cache_key session's second turn
    cached."""
    client, bridge = openai_client(sdk_url, name_api=False)
    with_system = client.chat.completions.create(model=MODEL, max_tokens=16, tools=[OPENAI_READ_TOOL],
                                                 messages=[{"role": "system", "content": "Be brief."}, *ASK])
    plain = client.chat.completions.create(model=MODEL, max_tokens=16, tools=[OPENAI_READ_TOOL],
                                           messages=ASK)
    expect(with_system.object == "chat.completion" and bridge.outputs[-1]["api"] == "openai",
           str(with_system))
    assert with_system.usage is not None and plain.usage is not None
    expect(with_system.usage.prompt_tokens > plain.usage.prompt_tokens,
           f"system message not in the prompt: {with_system.usage.prompt_tokens} vs "
           f"{plain.usage.prompt_tokens}")
    turn1: list[Any] = [{"role": "user", "content": _long_text("o")}]
    first = client.chat.completions.create(model=MODEL, max_tokens=8, messages=turn1,
                                           prompt_cache_key="standin-process-o")
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content or "."},
             {"role": "user", "content": "And the last line?"}]
    second = client.chat.completions.create(model=MODEL, max_tokens=8, messages=turn2,
                                            prompt_cache_key="standin-process-o")
    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    expect(cached >= 128, f"second turn cached {cached} of {second.usage.prompt_tokens}")
    calls = [c.function.name for c in with_system.choices[0].message.tool_calls or ()]
    return (f"chat.completion, finish {with_system.choices[0].finish_reason}, tool_calls "
            f"{calls or 'none (model)'}; system kept: {with_system.usage.prompt_tokens} prompt tokens vs "
            f"{plain.usage.prompt_tokens} without; turn 2 cached {cached} of {second.usage.prompt_tokens}")


Conversation = list[dict[str, Any]]


def process_session_turn(sdk_url: str, session: str,
                         history: Conversation | None = None) -> tuple[Conversation, int, int]:
    """One turn of a Claude Code-shaped session (``metadata.user_id``'s ``session_id``) through
    /process: the first turn is a long user message; a next turn is ``history`` plus one short user
    message. Returns (the conversation with the answer, cached prompt tokens, prompt tokens)."""
    client, _ = anthropic_client(sdk_url)
    metadata = {"user_id": json.dumps({"device_id": "standin", "session_id": session})}
    if history is None:
        messages: Conversation = [{"role": "user", "content": _long_text(session, lines=320)}]
    else:
        messages = [*history, {"role": "user", "content": "And the last line?"}]
    answer = client.messages.create(model=MODEL, max_tokens=8, metadata=metadata, messages=messages)
    cached = answer.usage.cache_read_input_tokens or 0
    reply = [b.model_dump() for b in answer.content] or "."
    return [*messages, {"role": "assistant", "content": reply}], cached, answer.usage.input_tokens + cached


def _long_text(tag: str, lines: int = 160) -> str:
    return " ".join(f"line {i} ({tag}): the quick brown fox jumps over the lazy dog." for i in range(lines))


def native_healthz(native_url: str) -> str:
    resp = httpx.get(native_url + "/healthz", timeout=10)
    body = resp.json()
    expect(resp.status_code == 200 and body["status"] in ("ready", "degraded"), f"{resp.status_code} {body}")
    patch = [w for w in body.get("warnings") or [] if "lacks the prefix-cache patch" in w]
    expect(not patch, f"preflight misses the patch the DeepInfer venv has: {patch}")
    return f"{body['status']} {body.get('reasons') or ''} warnings={len(body.get('warnings') or [])}"


def anthropic_messages(native_url: str) -> str:
    with anthropic.Anthropic(base_url=native_url, api_key=API_KEY, max_retries=0, timeout=300) as client:
        msg = client.messages.create(model=MODEL, max_tokens=24, tools=[READ_TOOL], messages=ASK)
        expect(msg.type == "message" and msg.usage.output_tokens > 0 and msg.content is not None, str(msg))
        with client.messages.stream(model=MODEL, max_tokens=24, tools=[READ_TOOL], messages=ASK) as stream:
            events = [event.type for event in stream]
            final = stream.get_final_message()
    expect(events[0] == "message_start" and "message_stop" in events, f"events {events}")
    expect(final.usage.output_tokens > 0, str(final))
    return (f"create: {msg.stop_reason}, {msg.usage.output_tokens} tokens; stream: {len(events)} events, "
            f"{final.stop_reason}")


def openai_chat(native_url: str) -> str:
    with openai.OpenAI(base_url=native_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
        done = client.chat.completions.create(model=MODEL, max_tokens=24, tools=[OPENAI_READ_TOOL],
                                              messages=ASK)
        expect(done.object == "chat.completion" and done.usage.completion_tokens > 0, str(done))
        chunks = list(client.chat.completions.create(model=MODEL, max_tokens=24, tools=[OPENAI_READ_TOOL],
                                                     messages=ASK, stream=True,
                                                     stream_options={"include_usage": True}))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expect(len(finish) == 1 and chunks[-1].usage is not None, f"finish reasons {finish}")
    return (f"create: {done.choices[0].finish_reason}, {done.usage.completion_tokens} tokens; stream: "
            f"{len(chunks)} chunks, {finish[0]}")


def prefix_cache_hit(native_url: str) -> str:
    """A repeated 1,000-token prompt starts from the cached blocks of the first."""
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    messages = [{"role": "user", "content": text}]
    with openai.OpenAI(base_url=native_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
        first = client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
        second = client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    cached = second.usage.prompt_tokens_details.cached_tokens if second.usage.prompt_tokens_details else 0
    expect(cached and cached >= 128, f"second turn cached_tokens {cached} of {second.usage.prompt_tokens}")
    return (f"{cached} of {second.usage.prompt_tokens} prompt tokens cached on the repeat (first "
            f"{first.usage.prompt_tokens})")


def claude_print(claude: str, native_url: str, home: Path) -> str:
    """``claude -p`` (the pinned CLI) against the native endpoint; short replies keep it quick."""
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    project = home / "project"
    project.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home / "tmp"),
           "LANG": "C.UTF-8", "TERM": "dumb", "ANTHROPIC_BASE_URL": native_url, "ANTHROPIC_API_KEY": API_KEY,
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "500000", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512", "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"}
    res = subprocess.run([claude, "-p", "Say hello in five words.", "--output-format", "json"], cwd=project,
                         env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    expect(res.returncode == 0, f"exit {res.returncode}: {res.stdout[-1500:]} {res.stderr[-1500:]}")
    result = json.loads(res.stdout.strip().splitlines()[-1])
    return (f"exit 0, {result.get('num_turns')} turn(s), is_error={result.get('is_error')}, "
            f"{result.get('duration_ms')} ms")


def runtime_packages(serve_log: str, deepinfer_venv: Path) -> str:
    """The backend process took numpy, orjson, pyzmq, tokenizers (and torch, if it loaded it) from the
    DeepInfer venv."""
    match = re.search(r"runtime packages: (.*)", serve_log)
    expect(match is not None, "no 'runtime packages' line in the serve log")
    assert match is not None
    found = dict(re.findall(r"(\w+) [^ ]+ \(([^)]*)\)", match.group(1)))
    missing = [m for m in REQUIRED_MODULES if m not in found]
    expect(not missing, f"not loaded by the backend process: {missing}")
    wrong = {m: path for m, path in found.items()
             if m in RUNTIME_MODULES and not path.startswith(str(deepinfer_venv))}
    expect(not wrong, f"not from the DeepInfer venv: {wrong}")
    return match.group(1).replace(str(deepinfer_venv), "<di-venv>")


def ranks(rank_procs: list[psutil.Process], deepinfer_venv: Path, backend_dir: Path, engine: str,
          master_port: int) -> str:
    """Interpreter, PYTHONPATH, the configured MASTER_PORT and (engine deepinfer) DeepInfer's _C."""
    expect(len(rank_procs) == 2, f"{len(rank_procs)} rank processes")
    python = str(deepinfer_venv / "bin" / "python")
    for proc in rank_procs:
        expect(proc.cmdline()[0] == python, f"rank interpreter {proc.cmdline()[0]}, want {python}")
        expect(proc.environ().get("PYTHONPATH") == str(backend_dir),
               f"PYTHONPATH {proc.environ().get('PYTHONPATH')}")
    rendezvous = master_port - 50 if engine == "deepinfer" else master_port
    listening = {c.laddr.port for p in rank_procs for c in p.net_connections("tcp") if c.status == "LISTEN"}
    expect(rendezvous in listening, f"no rank listens on the rendezvous port {rendezvous} (MASTER_PORT "
           f"{master_port}); listening: {sorted(listening)}")
    detail = f"2 ranks on {python.replace(str(deepinfer_venv), '<di-venv>')}, rendezvous on {rendezvous}"
    if engine == "deepinfer":
        maps = Path(f"/proc/{rank_procs[0].pid}/maps").read_text()
        loaded = sorted({line.split()[-1] for line in maps.splitlines() if "/deepinfer/_C" in line})
        expect(loaded != [] and all(path.startswith(str(deepinfer_venv.parent)) for path in loaded),
               f"deepinfer._C not loaded from the build: {loaded}")
        detail += f", DeepInfer's _C loaded ({Path(loaded[0]).name})"
    return detail


def healthz_warnings(native_url: str) -> list[Any]:
    return list(httpx.get(native_url + "/healthz", timeout=10).json().get("warnings") or [])
