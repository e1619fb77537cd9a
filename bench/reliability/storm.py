"""Disconnect storm: many streams, each cut by its client at a random point.

Clients are raw asyncio sockets (HTTP/1.1 written by hand), so a cut can land anywhere: in the
request headers, in the request body, after the request but before any response, or after a
random number of response bytes; half the cuts are a plain close (FIN), half an abortive close
(RST, ``SO_LINGER`` 0). A few streams are read to their end as a control.

Server side, ``EngineSpy`` wraps the rank client (``submit``, ``abort`` and the per-step output
dispatch) to learn, per engine request, whether it was aborted and how it finished. ``run_storm``
then waits for quiescence and checks every balance (``runtime_thread.settle``).

    python -m bench.reliability.storm --streams 1000 --concurrency 64
    python -m bench.reliability.storm --quick     # 40 streams, 8 at once, in-process ranks
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.support.bodies import chat_body, filler_text, path_of
from bench.support.quick import add_quick
from bench.support.runtime_thread import RuntimeThread

CUT_KINDS = ("in_headers", "in_body", "after_request", "in_response", "in_response", "in_response",
             "in_response", "read_to_end")


class EngineSpy:
    """Records what reached the engines: submitted ids, abort calls, terminal finish reasons.

    Installed on the rank client instance (``submit``/``abort`` and the dispatch of step outputs
    are wrapped); runs on the runtime's loop like the client itself."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.submitted: set[str] = set()
        self.abort_calls: set[str] = set()
        self.finish: dict[str, str] = {}
        self._orig = (group.submit, group.abort)
        group.submit = self._submit
        group.abort = self._abort
        self._stream_cls_push: Any = None
        self._wrap_outputs()

    def _submit(self, rank: int, request: Any) -> Any:
        stream = self._orig[0](rank, request)
        self.submitted.add(request.request_id)
        return stream

    def _abort(self, rank: int, request_id: str) -> None:
        self.abort_calls.add(request_id)
        self._orig[1](rank, request_id)

    def _wrap_outputs(self) -> None:
        group = self.group
        if hasattr(group, "_dispatch") and hasattr(group, "engines"):  # LocalRankGroup
            orig = group._dispatch

            def dispatch(rank: int, outputs: list[Any]) -> None:
                for out in outputs:
                    if out.finished:
                        self.finish[out.request_id] = out.finish_reason.value
                orig(rank, outputs)

            group._dispatch = dispatch
        else:  # RankGroup: terminal outputs are decoded in messages.dispatch(r, header, frames)
            orig = group.messages.dispatch

            def dispatch(r: Any, header: dict[str, Any], frames: list[bytes]) -> None:
                before = {h: req.request_id for h, req in r.requests.items()}
                orig(r, header, frames)
                import numpy as np

                handles = np.frombuffer(frames[1], dtype="<i4").tolist()
                for entry in header["fin"]:
                    rid = before.get(handles[entry[0]])
                    if rid is not None:
                        self.finish[rid] = entry[1]

            group.messages.dispatch = dispatch

    def summary(self) -> dict[str, int]:
        reasons = Counter(self.finish.get(rid, "none") for rid in self.submitted)
        return {"submitted": len(self.submitted), "abort_calls": len(self.abort_calls & self.submitted),
                **{f"finish_{k}": v for k, v in sorted(reasons.items())}}

    def problems(self) -> list[str]:
        """Engine requests that were not settled correctly."""
        out = []
        for rid in sorted(self.submitted):
            reason = self.finish.get(rid)
            if reason is None:
                out.append(f"{rid}: no terminal output from the engine")
            elif reason == "abort" and rid not in self.abort_calls:
                out.append(f"{rid}: aborted without an abort call")
            elif reason not in ("abort", "stop", "length"):
                out.append(f"{rid}: finished with {reason}")
        return out


@dataclass(slots=True)
class StormReport:
    num_streams: int
    cuts: dict[str, int] = field(default_factory=dict)
    client_saw: dict[str, int] = field(default_factory=dict)
    engine: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    sizes_before: dict[str, Any] = field(default_factory=dict)
    sizes_after: dict[str, Any] = field(default_factory=dict)
    disconnects_metric: float = 0.0
    duration_s: float = 0.0
    balance_error: str | None = None

    def lines(self) -> list[str]:
        a = self.sizes_after
        return [
            f"disconnect storm: {self.num_streams} streams in {self.duration_s:.1f} s; cuts {self.cuts}",
            f"  client saw: {self.client_saw}",
            f"  engine: {self.engine}; server disconnects counted: {self.disconnects_metric:.0f}",
            (f"  after: free blocks {a.get('engine_free_blocks')} of {a.get('num_blocks')} (block 0 "
             "scratch), "
             f"cache-held {a.get('engine_cached_blocks')} == L0 {a.get('l0_blocks')}, "
             f"L1 entries {a.get('l1_entries')} used slots {a.get('l1_used_slots')}/{a.get('l1_slots')}, "
             f"open admissions {a.get('open_admissions')}, running {a.get('running')} waiting "
             f"{a.get('waiting')}"),
            (f"  balance: {'OK' if self.balance_error is None else self.balance_error}; "
             f"unsettled engine requests: {len(self.problems)}"),
        ]


def _request_bytes(host: str, port: int, path: str, body: bytes,
                   headers: dict[str, str]) -> tuple[bytes, bytes]:
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode(), body


