"""A free TCP port on loopback, for a bench that starts a server on a port it must know in advance
(``--port 0``; the quick modes use it so that two runs on one machine do not collide)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
