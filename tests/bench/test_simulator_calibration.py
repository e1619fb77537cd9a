"""The calibration table's arithmetic, the arrival presets, DeepInfer's second vote, per-request
acceptance, and multi-node routing, on tiny fixtures (no timings asserted)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from bench.loadgen.distributions import WorkloadParams
from bench.simulator import calibration
from bench.simulator.agents import conversation_size, restart_limit
from bench.simulator.engine import SimGroup
from bench.simulator.model import ARRIVALS, Deployment, EngineModel, SimConfig
from bench.simulator.nodes import simulate_nodes, sticky_node
from bench.simulator.vclock import run_virtual
from rank.engine import EngineRequest, FinishReason, SamplingParams


def test_cells_residuals_and_tolerance_on_a_fixture() -> None:
    sim = {"ttft_p50_s": 3.0, "ttft_p95_s": 20.0, "tok_s_p50": 75.0, "tok_s_p10": float("nan"),
           "cache_hit": 0.99}
    cells = calibration.row_cells(sim, (2.4, 10.0, 100.0, 20.0, 0.99))
    assert [c.column for c in cells] == list(calibration.COLUMNS)
    assert cells[0].residual == pytest.approx(0.25) and cells[0].within  # exactly 25% counts as within
    assert cells[1].residual == pytest.approx(1.0) and not cells[1].within
    assert cells[2].residual == pytest.approx(-0.25) and cells[2].within
    assert math.isnan(cells[3].residual) and not cells[3].within  # no simulated figure is not a match
    assert cells[4].residual == pytest.approx(0.0) and cells[4].within
    text = calibration.format_table([(500_000, 50, cells)])
    assert "500K x 50" in text and "3 of 5" in text
    line = text.splitlines()[2]
    assert line.count("*") == 2  # the two cells outside tolerance are marked
    assert "+100%" in line and "+25%" in line and "-25%" in line


def test_published_rows_are_the_seed_table() -> None:
    assert calibration.PUBLISHED[(500_000, 100)] == (2.6, 37.0, 135.0, 39.0, 0.99)
    assert set(calibration.PUBLISHED) == {(128_000, 300), (500_000, 50), (500_000, 100), (1_000_000, 48)}


def test_collapse_verdict_direction_and_order_of_magnitude() -> None:
    ref = {"ttft_p50_s": 2.6, "cache_hit": 0.99}
    v = calibration.collapse_verdict({"ttft_p50_s": 300.0, "cache_hit": 0.03}, ref)
    assert v["direction"] and v["order_ttft_p50"] and v["order_cache_hit"] is False  # 0.03 / 0.41 < 0.1
    assert calibration.collapse_verdict({"ttft_p50_s": 300.0, "cache_hit": 0.05}, ref)["order_cache_hit"]
    v = calibration.collapse_verdict({"ttft_p50_s": 2.0, "cache_hit": 0.95}, ref)
    assert not v["direction"] and not v["order_ttft_p50"] and v["order_cache_hit"]
    v = calibration.collapse_verdict({"ttft_p50_s": 151.0, "cache_hit": 0.0}, ref)
    assert v["direction"] and not v["order_cache_hit"]


def test_arrival_presets_sizes_and_restarts() -> None:
    params = WorkloadParams(context_target_tokens=500_000)
    rng = np.random.default_rng(1)
    seed_cfg = SimConfig(arrivals=ARRIVALS["seed"])
    sizes = [conversation_size(seed_cfg, params, rng, first=True) for _ in range(200)]
    assert 0.8 * 500_000 <= min(sizes) and max(sizes) <= 0.95 * 500_000
    assert restart_limit(seed_cfg, params) == seed_cfg.max_model_len  # no compaction at the target
    fresh = SimConfig(arrivals=ARRIVALS["fresh"])
    sizes = [conversation_size(fresh, params, rng, first=True) for _ in range(200)]
    assert 0.4 * 500_000 <= min(sizes) and max(sizes) <= 0.6 * 500_000
    assert restart_limit(fresh, params) == 500_000
    steady = SimConfig(arrivals=ARRIVALS["steady"])
    firsts = [conversation_size(steady, params, rng, first=True) for _ in range(200)]
    later = [conversation_size(steady, params, rng, first=False) for _ in range(200)]
    assert max(firsts) > 0.6 * 500_000 >= max(later)  # only the first joins mid-life
    big = SimConfig(arrivals=ARRIVALS["seed"], max_model_len=400_000)
    assert conversation_size(big, params, rng, first=True) <= 0.97 * 400_000


def test_accepted_tokens_spread_and_bounds() -> None:
    rng = np.random.default_rng(0)
    assert EngineModel(decode_tokens_per_step=3.0, decode_accept_sigma=0.0).accepted_tokens(rng) == 3.0
    model = EngineModel(decode_tokens_per_step=3.0, decode_accept_sigma=0.4, nextn=5)
    draws = np.array([model.accepted_tokens(rng) for _ in range(4000)])
    assert draws.min() >= 1.0 and draws.max() <= 6.0
    assert draws.mean() == pytest.approx(3.0, rel=0.05)
    assert np.quantile(draws, 0.1) < 2.5 and np.quantile(draws, 0.9) > 3.5


def _request(rid: str, n: int, max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, np.arange(n, dtype=np.int32) % 1000 + 5, SamplingParams(max_tokens=max_tokens))


def test_second_vote_turns_an_empty_prompt_step_into_nothing_and_a_fitting_head_runs() -> None:
    """DeepInfer's want is 'usage <= 0.9 and a waiting head'; whether the head fits is found out by
    the prompt schedule, and a prompt step where no rank scheduled anything does not happen."""

    async def run() -> None:
        group = SimGroup(Deployment(num_ranks=1, gpu_kv_tokens_per_rank=100 * 128, block_tokens=128),
                         EngineModel(max_num_batched_tokens=16_384))  # not started: we drive the steps
        held = await group.import_blocks(0, 0, 50)  # cached blocks: usage 0.5
        group.submit(0, _request("big", 80 * 128))  # needs 80 blocks, 49 are free
        assert group._wants_prefill(group.ranks[0])  # below the watermark with a waiting head
        before = (group._decode_step, group.num_prefill_steps, len(group.ranks[0].free))
        group._decode_step = 70
        assert not await group._prefill_step([True])
        assert (group.num_prefill_steps, len(group.ranks[0].free)) == before[1:]
        assert group._decode_step == 70 and len(group.ranks[0].waiting) == 1
        await group.release(0, held)
        assert await group._prefill_step([True])  # now it fits: a prompt step, decode_step reset
        assert group._decode_step == 0 and group.num_prefill_steps == 1
        group.check_accounting()

    run_virtual(run())


@pytest.mark.parametrize("filler", [False, True])
def test_the_vote_filler_passes_an_all_point_that_an_empty_rank_would_veto(filler: bool) -> None:
    """Two ranks, rank 0 with a prompt waiting that fits, rank 1 with nothing waiting: DeepInfer's
    ALL point (decode_step 0, 70) fails; with the vote filler (rank/vote_filler.py) it passes. ANY
    points and the guards (an empty rank over the watermark, a head that cannot start, the streak
    cap) are the same either way."""

    async def run() -> None:
        group = SimGroup(Deployment(num_ranks=2, gpu_kv_tokens_per_rank=100 * 128, block_tokens=128),
                         EngineModel(), vote_filler=filler)  # not started: we ask the vote directly
        group.submit(0, _request("a", 15 * 128))  # needs 15 blocks
        wants = [group._wants_prefill(r) for r in group.ranks]
        assert wants == [True, False]
        for step, passes in ((0, filler), (70, filler), (140, filler), (100, True), (35, False)):
            group._decode_step = step
            assert group._vote_passes(wants) is passes, step
        group._decode_step = 0
        group._prompt_streak = 8  # FILLER_MAX_STREAK prompt steps in a row
        assert group._vote_passes(wants) is False
        group._prompt_streak = 0
        held = await group.import_blocks(1, 0, 95)  # rank 1 over the watermark: its vote is no
        assert group._vote_passes(wants) is False
        await group.release(1, held)
        held = await group.import_blocks(0, 0, 86)  # usage 0.87: rank 0 wants, its head does not fit
        assert group._wants_prefill(group.ranks[0]) and group._vote_passes(wants) is False
        await group.release(0, held)
        assert group._vote_passes(wants) is filler
        assert group.counters.filler_votes == (4 if filler else 0)

    run_virtual(run())


def test_prompt_larger_than_the_pool_is_ignored_and_leaks_nothing() -> None:
    async def run() -> None:
        group = SimGroup(Deployment(num_ranks=1, gpu_kv_tokens_per_rank=20 * 128, block_tokens=128),
                         EngineModel())
        group.start()
        outs = [o async for o in group.submit(0, _request("huge", 30 * 128))]
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ERROR
        assert outs[-1].error == "prompt exceeds the KV pool"
        ok = [o async for o in group.submit(0, _request("small", 3 * 128))]
        assert ok[-1].finish_reason == FinishReason.LENGTH
        await group.release(0, ok[-1].kept_blocks)
        group.check_accounting()
        assert group.stats(0).num_free_blocks == group.num_blocks - 1
        await group.close()

    run_virtual(run())


def test_sticky_node_is_stable_and_spreads() -> None:
    assert sticky_node("a1-c0", 4) == sticky_node("a1-c0", 4)
    assert len({sticky_node(f"a{i}-c0", 4) for i in range(64)}) == 4


@pytest.mark.parametrize("policy", ["ours", "seed"])
def test_sticky_routing_keeps_each_session_on_one_worker_and_caches_better(policy: str) -> None:
    config = SimConfig(
        policy=policy,
        arrivals=ARRIVALS["steady"],
        deployment=Deployment(num_ranks=2, gpu_kv_tokens_per_rank=200_000, l1_tokens_per_rank=1_000_000,
                              block_tokens=256),
        engine=EngineModel(max_num_seqs=8, max_num_batched_tokens=4096),
        duration_s=120.0, warmup_s=20.0, ramp_s=5.0,
    )
    sticky = run_virtual(simulate_nodes(config, 20_000, 3, 2, "sticky"))
    rand = run_virtual(simulate_nodes(config, 20_000, 3, 2, "random"))
    for r in (sticky, rand):
        t = r.totals
        assert t.num_submitted > 20 and t.num_finished + t.num_failed_in_engine == t.num_submitted
        assert sum(r.requests_per_node) == len(r.records)
    assert sticky.nodes_per_session == 1.0 < rand.nodes_per_session
    assert sticky.stats.cache_hit > rand.stats.cache_hit


class _Restores:
    """Two ranks, 100-token blocks copying at 10 ms each; ``restore`` imports ``blocks`` at
    virtual time ``at`` and notes when it returned (s from the start) under ``name``."""

    def __init__(self, model: EngineModel) -> None:
        self.loop = asyncio.get_running_loop()
        self.group = SimGroup(Deployment(num_ranks=2, gpu_kv_tokens_per_rank=100 * 100,
                                         l1_tokens_per_rank=10_000, block_tokens=100,
                                         restore_tokens_per_s=10_000), model)
        self.t0 = self.loop.time()
        self.done: dict[str, float] = {}

    def now(self) -> float:
        return round(self.loop.time() - self.t0, 6)

    async def restore(self, name: str, at: float, rank: int, blocks: int) -> None:
        await asyncio.sleep(at)
        ids = await self.group.import_blocks(rank, 0, blocks)
        self.done[name] = self.now()
        await self.group.release(rank, ids)


@pytest.mark.parametrize("at_boundary", [False, True])
def test_copies_at_step_boundaries_wait_for_one_and_stall_the_group(at_boundary: bool) -> None:
    """``EngineModel.imports_at_boundary`` (DeepInfer without the transfer thread): an import waits
    for its rank's next step boundary, and the group stands there for the longest copy of any rank
    at that boundary (lockstep); one that comes while the group stands joins the stall. Beside the
    step (the reference engine), it copies at once and the steps do not wait."""

    async def run() -> None:
        r = _Restores(EngineModel(imports_at_boundary=at_boundary))

        async def steps() -> float:
            stalled = await r.group._steps(0.1, 5)  # 5 steps of 100 ms
            r.done["steps"] = r.now()
            return stalled

        stalled, *_ = await asyncio.gather(steps(), r.restore("a", 0.25, 0, 3), r.restore("b", 0.26, 1, 5),
                                           r.restore("c", 0.52, 0, 3))
        ended = r.done.pop("steps")
        if at_boundary:
            # a and b reach boundary 3 (0.3 s); the group stands 50 ms there (b's copy), counted at
            # the end of the steps (0.5 s); c comes while it stands and adds its 30 ms.
            assert r.done == {"a": 0.33, "b": 0.35, "c": 0.55} and stalled == pytest.approx(0.08)
            assert ended == pytest.approx(0.58)
        else:
            assert r.done == {"a": 0.28, "b": 0.31, "c": 0.55} and stalled == 0.0 and ended == 0.5
        assert r.group.counters.transfer_stall_s == pytest.approx(stalled)

    run_virtual(run())


def test_fenced_imports_wait_for_the_decode_step_in_progress_only() -> None:
    """``EngineModel.imports_wait_decode_step`` (DeepInfer through the transfer thread,
    rank/deepinfer_transfers.py): an import in a decode step copies after that step ends, beside
    the next one, without stopping the group; in a prompt step (synced in place) it copies at once."""

    async def run() -> None:
        r = _Restores(EngineModel(imports_wait_decode_step=True))

        async def steps() -> None:
            stalled = await r.group._steps(0.1, 5)  # 5 decode steps of 100 ms
            stalled += await r.group._steps(1.0, 1, prompt=True)  # then one prompt step of 1 s
            assert stalled == 0.0
            r.done["steps"] = r.now()

        await asyncio.gather(steps(), r.restore("a", 0.25, 0, 3), r.restore("b", 0.26, 1, 5),
                             r.restore("c", 0.52, 0, 3), r.restore("d", 0.80, 1, 2))
        # a, b: the step in progress ends at 0.3 s, then they copy (30, 50 ms) beside step 4;
        # c, d: in the prompt step from 0.5 s, at once.
        assert r.done == {"a": 0.33, "b": 0.35, "c": 0.55, "d": 0.82, "steps": 1.5}
        assert r.group.counters.transfer_stall_s == 0.0

    run_virtual(run())