async def cut_stream(host: str, port: int, api: str, body: dict[str, Any], cut: str, rng: random.Random,
                     headers: dict[str, str], read_timeout_s: float = 60.0) -> str:
    """One client; returns what it saw before it cut (or the end it reached)."""
    head, payload = _request_bytes(host, port, path_of(api), orjson.dumps(body), headers)
    reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    if rng.random() < 0.5 and sock is not None:  # abortive close: RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    seen = "nothing"
    try:
        if cut == "in_headers":
            writer.write(head[: rng.randrange(1, len(head))])
            await writer.drain()
            return "cut_in_headers"
        if cut == "in_body":
            writer.write(head + payload[: rng.randrange(0, max(1, len(payload)))])
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.05)
            return "cut_in_body"
        writer.write(head + payload)
        await writer.drain()
        if cut == "after_request":
            await asyncio.sleep(rng.random() * 0.2)
            return "cut_after_request"
        limit = rng.randrange(1, 6000) if cut == "in_response" else 1 << 30
        got = 0
        tail = b""
        while got < limit:
            chunk = await asyncio.wait_for(reader.read(min(4096, limit - got)), read_timeout_s)
            if not chunk:
                seen = "complete" if seen == "complete" else "eof_without_end_frame"
                break
            got += len(chunk)
            tail = (tail + chunk)[-200:]
            if b"message_stop" in tail or b"[DONE]" in tail:
                seen = "complete"
        if seen == "nothing":
            seen = f"cut_after_{'status' if got < 200 else 'stream_bytes'}"
        return seen
    except asyncio.TimeoutError:
        return "hung"
    except (ConnectionError, OSError):
        return "connection_error"
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def run_storm(rt: RuntimeThread, *, num_streams: int = 1000, concurrency: int = 64, seed: int = 0,
                    max_tokens_range: tuple[int, int] = (8, 160), prompt_words: tuple[int, int] = (20, 200),
                    num_sessions: int = 40) -> StormReport:
    runtime = rt.runtime
    rng = random.Random(seed)
    report = StormReport(num_streams)
    host = "127.0.0.1"
    port = runtime.port

    async def install() -> EngineSpy:
        return EngineSpy(runtime.group)

    spy = await rt.acall(install)
    report.sizes_before = await rt.acall(lambda: _sizes(runtime))
    sem = asyncio.Semaphore(concurrency)
    cuts: Counter[str] = Counter()
    saw: Counter[str] = Counter()

    async def one(i: int) -> None:
        api = "anthropic" if rng.random() < 0.5 else "openai"
        session = rng.randrange(num_sessions)
        # sessions repeat their head, so later turns hit L0 (and the cut turn's prefix is pinned)
        text = f"session {session} " + filler_text(session, rng.randint(*prompt_words))
        body = chat_body(api, text, max_tokens=rng.randint(*max_tokens_range), stream=True)
        cut = rng.choice(CUT_KINDS)
        headers = {"x-claude-code-session-id": f"storm-{seed}-{session}"}
        async with sem:
            cuts[cut] += 1
            saw[await cut_stream(host, port, api, body, cut, random.Random(rng.random()), headers)] += 1

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(num_streams)))
    report.duration_s = time.monotonic() - t0
    report.cuts, report.client_saw = dict(cuts), dict(saw)
    try:
        report.sizes_after = await rt.acall(lambda: _settle(runtime))
    except AssertionError as exc:
        report.balance_error = str(exc) or "AssertionError"
        report.sizes_after = await rt.acall(lambda: _sizes(runtime))
    report.engine = spy.summary()
    report.problems = spy.problems()
    report.disconnects_metric = _metric(runtime, "disconnects")
    return report


def _metric(runtime: Any, name: str) -> float:
    counter = getattr(runtime.metrics, name, None)
    try:
        return float(counter._value.get())  # prometheus_client Counter without labels
    except AttributeError:
        return float("nan")


async def _sizes(runtime: Any) -> dict[str, Any]:
    from bench.support.runtime_thread import cache_sizes

    return cache_sizes(runtime)


async def _settle(runtime: Any) -> dict[str, Any]:
    from bench.support.runtime_thread import settle

    return await settle(runtime, 120.0)


def storm_config(*, rank_mode: str = "local", num_ranks: int = 2, **overrides: Any) -> dict[str, Any]:
    """Null model, small pool (so L0 evicts and L1 write-through runs), a small L1."""
    raw: dict[str, Any] = {
        "engine": "reference", "reference_model": "null", "ep": num_ranks, "block_size": 16,
        "reference_num_blocks": 768, "max_model_len": 4096, "max_num_seqs": 64,
        "l1_cache": True, "l1_host_gb": 0.0002 if rank_mode == "local" else 0.001, "port": 0,
        "request_timeout_secs": 120,
    }
    raw.update(overrides)
    return raw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reliability.storm", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rank-mode", choices=["local", "process"], default="local")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_quick(p, argv, streams=40, concurrency=8)
    args = p.parse_args(argv)
    with RuntimeThread(storm_config(rank_mode=args.rank_mode, num_ranks=args.ranks),
                       rank_mode=args.rank_mode) as rt:
        report = asyncio.run(run_storm(rt, num_streams=args.streams, concurrency=args.concurrency,
                                       seed=args.seed))
    print("\n".join(report.lines()))
    for line in report.problems[:20]:
        print("  problem:", line)
    return 0 if report.balance_error is None and not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
