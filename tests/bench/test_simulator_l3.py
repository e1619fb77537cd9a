"""The simulator's L3 rows (``bench/simulator/l3.py``): with a store shared by the workers, a
randomly routed conversation restores on the worker it lands on instead of recomputing."""

from __future__ import annotations

from bench.simulator.model import ARRIVALS, Deployment, EngineModel, SimConfig
from bench.simulator.nodes import L3Model, simulate_nodes
from bench.simulator.vclock import run_virtual


def test_random_routing_with_l3_restores_what_other_workers_spilled() -> None:
    config = SimConfig(
        policy="ours", arrivals=ARRIVALS["steady"],
        deployment=Deployment(num_ranks=2, gpu_kv_tokens_per_rank=40_000, l1_tokens_per_rank=400_000,
                              block_tokens=256),
        engine=EngineModel(max_num_seqs=8, max_num_batched_tokens=4096),
        duration_s=120.0, warmup_s=20.0, ramp_s=5.0,
    )
    without = run_virtual(simulate_nodes(config, 20_000, 4, 2, "random"))
    with_l3 = run_virtual(simulate_nodes(config, 20_000, 4, 2, "random", l3=L3Model(2e9)))
    assert without.l3_restored_blocks == 0
    assert with_l3.l3_restored_blocks > 0
    assert with_l3.stats.cache_hit > without.stats.cache_hit
