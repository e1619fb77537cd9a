"""Soak: agent-like load for a long time on the reference engine; does anything grow?

    python -m bench.soak --minutes 30                 # 4 rank processes, null model, 24 agents
    python -m bench.soak --minutes 5 --model tiny --agents 8 --out soak.json
    python -m bench.soak --quick                      # 9 s, 1 rank, 2 agents; no trend is judged

The backend runs in this process (``Runtime``: HTTP server, cache, ``RankGroup`` of rank
processes). Agents behave like Claude Code sessions: a conversation that grows turn by turn (the
assistant's blocks are sent back, thinking signatures included; tool calls get tool results;
otherwise a follow-up message), ``X-Claude-Code-Session-Id``, pauses between turns, mostly
streamed ``/v1/messages`` with some ``/v1/chat/completions``, non-streamed turns, ``count_tokens``
calls, and a few streams the client abandons halfway. A session ends after a random number of
turns or when its context nears the window, and a new one starts (session churn).

Every ``--sample-s`` seconds it samples: RSS and open file descriptors of the backend and of
every rank process (psutil), threads, per-rank free / cache-held blocks, L0 and L1 sizes,
sessions, ledger and tokenizer-cache bytes, and the request counters. At the end it prints the
samples as a table and, per series, the least-squares slope over the samples after the warm-up
(first 25 %) and a verdict: flat when the fitted change over the measured span is within the
tolerance (``--tolerance``, relative to the series' mean, with an absolute floor per unit).
Not part of the test run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from bench.support.bodies import filler_text
from bench.support.quick import add_quick
from bench.support.runtime_thread import RuntimeThread
from bench.support.sse import SseParser, is_done_event, is_error_event


def soak_config(*, num_ranks: int, model: str, **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "engine": "reference", "reference_model": model, "ep": num_ranks, "block_size": 16,
        "reference_num_blocks": 2048, "max_model_len": 16384, "max_num_seqs": 64,
        "l1_cache": True, "l1_host_gb": 0.002, "port": 0, "request_timeout_secs": 300,
        "load_timeout_seconds": 900,
    }
    raw.update(overrides)
    return raw


@dataclass(slots=True)
class Counters:
    turns_ok: int = 0
    turns_error: int = 0
    abandoned: int = 0
    count_tokens: int = 0
    sessions: int = 0
    http_errors: dict[str, int] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)  # first words of each error message

    def error(self, what: str) -> None:
        self.turns_error += 1
        key = what[:90]
        self.error_kinds[key] = self.error_kinds.get(key, 0) + 1


TOOL = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}


class Agent:
    """One simulated coding-agent session after another (see the module docstring)."""

    def __init__(self, index: int, url: str, client: httpx.AsyncClient, counters: Counters,
                 rng: random.Random,
                 max_context_chars: int) -> None:
        self.index, self.url, self.client, self.c, self.rng = index, url, client, counters, rng
        self.max_context_chars = max_context_chars

    async def run(self, stop_at_s: float) -> None:
        generation = 0
        while time.monotonic() < stop_at_s:
            generation += 1
            errors_before = self.c.turns_error
            try:
                await self._session(f"soak-{self.index}-{generation}", stop_at_s)
            except httpx.HTTPError as exc:  # the agent survives a broken connection, as a user would
                self.c.error(f"{type(exc).__name__}: {exc}")
            if self.c.turns_error > errors_before:
                await asyncio.sleep(self.rng.uniform(1.0, 4.0))  # back off, as Claude Code does

    async def _session(self, sid: str, stop_at_s: float) -> None:
        self.c.sessions += 1
        rng = self.rng
        system = "You are a coding agent. " + filler_text(rng.randrange(4), 300)  # shared by agents
        messages: list[dict[str, Any]] = [{"role": "user",
                                           "content": f"task {sid}: "
                                           + filler_text(rng.randrange(10**6), 120)}]
        for _ in range(rng.randint(4, 24)):
            if time.monotonic() >= stop_at_s:
                return
            body = {"model": "default", "max_tokens": rng.randint(16, 160), "system": system,
                    "tools": [TOOL], "messages": messages, "stream": rng.random() < 0.85}
            headers = {"x-claude-code-session-id": sid, "anthropic-version": "2023-06-01"}
            if rng.random() < 0.1:
                await self._count_tokens(body, headers)
            if rng.random() < 0.15:
                ok = await self._openai_turn(messages, system, headers)
                reply_blocks: list[dict[str, Any]] | None = [{"type": "text",
                                                              "text": "(openai turn)"}] if ok else None
            else:
                reply_blocks = await self._anthropic_turn(body, headers)
            if reply_blocks is None:
                return  # error or abandoned: the agent starts over, like a user after a failure
            messages.append({"role": "assistant", "content": reply_blocks})
            tool_uses = [b for b in reply_blocks if b.get("type") == "tool_use"]
            if tool_uses:
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b["id"],
                     "content": filler_text(rng.randrange(10**6), rng.randint(20, 200))}
                    for b in tool_uses]})
            else:
                messages.append({"role": "user",
                                 "content": "next: "
                                 + filler_text(rng.randrange(10**6), rng.randint(10, 120))})
            if len(json.dumps(messages)) > self.max_context_chars:
                return
            await asyncio.sleep(rng.uniform(0.2, 2.0))  # the tool runs, the user reads

    async def _count_tokens(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        payload = {k: body[k] for k in ("model", "system", "tools", "messages")}
        resp = await self.client.post(self.url + "/v1/messages/count_tokens", json=payload, headers=headers)
        self._count(resp.status_code)
        if resp.status_code == 200:
            self.c.count_tokens += 1

    def _count(self, status: int) -> None:
        if status != 200:
            self.c.http_errors[str(status)] = self.c.http_errors.get(str(status), 0) + 1

    async def _anthropic_turn(self, body: dict[str, Any],
                              headers: dict[str, str]) -> list[dict[str, Any]] | None:
        if not body["stream"]:
            resp = await self.client.post(self.url + "/v1/messages", json=body, headers=headers)
            self._count(resp.status_code)
            if resp.status_code != 200:
                self.c.error(f"{resp.status_code} {resp.text}")
                return None
            self.c.turns_ok += 1
            return _sendable(resp.json()["content"])
        abandon_after = self.rng.randint(1, 40) if self.rng.random() < 0.05 else None
        parser = SseParser()
        blocks: dict[int, dict[str, Any]] = {}
        num_events = 0
        async with self.client.stream("POST", self.url + "/v1/messages", json=body, headers=headers) as resp:
            self._count(resp.status_code)
            if resp.status_code != 200:
                self.c.error(f"{resp.status_code} {(await resp.aread()).decode(errors='replace')}")
                return None
            async for chunk in resp.aiter_raw():
                for ev in parser.feed(chunk):
                    num_events += 1
                    if abandon_after is not None and num_events >= abandon_after:
                        self.c.abandoned += 1
                        return None  # leaving the block closes the connection mid-stream
                    if is_error_event("anthropic", ev):
                        self.c.error(f"stream error: {ev.data['error'].get('message')}")
                        return None
                    _apply_event(blocks, ev)
                    if is_done_event("anthropic", ev):
                        self.c.turns_ok += 1
                        return _sendable([blocks[i] for i in sorted(blocks)])
        self.c.error("anthropic stream ended without message_stop")
        return None

    async def _openai_turn(self, messages: list[dict[str, Any]], system: str,
                           headers: dict[str, str]) -> bool:
        text_only = [{"role": "system", "content": system}] + [
            {"role": m["role"],
             "content": m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])[:2000]}
            for m in messages]
        body = {"model": "default", "max_tokens": self.rng.randint(16, 120), "messages": text_only,
                "stream": True}
        async with self.client.stream("POST", self.url + "/v1/chat/completions", json=body,
                                      headers=headers) as resp:
            self._count(resp.status_code)
            if resp.status_code != 200:
                self.c.error(f"{resp.status_code} {(await resp.aread()).decode(errors='replace')}")
                return False
            parser = SseParser()
            async for chunk in resp.aiter_raw():
                for ev in parser.feed(chunk):
                    if is_error_event("openai", ev):
                        self.c.error(f"openai stream error: {ev.data['error'].get('message')}")
                        return False
                    if is_done_event("openai", ev):
                        self.c.turns_ok += 1
                        return True
        self.c.error("openai stream ended without [DONE]")
        return False


def _apply_event(blocks: dict[int, dict[str, Any]], ev: Any) -> None:
    data = ev.data if isinstance(ev.data, dict) else {}
    if ev.event == "content_block_start":
        blocks[data["index"]] = dict(data["content_block"])
        if blocks[data["index"]].get("type") == "tool_use":
            blocks[data["index"]]["_json"] = ""
    elif ev.event == "content_block_delta":
        block, delta = blocks.get(data["index"]), data["delta"]
        if block is None:
            return
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta["text"]
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "input_json_delta":
            block["_json"] += delta["partial_json"]


def _sendable(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The assistant's blocks as Claude Code sends them back next turn."""
    out = []
    for b in blocks:
        b = dict(b)
        if b.get("type") == "tool_use":
            raw = b.pop("_json", "") or "{}"
            try:
                b["input"] = json.loads(raw)
            except ValueError:
                b["input"] = {}
        if b.get("type") == "text" and not b.get("text"):
            continue
        if b.get("type") == "thinking" and not b.get("signature"):
            b["signature"] = ""
        out.append(b)
    return out or [{"type": "text", "text": "(empty)"}]


