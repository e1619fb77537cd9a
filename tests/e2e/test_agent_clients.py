"""Real OpenAI-side agent clients against the backend on the scripted stand-in model.

Codex CLI (Responses only), OpenCode (both providers: ``@ai-sdk/openai-compatible`` -> chat
completions, ``@ai-sdk/openai`` -> Responses), openai-agents (its default Responses model and its
chat-completions model) and aider (chat completions, edits in text). Pinned versions are
installed by ``scripts/agent_clients_install.sh``; ``scripts/agent_clients_e2e.sh`` runs this
file (the Codex checks once per pin in ``scripts/codex-versions.txt``, ``CODEX_VERSION`` picks the
one a run uses) and prints the client matrix (docs/responses.md). Marked ``agent_clients`` (not in the
default run: it needs npm and PyPI once, for the installs). Replies: scenarios/agent_clients.json.
Each client runs with its own HOME and project dir and only the variables it needs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.e2e_harness import API_KEY, MODEL, running_backend

pytestmark = [pytest.mark.agent_clients, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(os.environ.get("AGENT_CLIENTS_DIR", ROOT / ".cache" / "agent-clients"))
MATRIX = os.environ.get("AGENT_MATRIX_OUT")  # one JSON line per check, for the matrix table
CODEX_PINS = ROOT / "scripts" / "codex-versions.txt"  # oldest / newest supported Codex CLI


def codex_pins() -> dict[str, str]:
    """``scripts/codex-versions.txt`` as {role: version} (oldest, newest)."""
    words = (line.split() for line in CODEX_PINS.read_text().splitlines())
    return {w[0]: w[1] for w in words if len(w) >= 2 and not w[0].startswith("#")}


VERSIONS = {"codex": os.environ.get("CODEX_VERSION") or codex_pins()["oldest"],
            "opencode": os.environ.get("OPENCODE_VERSION", "1.18.33"),
            "openai-agents": os.environ.get("OPENAI_AGENTS_VERSION", "0.24.0"),
            "aider": os.environ.get("AIDER_VERSION", "0.86.2")}
README = "The launch code is PURPLE-OTTER-42.\n"


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/agent_clients_install.sh")
    return path


def record(client: str, wire: str, check: str, result: str) -> None:
    if MATRIX:
        with open(MATRIX, "a") as f:
            f.write(json.dumps({"client": client, "version": VERSIONS[client], "wire": wire, "check": check,
                                "result": result}) + "\n")


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "TERM": "dumb"}
    return subprocess.run(cmd, cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def served(backend, start: int) -> list[tuple[str, int, int]]:
    """(api, cached tokens, output tokens) of each request the backend finished since ``start``."""
    rows = re.findall(r"api=(\w+) finish=\w+ rank=-?\d+ prompt=\d+ cached=(\d+) output=(\d+)",
                      backend.log_text()[start:])
    return [(api, int(c), int(o)) for api, c, o in rows]


@pytest.fixture(scope="module")
def backend():
    with running_backend("agent_clients.json", ranks=1) as b:
        yield b


# --- Codex CLI -----------------------------------------------------------------------------------
def codex(backend, tmp_path: Path, prompt: str) -> tuple[subprocess.CompletedProcess, Path]:
    binary = need(CLIENTS / "codex" / VERSIONS["codex"] / "node_modules" / ".bin" / "codex")
    home, project = tmp_path / "codex-home", tmp_path / "project"
    home.mkdir(exist_ok=True)
    project.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "local"\napproval_policy = "never"\nsandbox_mode = '
        '"danger-full-access"\n\n'
        f'[model_providers.local]\nname = "local"\nbase_url = "{backend.base_url}/v1"\nenv_key = '
        '"LOCAL_KEY"\n'
        'wire_api = "responses"\n')
    return run([str(binary), "exec", "--skip-git-repo-check", "-C", str(project), prompt], project,
               {"HOME": str(home), "CODEX_HOME": str(home), "LOCAL_KEY": API_KEY}), project


def test_codex_exec_command_round_trip(backend, tmp_path: Path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "README.md").write_text(README)
    start = len(backend.log_text())
    done, _ = codex(backend, tmp_path, "[flow:cx-exec] What is the launch code in README.md?")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "The launch code is PURPLE-OTTER-42." in done.stdout
    assert "cat README.md" in done.stderr + done.stdout  # the exec_command call ran
    assert [r[0] for r in served(backend, start)] == ["responses", "responses"]
    record("codex", "responses", "exec_command round trip", "pass")


def test_codex_parallel_calls(backend, tmp_path: Path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("Note: the deploy window opens at 14:00\n")
    done, _ = codex(backend, tmp_path, "[flow:cx-parallel] Read notes.txt and compute 6*7.")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "notes.txt says: the deploy window opens at 14:00. 6*7 = 42." in done.stdout
    record("codex", "responses", "two exec_command calls in one turn", "pass")


def test_codex_multi_turn_hits_the_cache(backend, tmp_path: Path):
    start = len(backend.log_text())
    done, project = codex(backend, tmp_path, "[flow:cx-chain] Log three lines, then count them.")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (project / "log.txt").read_text() == "one\ntwo\nthree\n"
    assert "log.txt has 3 lines." in done.stdout
    rows = served(backend, start)
    assert len(rows) == 4 and {r[0] for r in rows} == {"responses"}
    # each turn's prompt extends the previous prompt + output exactly (encrypted_content ->
    # ledger), so the cache covers all of it but the last partial blocks
    prompts = [int(m) for m in re.findall(r"turn \d+, thinking mode, (\d+) prompt tokens",
                                          backend.log_text()[start:])]
    for k in range(1, 4):
        assert rows[k][1] >= (prompts[k - 1] + rows[k - 1][2]) // 128 * 128 - 128, (rows, prompts)
    record("codex", "responses",
           "4-turn session, cached tokens per turn " + "/".join(str(r[1]) for r in rows), "pass")


_CODEX_HEADERS = ("session-id", "thread-id", "x-codex-parent-thread-id", "x-openai-subagent",
                  "x-codex-window-id", "x-client-request-id")
_CODEX_META = ("thread_source", "subagent_kind", "request_kind", "agent_name", "parent_thread_id")
_LOG_ROW = re.compile(r"request (\S+) api=responses finish=\w+ rank=(-?\d+) prompt=(\d+) cached=(\d+) .* "
                      r"session=(\S*)")


def codex_subagent_rows(records: list[dict], log: str) -> list[dict]:
    """One scrubbed row per captured ``/v1/responses`` request: Codex's session/thread headers
    (ids replaced by ``<session>``, ``<thread-N>``), what its turn metadata says about the thread,
    its first user text, and the rank, prompt and cached tokens and routing unit the backend
    logged."""
    names: dict[str, str] = {}

    def scrub(value: str) -> str:
        for old, new in names.items():
            value = value.replace(old, new)
        return value

    by_id = {m.group(1): m for m in _LOG_ROW.finditer(log)}
    rows = []
    for rec in sorted(records, key=lambda r: r["t"]):
        headers, body = rec["headers"], rec["body"]
        session, thread = headers.get("session-id", ""), headers.get("thread-id", "")
        names.setdefault(session, "<session>")
        if thread and thread not in names:
            names[thread] = f"<thread-{len(names)}>"
        meta = json.loads(headers.get("x-codex-turn-metadata") or "{}")
        texts = [c.get("text", "") for item in body.get("input", []) if item.get("role") == "user"
                 for c in item.get("content") or [] if isinstance(c, dict)]
        first = next((text for text in texts if text.startswith("[")), "")
        row = {"request_id": rec.get("request_id", ""), "status": rec.get("status"),
               "headers": {k: scrub(headers[k]) for k in _CODEX_HEADERS if k in headers},
               "prompt_cache_key": scrub(str(body.get("prompt_cache_key", ""))),
               "turn_metadata": {k: scrub(str(meta[k])) for k in _CODEX_META if k in meta},
               "tools": len(body.get("tools", [])), "num_input_items": len(body.get("input", [])),
               "first_user_text": first[:80]}
        m = by_id.get(row["request_id"])
        if m is not None:
            row.update(rank=int(m.group(2)), prompt_tokens=int(m.group(3)), cached_tokens=int(m.group(4)),
                       routing_unit=scrub(m.group(5)))
        rows.append(row)
    return rows


def test_codex_subagents_run_as_branches(tmp_path: Path):
    """Codex CLI's ``spawn_agent`` (multi_agent_v1) starts two subagents and waits for them, on 4
    ranks through a recording proxy. Each subagent's requests carry the root session's
    ``session-id``, a ``thread-id`` of its own and ``x-codex-parent-thread-id``; the backend runs
    each as a branch of the session (``server/agent_hints.py``), its second turn from its own
    prefix. With ``E2E_CAPTURE_DIR`` the rows are written as ``codex-<version>-subagents.json``
    (the fixtures in ``tests/e2e/captures/``)."""
    from tests.e2e.capture_proxy import CaptureProxy

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "a.txt").write_text("x\ny\nz\n")
    (tmp_path / "project" / "b.txt").write_text("1\n2\n3\n4\n5\n")
    task = "[flow:cx-sub] Count the lines of a.txt and b.txt, one subagent each."
    with running_backend("agent_clients.json", ranks=4) as b, \
            CaptureProxy(b.base_url, ("/v1/responses",)) as proxy:
        class Through:
            base_url = proxy.base_url

        done, _ = codex(Through, tmp_path, task)
        log = b.log_text()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Both subagents reported." in done.stdout
    rows = codex_subagent_rows(proxy.records, log)
    if os.environ.get("E2E_CAPTURE_DIR"):
        out = Path(os.environ["E2E_CAPTURE_DIR"]) / f"codex-{VERSIONS['codex']}-subagents.json"
        out.write_text(json.dumps({"cli_version": VERSIONS["codex"], "requests": rows}, indent=1) + "\n")
    for r in rows:
        print(r.get("rank"), f"{r.get('cached_tokens')}/{r.get('prompt_tokens')}",
              r["headers"].get("thread-id"), r.get("routing_unit"))
    parent = [r for r in rows if r["first_user_text"].startswith("[flow:cx-sub]")]
    children = [r for r in rows if r["first_user_text"].startswith("[cx-sub-child]")]
    assert len(parent) >= 3 and len(children) >= 4, rows
    assert all(r["headers"]["session-id"] == r["headers"]["thread-id"] == "<session>" for r in parent)
    assert all("x-codex-parent-thread-id" not in r["headers"] for r in parent)
    threads = {r["headers"]["thread-id"] for r in children}
    assert len(threads) == 2 and "<session>" not in threads
    assert all(r["headers"]["session-id"] == r["headers"]["x-codex-parent-thread-id"] == "<session>"
               for r in children)
    # the backend's routing units: the parent is the session, each subagent thread a branch of it
    assert {r["routing_unit"] for r in parent} == {"hint:<session>"}
    assert {r["routing_unit"] for r in children} == {f"hint:<session>/agent:{t}" for t in threads}
    for thread in threads:
        turns = [r for r in children if r["headers"]["thread-id"] == thread]
        for r in turns[1:]:  # a subagent's later turns start from its own prefix
            assert r["cached_tokens"] >= 0.9 * r["prompt_tokens"], r
    record("codex", "responses", "two spawn_agent subagents: each its own routing unit", "pass")


# --- OpenCode --------------------------------------------------------------------------------------
@pytest.mark.parametrize("provider, wire",
                         [("@ai-sdk/openai-compatible", "chat"), ("@ai-sdk/openai", "responses")])
def test_opencode_bash_round_trip(backend, tmp_path: Path, provider: str, wire: str):
    binary = need(CLIENTS / "opencode" / VERSIONS["opencode"] / "node_modules" / ".bin" / "opencode")
    home, project = tmp_path / "home", tmp_path / "project"
    (home / ".config" / "opencode").mkdir(parents=True)
    project.mkdir()
    (project / "README.md").write_text(README)
    model = {"name": "ds", "tool_call": True, "reasoning": True,
             "limit": {"context": 1_000_000, "output": 32000}}
    config = {"provider": {"local": {"npm": provider, "name": "local",
                                     "options": {"baseURL": f"{backend.base_url}/v1", "apiKey": API_KEY},
                                     "models": {MODEL: model}}},
              "permission": {"bash": "allow", "edit": "allow"}, "autoupdate": False, "share": "disabled"}
    (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(config))
    start = len(backend.log_text())
    done = run([str(binary), "run", "--format", "json", "-m", f"local/{MODEL}",
                "[flow:oc-bash] What is the launch code in README.md?"], project, {"HOME": str(home)})
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    assert texts and texts[-1] == "The launch code is PURPLE-OTTER-42.", done.stdout[-3000:]
    apis = {r[0] for r in served(backend, start)}
    assert apis == {"openai" if wire == "chat" else "responses"}
    record("opencode", f"{wire} ({provider})", "bash tool round trip", "pass")


# --- openai-agents -----------------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_function_tool(backend, tmp_path: Path, api: str):
    python = need(CLIENTS / "agents-venv" / "bin" / "python")
    (tmp_path / "README.md").write_text(README)
    done = run([str(python), str(Path(__file__).parent / "agent_clients" / "agents_driver.py"),
                f"{backend.base_url}/v1",
                API_KEY, MODEL, api, str(tmp_path), "[flow:agents] What is the launch code in README.md?"],
               tmp_path, {"HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["final"] == "The launch code is PURPLE-OTTER-42."
    assert result["calls"] == [{"name": "read_file", "path": "README.md"}] and result["requests"] == 2
    record("openai-agents",
           "responses (default model)" if api == "responses" else "chat (OpenAIChatCompletionsModel)",
           "function tool round trip", "pass")


# --- aider -------------------------------------------------------------------------------------------
def test_aider_search_replace_edit(backend, tmp_path: Path):
    aider = need(CLIENTS / "aider-venv" / "bin" / "aider")
    (tmp_path / "hello.py").write_text('print("hi")\n')
    done = run([str(aider), "--model", f"openai/{MODEL}", "--openai-api-base", f"{backend.base_url}/v1",
                "--openai-api-key", API_KEY, "--no-git", "--yes-always", "--no-check-update",
                "--no-analytics",
                "--no-show-model-warnings", "--no-pretty", "--edit-format", "diff", "--message",
                "[flow:aider] Make hello.py greet with Hello, aider", "hello.py"],
               tmp_path, {"HOME": str(tmp_path)})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert (tmp_path / "hello.py").read_text() == 'print("Hello, aider")\n', done.stdout[-2000:]
    record("aider", "chat (no tools, SEARCH/REPLACE)", "edit applied", "pass")
