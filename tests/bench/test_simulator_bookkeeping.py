"""The capacity simulator's bookkeeping: tokens conserved, every request ends, pools never overfull."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from bench.simulator.agents import simulate_step
from bench.simulator.engine import SimGroup
from bench.simulator.model import ARRIVALS, Deployment, EngineModel, OursPolicy, SimConfig
from bench.simulator.vclock import SimulationDeadlock, run_virtual
from rank.engine import CapacityExhausted, EngineMisuse, EngineRequest, SamplingParams
from server.scheduling import SchedulingConfig


def _small(policy: str, gpu_tokens: int = 120_000, arrivals: str = "steady") -> SimConfig:
    # "ours-gate": ours with the submit gate on (server/scheduling.py; off by default);
    # "ours-bound": ours without late binding (cache/router.py rule 4; on by default)
    gate = SchedulingConfig(enabled=policy == "ours-gate", engine_budget_tokens=4096, max_hold_s=5.0)
    return SimConfig(
        policy="ours" if policy.startswith("ours") else policy,
        ours=OursPolicy(scheduling=gate, place_homeless=policy != "ours-bound"),
        arrivals=ARRIVALS[arrivals],
        deployment=Deployment(num_ranks=2, gpu_kv_tokens_per_rank=gpu_tokens, l1_tokens_per_rank=2_000_000,
                              block_tokens=256),
        engine=EngineModel(max_num_seqs=8, max_num_batched_tokens=4096),
        duration_s=120.0,
        warmup_s=20.0,
        ramp_s=5.0,
    )


def test_virtual_time_jumps_and_detects_deadlock() -> None:
    async def sleeper() -> float:
        await asyncio.sleep(3600)
        return asyncio.get_running_loop().time()

    assert run_virtual(sleeper()) == pytest.approx(3600)

    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationDeadlock):
        run_virtual(stuck())


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[SimGroup]:
    """Every SimGroup built during the test (simulate_step creates its own), tracked by wrapping
    ``SimGroup.__init__`` for this test only."""
    made: list[SimGroup] = []
    orig_init = SimGroup.__init__

    def tracking_init(self: SimGroup, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SimGroup, "__init__", tracking_init)
    return made


@pytest.mark.parametrize(
    ("policy", "gpu_tokens", "arrivals"),  # roomy, and tight (evictions, L1 restores, queueing)
    [("seed", 400_000, "steady"), ("ours", 400_000, "steady"), ("seed", 60_000, "steady"),
     ("ours", 60_000, "steady"), ("seed", 400_000, "fresh"), ("seed", 400_000, "seed"),
     ("ours-gate", 60_000, "steady"), ("ours-bound", 60_000, "steady")],
)
def test_every_request_finishes_and_tokens_are_conserved(policy: str, gpu_tokens: int, arrivals: str,
                                                         groups: list[SimGroup]) -> None:
    config = _small(policy, gpu_tokens, arrivals)
    peaks: list[int] = []

    async def run() -> object:
        task = asyncio.create_task(simulate_step(config, 20_000, 6, check=True))
        while not task.done():
            await asyncio.sleep(0.5)
            # the group is created inside simulate_step; sample it through the task's frame-free API
            for group in groups:
                for rank in range(group.num_ranks):
                    st = group.stats(rank)
                    assert 0 <= st.num_free_blocks <= st.num_blocks - 1
                    held = int(np.count_nonzero(group.ranks[rank].seq_refs + group.ranks[rank].cache_refs))
                    assert held + st.num_free_blocks == st.num_blocks - 1
                    peaks.append(held)
        return task.result()

    result = run_virtual(run())
    t = result.totals
    assert t.num_submitted > 50
    # every submitted request ended with a terminal output: finished, or failed by the engine
    assert t.num_finished + t.num_failed_in_engine == t.num_submitted
    assert t.output_tokens_received + t.output_tokens_lost == t.output_tokens_expected
    assert t.cached_tokens <= t.prompt_tokens
    ok = [r for r in result.records if r.error is None]
    assert len(ok) == t.num_finished
    assert len(result.records) == t.num_finished + t.num_failed + t.num_failed_in_engine
    assert sum(r.output_tokens for r in ok) <= t.output_tokens_received
    assert sum(r.total_input_tokens for r in ok) == t.prompt_tokens
    assert all(r.ttft_s is not None and r.ttft_s >= 0 for r in ok)
    assert groups and peaks and max(peaks) <= config.deployment.for_context(20_000).num_blocks - 1
    # the gate let every turn go and counts none as queued in the engine
    assert result.gate is not None and result.gate.num_waiting(0) == result.gate.queued_tokens(0) == 0
    if policy == "ours-gate":
        assert result.gate.num_held > 0
    # after the run nothing is running and no sequence holds a block
    for r in result.group.ranks:
        assert not r.running and not r.waiting and not r.seq_refs.any()
    # the measured window's counters are consistent: passes within points, a no-vote per rank
    # per point at most, the slowest rank's time at least the ranks' mean, lowest <= mean <= highest
    c = result.group.counters
    assert 0 < c.votes_passed <= c.vote_points
    assert c.rank_votes_no_queue + c.rank_votes_over_mark <= c.vote_points * result.group.num_ranks
    assert c.decode_s >= c.decode_mean_s - 1e-9 and c.prefill_s >= c.prefill_mean_s - 1e-9
    assert c.min_seq_s <= c.seq_s + 1e-9 <= c.max_seq_s + 2e-9


def test_engine_rejects_bad_prefix_and_reports_capacity() -> None:
    async def run() -> None:
        group = SimGroup(Deployment(num_ranks=1, gpu_kv_tokens_per_rank=2048, block_tokens=256),
                         EngineModel())
        group.start()
        req = EngineRequest("r", np.arange(600, dtype=np.int32), SamplingParams(max_tokens=5),
                            prefix_blocks=[3],
                            num_cached_tokens=256)
        with pytest.raises(EngineMisuse):
            group.submit(0, req)  # block 3 is not held by anyone
        with pytest.raises(CapacityExhausted):
            await group.import_blocks(0, 0, 100)
        stream = group.submit(0,
                              EngineRequest("ok", np.arange(600, dtype=np.int32),
                                            SamplingParams(max_tokens=5)))
        outs = [o async for o in stream]
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 5
        assert len(outs[-1].kept_blocks) == (600 + 5 - 1) // 256
        await group.release(0, outs[-1].kept_blocks)
        group.check_accounting()
        assert group.stats(0).num_free_blocks == group.num_blocks - 1
        await group.close()

    run_virtual(run())


def test_pool_probe_splits_each_ranks_pool_without_losing_a_block() -> None:
    """The probe's split (bench/simulator/pool_probe.py) of a tight pool: each sample's parts sum
    to the rank's capacity, turns held blocks, and the keep-out is the cache's own."""
    config = _small("ours", 60_000, "steady")
    result = run_virtual(simulate_step(config, 20_000, 6, pool_probe_s=2.0))
    assert result.pool is not None and len(result.pool.samples) >= 40
    capacity = result.group.num_blocks - 1
    keep_out = result.manager.state.ledgers[0].keep_out_blocks()
    for per_rank in result.pool.samples:
        assert len(per_rank) == config.deployment.num_ranks
        for held, idle, reserved, releasing, out, free in per_rank:
            assert min(held, idle, reserved, releasing) >= 0 and out == keep_out
            assert held + idle + reserved + releasing + out + free == capacity
    assert max(s[0] for per_rank in result.pool.samples for s in per_rank) > 0
    assert "held by turns" in result.pool.summary(capacity, result.group.block_size)
