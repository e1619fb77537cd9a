"""Simulated agents in virtual time, and one simulated load-test step end to end.

Each agent runs the same session life as the load generator (``bench/loadgen/distributions.py``:
per-turn output and tool-result sizes from the public trace statistics, ``pacing_s`` between
turns), starting and restarting conversations as ``SimConfig.arrivals`` says (``model.ARRIVALS``:
the seed's test, the steady state, or the load generator's fresh 0.4-0.6 conversations). Token
ids are synthetic: a conversation is an int32 array that the agent extends with the output ids
the engine returned (so the next prompt hits the cache exactly like the protocol layer's output
ledger makes it) plus fresh ids for the tool result. Per turn the agent does what the server's
service does: tokenize (modelled delay), ``admit``, ``submit``, read the stream, ``finish``.
Subagent fan-outs (``SimConfig.subagent_mix``, ``bench/loadgen/subagents.py``) run as branches
under the parent's session id with the hint the server builds from Claude Code's agent headers;
the parent waits for them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.loadgen.client import RequestRecord
from bench.loadgen.distributions import ParametricTurnSource, TurnSpec, WorkloadParams, initial_context_tokens
from bench.loadgen.report import Criteria, StepStats, step_stats
from bench.loadgen.subagents import (
    SpawnSource,
    SubagentParams,
    SubagentPlan,
    subagent_hint,
    subagent_params,
)
from bench.simulator.engine import SimGroup
from bench.simulator.model import SimConfig
from bench.simulator.pool_probe import PoolProbe
from bench.simulator.seed_cache import SeedCacheManager
from cache.sessions import SessionHint, StopKind
from rank.engine import FinishReason, SamplingParams
from server.scheduling import SchedulingConfig, SubmitGate


@dataclass(slots=True)
class SimTotals:
    """Bookkeeping over a whole run (the tests check conservation with these)."""

    num_submitted: int = 0
    num_finished: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens_expected: int = 0
    output_tokens_received: int = 0
    output_tokens_lost: int = 0  # not generated because the engine failed the request
    num_failed_in_engine: int = 0  # submitted, then failed by the engine (preempted)
    # Per finished turn: (start, tokenize + admission, gate hold, engine to first token,
    # admission queue, L1 restore) s.
    phases: list[tuple[float, ...]] = field(default_factory=list)


def make_manager(config: SimConfig, group: SimGroup, clock: Any, below_l1: Any = None) -> Any:
    if config.policy == "seed":
        return SeedCacheManager(group, config.seed_policy, clock)
    from cache.config import CacheConfig
    from cache.manager import CacheManager

    # DeepInfer stops prefilling above its KV-usage watermark and counts cached blocks as used,
    # so on DeepInfer our admission must keep (1 - watermark) of the pool out of its reach.
    # (CacheConfig.usable_fraction: what WorkloadConfig.cache_config sets for engine 'deepinfer'.)
    cfg = CacheConfig(hash_salt="sim", usable_fraction=config.engine.kv_watermark,
                      place_homeless=config.ours.place_homeless, **config.ours.cache)
    return CacheManager(group, cfg, clock=clock, l2=below_l1)


def make_gate(config: SimConfig, group: SimGroup, clock: Any) -> SubmitGate:
    """The service's submission gate (``server/scheduling.py``); off for the seed's policy."""
    sched = config.ours.scheduling if config.policy == "ours" else SchedulingConfig(enabled=False)
    return SubmitGate(sched, clock=clock)


# Where a turn goes: (session id, agent's rng) -> (group, manager, gate). One deployment: always the same.
Placement = Callable[[str, np.random.Generator], tuple[SimGroup, Any, SubmitGate]]


def conversation_size(config: SimConfig, params: WorkloadParams, rng: np.random.Generator,
                      first: bool) -> int:
    """Tokens a new conversation starts with under ``config.arrivals`` (``first``: the agent's first)."""
    arrivals = config.arrivals
    size = initial_context_tokens(params, rng)
    if arrivals.start_fraction is not None:
        lo, hi = arrivals.start_fraction
        size = max(size, int(rng.uniform(lo, hi) * params.context_target_tokens))
    if first and arrivals.steady:  # join at a uniform point of the conversation's life
        size += int(rng.uniform(0.0, 1.0) * max(0, int(0.97 * params.context_target_tokens) - size))
    return min(size, int(0.97 * config.max_model_len))


def shared_prefix(config: SimConfig) -> np.ndarray:
    """The ids every conversation starts with (``SimConfig.shared_prefix_tokens``; one fixed draw)."""
    return np.random.default_rng(7).integers(1000, 120_000, config.shared_prefix_tokens, dtype=np.int32)


def restart_limit(config: SimConfig, params: WorkloadParams) -> int:
    """A conversation whose next request would pass this starts over (a new session, one cold turn)."""
    if config.arrivals.compact_at_target:
        return min(params.context_target_tokens, config.max_model_len)
    return config.max_model_len


@dataclass(slots=True)
class _AgentRun:
    """What one agent's turns share (its parent's and its subagents')."""

    agent_id: int
    config: SimConfig
    place: Placement
    records: list[RequestRecord]
    totals: SimTotals
    request_ids: Iterator[int]
    first_turn: bool = True  # the agent's first turn (prefilled at no cost under ``prewarm``)


async def _turn(run: _AgentRun, session: str, hint: SessionHint | None, tokens: np.ndarray, new_tokens: int,
                turn: TurnSpec, rng: np.random.Generator, stop: StopKind | None = None) -> list[int] | None:
    """One request as the service runs it: tokenize, admit, submit, read the stream, finish. The
    output ids, or None when it failed (after the client's back-off where it waits one).
    ``hint``: the subagent's session hint (``subagents.subagent_hint``); None: the main thread's
    plain session key. ``stop``: the stop kind to tell the cache (default: from ``turn``)."""
    config, totals = run.config, run.totals
    loop = asyncio.get_running_loop()
    group, manager, gate = run.place(session, rng)
    record = RequestRecord(run.agent_id, session, loop.time(), cold=new_tokens == len(tokens),
                           subagent_id=None if hint is None else hint.agent_id)
    retokenized = (len(tokens)
                   if config.seed_policy.full_retokenize and config.policy == "seed" else new_tokens)
    await asyncio.sleep(retokenized / config.deployment.tokenize_tokens_per_s)
    # Ours reads the agent headers' hint; the seed's model keys a subagent's chain apart and
    # routes it on the session id alone (seed_cache.py), as the seed's backend did.
    route: SessionHint | str = session
    if hint is not None:
        route = hint if config.policy == "ours" else f"{session}/agent:{hint.agent_id}"
    try:
        adm = await manager.admit(tokens, route, turn.output_tokens)
    except Exception as exc:  # Overloaded / PromptTooLong from the real manager
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        record.t_end = loop.time()
        run.records.append(record)
        totals.num_failed += 1
        await asyncio.sleep(1.0)
        return None
    request = adm.engine_request(f"{session}-{next(run.request_ids)}", tokens,
                                 SamplingParams(max_tokens=turn.output_tokens, ignore_eos=True))
    if config.arrivals.prewarm and run.first_turn:
        group.prewarmed_ids.add(request.request_id)
    run.first_turn = False
    # What the service does between admission and submit (server/scheduling.py).
    t_admitted = loop.time()
    await gate.hold(adm.rank, request.request_id, len(tokens) - adm.num_cached_tokens, record.t_start)
    t_submit = loop.time()
    totals.num_submitted += 1
    totals.output_tokens_expected += turn.output_tokens
    try:
        stream = group.submit(adm.rank, request)
    except Exception as exc:
        gate.done(adm.rank, request.request_id)
        manager.abort(adm)
        record.error = f"submit: {exc}"[:200]
        run.records.append(record)
        totals.num_failed += 1
        return None
    out_ids: list[int] = []
    t_first = t_last = None
    last = None
    make_room = getattr(manager, "make_room", None)  # ours: grow the KV room as the reply decodes
    async for out in stream:
        if out.token_ids or out.finished:
            gate.started(adm.rank, request.request_id)
        if out.token_ids:
            now = loop.time()
            t_first = now if t_first is None else t_first
            t_last = now
            out_ids.extend(out.token_ids)
            if make_room is not None:
                make_room(adm, len(out_ids))
        last = out
    assert last is not None and last.finished
    if last.finish_reason == FinishReason.ERROR:  # preempted: DeepInfer failed the request
        manager.abort(adm)
        totals.num_failed_in_engine += 1
        totals.output_tokens_received += len(out_ids)
        totals.output_tokens_lost += turn.output_tokens - len(out_ids)
        record.error = f"engine: {last.error}"
        record.t_end = loop.time()
        run.records.append(record)
        await asyncio.sleep(1.0)  # the load generator's retry: the same conversation again
        return None
    # What the service tells the cache (server/service.py: _stop_kind): a reply that ends in
    # tool calls comes back in seconds, one that ends the turn waits for a person, one cut at
    # max_tokens is unknown (SimConfig.reply_end).
    if config.reply_end == "length":
        stop = StopKind.UNKNOWN
    elif stop is None:
        stop = StopKind.TOOL_USE if turn.kind == "tool" else StopKind.END_TURN
    manager.finish(adm, tokens, out_ids, last, stop)
    totals.num_finished += 1
    totals.output_tokens_received += len(out_ids)
    record.t_end = loop.time()
    record.status = 200
    record.output_tokens = len(out_ids)
    # What the engine really started from (the usage a client is told); the seed's L0 can
    # drop a queued turn's prefix after admission, so this may be less than the admission's.
    num_cached = last.num_cached_tokens
    record.cached_tokens = num_cached
    record.input_tokens = len(tokens) - num_cached
    totals.prompt_tokens += len(tokens)
    totals.cached_tokens += num_cached
    if t_first is not None:
        record.ttft_s = t_first - record.t_start
        totals.phases.append((record.t_start, t_admitted - record.t_start, t_submit - t_admitted,
                              t_first - t_submit, getattr(adm, "queue_time_s", 0.0),
                              getattr(adm, "restore_s", 0.0)))
        record.decode_s = (t_last or t_first) - t_first
    run.records.append(record)
    return out_ids


def subagent_prefix(params: SubagentParams) -> np.ndarray:
    """A subagent type's system prompt and tools: the same ids for every subagent (one fixed draw)."""
    return np.random.default_rng(11).integers(1000, 120_000, params.prefix_tokens, dtype=np.int32)


async def _subagent(run: _AgentRun, session: str, plan: SubagentPlan, spawns: SpawnSource,
                    params: WorkloadParams, limit: int, stop_at: float) -> int:
    """One subagent: a fresh context under the parent's session id and its own agent id, grown
    step by step; its last step ends the turn (its report). Returns the report's size."""
    loop = asyncio.get_running_loop()
    rng = spawns.rng
    source = ParametricTurnSource(params)
    hint = subagent_hint(session, plan.agent_id)
    prefix = subagent_prefix(spawns.params)
    tokens = rng.integers(1000, 120_000, max(plan.first_tokens, len(prefix) + 1), dtype=np.int32)
    tokens[:len(prefix)] = prefix
    new_tokens = len(tokens)
    report = 0
    step = 0
    while step < plan.steps and loop.time() < stop_at:
        turn = source.next_turn(rng)
        addition = spawns.step_input_tokens()
        last = step + 1 == plan.steps or len(tokens) + turn.output_tokens + addition > limit
        out_ids = await _turn(run, session, hint, tokens, new_tokens, turn, rng,
                              StopKind.END_TURN if last else StopKind.TOOL_USE)
        if out_ids is None:
            continue  # the same request again
        step += 1
        report = len(out_ids)
        if last:
            break
        tail = np.concatenate([np.asarray(out_ids, dtype=np.int32),
                               rng.integers(1000, 120_000, addition, dtype=np.int32)])
        tokens = np.concatenate([tokens, tail])
        new_tokens = len(tail)
        await asyncio.sleep(turn.gap_s)
    return report


async def _agent(
    agent_id: int,
    params: WorkloadParams,
    config: SimConfig,
    place: Placement,
    records: list[RequestRecord],
    totals: SimTotals,
    stop_at: float,
    start_delay_s: float,
) -> None:
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(config.seed * 1_000_003 + agent_id)
    # Fan-outs come from a stream of their own: the parent's turns are the same with them on or off.
    spawns = SpawnSource(subagent_params(config.subagent_mix(), params.size_scale),
                         np.random.default_rng([config.seed, agent_id, 34]))
    source = ParametricTurnSource(params)
    request_ids = itertools.count()
    run = _AgentRun(agent_id, config, place, records, totals, request_ids)
    limit = restart_limit(config, params)
    await asyncio.sleep(start_delay_s)

    shared = shared_prefix(config)

    def new_conversation(first: bool = False) -> tuple[np.ndarray, str, bool]:
        size = conversation_size(config, params, rng, first)
        ids = rng.integers(1000, 120_000, size, dtype=np.int32)
        n = min(size, len(shared))
        ids[:n] = shared[:n]  # drawn first, then overwritten: the agent's rng stream is the same
        return ids, f"a{agent_id}-c{next(request_ids)}", spawns.conversation_spawns()

    tokens, session, spawning = new_conversation(first=True)
    new_tokens = len(tokens)
    turn = source.next_turn(rng)
    while loop.time() < stop_at:
        out_ids = await _turn(run, session, None, tokens, new_tokens, turn, rng)
        if out_ids is None:
            continue
        # The next prompt: this one + the output the engine produced + the tool result.
        next_turn = source.next_turn(rng)
        addition = rng.integers(1000, 120_000, turn.new_input_tokens, dtype=np.int32)
        plans = spawns.spawn(turn.kind == "tool") if spawning else []
        if plans:  # the parent waits for its subagents; their reports join its tool result
            sub_limit = min(limit, params.context_target_tokens)
            reports = await asyncio.gather(*(_subagent(run, session, plan, spawns, params, sub_limit, stop_at)
                                             for plan in plans))
            reported = spawns.rng.integers(1000, 120_000, sum(reports), dtype=np.int32)
            addition = np.concatenate([addition, reported])
        if len(tokens) + len(out_ids) + len(addition) + next_turn.output_tokens > limit:
            tokens, session, spawning = new_conversation()
            new_tokens = len(tokens)
        else:
            tokens = np.concatenate([tokens, np.asarray(out_ids, dtype=np.int32), addition])
            new_tokens = len(addition) + len(out_ids)
        gap = turn.gap_s
        turn = next_turn
        await asyncio.sleep(gap)


async def run_agents(config: SimConfig, params: WorkloadParams, num_agents: int, place: Placement,
                     records: list[RequestRecord], totals: SimTotals, stop_at: float) -> None:
    """``num_agents`` agents (started over ``config.ramp_s``) until ``stop_at``."""
    await asyncio.gather(*(
        _agent(i, params, config, place, records, totals, stop_at, config.ramp_s * i / max(1, num_agents))
        for i in range(num_agents)
    ))


@dataclass(slots=True)
class SimResult:
    stats: StepStats
    totals: SimTotals
    group: SimGroup
    manager: Any
    records: list[RequestRecord]
    gate: SubmitGate | None = None
    t_measure: tuple[float, float] = (0.0, 0.0)
    pool: PoolProbe | None = None  # ``pool_probe_s``: samples of our cache's pools

    def phases(self) -> dict[str, float]:
        """Where the TTFT went, over the turns started in the measured window: p50 / p95 of
        tokenize + admission (queue for KV room, restore), gate hold, and engine (submit to first
        token: its queue, the vote points, the prefill)."""
        lo, hi = self.t_measure
        rows = np.array([p[1:] for p in self.totals.phases if lo <= p[0] < hi] or [(0.0,) * 5])
        out: dict[str, float] = {}
        for i, name in enumerate(("admit", "gate", "engine", "queue", "restore")):
            out[f"{name}_p50_s"] = float(np.percentile(rows[:, i], 50))
            out[f"{name}_p95_s"] = float(np.percentile(rows[:, i], 95))
        return out


async def simulate_step(config: SimConfig, context_tokens: int, num_agents: int,
                        params: WorkloadParams | None = None, check: bool = False,
                        pool_probe_s: float = 0.0) -> SimResult:
    """One step (``num_agents`` at ``context_tokens``) under ``config.policy``; virtual time.
    ``pool_probe_s`` > 0 (ours only): sample the pools that often in the measured window."""
    loop = asyncio.get_running_loop()
    params = params or WorkloadParams(context_target_tokens=context_tokens, pacing=config.pacing)
    config = config.model_copy(update={"deployment": config.deployment.for_context(context_tokens)})
    group = SimGroup(config.deployment, config.engine, seed=config.seed,
                     vote_filler=config.uses_vote_filler())
    group.start()
    manager = make_manager(config, group, loop.time)
    gate = make_gate(config, group, loop.time)
    records: list[RequestRecord] = []
    totals = SimTotals()
    t0 = loop.time()
    stop_at = t0 + config.duration_s
    loop.call_at(t0 + config.warmup_s, group.reset_counters)
    probe = (PoolProbe(manager, loop.time, pool_probe_s, t0 + config.warmup_s)
             if pool_probe_s > 0 and config.policy == "ours" else None)
    await run_agents(config, params, num_agents, lambda _sid, _rng: (group, manager, gate), records, totals,
                     stop_at)
    if probe is not None:
        probe.stop()
    if hasattr(manager, "drain"):
        await manager.drain()
    if check:
        group.check_accounting()
        if hasattr(manager, "check_balance"):
            manager.check_balance()
    await group.close()
    label = f"{config.policy} {context_tokens // 1000}K x {num_agents}"
    stats = step_stats(label, context_tokens, num_agents, records, t0 + config.warmup_s, stop_at, Criteria(),
                       max_timeline=0)
    return SimResult(stats, totals, group, manager, records, gate, (t0 + config.warmup_s, stop_at), probe)