# ------------------------------------------------------------------ sampling

def _proc_sample(proc: psutil.Process) -> tuple[float, int, int]:
    with proc.oneshot():
        return proc.memory_info().rss / 2**20, proc.num_fds(), proc.num_threads()


async def _sample(rt: RuntimeThread, counters: Counters, t0: float) -> dict[str, Any]:
    runtime = rt.runtime
    backend_rss, backend_fds, backend_threads = _proc_sample(psutil.Process(os.getpid()))

    async def inner() -> dict[str, Any]:
        group, cache, proto = runtime.group, runtime.cache, runtime.protocol
        stats = [group.stats(r) for r in range(group.num_ranks)]
        return {
            "pids": group.pids(), "epoch": group.epoch,
            "free_blocks": sum(s.num_free_blocks for s in stats),
            "cached_blocks": sum(s.num_cached_blocks for s in stats),
            "running": sum(s.num_running for s in stats), "waiting": sum(s.num_waiting for s in stats),
            "l0_blocks": sum(len(cache.l0[r]) for r in range(group.num_ranks)),
            "l1_used_slots": cache.l1.alloc.num_used_slots, "l1_entries": len(cache.l1.entries),
            "l1_slots": cache.l1.num_slots, "num_blocks": group.num_blocks * group.num_ranks,
            "cache_sessions": len(cache.sessions), "open_admissions": cache.num_open_turns,
            "cache_tasks": cache.num_background_tasks,
            "ledger_mib": proto.ledger.stats.num_bytes / 2**20,
            "piece_cache_mib": proto.tokenizer.cache.stats.num_bytes / 2**20,
        }

    state = await rt.acall(inner)
    rank_rss, rank_fds = [], []
    for pid in state.pop("pids"):
        try:
            rss, fds, _ = _proc_sample(psutil.Process(pid))
        except psutil.Error:
            continue
        rank_rss.append(rss)
        rank_fds.append(fds)
    return {
        "t_min": (time.monotonic() - t0) / 60,
        "backend_rss_mib": backend_rss, "backend_fds": backend_fds, "backend_threads": backend_threads,
        "rank_rss_mib_max": max(rank_rss, default=0.0), "rank_rss_mib_sum": sum(rank_rss),
        "rank_fds_max": max(rank_fds, default=0),
        **state,
        "turns_ok": counters.turns_ok, "turns_error": counters.turns_error, "abandoned": counters.abandoned,
        "sessions": counters.sessions,
    }


