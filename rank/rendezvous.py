"""The ranks' rendezvous listens on the address it is given, never on every interface.

torch.distributed's ``tcp://HOST:PORT`` rendezvous starts a ``TCPStore`` server on rank 0 that
binds the port on every interface (``::``) whatever HOST is: anyone who can reach the machine
could read and write the store, which has no authentication. ``install`` replaces the ``tcp``
rendezvous handler in this process with one that binds rank 0's listening socket to HOST itself
(``MASTER_ADDR``: ``127.0.0.1`` unless the deployment names another interface) and hands it to
the store (``TCPStore(master_listen_fd=...)``). It serves both our own group
(``init_process_group(init_method="tcp://...")`` in ``rank/rank_setup.py``) and the one DeepInfer
builds while its engine loads, which the backend does not otherwise control.

Gloo's and NCCL's own pair sockets are chosen by ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
(``rank/launch.py`` sets Gloo's to loopback unless the deployment sets it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

LISTEN_BACKLOG = 128


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` only (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _handler(url: str, timeout: timedelta = timedelta(minutes=10), **_kwargs: Any) -> Iterator[Any]:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if parsed.hostname is None or parsed.port is None or "rank" not in query or "world_size" not in query:
        raise ValueError(f"tcp:// rendezvous needs host, port, rank and world_size: {url!r}")
    rank, world_size = int(query["rank"]), int(query["world_size"])
    listener = bound_listener(parsed.hostname, parsed.port) if rank == 0 else None
    store = TCPStore(parsed.hostname, parsed.port, world_size, rank == 0, timeout, multi_tenant=True,
                          master_listen_fd=listener.fileno() if listener is not None else None)
    _listeners.append(listener)  # the store's server uses the fd; keep the socket object alive with it
    yield store, rank, world_size
    raise RuntimeError("tcp:// rendezvous cannot re-rendezvous")


_listeners: list[socket.socket | None] = []


def install() -> None:
    """Route ``tcp://`` rendezvous in this process through ``_handler`` (idempotent)."""
    from torch.distributed.rendezvous import _rendezvous_handlers, register_rendezvous_handler

    if _rendezvous_handlers.get("tcp") is not _handler:
        _rendezvous_handlers.pop("tcp", None)  # no public way to replace a registered handler
        register_rendezvous_handler("tcp", _handler)  # type: ignore[no-untyped-call]
