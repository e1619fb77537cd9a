"""Claude Code's and Codex CLI's agent headers -> the cache's ``SessionHint``.

Claude Code (2.1.3xx) labels each request with where it sits in its session
(``docs/claude-code.md``, "Agent headers", has what each version sends):

=================================  ==========================================================
``x-claude-code-agent-id``         the subagent (branch) that sent it; absent on the main thread
``x-claude-code-parent-agent-id``  the agent that spawned that subagent
``x-claude-code-agent-type``       the subagent's type (``Explore``, ``general-purpose``, ...)
``x-claude-code-request-class``    what the request is (main thread, subagent, compaction,
                                   auxiliary)
``x-claude-code-compaction``       the summary request of a compaction
``x-claude-code-context-compacted`` a turn on the compacted context
``x-claude-code-auxiliary-type``   a one-off beside the session (title, memory pass)
``x-claude-code-prompt-id``        the user prompt the request serves
=================================  ==========================================================

Codex CLI (0.169-0.171) runs each subagent (``spawn_agent``) as a thread of its own under the
root session's ``session-id`` (and ``prompt_cache_key``); a subagent's requests add
``x-codex-parent-thread-id`` (the thread that spawned it) and ``x-openai-subagent``
(``collab_spawn``), and their ``thread-id`` is the subagent's own (the main thread's equals its
session id). So a request with a parent thread is a subagent whose agent id is its
``thread-id`` (``docs/claude-code.md``, "Codex CLI subagents").

Only the session key itself comes from the protocol layer (``PreparedRequest.session_key``,
which also reads bodies); ``ChatService`` fills it in. Values are bounded and unknown classes
fall back to the main thread, so a malformed header never fails a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from cache.sessions import RequestClass, SessionHint

MAX_HEADER_CHARS = 256
_PREFIX = "x-claude-code-"
_TRUE = frozenset({"1", "true", "yes", "on"})
_CLASSES = {
    "main": RequestClass.MAIN, "main_thread": RequestClass.MAIN, "main-thread": RequestClass.MAIN,
    "subagent": RequestClass.SUBAGENT, "agent": RequestClass.SUBAGENT, "sidechain": RequestClass.SUBAGENT,
    "compaction": RequestClass.COMPACTION, "compact": RequestClass.COMPACTION,
    "auxiliary": RequestClass.AUXILIARY,
}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if not value:
        return None
    value = value.strip()
    return value if 0 < len(value) <= MAX_HEADER_CHARS else None


def _get(headers: Mapping[str, str], name: str) -> str | None:
    return _header(headers, _PREFIX + name)


def _codex_subagent(headers: Mapping[str, str]) -> SessionHint | None:
    """A Codex CLI subagent's request: its thread is the branch, its parent thread the parent."""
    parent = _header(headers, "x-codex-parent-thread-id")
    thread = _header(headers, "thread-id")
    if parent is None or thread is None or thread == parent:
        return None
    return SessionHint(agent_id=thread, parent_agent_id=parent,
                       agent_type=_header(headers, "x-openai-subagent"), request_class=RequestClass.SUBAGENT)


def agent_hint(headers: Mapping[str, str] | None) -> SessionHint:
    """The agent part of a request's hint (``key`` is left None: the protocol layer's session
    key is filled in by the service). ``headers`` as Starlette gives them (case-insensitive) or
    a dict with lower-case names."""
    if not headers:
        return SessionHint()
    agent_id = _get(headers, "agent-id")
    if agent_id is None and (codex := _codex_subagent(headers)) is not None:
        return codex
    auxiliary_type = _get(headers, "auxiliary-type")
    label = (_get(headers, "request-class") or "").lower()
    request_class = _CLASSES.get(label, RequestClass.MAIN)
    if label.startswith("aux"):
        request_class = RequestClass.AUXILIARY
    if (_get(headers, "compaction") or "").lower() in _TRUE:
        request_class = RequestClass.COMPACTION
    elif auxiliary_type is not None and request_class is RequestClass.MAIN:
        request_class = RequestClass.AUXILIARY
    elif agent_id is not None and request_class is RequestClass.MAIN and not label:
        request_class = RequestClass.SUBAGENT
    return SessionHint(
        agent_id=agent_id,
        parent_agent_id=_get(headers, "parent-agent-id"),
        agent_type=_get(headers, "agent-type"),
        request_class=request_class,
        prompt_id=_get(headers, "prompt-id"),
        context_compacted=(_get(headers, "context-compacted") or "").lower() in _TRUE,
        auxiliary_type=auxiliary_type,
    )


def with_body_class(hint: SessionHint, one_off: bool) -> SessionHint:
    """A request no header labels (main thread, no agent id) whose body marks it a one-off
    (``PreparedRequest.one_off``: a structured output offering no tools, as Claude Code's session
    titles are) is auxiliary. Without this, a title sent before the first main turn opened the
    session and gave it its first prompt, and the next title, sharing half of it and extending
    none of its tails, read as a compaction's first turn: the main thread's prefix was retired
    (seen with 2.1.197; ``docs/claude-code.md``)."""
    if one_off and hint.request_class is RequestClass.MAIN and hint.agent_id is None:
        return replace(hint, request_class=RequestClass.AUXILIARY,
                       auxiliary_type=hint.auxiliary_type or "one-off")
    return hint
