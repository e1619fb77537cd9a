"""A recording HTTP proxy between the Claude Code CLI and the backend (127.0.0.1 only): every
request is forwarded unchanged and its response streamed back; each ``POST /v1/messages`` is
kept with its headers, body, the backend's ``x-request-id`` and the usage of the reply's
``message_start`` event. ``summarize`` turns the records into small scrubbed fixtures
(``tests/e2e/captures/``): the ``x-claude-code-*`` headers, ``metadata.user_id``'s keys, the
system prompt's and tools' hashes, the tool names, and what each request's prompt shares with
the first request of its session (the parent's)."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import xxhash

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


class CaptureProxy:
    """``paths``: the POST routes recorded (``/v1/responses`` for Codex CLI)."""

    def __init__(self, upstream: str, paths: tuple[str, ...] = ("/v1/messages",)) -> None:
        self.upstream = upstream.rstrip("/")
        self.paths = paths
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                record: dict[str, Any] | None = None
                if self.command == "POST" and self.path.split("?")[0] in proxy.paths:
                    record = {"t": time.monotonic(), "body": json.loads(body or b"{}"),
                              "headers": {k.lower(): v for k, v in self.headers.items()}}
                with httpx.Client(timeout=600) as client, client.stream(
                        self.command, proxy.upstream + self.path, headers=headers, content=body) as r:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in _HOP and k.lower() != "content-encoding":
                            self.send_header(k, v)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    head = b""
                    for chunk in r.iter_raw():
                        if record is not None and len(head) < 65536:
                            head += chunk
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    if record is not None:
                        record["status"] = r.status_code
                        record["request_id"] = r.headers.get("x-request-id", "")
                        record["usage"] = _first_usage(head)
                        with proxy._lock:
                            proxy.records.append(record)

            do_GET = do_POST = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> CaptureProxy:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _first_usage(head: bytes) -> dict[str, Any]:
    """The usage of the reply: ``message_start``'s (streamed) or the body's (not streamed)."""
    text = head.decode("utf-8", "replace")
    m = re.search(r"data: (\{\"type\":\"message_start\".*)", text)
    try:
        if m:
            return dict(json.loads(m.group(1))["message"]["usage"])
        return dict(json.loads(text).get("usage", {}))
    except (ValueError, KeyError, TypeError):
        return {}


def _hash(value: Any) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _first_user_text(body: dict[str, Any]) -> str:
    for m in body.get("messages", []):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            return content
        texts = [b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text"]
        return texts[-1] if texts else ""
    return ""


def _items(body: dict[str, Any]) -> list[str]:
    """The request as a sequence of hashed items (system blocks, tools, messages) for prefix sharing."""
    system = body.get("system")
    blocks = system if isinstance(system, list) else [system] if system else []
    return ([_hash(["system", b]) for b in blocks] + [_hash(["tool", t]) for t in body.get("tools", [])]
            + [_hash(["message", m]) for m in body.get("messages", [])])


def _system_texts(body: dict[str, Any]) -> list[str]:
    system = body.get("system")
    blocks = system if isinstance(system, list) else [{"text": system}] if system else []
    return [str(b.get("text", "")) if isinstance(b, dict) else "" for b in blocks]


def _output_format(body: dict[str, Any]) -> list[str] | None:
    """The properties of a structured-output schema (``output_config.format``), if any."""
    fmt = (body.get("output_config") or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    return sorted((fmt.get("schema") or {}).get("properties") or {})


def summarize(records: list[dict[str, Any]], scrub: dict[str, str],
              anchor: Callable[[dict[str, Any]], bool] = lambda _body: True) -> list[dict[str, Any]]:
    """Small, scrubbed rows (one per request, in arrival order). ``scrub``: text -> placeholder
    (paths, ids) replaced in every string kept. ``anchor(body)``: which requests may be their
    session's first (what ``items_shared_with_first_request`` compares with): the main thread's
    where a one-off side request (a title) comes first."""
    def clean(value: str) -> str:
        for old, new in scrub.items():
            value = value.replace(old, new)
        return value

    rows = []
    firsts: dict[str, list[str]] = {}
    ordered = sorted(records, key=lambda r: r["t"])
    for rec in ordered:
        if anchor(rec["body"]):
            firsts.setdefault(rec["headers"].get("x-claude-code-session-id", ""), _items(rec["body"]))
    for rec in ordered:
        body, headers = rec["body"], rec["headers"]
        session = headers.get("x-claude-code-session-id", "")
        items = _items(body)
        parent = firsts.setdefault(session, items)
        shared = next((i for i, (a, b) in enumerate(zip(parent, items)) if a != b),
                      min(len(parent), len(items)))
        user_id = (body.get("metadata") or {}).get("user_id")
        try:
            uid = json.loads(user_id) if isinstance(user_id, str) else None
        except ValueError:
            uid = None
        system = body.get("system")
        rows.append({
            "request_id": rec.get("request_id", ""),
            "status": rec.get("status"),
            "claude_code_headers": {k: clean(v) for k, v in sorted(headers.items())
                                    if k.startswith(("x-claude-code-", "x-claude-1p-"))
                                    and k != "x-claude-code-session-id"},
            "session": "<session>" if session else None,
            "metadata_user_id": sorted(uid) if isinstance(uid, dict) else ("<string>" if user_id else None),
            "system_hash": _hash(system)[:12] if system else None,
            "system_blocks": len(system) if isinstance(system, list) else int(bool(system)),
            "system_text": [clean(t)[:80] for t in _system_texts(body)],
            "model": body.get("model"),
            "stream": body.get("stream"),
            "output_format": _output_format(body),
            "tools": [t.get("name") for t in body.get("tools", [])],
            "tools_hash": _hash(body.get("tools", []))[:12],
            "num_messages": len(body.get("messages", [])),
            "first_user_text": clean(_first_user_text(body))[:120],
            "items_shared_with_first_request": shared,
            "num_items": len(items),
            "max_tokens": body.get("max_tokens"),
            "usage": {k: v for k, v in rec.get("usage", {}).items()
                      if k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")},
        })
    return rows
