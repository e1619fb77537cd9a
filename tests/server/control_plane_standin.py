"""A local stand-in for the InferenceKey control plane's custom-backend upload endpoint.

``POST /api/tenants/{tenant}/custom-backends`` with the SDK's multipart body: 201 with a record
for a new (slug, version), 409 for a repeat, 401 for a wrong token, 500 when ``fail_next`` is set.
Every accepted archive is kept (bytes) so tests can list what was uploaded.
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

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            state.requests.append(f"GET {self.path}")
            if self.headers.get("Authorization") != f"Bearer {state.token}":
                self._send(401, {"error": "invalid token"})
                return
            self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            state.requests.append(f"POST {self.path}")
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Authorization") != f"Bearer {state.token}":
                self._send(401, {"error": "invalid token"})
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
                self._send(409, {"error": f"{key[0]} {key[1]} already exists"})
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
