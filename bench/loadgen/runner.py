"""Runs concurrent simulated agents against a backend, step by step, with a progress line.

A step holds ``num_agents`` agents for ``duration_s``: they start spread over ``ramp_s``, each
sending a turn, waiting for the whole stream, pausing ``gap_s`` (3 s by default, the seed's pacing)
and sending the next. Statistics cover requests started after ``warmup_s``. When the step's time is
up, agents stop sending and in-flight requests get ``drain_s`` to finish (then are cancelled and
not counted). A cold-start run sends N fresh conversations of one size at once, one request each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from bench.loadgen.client import RequestRecord, stream_message
from bench.loadgen.distributions import (
    TurnSource,
    TurnSpec,
    WorkloadParams,
    initial_context_tokens,
    next_turn,
)
from bench.loadgen.session import SUBAGENT_TOOLS, AgentSession, build_tools
from bench.loadgen.subagents import SpawnSource, SubagentPlan, subagent_params
from bench.loadgen.textgen import TextSynth


@dataclass(slots=True)
class RunConfig:
    base_url: str
    model: str = "deepseek-v4.1-flash"
    api_key: str | None = None
    duration_s: float = 600.0
    warmup_s: float = 120.0
    ramp_s: float = 30.0
    drain_s: float = 120.0
    request_timeout_s: float = 1800.0
    seed: int = 0
    mid_conversation_system: bool = True
    error_backoff_s: float = 1.0
    # Subagent fan-outs (bench/loadgen/subagents.py): off, light (3% of sessions), heavy (~40% of requests).
    subagents: str = "light"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/messages?beta=true"


@dataclass(slots=True)
class LiveCounters:
    """What the progress line shows (updated by the agents, read by the display task)."""

    num_requests: int = 0
    num_errors: int = 0
    in_flight: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    compactions: int = 0
    recent_ttft_s: list[float] = field(default_factory=list)


class Progress:
    """A single refreshing status line on stderr (a plain line every 10 s when not a TTY)."""

    def __init__(self, label: str, counters: LiveCounters, t0: float, duration_s: float) -> None:
        self.label = label
        self.counters = counters
        self.t0 = t0
        self.duration_s = duration_s
        self.tty = sys.stderr.isatty()

    def line(self) -> str:
        c = self.counters
        elapsed = time.monotonic() - self.t0
        recent = c.recent_ttft_s[-200:]
        p50 = f"{np.quantile(recent, 0.5):.2f}s" if recent else "-"
        hit = f"{100 * c.cached_tokens / c.input_tokens:.1f}%" if c.input_tokens else "-"
        return (
            f"[{self.label}] {elapsed:5.0f}/{self.duration_s:.0f}s req={c.num_requests} "
            f"inflight={c.in_flight} err={c.num_errors} ttft50={p50} hit={hit} "
            f"out={c.output_tokens} compactions={c.compactions}"
        )

    async def run(self, stop: asyncio.Event) -> None:
        last_plain = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if self.tty:
                sys.stderr.write("\r" + self.line()[:160].ljust(160))
                sys.stderr.flush()
            elif now - last_plain >= 10:
                sys.stderr.write(self.line() + "\n")
                last_plain = now
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        sys.stderr.write(("\r" if self.tty else "") + self.line() + "\n")


class Agent:
    """One simulated coding agent: a sequence of conversations, each grown to the context target."""

    def __init__(
        self,
        agent_id: int,
        params: WorkloadParams,
        source: TurnSource,
        synth: TextSynth,
        tools: list,
        config: RunConfig,
        seed: int,
    ) -> None:
        self.agent_id = agent_id
        self.params = params
        self.source = source
        self.synth = synth
        self.tools = tools
        self.config = config
        self.rng = np.random.default_rng(seed)
        # Fan-outs come from a stream of their own: the parent's turns are the same with them on or off.
        self.spawns = SpawnSource(subagent_params(config.subagents, params.size_scale),
                                  np.random.default_rng([seed, 34]))
        self.session = self._new_session()
        self.spawning = self.spawns.conversation_spawns()
        self.cold = True
        self.turn: TurnSpec = next_turn(source, self.rng, agent_id)

    def _new_session(self) -> AgentSession:
        return AgentSession(
            self.params,
            self.synth,
            self.tools,
            self.rng,
            initial_context_tokens(self.params, self.rng),
            self.config.model,
            self.config.mid_conversation_system,
        )

    def headers(self) -> dict[str, str]:
        headers = self.session.headers()
        if self.config.api_key:
            headers["x-api-key"] = self.config.api_key
        return headers

    async def _send(self, client: httpx.AsyncClient, session: AgentSession, output_tokens: int,
                    records: list[RequestRecord], counters: LiveCounters, cold: bool) -> RequestRecord:
        record = RequestRecord(self.agent_id, session.session_id, time.monotonic(), cold=cold,
                               subagent_id=session.agent_id)
        record.context_tokens_sent = session.context_tokens
        headers = session.headers()
        if self.config.api_key:
            headers["x-api-key"] = self.config.api_key
        counters.in_flight += 1
        try:
            await stream_message(client, self.config.url, session.body_bytes(output_tokens), headers, record,
                                 self.config.request_timeout_s)
        finally:
            counters.in_flight -= 1
        records.append(record)
        counters.num_requests += 1
        if record.error is not None:
            counters.num_errors += 1
            await asyncio.sleep(self.config.error_backoff_s)
            return record
        counters.input_tokens += record.total_input_tokens
        counters.cached_tokens += record.cached_tokens
        counters.output_tokens += record.output_tokens
        if record.ttft_s is not None:
            counters.recent_ttft_s.append(record.ttft_s)
            if len(counters.recent_ttft_s) > 1000:
                del counters.recent_ttft_s[:500]
        session.observe_usage(record.total_input_tokens, record.output_tokens)
        return record

    async def _subagent(self, client: httpx.AsyncClient, plan: SubagentPlan, records: list[RequestRecord],
                        counters: LiveCounters, stop_at: float) -> int:
        """One subagent: a fresh conversation under the parent's session id with its own agent id,
        ``plan.steps`` requests (fewer if it would pass the context target); its report's size."""
        rng = self.spawns.rng
        sub = AgentSession(self.params, self.synth, self.tools[:SUBAGENT_TOOLS], rng, plan.first_tokens,
                           self.config.model, mid_conversation_system=False,
                           session_id=self.session.session_id, agent_id=plan.agent_id)
        output = next_turn(self.source, rng, self.agent_id).output_tokens
        step, report = 0, 0
        while step < plan.steps and time.monotonic() < stop_at:
            record = await self._send(client, sub, output, records, counters, cold=step == 0)
            if record.error is not None:
                continue  # the same request again
            step += 1
            report = record.output_tokens
            drawn = next_turn(self.source, rng, self.agent_id)
            turn = TurnSpec("tool", self.spawns.step_input_tokens(), drawn.output_tokens, 1, drawn.thinking,
                            drawn.gap_s)
            if step == plan.steps or not sub.fits(turn):
                break  # its answer ends the turn: the report goes to the parent
            sub.append_response(record.blocks, turn)
            output = turn.output_tokens
            await asyncio.sleep(turn.gap_s)
        return report

    async def run(
        self,
        client: httpx.AsyncClient,
        records: list[RequestRecord],
        counters: LiveCounters,
        stop_at: float,
        start_delay_s: float,
    ) -> None:
        await asyncio.sleep(start_delay_s)
        while time.monotonic() < stop_at:
            record = await self._send(client, self.session, self.turn.output_tokens, records, counters,
                                      self.cold)
            if record.error is not None:
                continue  # resend the same conversation (the client retries)
            self.cold = False
            turn = self.turn
            self.turn = next_turn(self.source, self.rng, self.agent_id)
            plans = self.spawns.spawn(turn.kind == "tool") if self.spawning else []
            if plans:  # the parent waits for its subagents; their reports join its tool result
                reports = await asyncio.gather(*(self._subagent(client, plan, records, counters, stop_at)
                                                 for plan in plans))
                turn = dataclasses.replace(turn, new_input_tokens=turn.new_input_tokens + sum(reports))
            self.session.append_response(record.blocks, turn)
            if not self.session.fits(self.turn):
                counters.compactions += 1
                self.session = self._new_session()
                self.spawning = self.spawns.conversation_spawns()
                self.cold = True
            await asyncio.sleep(turn.gap_s)


