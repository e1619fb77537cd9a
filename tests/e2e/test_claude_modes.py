"""The real Claude Code CLI in its other modes, against the backend on the scripted stand-in model:
several prompts in one process (``--input-format stream-json``), a session resumed by a new
process (``--continue``), and the interactive TUI's ``/context`` (count_tokens) and ``/compact``.
Each keeps the prefix cache: a request that extends the session's previous one is served mostly
from it. Run with ``scripts/claude_e2e.sh`` (every pinned CLI version)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cli_sessions import StreamJsonSession, TuiSession
from tests.e2e.e2e_harness import assert_success, make_project, run_claude

pytestmark = [pytest.mark.claude_cli, pytest.mark.timeout(600)]


def cached_share(usage: dict, what: str) -> float:
    """The cached share of one request's prompt (printed: ``claude_e2e.sh`` shows it)."""
    cached = usage.get("cache_read_input_tokens", 0)
    total = usage["input_tokens"] + cached
    print(f"{what}: {cached} of {total} prompt tokens cached")
    return cached / total


def test_stream_json_input_several_prompts(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path)
    session = StreamJsonSession(claude_bin, project, shared_backend.base_url)
    try:
        first = session.ask("MULTI-PROMPT-SESSION: remember the number 4817 and reply OK.")
        second = session.ask("What number did I ask you to remember?")
        third = session.ask("Echo the third marker with a shell command.")
    finally:
        run = session.close()
    assert first["result"] == "OK, I will remember 4817.", first
    assert second["result"] == "You asked me to remember 4817.", second  # the history was kept
    assert third["result"] == "The command printed THIRD-4817.", third  # the Bash call ran
    assert run.rc == 0, run.describe()
    assert len({r["session_id"] for r in (first, second, third)}) == 1
    usages = run.assistant_usages()
    assert len(usages) == 4, usages  # three prompts, one of them with a tool round
    for i, usage in enumerate(usages[1:], start=2):
        assert cached_share(usage, f"stream-json input: request {i}") >= 0.9, (i, usage)


def test_continue_resumes_the_session_from_the_cache(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path, {"code.txt": "The secret code is HERON-7731.\n"})
    first = run_claude(claude_bin, "CONTINUE-SESSION: read code.txt and tell me the code.", project,
                       shared_backend.base_url, stream_json=True)
    assert_success(first)
    assert first.result["result"] == "The code in code.txt is HERON-7731."
    # a new process, same project and HOME: the conversation goes on from its transcript
    second = run_claude(claude_bin, "What was the code again?", project, shared_backend.base_url,
                        stream_json=True, args=("--continue",))
    assert_success(second)
    assert second.result["result"] == "It was HERON-7731, from code.txt."  # only the history had it
    usages = second.assistant_usages()
    assert len(usages) == 1 and cached_share(usages[0], "--continue: first request") >= 0.9, usages


def test_tui_context_and_compact(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path)
    before = {
        k: shared_backend.metrics().get(f'deepinfer_requests_total{{route="count_tokens",status="{k}"}}', 0.0)
              for k in ("200", "400")}
    try:
        tui = TuiSession(claude_bin, project, shared_backend.base_url, "claude-e2e")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        tui.wait_for(r"Claude Code v\d")
        tui.wait_for(r"❯")
        tui.type_line("TUI-SESSION: say hello")
        tui.wait_for(r"Hello from the TUI scenario\.")
        tui.type_line("TUI-SESSION: how are you?")  # 2.1.197 will not compact a single exchange
        tui.wait_for(r"Fine, thanks: the TUI scenario is going well\.")
        # /context: Claude Code counts each part of its prompt with POST /v1/messages/count_tokens
        tui.type_line("/context")
        usage = tui.wait_for(r"(?i)([\d.]+)k/[\d.]+[km]? tokens")
        counted = {
            k: shared_backend.metrics().get(f'deepinfer_requests_total{{route="count_tokens",status="{k}"}}',
                                            0.0)
                   - v for k, v in before.items()}
        assert counted["200"] >= 1 and counted["400"] == 0, counted
        assert float(usage.group(1)) >= 1.0, usage.group(0)  # thousands of tokens, as counted here
        print(f"/context: {counted['200']:.0f} count_tokens requests; the TUI shows {usage.group(0)}")
        # /compact: a summary request (the scripted summary), then the session restarts from it
        tui.type_line("/compact")
        tui.wait_for(r"(?i)compacted")
        tui.type_line("TUI-SESSION: anything left?")
        tui.wait_for(r"Nothing left: the compacted TUI session carries on\.")
    finally:
        tui.close()
    log = shared_backend.log_text()
    assert "reply 'tui-summary'" in log and "reply 'tui-after-compact'" in log
