"""Claude Code's auxiliary requests (session titles) with nonessential traffic allowed, through
the recording proxy, on 2 ranks (scripted stand-in model).

The other CLI tests switch nonessential traffic off (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``,
``e2e_harness.claude_env``), which also stops the title requests. Here four runs per version:

* ``print_mode``: ``claude -p`` with nonessential traffic allowed: no title (``-p`` names none);
* ``tui_nonessential_off``: the interactive CLI, two prompts, the harness's default: no title;
* ``tui``: the same with nonessential traffic allowed: a title request per prompt, labelled
  only by the session id (no class header), so the backend does not see it as auxiliary;
* ``tui_hint_headers``: the same with ``CLAUDE_CODE_GATEWAY_HINT_HEADERS=1`` (2.1.332 reads it;
  the CLI sends the class headers to Anthropic's own API only): titles then carry
  ``x-claude-code-request-class: auxiliary`` and run as an auxiliary unit of their own.

With ``E2E_CAPTURE_DIR`` set the scrubbed requests are written there as
``claude-<version>-auxiliary.json`` (the fixtures in ``tests/e2e/captures/``, read by
``tests/server/test_agent_hints.py`` and ``tests/cache/test_cache_request_classes.py``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from cache.sessions import RequestClass
from server.agent_hints import agent_hint
from tests.e2e.capture_proxy import CaptureProxy
from tests.e2e.cli_sessions import TuiSession
from tests.e2e.e2e_harness import Backend, assert_success, make_project, run_claude, running_backend
from tests.e2e.test_claude_subagents import _rows, _version

pytestmark = [pytest.mark.claude_cli, pytest.mark.timeout(900)]

NONESSENTIAL_ON = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": ""}  # "": left out of the env
HINTS_ON = {**NONESSENTIAL_ON, "CLAUDE_CODE_GATEWAY_HINT_HEADERS": "1"}


def is_title(row: dict[str, Any]) -> bool:
    """A session-title request: a structured output with one ``title`` property, no tools."""
    return row["output_format"] == ["title"] and not row["tools"]


def _anchor(body: dict[str, Any]) -> bool:
    return bool(body.get("tools"))  # the main thread's requests carry the tools; a title none


def _tui(binary: Path, backend: Backend, root: Path, name: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Two prompts in the interactive CLI; the summarised requests once the titles are in."""
    project = make_project(root)
    with CaptureProxy(backend.base_url) as proxy:
        tui = TuiSession(binary, project, proxy.base_url, f"aux-{os.getpid()}-{name}", extra_env=env)
        try:
            tui.wait_for(r"Claude Code v\d")
            tui.wait_for(r"❯")
            tui.type_line("TUI-SESSION: say hello")
            tui.wait_for(r"Hello from the TUI scenario\.")
            tui.type_line("TUI-SESSION: how are you?")
            tui.wait_for(r"Fine, thanks: the TUI scenario is going well\.")
            deadline = time.monotonic() + 8.0  # the second title may follow the reply
            while time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            tui.close()
        return _rows(proxy, backend.log_text(), {str(root): "<tmp>"}, anchor=_anchor)


def _print(binary: Path, backend: Backend, root: Path) -> list[dict[str, Any]]:
    with CaptureProxy(backend.base_url) as proxy:
        run = run_claude(binary, "MULTI-PROMPT-SESSION: remember the number 4817 and reply OK.",
                         make_project(root), proxy.base_url, stream_json=True, extra_env=NONESSENTIAL_ON)
        time.sleep(3.0)  # anything sent after the answer
        assert_success(run)
        return _rows(proxy, backend.log_text(), {str(root): "<tmp>"}, anchor=_anchor)


def _show(what: str, rows: list[dict[str, Any]]) -> None:
    print(f"{what}: {len(rows)} requests")
    for r in rows:
        print(f"   {'title' if is_title(r) else 'main '} tools={len(r['tools']):>2} msgs={r['num_messages']} "
              f"max_tokens={r['max_tokens']} shared={r['items_shared_with_first_request']} "
              f"prompt={r.get('prompt_tokens')} rank={r.get('rank')} unit={r.get('routing_unit')} "
              f"{r['claude_code_headers']}")


def test_auxiliary_requests_captured(claude_bin, tmp_path: Path):
    version = _version(claude_bin)
    with running_backend("shared.json", ranks=2) as backend:
        runs = {
            "print_mode": _print(claude_bin, backend, tmp_path / "p"),
            "tui_nonessential_off": _tui(claude_bin, backend, tmp_path / "off", "off", {}),
            "tui": _tui(claude_bin, backend, tmp_path / "tui", "on", NONESSENTIAL_ON),
            "tui_hint_headers": _tui(claude_bin, backend, tmp_path / "hints", "hints", HINTS_ON),
        }
    for what, rows in runs.items():
        _show(f"claude {version} {what}", rows)
    if os.environ.get("E2E_CAPTURE_DIR"):
        out = Path(os.environ["E2E_CAPTURE_DIR"]) / f"claude-{version}-auxiliary.json"
        kept = {what: [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
                for what, rows in runs.items()}
        out.write_text(json.dumps({"cli_version": version, **kept}, indent=1) + "\n")

    # 2.1.3xx: titles only in the interactive CLI with nonessential traffic allowed; 2.1.197 sends
    # them in -p mode once it is allowed, and in the interactive CLI even with it off
    old = version.startswith("2.1.1")
    assert sum(map(is_title, runs["print_mode"])) == (1 if old else 0)
    assert sum(map(is_title, runs["tui_nonessential_off"])) == (2 if old else 0)
    for what in ("tui", "tui_hint_headers"):
        rows = runs[what]
        titles = [r for r in rows if is_title(r)]
        mains = [r for r in rows if not is_title(r)]
        assert len(mains) == 2 and len(titles) == 2, _show(what, rows)
        for t in titles:  # one user message, no tools, nothing shared with the main thread's prefix
            assert t["num_messages"] == 1 and t["items_shared_with_first_request"] == 0, t
            assert t["max_tokens"] == mains[0]["max_tokens"] and t["model"] == mains[0]["model"], t
            assert t["metadata_user_id"] == mains[0]["metadata_user_id"], t
            assert t["first_user_text"].startswith("<session>"), t
        hints = [agent_hint(r["claude_code_headers"]) for r in titles]
        if what == "tui_hint_headers" and not old:
            assert all(r["claude_code_headers"] == {"x-claude-1p-request-class": "summary-extraction",
                                                    "x-claude-code-request-class": "auxiliary"}
                       for r in titles), titles
            assert all(h.request_class is RequestClass.AUXILIARY for h in hints)
            assert {r["routing_unit"] for r in titles} == {"hint:<session>/aux:auxiliary"}
            assert all(r["claude_code_headers"]["x-claude-code-request-class"] == "main" for r in mains)
            assert {r["routing_unit"] for r in mains} == {"hint:<session>"}
        else:  # only the session id: the body tells a title (a structured output, no tools)
            assert all(r["claude_code_headers"] == {} for r in titles), titles
            assert all(h.request_class is RequestClass.MAIN for h in hints)  # by the headers alone
            assert {r["routing_unit"] for r in titles} == {"hint:<session>/aux:one-off"}, titles
            assert {r["routing_unit"] for r in mains} == {"hint:<session>"}, mains
        # the main thread's second turn is served from its first
        assert mains[1]["cached_tokens"] >= 0.95 * mains[1]["prompt_tokens"], mains[1]
