"""Claude Code's agent headers -> SessionHint -> the cache's session ids (one owner)."""

from __future__ import annotations

from dataclasses import replace

from cache.sessions import RequestClass, SessionHint, session_id_for_hint
from server.agent_hints import MAX_HEADER_CHARS, agent_hint


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
