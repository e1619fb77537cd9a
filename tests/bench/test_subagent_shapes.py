"""Subagent fan-outs in the load generator and the simulator: counts, share of requests, and the
headers and hints each subagent request carries (bench/loadgen/subagents.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import httpx
import numpy as np
import pytest

from bench.loadgen.client import RequestRecord
from bench.loadgen.distributions import ParametricTurnSource, WorkloadParams
from bench.loadgen.fake_server import build_app
from bench.loadgen.runner import Agent, LiveCounters, RunConfig
from bench.loadgen.session import SUBAGENT_LINE, SUBAGENT_TOOLS, AgentSession, build_tools
from bench.loadgen.subagents import (
    AGENT_HEADER,
    SESSION_HEADER,
    SpawnSource,
    SubagentPlan,
    subagent_hint,
    subagent_params,
)
from bench.loadgen.textgen import TextSynth
from bench.simulator.agents import simulate_step
from bench.simulator.model import ARRIVALS, Deployment, EngineModel, SimConfig
from bench.simulator.vclock import run_virtual
from cache.sessions import RequestClass, session_id_for_hint


def _spawn_draws(mix: str, main_steps: int) -> tuple[list[list[SubagentPlan]], int]:
    """Fan-outs over ``main_steps`` main-thread steps (94% end in a tool call, as the workload's)."""
    spawns = SpawnSource(subagent_params(mix), np.random.default_rng(3))
    steps_rng = np.random.default_rng(4)
    fanouts = [spawns.spawn(bool(steps_rng.random() < 0.94)) for _ in range(main_steps)]
    return [f for f in fanouts if f], main_steps


def test_heavy_mix_shapes_and_share_of_requests() -> None:
    fanouts, main_steps = _spawn_draws("heavy", 40_000)
    counts = Counter(len(f) for f in fanouts)
    assert set(counts) == {1, 2, 3, 4}  # 1-4 in parallel per spawn
    plans = [p for f in fanouts for p in f]
    sub_requests = sum(p.steps for p in plans)
    share = sub_requests / (sub_requests + main_steps)
    assert 0.36 <= share <= 0.44  # ~40% of requests off the main thread
    assert 10 <= np.median([p.steps for p in plans]) <= 12  # ~11 steps
    assert 9_500 <= np.median([p.first_tokens for p in plans]) <= 11_000  # fresh ~10K contexts
    ids = [p.agent_id for p in plans]
    assert len(set(ids)) == len(ids) and all(len(i) == 17 and int(i, 16) >= 0 for i in ids)


def test_light_mix_spawns_in_few_conversations_and_off_never() -> None:
    light = SpawnSource(subagent_params("light"), np.random.default_rng(5))
    share = np.mean([light.conversation_spawns() for _ in range(20_000)])
    assert 0.02 <= share <= 0.04  # 3% of sessions
    off = SpawnSource(subagent_params("off"), np.random.default_rng(5))
    assert not any(off.conversation_spawns() for _ in range(1_000))
    assert not any(off.spawn(True) for _ in range(1_000))
    with pytest.raises(ValueError, match="unknown mix"):
        subagent_params("some")


def test_subagent_hint_is_what_the_server_builds() -> None:
    hint = subagent_hint("sess-1", "ab3cae3c9491bab81")
    assert hint.key == "sess-1" and hint.agent_id == "ab3cae3c9491bab81"
    assert hint.request_class is RequestClass.SUBAGENT
    assert session_id_for_hint(hint) == "hint:sess-1/agent:ab3cae3c9491bab81"


def test_subagent_session_headers_and_body() -> None:
    synth = TextSynth(corpus_tokens=8_192)
    params = WorkloadParams(context_target_tokens=16_000, size_scale=0.2)
    tools = build_tools(params, synth)
    rng = np.random.default_rng(1)
    parent = AgentSession(params, synth, tools, rng, 6_000, "m")
    sub = AgentSession(params, synth, tools[:SUBAGENT_TOOLS], rng, 2_000, "m", mid_conversation_system=False,
                       session_id=parent.session_id, agent_id="a0123456789abcdef")
    assert AGENT_HEADER not in parent.headers()
    h = sub.headers()
    assert h[SESSION_HEADER] == parent.session_id and h[AGENT_HEADER] == "a0123456789abcdef"
    body = sub.body(16)
    assert body["system"][1]["text"] == SUBAGENT_LINE and len(body["tools"]) == SUBAGENT_TOOLS
    assert parent.session_id in body["metadata"]["user_id"]
    other = AgentSession(params, synth, tools[:SUBAGENT_TOOLS], rng, 2_000, "m",
                         mid_conversation_system=False, session_id=parent.session_id, agent_id="a1")
    assert other.system[2] == sub.system[2] != parent.system[2]  # siblings share their system prompt


class _Capture(httpx.ASGITransport):
    def __init__(self) -> None:
        super().__init__(app=build_app(tokens_per_s=5_000.0))
        self.headers: list[httpx.Headers] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        return await super().handle_async_request(request)


def test_loadgen_subagent_requests_carry_the_parent_session_and_their_agent_id() -> None:
    synth = TextSynth(corpus_tokens=8_192)
    params = WorkloadParams(context_target_tokens=16_000, size_scale=0.05, pacing_s=0.0)
    config = RunConfig(base_url="http://fake", subagents="heavy")
    agent = Agent(0, params, ParametricTurnSource(params), synth, build_tools(params, synth), config, seed=2)
    plans = [SubagentPlan("a" + f"{i:x}" * 16, 1_000, 3) for i in (1, 2)]
    transport = _Capture()
    records: list[RequestRecord] = []

    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=transport) as client:
            stop = time.monotonic() + 60
            return await asyncio.gather(*(agent._subagent(client, p, records, LiveCounters(), stop)
                                          for p in plans))

    reports = asyncio.run(go())
    assert len(records) == 6 and all(r.status == 200 for r in records)
    assert Counter(r.subagent_id for r in records) == {plans[0].agent_id: 3, plans[1].agent_id: 3}
    assert all(r > 0 for r in reports)
    assert {h["x-claude-code-session-id"] for h in transport.headers} == {agent.session.session_id}
    assert Counter(h["x-claude-code-agent-id"] for h in transport.headers) == {p.agent_id: 3 for p in plans}
    # each subagent's later turns extend its own conversation (the stand-in's per-branch cache)
    for p in plans:
        later = [r for r in records if r.subagent_id == p.agent_id][1:]
        assert all(r.cached_tokens > 0 for r in later)