# Series judged for flatness: (key, absolute floor of allowed change over the run).
JUDGED = (("backend_rss_mib", 24.0), ("backend_rss_unaccounted_mib", 24.0), ("rank_rss_mib_max", 16.0),
          ("rank_rss_mib_sum", 48.0),
          ("backend_fds", 8.0), ("rank_fds_max", 2.0), ("backend_threads", 2.0),
          ("open_admissions", 2.0), ("cache_tasks", 4.0))


def _derive(sample: dict[str, Any]) -> dict[str, Any]:
    """RSS not explained by the two byte-bounded caches (ledger, tokenizer pieces): a leak shows here."""
    sample.setdefault("backend_rss_unaccounted_mib",
                      sample["backend_rss_mib"] - sample["ledger_mib"] - sample["piece_cache_mib"])
    return sample


def slope_per_min(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def verdicts(samples: list[dict[str, Any]], tolerance: float) -> list[tuple[str, float, float, float, bool]]:
    """(series, slope per minute, fitted change over the measured span, allowed change, flat)."""
    samples = [_derive(s) for s in samples]
    tail = samples[len(samples) // 4 :] if len(samples) >= 4 else samples
    xs = [s["t_min"] for s in tail]
    span = (xs[-1] - xs[0]) if len(xs) > 1 else 0.0
    out = []
    for key, floor in JUDGED:
        ys = [float(s[key]) for s in tail]
        slope = slope_per_min(xs, ys)
        change = slope * span
        mean = sum(ys) / len(ys) if ys else 0.0
        allowed = max(floor, tolerance * abs(mean))
        out.append((key, slope, change, allowed, change <= allowed))  # shrinking is no leak
    return out


COLUMNS = ("t_min", "backend_rss_mib", "rank_rss_mib_max", "backend_fds", "rank_fds_max", "backend_threads",
           "free_blocks", "cached_blocks", "l0_blocks", "l1_used_slots", "running", "open_admissions",
           "cache_sessions", "ledger_mib", "piece_cache_mib", "turns_ok", "turns_error", "abandoned")


def format_table(samples: list[dict[str, Any]]) -> str:
    short = {"t_min": "min", "backend_rss_mib": "be_rss", "rank_rss_mib_max": "rk_rss",
             "backend_fds": "be_fd",
             "rank_fds_max": "rk_fd", "backend_threads": "thr", "free_blocks": "free",
             "cached_blocks": "cached",
             "l0_blocks": "L0", "l1_used_slots": "L1slots", "running": "run", "open_admissions": "adm",
             "cache_sessions": "sess", "ledger_mib": "ledger", "piece_cache_mib": "pieces", "turns_ok": "ok",
             "turns_error": "err", "abandoned": "cut"}
    rows = [[short[c] for c in COLUMNS]]
    for s in samples:
        rows.append([f"{s[c]:.1f}" if isinstance(s[c], float) else str(s[c]) for c in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


async def soak(rt: RuntimeThread, *, minutes: float, num_agents: int, sample_s: float,
               seed: int) -> list[dict[str, Any]]:
    counters = Counters()
    rng = random.Random(seed)
    t0 = time.monotonic()
    stop_at = t0 + minutes * 60
    samples: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=num_agents * 2 + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, read=300.0)) as client:
        agents = [Agent(i, rt.url, client, counters, random.Random(rng.random()), 40_000)
                  for i in range(num_agents)]

        async def sampler() -> None:
            while True:
                samples.append(await _sample(rt, counters, t0))
                print(format_table(samples[-1:]).splitlines()[-1], flush=True)
                if time.monotonic() >= stop_at:
                    return
                await asyncio.sleep(min(sample_s, max(0.0, stop_at - time.monotonic())))

        print(format_table([]), flush=True)
        tasks = [asyncio.create_task(a.run(stop_at)) for a in agents]
        await sampler()
        await asyncio.gather(*tasks, return_exceptions=True)
    # after the load: everything idle and balanced
    from bench.support.runtime_thread import settle

    try:
        final = await rt.acall(lambda: settle(rt.runtime, 120.0))
        print(f"settled after the load: free blocks {final['engine_free_blocks']}, cache-held "
              f"{final['engine_cached_blocks']} == L0 {final['l0_blocks']}, L1 used slots "
              f"{final['l1_used_slots']}, "
              f"open admissions {final['open_admissions']}")
    except AssertionError as exc:
        print(f"BALANCE FAILED after the load: {exc}")
        samples[-1]["balance_failed"] = str(exc)
    print(f"turns ok {counters.turns_ok}, errors {counters.turns_error}, abandoned {counters.abandoned}, "
          f"count_tokens {counters.count_tokens}, sessions {counters.sessions}, HTTP errors "
          f"{counters.http_errors}")
    for what, n in sorted(counters.error_kinds.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {n:6d} x {what}")
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--agents", type=int, default=24)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--model", default="null", choices=["null", "tiny", "small"])
    p.add_argument("--sample-s", type=float, default=20.0)
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed fitted change, share of the mean")
    p.add_argument("--l1-gb", type=float, default=0.002,
                   help="L1 host pool per rank, GiB (small: it fills early)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the samples and verdicts as JSON")
    p.add_argument("--analyze", default=None, help="only print the table and verdicts of a saved --out file")
    # seconds of load show no trend: the quick run checks the plumbing, with a tolerance nothing exceeds
    add_quick(p, argv, minutes=0.15, agents=2, ranks=1, sample_s=2.0, tolerance=1e6)
    args = p.parse_args(argv)
    if args.analyze:
        with open(args.analyze, encoding="utf-8") as f:
            samples = json.load(f)["samples"]
        return _report(samples, args.tolerance)
    t0 = time.monotonic()
    with RuntimeThread(soak_config(num_ranks=args.ranks, model=args.model, l1_host_gb=args.l1_gb)) as rt:
        print(f"runtime up in {time.monotonic() - t0:.1f} s: {rt.runtime.describe()}", flush=True)
        samples = asyncio.run(soak(rt, minutes=args.minutes, num_agents=args.agents, sample_s=args.sample_s,
                                   seed=args.seed))
    code = _report(samples, args.tolerance)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "samples": samples,
                       "verdicts": [dict(zip(("series", "slope_per_min", "change", "allowed", "flat"), r))
                                    for r in verdicts(samples, args.tolerance)]}, f, indent=1)
    return code


