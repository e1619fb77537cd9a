"""Serving-layer throughput: N concurrent streaming ``/v1/messages`` through the full server.

    python -m bench.serving_bench                      # 512 streams, null-compute reference engine
    python -m bench.serving_bench --concurrency 64 --max-tokens 128 --ranks 2
    python -m bench.serving_bench --url http://127.0.0.1:8000   # an already running server
    python -m bench.serving_bench --quick              # 8 streams x 32 tokens, 1 rank, a free port

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
* the same two figures in steady state: the window from the moment every stream has its first
  token to the first stream's end (no admissions in flight), with tokens/s from the server's
  live ``deepinfer_output_tokens_total`` counter sampled every 0.25 s;
* time to first token p50/p99, and deliveries per stream (how much batching kicked in);
* CPU seconds of the backend process and of the rank processes during the round, and tokens per
  backend CPU-second: a figure that does not depend on what else the machine is running (the
  2-core build machine is shared, so wall-clock figures vary from run to run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import psutil

from bench.support.ports import free_port
from bench.support.quick import add_quick

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
    gap_times_s: list[float] = field(default_factory=list)  # when each gap ended
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
                st.gap_times_s.append(now)
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


_TOKENS_RE = re.compile(rb"^deepinfer_output_tokens_total (\S+)$", re.MULTILINE)


async def _scrape_tokens(host: str, port: int) -> float:
    """The server's live output-token counter (bumped once per streamed batch)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    found = _TOKENS_RE.search(data)
    return float(found.group(1)) if found else float("nan")