def make_client(num_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections + 8, max_keepalive_connections=num_connections + 8)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0, connect=30.0))


async def run_step(
    params: WorkloadParams,
    source: TurnSource,
    synth: TextSynth,
    config: RunConfig,
    num_agents: int,
    label: str,
) -> tuple[list[RequestRecord], float, float]:
    """Run one step; returns (records, measure start, measure end) in monotonic seconds."""
    tools = build_tools(params, synth)
    agents = [
        Agent(i, params, source, synth, tools, config, seed=config.seed * 1_000_003 + num_agents * 7919 + i)
        for i in range(num_agents)
    ]
    records: list[RequestRecord] = []
    counters = LiveCounters()
    t0 = time.monotonic()
    stop_at = t0 + config.duration_s
    stop = asyncio.Event()
    progress = Progress(label, counters, t0, config.duration_s)
    display = asyncio.create_task(progress.run(stop))
    async with make_client(num_agents) as client:
        tasks = [
            asyncio.create_task(agent.run(client, records, counters, stop_at,
                                          config.ramp_s * i / max(1, num_agents)))
            for i, agent in enumerate(agents)
        ]
        remaining = max(1.0, stop_at - time.monotonic() + config.drain_s)
        _done, pending = await asyncio.wait(tasks, timeout=remaining)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await display
    return records, t0 + config.warmup_s, stop_at