def _report(samples: list[dict[str, Any]], tolerance: float) -> int:
    print("\n" + format_table(samples))
    results = verdicts(samples, tolerance)
    print(f"\n{'series':28s} slope/min   change over run   allowed   verdict")
    for key, slope, change, allowed, flat in results:
        print(f"{key:28s} {slope:9.3f} {change:17.2f} {allowed:9.2f}   {'flat' if flat else 'GROWS'}")
    # pools fill up by design; what matters is that they stay inside their bounds
    l1_max = max(s["l1_used_slots"] for s in samples)
    blocks_max = max(s["cached_blocks"] + s["free_blocks"] for s in samples)
    bounded = l1_max <= samples[-1]["l1_slots"] and blocks_max <= samples[-1]["num_blocks"]
    print(f"L1 used slots peak {l1_max} of {samples[-1]['l1_slots']}; free + cache-held blocks peak "
          f"{blocks_max} "
          f"of {samples[-1]['num_blocks']}: {'bounded' if bounded else 'OVER THE POOL'}")
    all_flat = all(r[4] for r in results) and bounded and "balance_failed" not in samples[-1]
    print(f"\nverdict: {'everything flat' if all_flat else 'something grows (see above)'}")
    return 0 if all_flat else 1


if __name__ == "__main__":
    sys.exit(main())
