"""A local stand-in for the InferenceKey control plane, speaking what SDK 0.260725.739 sends.

Custom backends: ``POST /api/tenants/{tenant}/custom-backends`` with the SDK's multipart body: 201
with a record for a new (slug, version), 409 for a repeat (with the stored archive's sha256 in the
body when ``conflict_reports_sha256`` is set), 401 for a wrong token, 500 when ``fail_next`` is set.
Every accepted archive is kept (bytes) so tests can list what was uploaded.

Workloads (``ManagementClient``; paths and bodies as its native client sends them, observed against
this server): ``GET /api/projects/{p}/workloads`` lists the project's records, ``POST`` there creates
one (``reject_create`` answers 400 echoing the body instead), ``PATCH /api/workloads/{id}`` updates
one (a reconcile), and ``GET /api/projects/{p}/workloads/{slug}/readiness-events`` answers one
server-sent-events response per connection from ``readiness`` (a list of event lists, one per
connection; the last repeats) and closes it. The SDK's client reconnects when a response ends.
"""

from __future__ import annotations

import email
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


@dataclass
class StandinState:
    token: str
    published: dict[tuple[str, str], bytes] = field(default_factory=dict)
    fail_next: bool = False
    requests: list[str] = field(default_factory=list)
    conflict_reports_sha256: bool = False
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> record
    created: list[dict[str, Any]] = field(default_factory=list)  # create bodies as received
    patches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reject_create: bool = False
    readiness: list[list[dict[str, Any]]] = field(default_factory=lambda: [[{"phase": "ready",
                                                                              "message": "serving"}]])
    readiness_connections: int = 0

    def add_workload(self, project: str, **fields: Any) -> dict[str, Any]:
        wid = f"wl-{len(self.workloads) + 1}"
        record = {"id": wid, "project_id": project, "created_at": "2026-01-01T00:00:00Z",
                  "updated_at": "2026-01-01T00:00:00Z", "task_type": "text2text", **fields}
        self.workloads[wid] = record
        return record


def _parse_multipart(body: bytes, content_type: str) -> tuple[dict[str, str], bytes | None]:
    msg = email.message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    fields: dict[str, str] = {}
    file_bytes = None
    for part in msg.walk():
        if part.is_multipart():
            continue
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True) or b""
        if part.get_filename():
            file_bytes = payload
        elif name:
            fields[str(name)] = payload.decode()
    return fields, file_bytes


def _handler(state: StandinState) -> type:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def _send(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") != f"Bearer {state.token}":
                self._send(401, {"error": "invalid token"})
                return False
            return True

        def do_GET(self) -> None:
            state.requests.append(f"GET {self.path}")
            if not self._authorized():
                return
            parts = self.path.strip("/").split("/")
            if len(parts) == 4 and parts[:2] == ["api", "projects"] and parts[3] == "workloads":
                self._send(200, [w for w in state.workloads.values() if w["project_id"] == parts[2]])
            elif len(parts) == 6 and parts[:2] == ["api", "projects"] and parts[5] == "readiness-events":
                self._readiness()
            else:
                self._send(404, {"error": "not found"})

        def _readiness(self) -> None:
            index = min(state.readiness_connections, len(state.readiness) - 1)
            state.readiness_connections += 1
            events = state.readiness[index] if state.readiness else []
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def do_PATCH(self) -> None:
            state.requests.append(f"PATCH {self.path}")
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            if not self._authorized():
                return
            parts = self.path.strip("/").split("/")
            record = state.workloads.get(parts[-1]) if parts[:2] == ["api", "workloads"] else None
            if record is None:
                self._send(404, {"error": "not found"})
                return
            state.patches.append((parts[-1], body))
            record.update(body)
            self._send(200, record)

        def _create_workload(self, project: str, raw: bytes) -> None:
            body = json.loads(raw or b"{}")
            state.created.append(body)
            if state.reject_create:
                self._send(400, {"error": f"invalid workload: {json.dumps(body)}"})
                return
            self._send(201, state.add_workload(project, **body))

        def do_POST(self) -> None:
            state.requests.append(f"POST {self.path}")
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if not self._authorized():
                return
            route = self.path.strip("/").split("/")
            if len(route) == 4 and route[:2] == ["api", "projects"] and route[3] == "workloads":
                self._create_workload(route[2], body)
                return
            if state.fail_next:
                state.fail_next = False
                self._send(500, {"error": "storage unavailable"})
                return
            parts = self.path.strip("/").split("/")
            if len(parts) != 4 or parts[:2] != ["api", "tenants"] or parts[3] != "custom-backends":
                self._send(404, {"error": "not found"})
                return
            fields, archive = _parse_multipart(body, self.headers["Content-Type"])
            if archive is None or not fields.get("version"):
                self._send(400, {"error": "file and version are required"})
                return
            key = (fields["slug"], fields["version"])
            if key in state.published:
                conflict: dict[str, Any] = {"error": f"{key[0]} {key[1]} already exists"}
                if state.conflict_reports_sha256:
                    conflict["sha256"] = hashlib.sha256(state.published[key]).hexdigest()
                self._send(409, conflict)
                return
            state.published[key] = archive
            self._send(201, {"id": f"cb-{len(state.published)}", "slug": key[0], "version": key[1],
                             "sha256": hashlib.sha256(archive).hexdigest(), "tenant": parts[2]})

    return Handler


class ControlPlaneStandin:
    def __init__(self, token: str) -> None:
        self.state = StandinState(token=token)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
