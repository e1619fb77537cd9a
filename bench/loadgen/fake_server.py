"""A stand-in ``/v1/messages`` server for dry-running the load generator without a backend.

It streams Anthropic SSE events (thinking, text, tool_use with ``input_json_delta``) at a fixed
token rate and reports usage with a per-session prefix cache measured on the request JSON
(about 4 bytes per token). It is no model and no backend: it exists so the load generator and its
tests can run anywhere. Run it with ``python -m bench.loadgen.fake_server --port 8011``; ``running()``
starts it for the quick runs of ``bench.loadgen`` and ``bench.multi_gpu.load`` (``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.support.ports import free_port

BYTES_PER_TOKEN = 4
REPO = Path(__file__).resolve().parents[2]


def _strip_markers(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip_markers(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip_markers(v) for v in value]
    return value


def _sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class FakeState:
    """Per-session last prompt bytes (the 'cache'); bounded by ``max_sessions`` (FIFO)."""

    def __init__(self, tokens_per_s: float, max_sessions: int = 10_000) -> None:
        self.tokens_per_s = tokens_per_s
        self.max_sessions = max_sessions
        self.last_prompt: dict[str, bytes] = {}
        self.counter = 0


def build_app(tokens_per_s: float = 200.0) -> Starlette:
    state = FakeState(tokens_per_s)

    async def messages(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return JSONResponse({"type": "error",
                                 "error": {"type": "invalid_request_error", "message": "bad JSON"}}, 400)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return JSONResponse({"type": "error",
                                 "error": {"type": "invalid_request_error", "message": "messages"}}, 400)
        prompt = orjson.dumps(_strip_markers([body.get("system"), body.get("tools"), body["messages"]]))
        # A subagent's conversation is its own prompt under its parent's session id.
        sid = (request.headers.get("x-claude-code-session-id", "") + "/"
               + request.headers.get("x-claude-code-agent-id", ""))
        prev = state.last_prompt.get(sid, b"")
        common = os.path.commonprefix([prev, prompt[: len(prev)]]) if prev else b""
        state.last_prompt[sid] = prompt
        if len(state.last_prompt) > state.max_sessions:
            state.last_prompt.pop(next(iter(state.last_prompt)))
        total = max(1, len(prompt) // BYTES_PER_TOKEN)
        cached = min(total - 1, len(common) // BYTES_PER_TOKEN)
        max_tokens = int(body.get("max_tokens", 16))
        state.counter += 1
        n = state.counter

        async def stream() -> object:
            yield _sse("message_start", {"type": "message_start", "message": {
                "id": f"msg_{n}", "type": "message", "role": "assistant", "content": [],
                "model": body.get("model"),
                "usage": {"input_tokens": total - cached, "cache_read_input_tokens": cached,
                          "cache_creation_input_tokens": 0, "output_tokens": 0}}})
            await asyncio.sleep(0.01)
            thinking = max_tokens // 4
            text = max_tokens - thinking
            idx = 0
            if thinking:
                yield _sse("content_block_start", {"type": "content_block_start", "index": idx,
                                                   "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}})
                for _ in range(thinking):
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                       "delta": {"type": "thinking_delta",
                                                                 "thinking": "hm "}})
                    await asyncio.sleep(1 / state.tokens_per_s)
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                   "delta": {"type": "signature_delta",
                                                             "signature": f"sig{n}"}})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": idx})
                idx += 1
            yield _sse("content_block_start", {"type": "content_block_start", "index": idx,
                                               "content_block": {"type": "text", "text": ""}})
            for _ in range(text):
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                   "delta": {"type": "text_delta", "text": "ok "}})
                await asyncio.sleep(1 / state.tokens_per_s)
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": idx})
            idx += 1
            yield _sse("content_block_start", {"type": "content_block_start", "index": idx,
                                               "content_block": {"type": "tool_use", "id": f"toolu_{n}",
                                                                 "name": "Bash", "input": {}}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                               "delta": {"type": "input_json_delta", "partial_json": ""}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": '{"command": "ls"}'}})
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": idx})
            yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                                         "usage": {"output_tokens": max_tokens}})
            yield _sse("message_stop", {"type": "message_stop"})

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])


@contextlib.contextmanager
def running(tokens_per_s: float = 2000.0) -> Iterator[str]:
    """This server in a child process on a free port, for a quick run of a load driver; yields its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.loadgen.fake_server", "--port", str(port),
                             "--tokens-per-s", str(tokens_per_s)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake_server did not start (exit {proc.poll()})") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--tokens-per-s", type=float, default=200.0)
    args = parser.parse_args()
    uvicorn.run(build_app(args.tokens_per_s), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