async def _sample(host: str, port: int, samples: list[tuple[float, float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        value = await _scrape_tokens(host, port)
        samples.append(((t0 + time.perf_counter()) / 2, value))
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def run_client(url: str, concurrency: int, max_tokens: int
                     ) -> tuple[list[StreamStats], float, list[tuple[float, float]]]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    stats = [StreamStats() for _ in range(concurrency)]
    futures = [loop.create_future() for _ in range(concurrency)]
    samples: list[tuple[float, float]] = []
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample(host, port, samples, stop))
    requests = [_request_bytes(host, port, max_tokens, i) for i in range(concurrency)]
    address = (socket.gethostbyname(host), port)  # resolved once: no getaddrinfo per connection

    async def open_one(i: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, address)
        await loop.create_connection(lambda: _SSECounter(requests[i], stats[i], futures[i]), sock=sock)

    start_s = time.perf_counter()
    await asyncio.gather(*(open_one(i) for i in range(concurrency)))
    await asyncio.gather(*futures)
    stop.set()
    await sampler
    return stats, start_s, samples


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
    # Room for every round's finished sessions to stay cached (the prefix cache is on, and a
    # session returning within protect_s is not evicted): the pool is not what is measured here.
    config = {
        "engine": "reference", "reference_model": "null", "ep": args.ranks, "port": args.port,
        "max_num_seqs": max(per_rank, 1),
        "reference_num_blocks": (args.rounds + 1) * per_rank * blocks_per_seq + 64,
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


def _steady(stats: list[StreamStats],
            samples: list[tuple[float, float]]) -> tuple[float, float, float, list[float]]:
    """Window where every stream is streaming: from the last first-token to the first finish."""
    begin_s = max(s.first_token_s for s in stats)
    end_s = min(s.done_s for s in stats)
    inside = [(t, v) for t, v in samples if begin_s <= t <= end_s]
    rate = float("nan")
    if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
        rate = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
    gaps = [g for s in stats for g, t in zip(s.gaps_s, s.gap_times_s) if begin_s <= t <= end_s]
    return rate, begin_s, end_s, gaps


def report(stats: list[StreamStats], start_s: float, args: argparse.Namespace,
           samples: list[tuple[float, float]]) -> dict[str, float]:
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
        "inter_token_ms_p50": float(np.percentile(gaps, 50)),
        "inter_token_ms_p99": float(np.percentile(gaps, 99)),
        "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "deliveries_per_stream_mean": float(deliveries.mean()),
        "tokens_per_delivery": total_tokens / max(1, int(deliveries.sum())),
    }
    figures["steady_tokens_per_s"] = float("nan")
    if ok and not errors:
        rate, begin_s, end_s, steady_gaps = _steady(ok, samples)
        sg = np.array(steady_gaps or [float("nan")]) * 1e3
        figures.update({"steady_tokens_per_s": rate, "steady_window_s": end_s - begin_s,
                        "steady_inter_token_ms_p50": float(np.percentile(sg, 50)),
                        "steady_inter_token_ms_p99": float(np.percentile(sg, 99))})
    print(f"streams {len(stats)} (errors {len(errors)}), max_tokens {args.max_tokens}, ranks {args.ranks}")
    print(f"streamed tokens/s: {figures['tokens_per_s']:.0f}  ({total_tokens} tokens in {wall_s:.2f} s)")
    print(f"added inter-token delay: p50 {figures['inter_token_ms_p50']:.2f} ms, "
          f"p99 {figures['inter_token_ms_p99']:.2f} ms")
    if figures.get("steady_window_s", 0) > 0:
        print(f"steady state (all {len(stats)} streams active, {figures['steady_window_s']:.1f} s): "
              f"{figures['steady_tokens_per_s']:.0f} tokens/s, inter-token delay p50 "
              f"{figures['steady_inter_token_ms_p50']:.2f} ms, p99 "
              f"{figures['steady_inter_token_ms_p99']:.2f} ms")
    print(f"time to first token: p50 {figures['ttft_ms_p50']:.1f} ms, p99 {figures['ttft_ms_p99']:.1f} ms; "
          f"deliveries per stream {figures['deliveries_per_stream_mean']:.1f}, "
          f"tokens per delivery {figures['tokens_per_delivery']:.2f}")
    if errors:
        print(f"first error: status {errors[0].status} {errors[0].error[:200]}")
    return figures


async def service_only(num_streams: int, num_steps: int) -> float:
    """CPU per delivery of ChatService + protocol alone: no HTTP, no ranks, no cache decisions.

    Stand-ins replace the cache (admits everything, no prefix) and the rank client (streams we
    push one single-token output per step into); the protocol is the real one. Every step is
    consumed before the next, so each token is its own delivery: the worst case for batching.
    """
    from protocol.api import Protocol
    from protocol.ledger import OutputLedger
    from protocol.tokenize import PromptTokenizer
    from rank.client import GroupState, RequestStream
    from rank.engine import FinishReason, RequestOutput
    from server.config import load_config
    from server.metrics import ServerMetrics
    from server.service import ChatService
    from standins.admit_all_cache import AdmitAllCache

    class _Client:
        state = GroupState.READY

        def __init__(self) -> None:
            self.streams: list[RequestStream] = []

        def submit(self, rank: int, request_id: str) -> RequestStream:
            self.streams.append(RequestStream(request_id, rank, 1))
            return self.streams[-1]

    config = load_config({"max_model_len": 8192})
    protocol = Protocol(PromptTokenizer.load(None), OutputLedger(), config.served_model_names, 8192)
    client = _Client()
    service = ChatService(protocol, AdmitAllCache(max_output_tokens=8192), client, ServerMetrics(), config)
    text_ids = protocol.tokenizer.encode_plain(" the quick brown fox jumps over the lazy dog" * 20).tolist()

    async def write(_: bytes) -> None:
        return None

    tasks = []
    for i in range(num_streams):
        body = json.dumps({"model": "default", "max_tokens": num_steps, "stream": True,
                           "messages": [{"role": "user", "content": f"stream {i}"}]}).encode()
        prepared = protocol.prepare_anthropic(body, {})
        tasks.append(asyncio.ensure_future(service.stream(prepared, f"r{i}", write, time.perf_counter())))
    await asyncio.sleep(0.05)
    push_s = 0.0
    start_cpu_s = time.process_time()
    for step in range(num_steps):
        last = step == num_steps - 1
        t0 = time.process_time()
        for stream in client.streams:
            stream.push(RequestOutput(stream.request_id, [text_ids[step % len(text_ids)]], last,
                                      FinishReason.LENGTH if last else None, 5, 0))
        push_s += time.process_time() - t0
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.process_time() - start_cpu_s - push_s) / (num_streams * num_steps)


def _cpu_s(server: psutil.Process | None) -> tuple[float, float]:
    """CPU seconds (user + system) of the backend process and of its rank processes."""
    if server is None:
        return 0.0, 0.0
    own = server.cpu_times()
    ranks = 0.0
    for child in server.children(recursive=True):
        try:
            t = child.cpu_times()
            ranks += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return own.user + own.system, ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=1, help="rank processes of the null engine")
    parser.add_argument("--port", type=int, default=18431, help="the server's port (0: a free one)")
    parser.add_argument("--url", default=None, help="benchmark a running server instead")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the first warms up")
    parser.add_argument("--profile", action="store_true", help="cProfile the server (server.prof)")
    parser.add_argument("--json", action="store_true", help="print the last round's figures as JSON")
    parser.add_argument("--service-only", action="store_true",
                        help="measure ChatService + protocol CPU per delivery in process (no HTTP, no ranks)")
    add_quick(parser, argv, concurrency=8, max_tokens=32, port=0)
    args = parser.parse_args(argv)
    if args.port == 0:
        args.port = free_port()
    if args.service_only:
        per_s = asyncio.run(service_only(args.concurrency, min(args.max_tokens, 256)))
        print(f"ChatService + protocol: {per_s * 1e6:.1f} us CPU per delivery of one token "
              f"({args.concurrency} streams, every step consumed: no batching)")
        return 0

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
        server = psutil.Process(proc.pid) if proc is not None else None
        for round_no in range(args.rounds):
            print(f"-- round {round_no + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f} "
                  f"on {os.cpu_count()} CPUs)")
            before = _cpu_s(server)
            stats, start_s, samples = runner(run_client(url, args.concurrency, args.max_tokens))
            after = _cpu_s(server)
            figures = report(stats, start_s, args, samples)
            if server is not None:
                tokens = figures["output_tokens"]
                http_s, ranks_s = after[0] - before[0], after[1] - before[1]
                figures.update({"server_cpu_s": http_s, "ranks_cpu_s": ranks_s,
                                "tokens_per_server_cpu_s": tokens / http_s if http_s else 0.0})
                print(f"CPU: backend process {http_s:.2f} s ({1e6 * http_s / max(tokens, 1):.1f} us/token, "
                      f"{figures['tokens_per_server_cpu_s']:.0f} tokens per backend CPU-second), "
                      f"rank processes {ranks_s:.2f} s")
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
                print(f"server log: {tmp / 'server.log'}"
                      + (f", profile: {tmp / 'server.prof'}" if args.profile else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
