"""Helpers for the server tests: run an ASGI app or a whole Runtime on a background loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from server.background import LoopThread


@contextlib.contextmanager
def serve_asgi(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1:<free port>; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    config = uvicorn.Config(app, loop="none", lifespan="off", access_log=False, log_level="warning")
    server = uvicorn.Server(config)
    loop = LoopThread("test-asgi")
    task_box: dict[str, Any] = {}

    async def start() -> None:
        task_box["task"] = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)

    async def stop() -> None:
        server.should_exit = True
        await task_box["task"]

    loop.start(start, timeout_s=30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        loop.stop(stop)
        sock.close()


@contextlib.contextmanager
def run_runtime(runtime: Any, timeout_s: float = 120) -> Iterator[Any]:
    """Start a ``server.runtime.Runtime`` on a background loop; yields (runtime, loop)."""
    loop = LoopThread("test-runtime")
    loop.start(runtime.start, timeout_s=timeout_s)
    try:
        yield loop
    finally:
        loop.stop(runtime.stop)
