"""The real Claude Code CLI spawns subagents (the Agent tool) through a recording proxy, on 4
ranks (scripted stand-in model): one subagent, then four in parallel.

What is shown: each subagent's later turns start from its own prefix (>= 90% of the prompt
cached), the parent's turn after its subagents >= 95% cached, and the four subagents' requests
spread over the ranks (the backend's log: rank per request). The requests themselves (every
``x-claude-code-*`` header, ``metadata.user_id``, the system prompt's and tools' identity, what
each shares with the parent) are summarised; with ``E2E_CAPTURE_DIR`` set they are written
there as ``claude-<version>-subagents.json`` (the fixtures in ``tests/e2e/captures/``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from cache.sessions import RequestClass
from server.agent_hints import agent_hint
from tests.e2e.capture_proxy import CaptureProxy, summarize
from tests.e2e.e2e_harness import assert_success, make_project, run_claude, running_backend

pytestmark = [pytest.mark.claude_cli, pytest.mark.timeout(900)]

FILES = {f"mod{i}.txt": "line\n" * (10 * i + 3) for i in range(1, 5)}
_LOG_ROW = re.compile(r"^(\S+ \S+) \S+ deepinfer.service: request (\S+) api=\w+ finish=\w+ rank=(-?\d+) "
                      r"prompt=(\d+) cached=(\d+) .* total_ms=([\d.]+) session=(\S*)", re.MULTILINE)


def _version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60,
                         env={"HOME": "/tmp", "PATH": os.environ.get("PATH", "")}, check=False)
    return out.stdout.split()[0] if out.stdout.strip() else "unknown"


def _rows(proxy: CaptureProxy, log: str, scrub: dict[str, str], **kw: Any) -> list[dict[str, Any]]:
    """The summarised requests (``kw``: ``summarize``'s), each with the rank, prompt and cached
    tokens the backend logged."""
    by_id = {m.group(2): m for m in _LOG_ROW.finditer(log)}
    rows = summarize(proxy.records, scrub, **kw)
    for row in rows:
        m = by_id.get(row["request_id"])
        if m is not None:
            row["rank"] = int(m.group(3))
            row["prompt_tokens"] = int(m.group(4))
            row["cached_tokens"] = int(m.group(5))
            row["routing_unit"] = re.sub(r"^hint:[^/]+", "hint:<session>", m.group(7))
            end = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            row["_span"] = (end - float(m.group(6)) / 1e3, end)  # when it ran (not in the fixtures)
    return rows


def _overlapping_on_one_rank(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of requests that ran on the same rank at the same time."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["rank"] == b["rank"] and a["_span"][0] < b["_span"][1] and b["_span"][0] < a["_span"][1]:
                out.append((a["request_id"], b["request_id"]))
    return out


def report_ranks(by_agent: dict[str, list[dict[str, Any]]]) -> dict[str, list[int]]:
    return {agent: [r["rank"] for r in turns] for agent, turns in by_agent.items()}


def _is_subagent(row: dict[str, Any]) -> bool:
    return str(row["first_user_text"]).startswith("Subagent task")


def _context(words: int) -> str:
    """A large first prompt (a pasted design note), so the parent's context has a working
    session's size rather than its system prompt's: a share of the prompt then measures reuse
    fairly (the few hundred new tokens of a turn are not a tenth of it)."""
    vocab = ["kernel", "buffer", "queue", "socket", "thread", "module", "vector", "matrix", "render",
             "parse", "token", "cache", "block", "rank"]
    return " ".join(f"{vocab[i % len(vocab)]}{i % 97}" for i in range(words))


def test_parallel_subagents_run_as_branches(claude_bin, tmp_path: Path):
    note = f"\n\nDesign note for reference:\n{_context(12_000)}"
    with running_backend("subagents.json", ranks=4) as backend, CaptureProxy(backend.base_url) as proxy:
        one = run_claude(claude_bin, "Survey the one module with a subagent.",
                         make_project(tmp_path / "one", FILES), proxy.base_url, stream_json=True)
        num_one = len(proxy.records)
        four = run_claude(claude_bin, "Survey the four modules: one subagent per file, all four in parallel."
                          + note, make_project(tmp_path / "four", FILES), proxy.base_url, stream_json=True)
        log = backend.log_text()
    version = _version(claude_bin)
    if os.environ.get("E2E_RAW_DIR"):  # everything, unscrubbed, for a look by hand (never committed)
        raw = Path(os.environ["E2E_RAW_DIR"]) / f"claude-{version}-subagents-raw.json"
        raw.write_text(json.dumps({"records": proxy.records, "log": log, "num_one": num_one,
                                   "tmp": str(tmp_path)}))
    rows = _rows(proxy, log, {str(tmp_path): "<tmp>"})
    if os.environ.get("E2E_CAPTURE_DIR"):
        out = Path(os.environ["E2E_CAPTURE_DIR"]) / f"claude-{version}-subagents.json"
        kept = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        out.write_text(json.dumps({"cli_version": version, "one_subagent": kept[:num_one],
                                   "four_subagents": kept[num_one:]}, indent=1) + "\n")
    session = rows[num_one:]
    print(f"claude {version}: rank, messages, cached/prompt, agent id, routing unit per request:")
    for r in session:
        print(f"   {r.get('rank')} {r['num_messages']:>2} {r.get('cached_tokens')}/{r.get('prompt_tokens')} "
              f"{r['claude_code_headers'].get('x-claude-code-agent-id')} {r.get('routing_unit')}")
    assert_success(one)
    assert_success(four)
    assert four.result["result"].startswith("SURVEY-"), four.describe()
    subagent_rows = [r for r in session if _is_subagent(r)]
    by_agent: dict[str, list[dict[str, Any]]] = {}
    for r in subagent_rows:  # a subagent: its agent id, else its task text
        key = r["claude_code_headers"].get("x-claude-code-agent-id") or r["first_user_text"]
        by_agent.setdefault(key, []).append(r)
    assert len(by_agent) == 4 and all(len(v) >= 2 for v in by_agent.values()), json.dumps(session, indent=1)
    # each subagent's later turns hit its own prefix
    for turns in by_agent.values():
        for r in turns[1:]:
            assert r["cached_tokens"] >= 0.9 * r["prompt_tokens"], r
    # the parent's turns after it spawned them (its answer, or the task notifications of 2.1.3xx)
    parent_later = [r for r in session if not _is_subagent(r) and r["status"] == 200][1:]
    assert parent_later, json.dumps(session, indent=1)
    for r in parent_later:
        assert r["cached_tokens"] >= 0.95 * r["prompt_tokens"], r
    # spread: four routing units over more than one rank. The CLI starts them a few hundred ms
    # apart, so whether two first turns overlap on one rank depends on timing (printed, not
    # asserted: docs/claude-code.md has what was seen). A later turn stays on its first turn's
    # rank unless it was bound late (router rule 4: L1 holds all of its chain once its turn was
    # written through, and another rank had room first while siblings ran on its own); then it
    # restores its prefix there, so the >= 90% above holds either way (printed: which moved).
    assert len({r["routing_unit"] for r in subagent_rows}) == 4
    firsts = [turns[0] for turns in by_agent.values()]
    assert len({r["rank"] for r in firsts}) >= 2, [r["rank"] for r in firsts]
    overlaps = _overlapping_on_one_rank(subagent_rows)
    moved = {agent: ranks for agent, ranks in report_ranks(by_agent).items() if len(set(ranks)) > 1}
    print(f"claude {version}: subagent first turns on ranks {sorted(r['rank'] for r in firsts)}; "
          f"{len(overlaps)} pairs of subagent requests on one rank overlapped from arrival to finish; "
          f"bound late to another rank: {moved or 'none'}")


def test_compaction_requests_captured(claude_bin, shared_backend, tmp_path: Path):
    """The compaction flow of ``test_claude_cli.py`` through the proxy: which headers the
    summary request and the compacted turns carry (written with the fixtures), and the backend
    lets the old prefix go at the first compacted turn (labelled, or seen from its prompt)."""
    from tests.e2e.test_claude_cli import COMPACTION_PROMPT, WINDOW_MARGIN_TOKENS

    dry = run_claude(claude_bin, COMPACTION_PROMPT, make_project(tmp_path / "dry"), shared_backend.base_url,
                     stream_json=True)
    assert_success(dry)
    sizes = [u["input_tokens"] + u.get("cache_read_input_tokens", 0) for u in dry.assistant_usages()]
    window = sizes[2] - WINDOW_MARGIN_TOKENS
    with running_backend("compaction.json", ranks=1, config={"max_model_len": window}) as backend, \
            CaptureProxy(backend.base_url) as proxy:
        run = run_claude(claude_bin, COMPACTION_PROMPT, make_project(tmp_path / "wet"), proxy.base_url,
                         stream_json=True)
        log = backend.log_text()
    assert_success(run)
    rows = _rows(proxy, log, {str(tmp_path): "<tmp>"})
    version = _version(claude_bin)
    if os.environ.get("E2E_CAPTURE_DIR"):
        out = Path(os.environ["E2E_CAPTURE_DIR"]) / f"claude-{version}-compaction.json"
        kept = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        out.write_text(json.dumps({"cli_version": version, "requests": kept}, indent=1) + "\n")
    for r in rows:
        print(f"   {r['status']} {r['num_messages']:>2} {r.get('cached_tokens')}/{r.get('prompt_tokens')} "
              f"{r['claude_code_headers']} {r['first_user_text'][:40]!r}")
    hints = [agent_hint(r["claude_code_headers"]) for r in rows]
    labelled = any(h.request_class is RequestClass.COMPACTION or h.context_compacted for h in hints)
    print(f"claude {version}: compaction labelled by headers: {labelled}")
    assert len(re.findall(r"compacted: \d+ blocks of its old prefix go first", log)) == 1
