"""Claude Code's and Codex CLI's agent headers -> SessionHint -> the cache's session ids (one owner)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cache.sessions import RequestClass, SessionHint, session_id_for_hint
from server.agent_hints import MAX_HEADER_CHARS, agent_hint

CAPTURES = Path(__file__).resolve().parents[1] / "e2e" / "captures"


def test_subagent_headers_name_a_branch_of_the_session() -> None:
    hint = agent_hint({"x-claude-code-agent-id": "agent:a1b2", "x-claude-code-parent-agent-id": "main",
                       "x-claude-code-agent-type": "Explore", "x-claude-code-prompt-id": "p-1"})
    assert (hint.agent_id, hint.parent_agent_id, hint.agent_type, hint.prompt_id) == (
        "agent:a1b2", "main", "Explore", "p-1")
    assert hint.request_class is RequestClass.SUBAGENT and hint.key is None
    assert session_id_for_hint(replace(hint, key="s1")) == "hint:s1/agent:agent:a1b2"


def test_request_classes_from_headers() -> None:
    assert agent_hint({}).request_class is RequestClass.MAIN
    assert agent_hint({"x-claude-code-compaction": "true"}).request_class is RequestClass.COMPACTION
    assert agent_hint({"x-claude-code-request-class": "compaction"}).request_class is RequestClass.COMPACTION
    aux = agent_hint({"x-claude-code-auxiliary-type": "memory"})
    assert aux.request_class is RequestClass.AUXILIARY
    assert session_id_for_hint(replace(aux, key="s")) == "hint:s/aux:memory"
    assert agent_hint({"x-claude-code-context-compacted": "1"}).context_compacted
    # a compaction of the main thread's context is the main session's; a subagent's, its branch's
    assert session_id_for_hint(SessionHint(key="s", request_class=RequestClass.COMPACTION)) == "hint:s"
    assert session_id_for_hint(SessionHint(key="s", agent_id="agent:1",
                                           request_class=RequestClass.COMPACTION)) == "hint:s/agent:agent:1"


def test_bad_header_values_fall_back_to_the_main_thread() -> None:
    hint = agent_hint({"x-claude-code-request-class": "no-such-class",
                       "x-claude-code-agent-type": "x" * (MAX_HEADER_CHARS + 1),
                       "x-claude-code-agent-id": " "})
    assert hint == SessionHint()
    assert session_id_for_hint(SessionHint.of("k")) == session_id_for_hint("k") == "hint:k"


@pytest.mark.parametrize("capture", sorted(CAPTURES.glob("claude-*-subagents.json")), ids=lambda p: p.stem)
def test_captured_claude_code_requests_map_to_their_branches(capture: Path) -> None:
    """The real CLI's requests (tests/e2e/captures, from test_claude_subagents.py): the parent's
    turns are the main session, each subagent's turns one branch of it."""
    data = json.loads(capture.read_text())
    rows = data["four_subagents"]
    ids = [session_id_for_hint(replace(agent_hint(r["claude_code_headers"]), key="s")) for r in rows]
    subagent = [r["first_user_text"].startswith("Subagent task") for r in rows]
    assert {i for i, sub in zip(ids, subagent) if not sub} == {"hint:s"}
    branches = {i for i, sub in zip(ids, subagent) if sub}
    assert len(branches) == 4 and all(i.startswith("hint:s/agent:") for i in branches)
    # the backend ran each on the routing unit the hint names, on >= 3 ranks
    assert [r["routing_unit"] for r in rows] == [i.replace("hint:s", "hint:<session>") for i in ids]
    assert len({r["rank"] for r, sub in zip(rows, subagent) if sub}) >= 3


