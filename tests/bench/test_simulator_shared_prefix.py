"""What the one-H200 on/off run showed the simulator lacked for the load generator on the reference
engine (docs/loadtest.md, "Why the model queued 20 s where the real run did not").

* The load generator's conversations all start with the same system prompt and tools, so the
  cache holds that prefix once per rank and a new conversation's cold turn is served it from
  another session's blocks (17 of 22 cold turns hit exactly 9,856 tokens = 77 blocks).
  ``SimConfig.shared_prefix_tokens`` models it; 0 (the default, the calibration's rows) leaves
  every conversation's ids its own and the agents' random streams as they were.
* The reference engine's replies are cut at max_tokens (the load generator sets it to the sampled
  reply size), so the service reports the stop kind as unknown and the cache never protects the
  session from eviction; ``SimConfig.reply_end="length"`` models it, ``"client"`` (the default)
  keeps tool_use / end_turn as a real model's replies to an agent end.
"""

from __future__ import annotations

from bench.loadgen.client import RequestRecord
from bench.simulator.agents import SimResult, simulate_step
from bench.simulator.model import ARRIVALS, OURS_OFF, Deployment, EngineModel, SimConfig
from bench.simulator.vclock import run_virtual
from cache.sessions import StopKind

BLOCK = 128


def _sim(shared: int, reply_end: str = "client") -> SimResult:
    config = SimConfig(
        policy="ours", ours=OURS_OFF, arrivals=ARRIVALS["fresh"], shared_prefix_tokens=shared,
        reply_end=reply_end,
        deployment=Deployment(num_ranks=1, gpu_kv_tokens_per_rank=400_000, l1_tokens_per_rank=0,
                              block_tokens=BLOCK),
        engine=EngineModel(max_num_seqs=8, max_num_batched_tokens=4096),
        duration_s=60.0, warmup_s=0.0, ramp_s=20.0,
    )
    result = run_virtual(simulate_step(config, 8_000, 4, check=True))
    assert result.totals.num_failed == 0
    return result


def _run(shared: int) -> list[RequestRecord]:
    return sorted(_sim(shared).records, key=lambda r: (r.agent_id, r.t_start))


def _cold_hits(records: list[RequestRecord]) -> list[int]:
    return [r.cached_tokens for r in sorted(records, key=lambda r: r.t_start) if r.cold]


def test_cold_turns_are_served_the_shared_prefix_from_other_sessions() -> None:
    shared = 1_000  # 7 whole blocks (896 tokens) are shareable; the 8th differs per conversation
    hits = _cold_hits(_run(shared))
    # Agents start 5 s apart and a turn here takes well under that: only the very first
    # conversation finds nothing; every later one (new agents, and restarts at the context
    # target) matches the first one's 7 blocks, on the one rank, and starts from 6 of them: the
    # last matched block is replayed (rank/engine.py usable_prefix_blocks), as on the real stack,
    # where a 78-block shared prefix gave cold turns 77 blocks (9,856 tokens).
    assert len(hits) >= 5
    assert hits == [0] + [6 * BLOCK] * (len(hits) - 1)


def test_without_it_conversations_share_nothing_and_draw_the_same_sizes() -> None:
    off, on = _run(0), _run(1_000)
    assert set(_cold_hits(off)) == {0}
    # the shared ids overwrite the drawn ones: every agent's prompts have the same sizes, turn
    # for turn, as without the option (the calibration's rows, shared_prefix_tokens=0, unchanged)
    for agent in range(4):
        sizes_off = [r.input_tokens + r.cached_tokens for r in off if r.agent_id == agent]
        sizes_on = [r.input_tokens + r.cached_tokens for r in on if r.agent_id == agent]
        n = min(len(sizes_off), len(sizes_on))
        assert n >= 3 and sizes_off[:n] == sizes_on[:n]


def test_replies_cut_at_max_tokens_leave_their_sessions_unprotected() -> None:
    cases = (("length", {StopKind.UNKNOWN}), ("client", {StopKind.TOOL_USE, StopKind.END_TURN}))
    for reply_end, kinds in cases:
        manager = _sim(0, reply_end).manager
        policy = manager.state.policy
        finished = [s for s in manager.sessions if s.last_finish_s is not None and s.home_rank is not None]
        assert len(finished) >= 4 and {s.last_stop for s in finished} <= kinds
        # one second after its turn: a tool call's session is expected back within protect_s (the
        # queue head may not evict it before queue_force_after_s); an unknown stop's expected
        # gap (the mean of the tool and human priors, 64.5 s) never falls under protect_s (30 s)
        protected = {(s.last_stop, policy.is_protected(s.home_rank, s.session_id, s.last_finish_s + 1.0))
                     for s in finished}
        if reply_end == "length":
            assert protected == {(StopKind.UNKNOWN, False)}
        else:
            assert (StopKind.TOOL_USE, True) in protected and (StopKind.TOOL_USE, False) not in protected
