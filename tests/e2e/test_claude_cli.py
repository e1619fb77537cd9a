"""The real Claude Code CLI completes tasks through the backend (scripted stand-in model).

Every layer but the logits is real: Claude Code's own requests (2.1.197: 24 tools; 2.1.3xx: 12,
most others deferred behind ToolSearch; inline system messages, adaptive thinking), the backend's
HTTP server, rendering, tokenizer, prefix cache and routing, rank processes, parser and SSE. The
model's replies come from ``scenarios/*.json``. Each test asserts on the CLI's JSON result and on
what the tools did on disk; thresholds come from the traffic measured in the run, not from one CLI
version's sizes. Run with ``scripts/claude_e2e.sh`` (every pinned CLI version, installed once) or
``pytest -m claude_cli tests/e2e`` (the newest pinned version installed, or $CLAUDE_BIN).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.e2e_harness import (
    Poller,
    assert_success,
    finish_claude,
    make_project,
    run_claude,
    running_backend,
    start_claude,
    transcript_tool_uses,
)

pytestmark = [pytest.mark.claude_cli, pytest.mark.timeout(600)]


def test_read_file_and_answer(claude_bin, shared_backend, tmp_path: Path):
    readme = "# Project Nightjar\n\nThe launch code is PURPLE-OTTER-42.\n"
    project = make_project(tmp_path, {"README.md": readme})
    before = shared_backend.messages_requests(200)
    run = run_claude(claude_bin, "What is the launch code in README.md?", project, shared_backend.base_url)
    assert_success(run, num_turns=2)
    # The code is only in the file: the Read tool ran and its result reached the model.
    assert run.result["result"] == "The launch code in README.md is PURPLE-OTTER-42."
    assert run.result["usage"]["output_tokens"] > 0 and run.result["usage"]["input_tokens"] > 0
    assert shared_backend.messages_requests(200) - before == 2
    uses = transcript_tool_uses(run.home)
    assert [u["name"]
            for u in uses] == ["Read"] and uses[0]["input"] == {"file_path": str(project / "README.md")}
    assert (project / "README.md").read_text() == readme  # reading changed nothing


def test_run_shell_command(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path, {"data.txt": "".join(f"row {i}\n" for i in range(37))})
    run = run_claude(claude_bin, "How many lines does data.txt have? Save the number to count.txt.",
                     project, shared_backend.base_url)
    assert_success(run, num_turns=2)
    assert (project / "count.txt").read_text().strip() == "37"  # the command really ran
    assert run.result["result"] == "data.txt has 37 lines; the count is saved in count.txt."


def test_edit_file_until_tests_pass(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path, copy_from="slugify")
    before = subprocess.run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_slug.py"],
                            cwd=project, capture_output=True, text=True, env=_pytest_env())
    assert "15 failed" in before.stdout, before.stdout
    run = run_claude(claude_bin, "Implement slugify in slug.py so that test_slug.py passes.",
                     project, shared_backend.base_url)
    assert_success(run, num_turns=4)
    assert run.result["result"] == "slugify is implemented and all 15 tests pass."
    source = (project / "slug.py").read_text()
    assert "NotImplementedError" not in source and "unicodedata.normalize" in source
    after = subprocess.run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_slug.py"],
                           cwd=project, capture_output=True, text=True, env=_pytest_env())
    assert after.returncode == 0 and "15 passed" in after.stdout, after.stdout
    assert [u["name"] for u in transcript_tool_uses(run.home)] == ["Read", "Edit", "Bash"]


def test_two_tool_calls_in_parallel(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path, {"notes.txt": "Note: the deploy window opens at 14:00\n"})
    before = shared_backend.messages_requests(200)
    run = run_claude(claude_bin, "Read notes.txt and, at the same time, compute 6*7 into answer.txt.",
                     project, shared_backend.base_url, stream_json=True)
    num_requests = shared_backend.messages_requests(200) - before
    # Both tools ran off one model reply, and both results went back in one request.
    assert_success(run)
    assert num_requests == 2 and len(run.assistant_usages()) == 2, (num_requests, run.assistant_usages())
    assert (run.result["result"]
            == "notes.txt says: the deploy window opens at 14:00. 6*7 = 42, saved in answer.txt.")
    assert (project / "answer.txt").read_text().strip() == "42"
    uses = run.tool_uses()
    assert sorted(u["name"] for u in uses) == ["Bash", "Read"]
    assert len({u["id"] for u in uses}) == 2


def test_long_session_hits_prefix_cache(claude_bin, shared_backend, tmp_path: Path):
    project = make_project(tmp_path)
    backend = shared_backend
    cached_before = backend.metric_sum("deepinfer_cached_tokens_total")
    prompt_before = backend.metric_sum("deepinfer_prompt_tokens_total")
    run = run_claude(claude_bin,
                     "Append five steps to log.txt, one command each, then tell me the line count.",
                     project, backend.base_url, stream_json=True)
    cached_delta = backend.metric_sum("deepinfer_cached_tokens_total") - cached_before
    prompt_delta = backend.metric_sum("deepinfer_prompt_tokens_total") - prompt_before
    assert_success(run, num_turns=7)
    assert run.result["result"] == "Done: log.txt now has 5 lines."
    assert (project / "log.txt").read_text() == "".join(f"step-{i}\n" for i in range(1, 6))
    usages = run.assistant_usages()
    assert len(usages) == 7, usages
    first, rest = usages[0], usages[1:]
    # A new session shares with earlier sessions on this backend what their prompts have in
    # common (how much depends on the CLI version: 2.1.197 puts the project path ~2 KB into the
    # system prompt, 2.1.3xx after the tools), never its own first prompt.
    first_total = first["input_tokens"] + first.get("cache_read_input_tokens", 0)
    assert first["input_tokens"] > 0 and first.get("cache_read_input_tokens", 0) < first_total, first
    for i, usage in enumerate(rest, start=2):
        total = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
        # Each request repeats the previous one: all but the new turn (and the replayed last
        # block) comes from the cache.
        assert usage.get("cache_read_input_tokens", 0) >= 0.9 * total, (i, usage)
    # The metrics agree with what the client was told.
    assert cached_delta == run.result["usage"]["cache_read_input_tokens"] == sum(
        u.get("cache_read_input_tokens", 0) for u in usages)
    assert prompt_delta == sum(u["input_tokens"] + u.get("cache_read_input_tokens", 0) for u in usages)


NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "intro", "metadata": {}, "outputs": [],
               "source": ["print('NOTEBOOK-ORIGINAL')"]}],
    "metadata": {"language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5,
}


def test_tool_search_loads_a_deferred_tool(claude_bin, shared_backend, tmp_path: Path):
    # Claude Code >= 2.1.328 defers most tools: NotebookEdit is listed by name only, so the model
    # loads it with ToolSearch. The next request must still come from the cache, and its prompt
    # must hold NotebookEdit's schema: the scripted read-notebook reply requires the expanded
    # "<functions>\n<function>{"name": "NotebookEdit", ..." in the tool result.
    project = make_project(tmp_path, {"notebook.ipynb": json.dumps(NOTEBOOK, indent=1)})
    run = run_claude(claude_bin, "Set the first cell of notebook.ipynb to print(42).", project,
                     shared_backend.base_url, stream_json=True)
    init = next(e for e in run.events if e.get("subtype") == "init")
    if "ToolSearch" not in init.get("tools", []):
        pytest.skip("this Claude Code "
                    f"({run.result.get('claude_code_version') or init.get('claude_code_version')}) "
                    "does not defer tools")
    assert_success(run)
    assert run.result["result"] == "The first cell of notebook.ipynb now prints 42."
    log = shared_backend.log_text()
    assert "reply 'read-notebook'" in log  # the schema was in the prompt of the request after ToolSearch
    assert [u["name"] for u in run.tool_uses()] == ["ToolSearch", "Read", "NotebookEdit"]
    usages = run.assistant_usages()
    assert len(usages) == 4, usages
    for i, usage in enumerate(usages[1:], start=2):  # request 2 is the one after ToolSearch
        total = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
        print(f"tool search: request {i}: {usage.get('cache_read_input_tokens', 0)} of {total} prompt tokens "
              "cached")
        assert usage.get("cache_read_input_tokens", 0) >= 0.9 * total, (i, usage)
    # the loaded tool's scripted call ran
    cell = json.loads((project / "notebook.ipynb").read_text())["cells"][0]
    assert "".join(cell["source"]) == "print(42)", cell


COMPACTION_PROMPT = "Print 100000-101499 and then 200000-200999 with seq, then write DONE to status.txt."
WINDOW_MARGIN_TOKENS = 128  # under the third request: covers a few tokens of run-to-run difference


def test_prompt_over_window_compacts_and_carries_on(claude_bin, shared_backend, tmp_path: Path):
    # The window comes from this CLI version's own traffic: the same session first runs with room
    # to spare (four requests: seq, seq, write, answer), then on a backend whose window the third
    # request (after both seq outputs) no longer fits. Project dirs "dry"/"wet": same path length.
    dry = run_claude(claude_bin, COMPACTION_PROMPT, make_project(tmp_path / "dry"), shared_backend.base_url,
                     stream_json=True)
    assert_success(dry)
    sizes = [u["input_tokens"] + u.get("cache_read_input_tokens", 0) for u in dry.assistant_usages()]
    assert len(sizes) == 4, sizes
    window = sizes[2] - WINDOW_MARGIN_TOKENS
    assert sizes[1] + 256 < window, sizes  # the second request (and its reply) still fit
    print(f"compaction: uncompacted request sizes {sizes} tokens -> window {window}")
    project = make_project(tmp_path / "wet")
    with running_backend("compaction.json", ranks=1, config={"max_model_len": window}) as backend:
        run = run_claude(claude_bin, COMPACTION_PROMPT, project, backend.base_url, stream_json=True)
        num_400, num_200 = backend.messages_requests(400), backend.messages_requests(200)
        log = backend.log_text()
    assert_success(run)
    assert run.result["result"] == "Both ranges are printed and status.txt says DONE."
    # The 400 made Claude Code compact: one rejected request, then the summary request, then the
    # restarted session (its tool call and its answer).
    assert (num_400, num_200) == (1, 5), (num_400, num_200, sizes, window)
    boundary = [e for e in run.events if e.get("subtype") == "compact_boundary"]
    assert len(boundary) == 1 and boundary[0]["compact_metadata"]["trigger"] == "auto", boundary
    meta = boundary[0]["compact_metadata"]
    assert meta["pre_tokens"] > meta["post_tokens"], meta  # Claude Code's own estimates
    assert "reply 'summary'" in log and "reply 'after-compaction-answer'" in log
    # Work after the compaction really happened on disk.
    assert (project / "status.txt").read_text() == "DONE\n"
    assert [u["input"]["command"] for u in run.tool_uses()] == [
        "seq 100000 101499", "seq 200000 200999", "echo DONE > status.txt && echo STATUS-WRITTEN"]


def test_unknown_model_name(claude_bin, shared_backend, tmp_path: Path):
    # The seed guide's text for a model name the endpoint does not serve (here a Claude model id,
    # what Claude Code sends when ANTHROPIC_MODEL is not set to ours), as a 410: newer CLIs resend
    # a 400 six times (dropping betas) and replace a 404's message; every version answers a 410
    # once and shows its message (docs/claude-code.md).
    project = make_project(tmp_path, {"README.md": "hello\n"})
    before = {s: shared_backend.messages_requests(s) for s in (200, 400, 404, 410)}
    run = run_claude(claude_bin, "What is the launch code in README.md?", project, shared_backend.base_url,
                     model="claude-sonnet-4-5")
    counts = {s: shared_backend.messages_requests(s) - n for s, n in before.items()}
    assert run.rc == 1 and run.result.get("is_error") is True, run.describe()
    assert run.result.get("api_error_status") == 410, run.describe()
    assert (run.result["result"]
            == "API Error: 410 Model 'claude-sonnet-4-5' is not available on this endpoint")
    assert counts == {200: 0, 400: 0, 404: 0, 410: 1}, counts  # one request: not retried
    assert sorted(p.name for p in project.iterdir()) == ["README.md"]  # nothing ran


def test_rank_killed_mid_turn(claude_bin, tmp_path: Path):
    project = make_project(tmp_path)
    with running_backend("rank_kill.json") as backend:
        epoch_before = backend.health()["epoch"]
        proc, home, t0 = start_claude(claude_bin, "Create survived.txt containing the word survived.",
                                      project, backend.base_url)
        killed: list[int] = []
        seen_busy: list[float] = []

        def kill_mid_stream() -> bool:
            pid = backend.busy_rank_pid()
            if pid is None:
                return False
            seen_busy.append(time.monotonic())
            if seen_busy[-1] - seen_busy[0] < 1.5:  # let the reply stream for a while first
                return False
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return True

        poller = Poller(kill_mid_stream, 0.1)
        poller.start()
        run = finish_claude(proc, home, project, t0, timeout_s=400)
        poller.stop()
        assert poller.error is None, poller.error
        assert killed, f"no rank was killed:\n{backend.log_text()[-3000:]}"
        health = backend.wait_ready(120)
        log = backend.log_text()
    assert_success(run, num_turns=2)
    assert run.result["result"] == "Created survived.txt."
    assert (project / "survived.txt").read_text() == "survived\n"
    # The Write ran once: the broken stream's partial reply never reached the tools.
    assert [u["name"] for u in transcript_tool_uses(run.home)] == ["Write"]
    assert health["epoch"] > epoch_before and health["ranks"]["restarts"] >= 1, health
    assert "killed by SIGKILL" in log and "finish=error" in log  # the turn really broke mid-stream
    assert f"pid {killed[0]}" in log


def _pytest_env() -> dict[str, str]:
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "HOME": os.environ.get("HOME", "/tmp")}