def _small(mix: str) -> SimConfig:
    return SimConfig(policy="ours", arrivals=ARRIVALS["steady"], subagents=mix,  # type: ignore[arg-type]
                     deployment=Deployment(num_ranks=2, gpu_kv_tokens_per_rank=400_000,
                                           l1_tokens_per_rank=4_000_000, block_tokens=256),
                     engine=EngineModel(max_num_seqs=16, max_num_batched_tokens=8192),
                     duration_s=150.0, warmup_s=30.0, ramp_s=5.0)


def test_simulated_fanouts_hints_and_the_parent_waiting() -> None:
    assert ARRIVALS["steady"].subagents == "heavy" and ARRIVALS["seed"].subagents == "off"
    result = run_virtual(simulate_step(_small("auto"), 60_000, 6, check=True))
    subs = [r for r in result.records if r.subagent_id is not None]
    mains = [r for r in result.records if r.subagent_id is None]
    assert 0.25 <= len(subs) / len(result.records) <= 0.6
    # every subagent request carries its parent's session id; each agent id lives in one session
    sessions_of_agent: dict[str, set[str]] = defaultdict(set)
    for r in subs:
        sessions_of_agent[r.subagent_id].add(r.session_id)  # type: ignore[index]
    assert all(len(s) == 1 for s in sessions_of_agent.values())
    assert {s for v in sessions_of_agent.values() for s in v} <= {r.session_id for r in mains}
    # the cache saw them as branches: one routing unit per subagent, named by the hint
    branches = [s for s in result.manager.sessions if "/agent:" in s.session_id]
    assert branches and all(s.request_class is RequestClass.SUBAGENT for s in branches)
    assert {s.session_id.split("/agent:")[1] for s in branches} <= set(sessions_of_agent)
    # the parent waits: no main-thread request of an agent starts while its subagents run
    for agent in {r.agent_id for r in subs}:
        spans = [(r.t_start, r.t_end) for r in subs if r.agent_id == agent and r.t_end]
        for m in (r for r in mains if r.agent_id == agent):
            assert not any(lo < m.t_start < hi for lo, hi in spans)
    off = run_virtual(simulate_step(_small("off"), 60_000, 4))
    assert not any(r.subagent_id for r in off.records)


def test_seed_model_routes_a_subagent_chain_to_its_parents_rank() -> None:
    from bench.simulator.engine import SimGroup
    from bench.simulator.model import SeedPolicy
    from bench.simulator.seed_cache import SeedCacheManager

    async def go() -> tuple[int, int, int]:
        group = SimGroup(Deployment(num_ranks=2, gpu_kv_tokens_per_rank=100_000, l1_tokens_per_rank=1_000_000,
                                    block_tokens=256), EngineModel())
        seed = SeedCacheManager(group, SeedPolicy(), asyncio.get_running_loop().time)
        ids = np.arange(1000, 5000, dtype=np.int32)
        seed.home["s1"] = 1  # not the least loaded rank (all are empty: rank 0)
        parent = await seed.admit(ids, "s1", 16)
        sub = await seed.admit(ids[::-1].copy(), "s1/agent:a1", 16)
        other = await seed.admit(ids, "s2/agent:a2", 16)
        return parent.rank, sub.rank, other.rank

    assert run_virtual(go()) == (1, 1, 0)