def test_codex_subagent_thread_headers_name_a_branch() -> None:
    """Codex CLI: a request with a parent thread is a subagent whose agent id is its own thread;
    the main thread (thread-id = session id, no parent) stays the main session."""
    sub = agent_hint({"session-id": "s1", "thread-id": "t2", "x-codex-parent-thread-id": "s1",
                      "x-openai-subagent": "collab_spawn"})
    assert (sub.agent_id, sub.parent_agent_id, sub.agent_type, sub.request_class) == (
        "t2", "s1", "collab_spawn", RequestClass.SUBAGENT)
    assert session_id_for_hint(replace(sub, key="s1")) == "hint:s1/agent:t2"
    assert agent_hint({"session-id": "s1", "thread-id": "s1"}) == SessionHint()
    # a thread naming itself as its parent, or an over-long id, is not a branch
    assert agent_hint({"thread-id": "s1", "x-codex-parent-thread-id": "s1"}) == SessionHint()
    too_long = "t" * (MAX_HEADER_CHARS + 1)
    assert agent_hint({"thread-id": too_long, "x-codex-parent-thread-id": "s1"}) == SessionHint()
    # Claude Code's agent id wins where a request carries both
    both = agent_hint({"x-claude-code-agent-id": "a1", "thread-id": "t2", "x-codex-parent-thread-id": "s1"})
    assert both.agent_id == "a1"


@pytest.mark.parametrize("capture", sorted(CAPTURES.glob("codex-*-subagents.json")), ids=lambda p: p.stem)
def test_captured_codex_requests_map_to_their_branches(capture: Path) -> None:
    """Codex CLI's real requests (tests/e2e/captures, from test_agent_clients.py's
    test_codex_subagents_run_as_branches): the parent's turns are the main session, each spawned
    subagent's turns one branch of it, as the backend ran them."""
    rows = json.loads(capture.read_text())["requests"]
    ids = [session_id_for_hint(replace(agent_hint(r["headers"]), key="<session>")) for r in rows]
    subagent = [r["first_user_text"].startswith("[cx-sub-child]") for r in rows]
    assert {i for i, sub in zip(ids, subagent) if not sub} == {"hint:<session>"}
    assert {i for i, sub in zip(ids, subagent) if sub} == {"hint:<session>/agent:<thread-1>",
                                                          "hint:<session>/agent:<thread-2>"}
    assert [r["routing_unit"] for r in rows] == ids


@pytest.mark.parametrize("capture", sorted(CAPTURES.glob("claude-*-auxiliary.json")), ids=lambda p: p.stem)
def test_captured_title_requests_classified_by_their_headers(capture: Path) -> None:
    """The real CLI's session-title requests (tests/e2e/captures, from test_claude_auxiliary.py):
    with CLAUDE_CODE_GATEWAY_HINT_HEADERS=1, 2.1.332 labels them ``auxiliary`` (an auxiliary unit
    of their own beside the session, as the backend ran them) and its main turns ``main``
    (x-claude-1p-request-class is not read); by default, and from 2.1.197 at all, a title
    carries only the session id and is read as a main-thread turn."""
    data = json.loads(capture.read_text())
    labelled = data["cli_version"].startswith("2.1.3")
    for run in ("tui", "tui_hint_headers"):
        rows = data[run]
        titles = [r for r in rows if r["output_format"] == ["title"] and not r["tools"]]
        mains = [r for r in rows if r["tools"]]
        assert len(titles) == len(mains) == 2
        hints = [replace(agent_hint(r["claude_code_headers"]), key="<session>") for r in rows]
        ids = [session_id_for_hint(h) for h in hints]
        title_ids = {i for i, r in zip(ids, rows) if r in titles}
        assert {i for i, r in zip(ids, rows) if r in mains} == {"hint:<session>"}
        if run == "tui_hint_headers" and labelled:
            assert title_ids == {"hint:<session>/aux:auxiliary"}
            assert all(h.prompt_id for h, r in zip(hints, rows) if r in mains)  # x-claude-code-prompt-id
            assert [r["routing_unit"] for r in rows] == ids
        else:
            assert title_ids == {"hint:<session>"}
            assert all(r["claude_code_headers"] == {} for r in titles)