async def run_cold_start(
    params: WorkloadParams,
    synth: TextSynth,
    config: RunConfig,
    num_conversations: int,
    context_tokens: int,
    max_tokens: int = 16,
) -> tuple[list[RequestRecord], float]:
    """N fresh conversations of ``context_tokens`` each, all sent at once; returns (records, wall s)."""
    tools = build_tools(params, synth)
    rng = np.random.default_rng(config.seed + 17)
    sessions = [
        AgentSession(params, synth, tools, np.random.default_rng(int(rng.integers(2**62))), context_tokens,
                     config.model)
        for _ in range(num_conversations)
    ]
    records: list[RequestRecord] = []
    counters = LiveCounters()
    t0 = time.monotonic()
    stop = asyncio.Event()
    display = asyncio.create_task(Progress("cold-start", counters, t0, config.request_timeout_s).run(stop))

    async def one(i: int, session: AgentSession, client: httpx.AsyncClient) -> None:
        record = RequestRecord(i, session.session_id, time.monotonic(), cold=True)
        headers = session.headers()
        if config.api_key:
            headers["x-api-key"] = config.api_key
        counters.in_flight += 1
        try:
            await stream_message(client, config.url, session.body_bytes(max_tokens), headers, record,
                                 config.request_timeout_s)
        finally:
            counters.in_flight -= 1
        records.append(record)
        counters.num_requests += 1
        counters.num_errors += record.error is not None
        counters.input_tokens += record.total_input_tokens
        counters.cached_tokens += record.cached_tokens
        if record.ttft_s is not None:
            counters.recent_ttft_s.append(record.ttft_s)

    async with make_client(num_conversations) as client:
        await asyncio.gather(*(one(i, s, client) for i, s in enumerate(sessions)))
    wall_s = time.monotonic() - t0
    stop.set()
    await display
    return records, wall_s
