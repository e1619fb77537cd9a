"""Serving-layer throughput: N concurrent streaming ``/v1/messages`` through the full server.

    python -m bench.serving_bench                      # 512 streams, null-compute reference engine
    python -m bench.serving_bench --concurrency 64 --max-tokens 128 --ranks 2
    python -m bench.serving_bench --url http://127.0.0.1:8000   # an already running server

The server runs in its own process (``python -m deepinfer_backend serve`` with the reference
engine's ``null`` model, which emits tokens without compute, so everything measured is the
serving path: rank loop, IPC, cache admission, protocol feed, SSE, HTTP). This process is only
the client: raw asyncio HTTP/1.1 connections (uvloop when installed) that count SSE events with
``bytes.count`` and never parse JSON per event, so the client is not the bottleneck.

Printed figures:
* streamed tokens/s: output tokens of all streams (each stream's ``usage.output_tokens`` from its
  final ``message_delta``) / wall time from the first request sent to the last stream done;
* inter-token delay added by the serving path: per stream, the gap between consecutive
  deliveries of token deltas at the client (p50, p99 over all deliveries of all streams). The
  null engine computes nothing, so the gap is what the serving path itself adds between two
  tokens reaching a client. Under load one delivery carries several tokens (the service feeds
  every buffered step at once): "tokens per delivery" says how many on average;
* time to first token p50/p99, and deliveries per stream (how much batching kicked in).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

_DELTA = b"event: content_block_delta"
_USAGE_RE = re.compile(rb'"output_tokens":\s*(\d+)')
_END = b"0\r\n\r\n"


@dataclass(slots=True)
class StreamStats:
    sent_s: float = 0.0
    first_token_s: float = 0.0
    done_s: float = 0.0
    status: int = 0
    output_tokens: int = 0
    num_deliveries: int = 0
    gaps_s: list[float] = field(default_factory=list)
    error: str = ""


class _SSECounter(asyncio.Protocol):
    """Counts delta events per ``data_received``; finds the usage at the end of the stream."""

    def __init__(self, request: bytes, stats: StreamStats, done: asyncio.Future[None]) -> None:
        self._request = request
        self._stats = stats
        self._done = done
        self._head = b""
        self._in_body = False
        self._carry = b""
        self._tail = b""
        self._last_delivery_s = 0.0
        self._pending_deltas = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._stats.sent_s = time.perf_counter()
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self._in_body:
            self._head += data
            idx = self._head.find(b"\r\n\r\n")
            if idx < 0:
                return
            self._stats.status = int(self._head[9:12])
            data = self._head[idx + 4:]
            self._in_body = True
        scan = self._carry + data
        num_deltas = scan.count(_DELTA)
        self._carry = scan[-(len(_DELTA) - 1):]
        self._tail = (self._tail + data)[-4096:]
        if num_deltas:
            st = self._stats
            if st.first_token_s:
                st.gaps_s.append(now - self._last_delivery_s)
            else:
                st.first_token_s = now
            st.num_deliveries += 1
            self._last_delivery_s = now
        if self._tail.endswith(_END) or (self._stats.status and self._stats.status != 200
                                          and b"\r\n\r\n" in self._head):
            self._finish()

    def _finish(self) -> None:
        st = self._stats
        st.done_s = time.perf_counter()
        found = _USAGE_RE.findall(self._tail)
        st.output_tokens = int(found[-1]) if found else 0
        if st.status != 200:
            st.error = self._tail[-300:].decode(errors="replace")
        self._transport.close()
        if not self._done.done():
            self._done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._stats.error = f"connection lost: {exc}"
            self._stats.done_s = time.perf_counter()
            self._done.set_result(None)


def _request_bytes(host: str, port: int, max_tokens: int, i: int) -> bytes:
    body = json.dumps({
        "model": "default", "max_tokens": max_tokens, "stream": True,
        "messages": [{"role": "user", "content": f"Benchmark stream {i}: count to a thousand."}],
    }).encode()
    head = (f"POST /v1/messages?beta=true HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"content-type: application/json\r\nanthropic-version: 2023-06-01\r\n"
            f"x-api-key: bench\r\nx-claude-code-session-id: bench-{i}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


async def run_client(url: str, concurrency: int, max_tokens: int) -> tuple[list[StreamStats], float]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    stats = [StreamStats() for _ in range(concurrency)]
    futures = [loop.create_future() for _ in range(concurrency)]
    start_s = time.perf_counter()
    for i in range(concurrency):
        req = _request_bytes(host, port, max_tokens, i)
        await loop.create_connection(lambda r=req, s=stats[i], f=futures[i]: _SSECounter(r, s, f),
                                     host, port)
    await asyncio.gather(*futures)
    return stats, start_s


def _wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("server not ready")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, Path]:
    per_rank = -(-args.concurrency // args.ranks)
    blocks_per_seq = -(-(args.max_tokens + 256) // 128) + 1
    config = {
        "engine": "reference", "reference_model": "null", "ep": args.ranks, "port": args.port,
        "max_num_seqs": max(per_rank, 1), "reference_num_blocks": per_rank * blocks_per_seq + 64,
        "l1_cache": False, "max_model_len": 8192, "api_key": "bench",
    }
    tmp = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(config))
    log_path = tmp / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "deepinfer_backend", "serve", "--config", str(cfg_path)]
    if args.profile:
        cmd = [sys.executable, "-m", "cProfile", "-o", str(tmp / "server.prof"), "-m", "deepinfer_backend",
               "serve", "--config", str(cfg_path)]
    proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    return proc, f"http://127.0.0.1:{args.port}", tmp


def report(stats: list[StreamStats], start_s: float, args: argparse.Namespace) -> dict[str, float]:
    errors = [s for s in stats if s.error or s.status != 200]
    ok = [s for s in stats if not (s.error or s.status != 200)]
    end_s = max(s.done_s for s in stats)
    wall_s = end_s - start_s
    total_tokens = sum(s.output_tokens for s in ok)
    gaps = np.array([g for s in ok for g in s.gaps_s] or [0.0]) * 1e3
    ttft = np.array([s.first_token_s - s.sent_s for s in ok if s.first_token_s] or [0.0]) * 1e3
    deliveries = np.array([s.num_deliveries for s in ok] or [0])
    figures = {
        "streams": len(stats), "errors": len(errors), "output_tokens": total_tokens,
        "wall_s": wall_s, "tokens_per_s": total_tokens / wall_s if wall_s > 0 else 0.0,
        "inter_token_ms_p50": float(np.percentile(gaps, 50)), "inter_token_ms_p99": float(np.percentile(gaps, 99)),
        "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "deliveries_per_stream_mean": float(deliveries.mean()),
        "tokens_per_delivery": total_tokens / max(1, int(deliveries.sum())),
    }
    print(f"streams {len(stats)} (errors {len(errors)}), max_tokens {args.max_tokens}, ranks {args.ranks}")
    print(f"streamed tokens/s: {figures['tokens_per_s']:.0f}  ({total_tokens} tokens in {wall_s:.2f} s)")
    print(f"added inter-token delay: p50 {figures['inter_token_ms_p50']:.2f} ms, "
          f"p99 {figures['inter_token_ms_p99']:.2f} ms")
    print(f"time to first token: p50 {figures['ttft_ms_p50']:.1f} ms, p99 {figures['ttft_ms_p99']:.1f} ms; "
          f"deliveries per stream {figures['deliveries_per_stream_mean']:.1f}, "
          f"tokens per delivery {figures['tokens_per_delivery']:.2f}")
    if errors:
        print(f"first error: status {errors[0].status} {errors[0].error[:200]}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=1, help="rank processes of the null engine")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--url", default=None, help="benchmark a running server instead")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the first warms up")
    parser.add_argument("--profile", action="store_true", help="cProfile the server (server.prof)")
    parser.add_argument("--json", action="store_true", help="print the last round's figures as JSON")
    args = parser.parse_args(argv)

    proc = None
    tmp = None
    url = args.url
    if url is None:
        proc, url, tmp = start_server(args)
    try:
        _wait_ready(url, proc, 180)
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        figures: dict[str, float] = {}
        for round_no in range(args.rounds):
            print(f"-- round {round_no + 1}/{args.rounds}")
            stats, start_s = runner(run_client(url, args.concurrency, args.max_tokens))
            figures = report(stats, start_s, args)
        if args.json:
            print(json.dumps(figures))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if tmp is not None:
                print(f"server log: {tmp / 'server.log'}" + (f", profile: {tmp / 'server.prof'}" if args.profile else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
