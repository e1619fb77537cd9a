"""Rank failure under load: kill (SIGKILL) or stall (SIGSTOP) one rank while streams are open.

    python -m bench.fault_injection --fault kill --fault stop      # 4 ranks, 64 streams, null model
    python -m bench.fault_injection --model tiny --streams 64 --ranks 4 --fault kill
    python -m bench.fault_injection --quick        # kill only, 2 ranks, 4 streams of 200 tokens

What one fault run does (``run_fault``), against a real ``Runtime`` (HTTP server, CacheManager,
``RankGroup`` of rank processes):

1. warm-up: a few finished turns, so the L0 index holds blocks of the epoch about to die;
2. ``num_streams`` streams, alternating ``/v1/messages`` and ``/v1/chat/completions``, each with its
   own session; waits until every one has streamed output;
3. the fault: ``os.kill(rank_pid, SIGKILL | SIGSTOP)``; from then on a prober sends a small new
   request and ``GET /healthz`` every ``probe_every_s`` until the group serves again;
4. every stream must end with its API's own error frame (``event: error`` / an OpenAI error chunk);
5. each failed stream is retried *without streaming* (what Claude Code does after a broken stream,
   see Claude Code's captured traffic, ``docs/claude-code.md``) until it succeeds, honouring no
   Retry-After longer than ``retry_poll_s`` so that the recovery time is measured, not waited;
6. the cache is checked: right after the restart (a restart listener registered after the
   cache's) the L0 index and L1 hold nothing, and once everything settled the engine's
   cache-held blocks equal the index (``CacheManager.check_balance``).

Figures: detection time (fault -> first/last stream error frame), the group's own detection
(``RankGroup.last_detection_s`` after it noticed), recovery time (fault -> /healthz 200, and
-> first successful retry), and the requests lost (in-flight streams that did not end with an
error frame, plus retries that never succeeded). Nothing here passes or fails on a stopwatch;
the tests assert on outcomes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench.support.bodies import chat_body, filler_text, path_of
from bench.support.quick import add_quick
from bench.support.runtime_thread import RuntimeThread, cache_sizes
from bench.support.sse import SseParser, error_body_problem, is_content_event, is_done_event, is_error_event


def fault_config(*, num_ranks: int = 4, model: str = "null", **overrides: Any) -> dict[str, Any]:
    """The workload config of a fault run: CPU reference engine, small blocks, an L1 pool."""
    raw: dict[str, Any] = {
        "engine": "reference", "reference_model": model, "ep": num_ranks, "block_size": 16,
        "reference_num_blocks": 4096, "max_model_len": 8192, "max_num_seqs": 128,
        "l1_cache": True, "l1_host_gb": 0.02, "port": 0, "request_timeout_secs": 600,
        "load_timeout_seconds": 600,
    }
    raw.update(overrides)
    return raw


@dataclass(slots=True)
class StreamOutcome:
    index: int
    api: str
    status: int = 0
    first_content_s: float | None = None  # monotonic
    end_s: float | None = None
    ended_with: str = "open"  # "error" | "done" | "eof" | "hung" | "http_<status>" | "exception"
    error_type: str | None = None
    num_content_events: int = 0


@dataclass(slots=True)
class Probe:
    t_s: float  # since the fault
    status: int
    retry_after: str | None
    should_retry: str | None
    shape_problem: str | None


@dataclass(slots=True)
class FaultReport:
    fault: str
    num_ranks: int
    num_streams: int
    victim_rank: int
    num_in_flight_at_fault: int = 0
    num_ended_with_error_frame: int = 0
    num_ended_otherwise: int = 0
    endings: dict[str, int] = field(default_factory=dict)
    first_error_after_fault_s: float | None = None
    last_stream_end_after_fault_s: float | None = None
    group_detection_s: float | None = None  # RankGroup: noticed -> every request failed
    healthz_ready_after_fault_s: float | None = None
    first_retry_ok_after_fault_s: float | None = None
    all_retries_ok_after_fault_s: float | None = None
    num_retried_ok: int = 0
    num_retry_attempts: int = 0
    num_lost: int = 0
    probes_503: int = 0
    probes_503_without_retry_after: int = 0
    probes_other: dict[str, int] = field(default_factory=dict)
    probe_shape_problems: list[str] = field(default_factory=list)
    healthz_states: list[str] = field(default_factory=list)
    epoch_before: int = 0
    epoch_after: int = 0
    last_failure: str | None = None
    sizes_before_fault: dict[str, Any] = field(default_factory=dict)
    sizes_at_restart: dict[str, Any] = field(default_factory=dict)
    sizes_after_settle: dict[str, Any] = field(default_factory=dict)
    serves_after_restart: bool = False

    def lines(self) -> list[str]:
        f = _fmt
        return [
            (f"fault {self.fault} on rank {self.victim_rank} of {self.num_ranks}, {self.num_streams} streams "
             f"({self.num_in_flight_at_fault} in flight at the fault)"),
            (f"  streams ended with their API's error frame: {self.num_ended_with_error_frame}; "
             f"otherwise: {self.num_ended_otherwise} {self.endings}"),
            (f"  detection: first error frame {f(self.first_error_after_fault_s)}, last stream ended "
             f"{f(self.last_stream_end_after_fault_s)} after the fault; group fail-out "
             f"{f(self.group_detection_s)}"),
            (f"  recovery: /healthz 200 after {f(self.healthz_ready_after_fault_s)}, first retry OK after "
             f"{f(self.first_retry_ok_after_fault_s)}, all {self.num_retried_ok} retries OK after "
             f"{f(self.all_retries_ok_after_fault_s)} ({self.num_retry_attempts} attempts)"),
            f"  requests lost: {self.num_lost}",
            (f"  new requests while restarting: {self.probes_503} x 503 "
             f"({self.probes_503_without_retry_after} without Retry-After), others {self.probes_other}"),
            f"  /healthz states seen: {sorted(set(self.healthz_states))}",
            f"  epoch {self.epoch_before} -> {self.epoch_after}; last failure: {self.last_failure}",
            (f"  L0 blocks before {self.sizes_before_fault.get('l0_blocks')} L1 entries "
             f"{self.sizes_before_fault.get('l1_entries')}; at restart L0 "
             f"{self.sizes_at_restart.get('l0_blocks')} "
             f"L1 entries {self.sizes_at_restart.get('l1_entries')} used slots "
             f"{self.sizes_at_restart.get('l1_used_slots')}"),
            (f"  after settle: L0 {self.sizes_after_settle.get('l0_blocks')} == engine cached "
             f"{self.sizes_after_settle.get('engine_cached_blocks')}, L1 used slots "
             f"{self.sizes_after_settle.get('l1_used_slots')}"),
        ]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


async def _stream(client: httpx.AsyncClient, url: str, api: str, body: dict[str, Any], out: StreamOutcome,
                  read_timeout_s: float) -> None:
    parser = SseParser()
    try:
        async with client.stream("POST", url + path_of(api), json=body,
                                 timeout=httpx.Timeout(30.0, read=read_timeout_s)) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                out.ended_with, out.end_s = f"http_{resp.status_code}", time.monotonic()
                return
            async for chunk in resp.aiter_raw():
                for ev in parser.feed(chunk):
                    if is_content_event(api, ev):
                        out.num_content_events += 1
                        if out.first_content_s is None:
                            out.first_content_s = time.monotonic()
                    elif is_error_event(api, ev):
                        out.ended_with, out.end_s = "error", time.monotonic()
                        out.error_type = ev.data["error"].get("type")
                    elif is_done_event(api, ev) and out.ended_with == "open":
                        out.ended_with, out.end_s = "done", time.monotonic()
        if out.ended_with == "open":
            out.ended_with, out.end_s = "eof", time.monotonic()
    except httpx.ReadTimeout:
        out.ended_with, out.end_s = "hung", time.monotonic()
    except httpx.HTTPError as exc:
        out.ended_with, out.end_s = f"exception:{type(exc).__name__}", time.monotonic()


async def _retry_until_ok(client: httpx.AsyncClient, url: str, api: str, body: dict[str, Any],
                          deadline_s: float, poll_s: float) -> tuple[float | None, int]:
    """Non-streaming retry loop; returns (monotonic time of success or None, attempts)."""
    attempts = 0
    while time.monotonic() < deadline_s:
        attempts += 1
        try:
            resp = await client.post(url + path_of(api), json={**body, "stream": False},
                                     timeout=httpx.Timeout(30.0, read=600.0))
        except httpx.HTTPError:
            await asyncio.sleep(poll_s)
            continue
        if resp.status_code == 200:
            return time.monotonic(), attempts
        retry_after = float(resp.headers.get("retry-after", poll_s))
        await asyncio.sleep(min(retry_after, poll_s))
    return None, attempts


async def _probe(client: httpx.AsyncClient, url: str, t_fault: float, report: FaultReport,
                 stop: asyncio.Event, every_s: float) -> None:
    """New requests and /healthz while the group restarts, until /healthz says ready."""
    i = 0
    while not stop.is_set():
        i += 1
        api = "anthropic" if i % 2 else "openai"
        body = chat_body(api, f"probe {i} " + filler_text(10_000 + i, 20), max_tokens=4, stream=False)
        try:
            resp = await client.post(url + path_of(api), json=body, timeout=30.0)
            if resp.status_code == 503:
                report.probes_503 += 1
                if not resp.headers.get("retry-after"):
                    report.probes_503_without_retry_after += 1
                problem = error_body_problem(api, 503, resp.content)
                anthropic_type = resp.json()["error"]["type"] if api == "anthropic" else None
                if problem is None and anthropic_type not in (None, "overloaded_error"):
                    problem = f"503 with Anthropic type {resp.json()['error']['type']}"
                if problem:
                    report.probe_shape_problems.append(problem)
            else:
                key = str(resp.status_code)
                report.probes_other[key] = report.probes_other.get(key, 0) + 1
            health = await client.get(url + "/healthz", timeout=30.0)
            state = health.json().get("status", "?")
            report.healthz_states.append(f"{health.status_code}:{state}")
            if health.status_code == 200 and report.healthz_ready_after_fault_s is None:
                report.healthz_ready_after_fault_s = time.monotonic() - t_fault
                return
        except httpx.HTTPError as exc:
            key = f"exception:{type(exc).__name__}"
            report.probes_other[key] = report.probes_other.get(key, 0) + 1
        await asyncio.sleep(every_s)


async def run_fault(rt: RuntimeThread, fault: str, *, num_streams: int = 64, victim_rank: int = 1,
                    max_tokens: int = 1500, prompt_words: int = 150, read_timeout_s: float = 120.0,
                    retry_deadline_s: float = 600.0, retry_poll_s: float = 1.0,
                    probe_every_s: float = 0.2, num_warmup: int = 8) -> FaultReport:
    """One fault against a started runtime (see the module docstring)."""
    if fault not in ("kill", "stop"):
        raise ValueError(f"fault must be 'kill' or 'stop', got {fault!r}")
    runtime = rt.runtime
    group = runtime.group
    report = FaultReport(fault, group.num_ranks, num_streams, victim_rank)
    url = rt.url
    limits = httpx.Limits(max_connections=num_streams * 2 + 16, max_keepalive_connections=num_streams * 2)
    tag = f"{fault}-{time.monotonic_ns()}"
    async with httpx.AsyncClient(limits=limits) as client:
        # 1. warm-up turns: the L0 index holds blocks of this epoch
        warm = [chat_body("anthropic" if i % 2 else "openai",
                          f"warm {tag} {i} " + filler_text(i, prompt_words),
                          max_tokens=8, stream=False) for i in range(num_warmup)]
        results = await asyncio.gather(*(client.post(url + path_of("anthropic" if i % 2 else "openai"),
                                                     json=b,
                                                     timeout=300.0) for i, b in enumerate(warm)))
        bad = [r.status_code for r in results if r.status_code != 200]
        if bad:
            raise RuntimeError(f"warm-up requests failed: {bad}")
        await rt.acall(runtime.cache.drain)
        report.sizes_before_fault = await rt.acall(_async(cache_sizes, runtime))
        report.epoch_before = group.epoch

        # a listener after the cache's: what the indexes hold right when the new epoch begins
        restart_seen = asyncio.get_running_loop().create_future()
        main_loop = asyncio.get_running_loop()

        def on_restart(epoch: int) -> None:
            sizes = cache_sizes(runtime)
            main_loop.call_soon_threadsafe(lambda: restart_seen.done() or restart_seen.set_result(sizes))

        await rt.acall(_async(group.add_restart_listener, on_restart))

        # 2. the streams
        outcomes = [StreamOutcome(i, "anthropic" if i % 2 else "openai") for i in range(num_streams)]
        bodies = [chat_body(o.api, f"stream {tag} {o.index} " + filler_text(1000 + o.index, prompt_words),
                            max_tokens=max_tokens, stream=True) for o in outcomes]
        tasks = [asyncio.create_task(_stream(client, url, o.api, bodies[o.index], o, read_timeout_s))
                 for o in outcomes]
        wait_until = time.monotonic() + 300
        while time.monotonic() < wait_until:
            if all(o.first_content_s is not None or o.ended_with != "open" for o in outcomes):
                break
            await asyncio.sleep(0.05)
        in_flight = [o for o in outcomes if o.ended_with == "open"]
        report.num_in_flight_at_fault = len(in_flight)

        # 3. the fault
        pid = group.pids()[victim_rank]
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t_fault = time.monotonic()
        stop_probe = asyncio.Event()
        prober = asyncio.create_task(_probe(client, url, t_fault, report, stop_probe, probe_every_s))

        # 4. every in-flight stream must end, with its error frame
        await asyncio.gather(*tasks)
        for o in in_flight:
            report.endings[o.ended_with] = report.endings.get(o.ended_with, 0) + 1
            if o.ended_with == "error":
                report.num_ended_with_error_frame += 1
            else:
                report.num_ended_otherwise += 1
        ends = [o.end_s - t_fault for o in in_flight if o.end_s is not None]
        errors = [o.end_s - t_fault for o in in_flight if o.ended_with == "error" and o.end_s is not None]
        report.first_error_after_fault_s = min(errors) if errors else None
        report.last_stream_end_after_fault_s = max(ends) if ends else None
        report.group_detection_s = group.last_detection_s

        # 5. Claude Code's non-streaming retry of every failed stream
        retry_deadline = time.monotonic() + retry_deadline_s
        retried = await asyncio.gather(*(
            _retry_until_ok(client, url, o.api, bodies[o.index], retry_deadline, retry_poll_s)
            for o in in_flight
        ))
        ok_times = [t - t_fault for t, _ in retried if t is not None]
        report.num_retried_ok = len(ok_times)
        report.num_retry_attempts = sum(n for _, n in retried)
        report.first_retry_ok_after_fault_s = min(ok_times) if ok_times else None
        report.all_retries_ok_after_fault_s = (max(ok_times)
                                               if len(ok_times) == len(in_flight) and ok_times else None)
        report.num_lost = report.num_ended_otherwise + (len(in_flight) - report.num_retried_ok)
        stop_probe.set()
        try:
            await asyncio.wait_for(prober, 60)
        except asyncio.TimeoutError:
            prober.cancel()

        # 6. the indexes
        try:
            report.sizes_at_restart = await asyncio.wait_for(restart_seen, 5)
        except asyncio.TimeoutError:
            report.sizes_at_restart = {}
        fresh = await client.post(url + "/v1/messages", json=chat_body(
            "anthropic", f"after {tag} " + filler_text(77, prompt_words), max_tokens=8, stream=False),
                                  timeout=300)
        report.serves_after_restart = fresh.status_code == 200
        report.sizes_after_settle = await rt.acall(lambda: _settle(runtime))
        report.epoch_after = group.epoch
        report.last_failure = group.last_failure
    return report


async def _settle(runtime: Any) -> dict[str, Any]:
    from bench.support.runtime_thread import settle

    return await settle(runtime, 120.0)


def _async(fn: Any, *args: Any) -> Any:
    async def run() -> Any:
        return fn(*args)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fault_injection", description=__doc__.split("\n")[0])
    p.add_argument("--fault", action="append", choices=["kill", "stop"],
                   help="repeatable; default: kill, stop")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--model", default="null", choices=["null", "tiny", "small"])
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--victim", type=int, default=1, help="rank to kill/stop")
    p.add_argument("--json", action="store_true", help="also print each report as JSON")
    add_quick(p, argv, ranks=2, streams=4, max_tokens=200)
    args = p.parse_args(argv)
    faults = args.fault or (["kill"] if args.quick else ["kill", "stop"])
    t0 = time.monotonic()
    with RuntimeThread(fault_config(num_ranks=args.ranks, model=args.model)) as rt:
        print(f"runtime up in {time.monotonic() - t0:.1f} s: {rt.runtime.describe()}", flush=True)
        for fault in faults:
            report = asyncio.run(run_fault(rt, fault, num_streams=args.streams, victim_rank=args.victim,
                                           max_tokens=args.max_tokens))
            print("\n".join(report.lines()), flush=True)
            if args.json:
                import orjson

                print(orjson.dumps(asdict(report)).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
