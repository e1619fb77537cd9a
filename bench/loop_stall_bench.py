"""Event-loop benchmark (not a test): ``/healthz`` latency while 20 MB bodies are tokenized, and the
time to refuse an over-long prompt.

Run: ``python -m bench.loop_stall_bench [--body-mb 20] [--clients 2] [--bodies 3]``; ``--quick``: two
1 MB bodies against a 65,536-token limit (seconds).

It starts ``python -m deepinfer_backend serve`` as a child process (reference engine, 'null'
model, one rank: the engine does nothing here; every request is refused at the boundary), so the
bench's own clients do not share the server's GIL. Then:

1. ``/healthz`` every 20 ms for ``--idle-s`` seconds: the idle latency;
2. ``--clients`` clients each send ``--bodies`` over-long bodies of ``--body-mb`` MB of text
   (distinct per body, so no piece is cached; ``--text code``: lines of code, ``--text dense``:
   minified JSON without whitespace), alternating ``/v1/messages/count_tokens`` and
   ``/v1/messages``; ``/healthz`` keeps being probed every 20 ms meanwhile.

Prints the probe latency (p50, p99, max) idle and under load, each refusal's status and time
(request sent -> answer), and the server's RSS (VmRSS, VmHWM) before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench.support.quick import add_quick

REPO = Path(__file__).resolve().parents[1]
_WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "True",
          "result", "config", "path", "os", "np", "array", "tokens", "=", "(", ")", ":", "+", "1", "42"]


def code_text(seed: int, num_bytes: int) -> str:
    rng = random.Random(seed)
    lines, n, k = [], 0, 0
    while n < num_bytes:
        k += 1
        ident = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(3, 14)))
        line = f"{k:>7}\t" + "    " * rng.randint(0, 3) + ident + " " + " ".join(
            rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def dense_text(seed: int, num_bytes: int) -> str:
    """Minified-JSON-like text: no whitespace at all, so the tokenizer's cheap lower bound says
    nothing and the prompt is tokenized (up to max_model_len) before it is refused."""
    rng = random.Random(seed)
    parts, n = [], 0
    while n < num_bytes:
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        part = f'"{key}":[{rng.randint(0, 99999)},"{key.upper()}{rng.randint(0, 999)}"],'
        parts.append(part)
        n += len(part)
    return "{" + "".join(parts) + "}"


def body_bytes(seed: int, num_bytes: int, count_tokens: bool, kind: str = "code") -> bytes:
    text = code_text(seed, num_bytes) if kind == "code" else dense_text(seed, num_bytes)
    body: dict[str, object] = {"model": "default", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": text}]}]}
    if not count_tokens:
        body["max_tokens"] = 64
    return orjson.dumps(body)


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    return out


def start_server(tmp: Path, extra: dict[str, object], args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m deepinfer_backend serve`` (reference engine, 'null' model, one rank) with
    ``extra`` config keys and ``args`` flags; returns the process and its URL once ready."""
    config = {"engine": "reference", "reference_model": "null", "ep": 1, "port": 0, "l1_cache": False,
              "reference_num_blocks": 256, **extra}
    (tmp / "config.json").write_text(json.dumps(config))
    with open(tmp / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deepinfer_backend", "serve", "--config",
                                 str(tmp / "config.json"), *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT,
                                env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = (tmp / "serve.log").read_text(errors="replace")
        url = re.search(r"listening on (http://\S+)", text)
        if url and "ready:" in text:
            return proc, url.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError("server did not start:\n" + (tmp / "serve.log").read_text(errors="replace")[-3000:])


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def probe(url: str, stop: asyncio.Event, interval_s: float = 0.02) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            await client.get("/healthz")
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(interval_s)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(name: str, latencies: list[float]) -> str:
    ms = [v * 1e3 for v in latencies]
    return (f"{name}: {len(ms)} probes, p50 {statistics.median(ms):.1f} ms, p99 {pct(ms, 0.99):.1f} ms, "
            f"max {max(ms):.1f} ms")


async def run(args: argparse.Namespace, url: str, pid: int) -> None:
    stop = asyncio.Event()
    idle_task = asyncio.create_task(probe(url, stop))
    await asyncio.sleep(args.idle_s)
    stop.set()
    idle = await idle_task
    print(describe("/healthz idle", idle))
    print(f"server RSS before: {rss_kib(pid)}")

    bodies = [body_bytes(1000 + i, int(args.body_mb * 1e6), i % 2 == 0, args.text)
              for i in range(args.clients * args.bodies)]
    refusals: list[tuple[str, int, float, str]] = []

    async def client(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for j in range(args.bodies):
                index = k * args.bodies + j
                path = "/v1/messages/count_tokens" if index % 2 == 0 else "/v1/messages"
                t0 = time.perf_counter()
                resp = await http.post(path, content=bodies[index],
                                       headers={"content-type": "application/json"})
                elapsed = time.perf_counter() - t0
                message = resp.json().get("error", {}).get("message",
                                                           "") if resp.status_code != 200 else resp.text
                refusals.append((path, resp.status_code, elapsed, message[:90]))

    stop = asyncio.Event()
    load_task = asyncio.create_task(probe(url, stop))
    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(args.clients)))
    wall = time.perf_counter() - t0
    stop.set()
    loaded = await load_task
    print(describe(f"/healthz under load ({args.clients} clients x {args.bodies} {args.text} bodies of "
                   f"{len(bodies[0]) / 1e6:.1f} MB, {wall:.1f} s)", loaded))
    for path, status, elapsed, message in refusals:
        print(f"  {path}: {status} in {elapsed:.2f} s: {message}")
    times = [r[2] for r in refusals]
    print(f"refusal time: median {statistics.median(times):.2f} s, max {max(times):.2f} s")
    print(f"server RSS after: {rss_kib(pid)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--body-mb", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--bodies", type=int, default=3, help="bodies per client")
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--text", choices=["code", "dense"], default="code",
                        help="code: lines of code (refused by the lower bound on the token count); "
                        "dense: minified JSON (tokenized up to max_model_len, then refused)")
    parser.add_argument("--max-model-len", type=int, default=1_064_960)
    add_quick(parser, argv, body_mb=1.0, clients=1, bodies=2, idle_s=0.5, max_model_len=65_536)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loop-stall-") as tmp:
        proc, url = start_server(Path(tmp), {"max_model_len": args.max_model_len})
        try:
            print(f"server {url} (pid {proc.pid}), max_model_len {args.max_model_len}, cpus "
                  f"{os.cpu_count()}, "
                  f"load {os.getloadavg()[0]:.1f}")
            asyncio.run(run(args, url, proc.pid))
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
