"""Connection attacks on a live server: lock-out by slow connections, and pipelining growth.

    python -m bench.connection_probe [--body-attackers 2100] [--header-attackers 2100]
        [--attack-s 40] [--pipelined 900000] [--pipeline-s 30] [--settle-s 5]
    python -m bench.connection_probe --quick     # 20 + 20 attackers, 2 s phases (seconds)

It starts ``python -m deepinfer_backend serve`` as a child process (reference engine, 'null'
model, one rank, an API key, the checkout's defaults otherwise), then on 127.0.0.1:

1. **Lock-out**: ``--body-attackers`` connections without the key, each sending
   ``POST /nope`` with ``Content-Length: 10000000`` and then one byte every 10 s, plus
   ``--header-attackers`` connections sending a request line and one header byte every 10 s
   (headers never complete). Meanwhile a client with the key opens a fresh connection every
   second for ``GET /healthz`` and ``POST /v1/messages`` (8 tokens). Printed: that client's
   statuses and latencies during the attack.
2. **Pipelining**: one socket writes up to ``--pipelined`` ``GET /healthz`` requests back to back
   for ``--pipeline-s`` seconds and never reads.

Both print the server's RSS (VmRSS) before, during (peak of samples every 0.5 s) and
``--settle-s`` after (the same wait lets the attack take hold before the client starts).
Every connection is the probe's own, on loopback, and closed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from bench.loop_stall_bench import rss_kib, start_server, stop_server
from bench.support.quick import add_quick

KEY = "probe-key"


def _mib(pid: int) -> float:
    return rss_kib(pid)["VmRSS"] / 1024


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.peak = max(self.peak, _mib(self.pid))
            await asyncio.sleep(0.5)


async def _attacker(port: int, first: bytes, stop: asyncio.Event, opened: list[int]) -> None:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return
    opened[0] += 1
    try:
        writer.write(first)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 10)
            except asyncio.TimeoutError:
                writer.write(b"x")
                await writer.drain()
    except (OSError, ConnectionError):
        pass
    finally:
        writer.close()


async def _request(port: int, raw: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
        writer.write(raw)
        line = await asyncio.wait_for(reader.readline(), 60)
        writer.close()
        status = int(line.split(b" ", 2)[1]) if line else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        status = 0
    return status, (time.perf_counter() - start) * 1000


def _legit_requests() -> tuple[bytes, bytes]:
    body = json.dumps({"model": "default", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    health = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {KEY}\r\n\r\n".encode()
    chat = (f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    return health, chat


async def lockout(args: argparse.Namespace, port: int, pid: int) -> None:
    stop = asyncio.Event()
    sampler = RssSampler(pid)
    before = _mib(pid)
    sampling = asyncio.ensure_future(sampler.run(stop))
    opened = [0]
    body_first = b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10000000\r\n\r\nx"
    header_first = b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    attackers = [asyncio.ensure_future(_attacker(port, body_first, stop, opened))
                 for _ in range(args.body_attackers)]
    attackers += [asyncio.ensure_future(_attacker(port, header_first, stop, opened))
                  for _ in range(args.header_attackers)]
    await asyncio.sleep(args.settle_s)  # let the attack take hold
    health, chat = _legit_requests()
    results: dict[str, list[tuple[int, float]]] = {"healthz": [], "messages": []}
    end = time.monotonic() + args.attack_s
    while time.monotonic() < end:
        results["healthz"].append(await _request(port, health))
        results["messages"].append(await _request(port, chat))
        await asyncio.sleep(1)
    during = sampler.peak
    stop.set()
    await asyncio.gather(*attackers, sampling)
    await asyncio.sleep(args.settle_s)
    print(f"lock-out: {args.body_attackers} slow-body + {args.header_attackers} slow-header attackers "
          f"({opened[0]} connected), {args.attack_s:g} s")
    for name, rows in results.items():
        statuses: dict[int, int] = {}
        for status, _ in rows:
            statuses[status] = statuses.get(status, 0) + 1
        lat = sorted(ms for _, ms in rows)
        print(f"  client with the key, {name}: statuses {statuses}; latency ms p50 {lat[len(lat) // 2]:.0f} "
              f"max {lat[-1]:.0f} ({len(rows)} requests)")
    print(f"  server RSS MiB: before {before:.0f}, during (peak) {during:.0f}, {args.settle_s:g} s after "
          f"{_mib(pid):.0f}")


async def pipelining(args: argparse.Namespace, port: int, pid: int) -> None:
    stop = asyncio.Event()
    sampler = RssSampler(pid)
    before = _mib(pid)
    sampling = asyncio.ensure_future(sampler.run(stop))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    one = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    batch = one * 2000
    sent, end = 0, time.monotonic() + args.pipeline_s
    try:
        while sent < args.pipelined and time.monotonic() < end:
            writer.write(batch)
            sent += 2000
            try:
                await asyncio.wait_for(writer.drain(), max(0.1, end - time.monotonic()))
            except asyncio.TimeoutError:
                break  # the server stopped reading
    except (OSError, ConnectionError):
        pass
    written = sent - writer.transport.get_write_buffer_size() // len(one)
    await asyncio.sleep(min(2.0, args.settle_s))
    during = sampler.peak
    writer.transport.abort()
    stop.set()
    await sampling
    await asyncio.sleep(args.settle_s)
    megabytes = written * len(one) / 1e6
    print(f"pipelining: one socket that never reads, {written:,} requests ({megabytes:.1f} MB) "
          f"taken by the kernel in {args.pipeline_s:g} s")
    print(f"  server RSS MiB: before {before:.0f}, during (peak) {during:.0f}, {args.settle_s:g} s after "
          f"{_mib(pid):.0f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.connection_probe")
    p.add_argument("--body-attackers", type=int, default=2100)
    p.add_argument("--header-attackers", type=int, default=2100)
    p.add_argument("--attack-s", type=float, default=40)
    p.add_argument("--pipelined", type=int, default=900_000)
    p.add_argument("--pipeline-s", type=float, default=30)
    p.add_argument("--settle-s", type=float, default=5.0, help="wait before the client and after each attack")
    add_quick(p, argv, body_attackers=20, header_attackers=20, attack_s=2.0, pipelined=20_000, pipeline_s=2.0,
              settle_s=0.5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp), {"api_key": KEY})
        port = int(url.rsplit(":", 1)[1])
        try:
            print(f"server {url} (pid {proc.pid})")
            asyncio.run(lockout(args, port, proc.pid))
            asyncio.run(pipelining(args, port, proc.pid))
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
