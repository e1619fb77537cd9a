"""More than one node: N deployments (each 4 ranks with its own cache) behind a request router.

The platform in front of the workers picks a worker per request. ``sticky`` routes by a hash of
the session id (what a router keyed on ``X-Claude-Code-Session-Id`` does: every turn of a
conversation lands on the worker that holds its prefix); ``random`` picks a worker per request
(round-robin or least-connections behave the same for the cache: consecutive turns of a session
land on different workers). Each worker runs the real ``cache/`` code (policy ``ours``) or the
seed model, exactly as ``agents.simulate_step`` does for one. With ``l3`` (``bench/simulator/l3.py``)
every worker's L1 spills to and fills from one shared store, as with config key ``l3``.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from bench.loadgen.client import RequestRecord
from bench.loadgen.distributions import WorkloadParams
from bench.loadgen.report import Criteria, StepStats, step_stats
from bench.simulator.agents import SimTotals, make_gate, make_manager, run_agents
from bench.simulator.engine import SimGroup
from bench.simulator.l3 import SharedStore, SimL3
from bench.simulator.model import SimConfig
from server.scheduling import SubmitGate

Routing = Literal["sticky", "random"]


def sticky_node(session_id: str, num_nodes: int) -> int:
    """The worker a session-id-keyed router sends ``session_id`` to (stable across processes)."""
    return zlib.crc32(session_id.encode()) % num_nodes


@dataclass(slots=True)
class NodesResult:
    stats: StepStats
    totals: SimTotals
    requests_per_node: list[int]
    nodes_per_session: float  # mean number of workers a conversation's turns reached
    records: list[RequestRecord]
    l3_restored_blocks: int = 0


@dataclass(frozen=True, slots=True)
class L3Model:
    """The shared store's measured figures (``bench/l3_bench.py``) and its size."""

    bytes_per_s: float
    latency_s: float = 1e-3
    capacity_gb: float = 1000.0
    prefill_tokens_per_s: float = 352_000.0


async def simulate_nodes(config: SimConfig, context_tokens: int, agents_per_node: int, num_nodes: int,
                         routing: Routing, params: WorkloadParams | None = None,
                         l3: L3Model | None = None) -> NodesResult:
    """``num_nodes`` x ``agents_per_node`` agents at ``context_tokens`` behind ``routing``."""
    loop = asyncio.get_running_loop()
    params = params or WorkloadParams(context_target_tokens=context_tokens, pacing=config.pacing)
    config = config.model_copy(update={"deployment": config.deployment.for_context(context_tokens)})
    nodes: list[tuple[SimGroup, Any, SubmitGate]] = []
    dep = config.deployment
    bpb = dep.block_tokens * dep.kv_bytes_per_token
    shared = SharedStore(int(l3.capacity_gb * 1e9 // bpb)) if l3 is not None else None
    for i in range(num_nodes):
        group = SimGroup(config.deployment, config.engine, seed=config.seed * 7919 + i,
                         vote_filler=config.uses_vote_filler())
        group.start()
        below = None
        if l3 is not None and shared is not None:
            below = SimL3(shared, bpb, dep.block_tokens, l3.bytes_per_s, l3.latency_s,
                          l3.prefill_tokens_per_s)
        nodes.append((group, make_manager(config, group, loop.time, below),
                      make_gate(config, group, loop.time)))
    served: list[int] = [0] * num_nodes
    visited: dict[str, set[int]] = {}

    def place(session_id: str, rng: np.random.Generator) -> tuple[SimGroup, Any, SubmitGate]:
        node = sticky_node(session_id, num_nodes) if routing == "sticky" else int(rng.integers(num_nodes))
        served[node] += 1
        visited.setdefault(session_id, set()).add(node)
        return nodes[node]

    records: list[RequestRecord] = []
    totals = SimTotals()
    t0 = loop.time()
    stop_at = t0 + config.duration_s
    await run_agents(config, params, agents_per_node * num_nodes, place, records, totals, stop_at)
    for group, manager, _gate in nodes:
        if hasattr(manager, "drain"):
            await manager.drain()
        await group.close()
    label = (f"{config.policy} {num_nodes} nodes {routing}{' +L3' if l3 else ''} {context_tokens // 1000}K x "
             f"{agents_per_node * num_nodes}")
    stats = step_stats(label, context_tokens, agents_per_node * num_nodes, records, t0 + config.warmup_s,
                       stop_at,
                       Criteria(), max_timeline=0)
    spread = float(np.mean([len(v) for v in visited.values()])) if visited else 0.0
    return NodesResult(stats, totals, served, spread, records, shared.restored_blocks if shared else 0)
