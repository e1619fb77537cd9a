"""bench/multi_gpu_run.py: the pure analysis helpers (fast) and the whole script in its CPU quick
mode (slow: two gloo rank processes, the HTTP server, agents, a session move and a SIGKILL)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.loadgen.client import RequestRecord
from bench.multi_gpu.analysis import (
    CopyLimit,
    cache_tiers,
    delta,
    fault_window,
    parse_metrics,
    phase_table,
    restore_table,
)
from bench.multi_gpu.load import record_from_dict, record_to_dict
from bench.multi_gpu.report import render_markdown
from rank.link import TransferTiming

ROOT = Path(__file__).resolve().parents[2]

METRICS_TEXT = """\
# HELP deepinfer_cache_prompt_tokens_total Prompt tokens of admitted turns.
# TYPE deepinfer_cache_prompt_tokens_total counter
deepinfer_cache_prompt_tokens_total 10000.0
# HELP deepinfer_cache_cached_tokens_total Prompt tokens served from cache, by tier.
# TYPE deepinfer_cache_cached_tokens_total counter
deepinfer_cache_cached_tokens_total{tier="l0"} 6000.0
deepinfer_cache_cached_tokens_total{tier="l1"} 1000.0
# HELP deepinfer_cache_l1_restored_tokens_total Tokens restored.
# TYPE deepinfer_cache_l1_restored_tokens_total counter
deepinfer_cache_l1_restored_tokens_total 3000.0
# HELP deepinfer_cache_l1_restore_seconds Wall time of one restore.
# TYPE deepinfer_cache_l1_restore_seconds histogram
deepinfer_cache_l1_restore_seconds_bucket{le="0.01"} 1.0
deepinfer_cache_l1_restore_seconds_bucket{le="+Inf"} 2.0
deepinfer_cache_l1_restore_seconds_count 2.0
deepinfer_cache_l1_restore_seconds_sum 0.05
"""


def test_metrics_parse_delta_and_tiers() -> None:
    after = parse_metrics(METRICS_TEXT)
    before = {"deepinfer_cache_prompt_tokens_total": 2000.0,
              "deepinfer_cache_cached_tokens_total{tier=l0}": 1000.0}
    tiers = cache_tiers(delta(after, before))
    assert tiers["prompt_tokens"] == 8000 and tiers["l0_tokens"] == 5000 and tiers["l1_tokens"] == 1000
    assert tiers["hit_l0"] == pytest.approx(5000 / 8000) and tiers["hit_total"] == pytest.approx(6000 / 8000)
    assert tiers["l1_restores"] == 2 and tiers["l1_restore_mean_s"] == pytest.approx(0.025)
    # prefetched restores (filed under l0 by the tier counter) move to the restored share
    assert tiers["hit_restored_corrected"] == pytest.approx(3000 / 8000)
    assert tiers["hit_resident_corrected"] == pytest.approx(3000 / 8000)
    assert math.isnan(cache_tiers({})["hit_l0"])


def test_copy_limit_interpolates_and_extrapolates() -> None:
    limit = CopyLimit.from_rows([{"bytes": 2000, "contiguous_s": 0.002},
                                 {"bytes": 1000, "contiguous_s": 0.0015}])
    assert limit.time_s(10) == pytest.approx(0.0015)  # latency floor below the smallest size
    assert limit.time_s(1500) == pytest.approx(0.00175)
    assert limit.time_s(4000) == pytest.approx(0.004)  # the largest size's bandwidth beyond it
    with pytest.raises(ValueError):
        CopyLimit.from_rows([])


def test_restore_table_against_the_limit_of_the_restoring_rank() -> None:
    limits = {0: CopyLimit([100, 1000], [0.001, 0.01]), 1: CopyLimit([100, 1000], [0.002, 0.02])}
    restores = [
        {"t": 0.0, "rank": 0, "num_blocks": 10, "wall_s": 0.02, "ok": True},
        {"t": 1.0, "rank": 1, "num_blocks": 10, "wall_s": 0.02, "ok": True},
        {"t": 2.0, "rank": 1, "num_blocks": 3, "wall_s": 0.5, "ok": False},
    ]
    table = restore_table(restores, limits, bytes_per_block=100)
    assert table["num"] == 2 and table["num_failed"] == 1
    assert table["by_rank"] == {"0": 1, "1": 1}
    assert table["ratio_p50"] == pytest.approx(1.5)  # ratios 2.0 (rank 0) and 1.0 (rank 1)
    assert table["total_bytes"] == 2000
    assert restore_table([], limits, 100)["num"] == 0


def test_restores_whose_copy_is_short_are_also_counted_apart() -> None:
    """A 1-block restore's ratio is its round trip's floor; the others' ratios are given alone."""
    limits = {0: CopyLimit([1, 100], [0.0001, 0.01])}  # 0.1 ms for one block, 10 ms for 100
    restores = [
        {"t": 0.0, "rank": 0, "num_blocks": 1, "wall_s": 0.001, "ok": True},  # 10x
        {"t": 1.0, "rank": 0, "num_blocks": 100, "wall_s": 0.012, "ok": True},  # 1.2x
        {"t": 2.0, "rank": 0, "num_blocks": 100, "wall_s": 0.014, "ok": True},  # 1.4x
    ]
    table = restore_table(restores, limits, bytes_per_block=1)
    assert table["num"] == 3 and table["num_small"] == 1
    assert table["small_wall_p50_s"] == pytest.approx(0.001)
    assert table["ratio_p95"] > 8  # the 10x one is in the whole table's tail
    assert table["ratio_p50_large"] == pytest.approx(1.3)
    assert table["ratio_p95_large"] == pytest.approx(1.39)


def test_phase_table_splits_one_ops_round_trips_in_the_window() -> None:
    def timing(op: str, sent: float, engine_s: float) -> TransferTiming:
        return TransferTiming(op, 0, sent, to_rank_s=0.001, wait_s=0.0, engine_s=engine_s, back_s=0.002,
                              resume_s=0.0)

    rows = [timing("import", 1.0, 0.004), timing("import", 2.0, 0.006), timing("export", 1.5, 0.1),
            timing("import", 9.0, 1.0)]
    table = phase_table(rows, "import", t_to=5.0)
    assert table["num"] == 2  # the export and the import sent at 9.0 are left out
    assert table["engine_s"]["p50"] == pytest.approx(0.005)
    assert table["engine_s"]["mean"] == pytest.approx(0.005)
    assert table["total_s"]["p50"] == pytest.approx(0.008)
    text = render_markdown({"command": "x", "phases": {"cache": {"transfer_phases": {"import": table}}}})
    assert "| import | 2 |" in text
    assert phase_table([], "import")["num"] == 0


def _rec(t_start: float, t_end: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(agent_id=0, session_id="s", t_start=t_start, t_end=t_end, error=error, status=200)


def test_fault_window_splits_in_flight_and_later_requests() -> None:
    records = [_rec(0, 5), _rec(8, 10.5, "killed"), _rec(9, 12), _rec(11, 11.2, "503"), _rec(13, 20)]
    w = fault_window(records, t_kill=10.0)
    assert w["in_flight_at_kill"] == 2 and w["in_flight_failed"] == 1 and w["in_flight_completed"] == 1
    assert w["first_error_end_after_kill_s"] == pytest.approx(0.5)
    assert w["requests_started_after_kill"] == 2 and w["errors_started_after_kill"] == 1
    assert w["agent_first_ok_end_after_kill_s"] == pytest.approx(10.0)


def test_record_round_trip_and_report_renders_partial_documents() -> None:
    r = _rec(1.0, 2.0)
    r.ttft_s, r.output_tokens, r.cached_tokens = 0.5, 7, 128
    back = record_from_dict(orjson.loads(orjson.dumps(record_to_dict(r))))
    assert (back.ttft_s, back.output_tokens, back.cached_tokens, back.t_start) == (0.5, 7, 128, 1.0)
    text = render_markdown({"command": "x", "phases": {"move": {"error": "boom"}}, "errors": ["run: boom"]})
    assert "boom" in text and text.startswith("# Multi-GPU lockstep run")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_mode_end_to_end(tmp_path: Path) -> None:
    env = {k: v
           for k, v in os.environ.items()
           if k not in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    proc = subprocess.run([sys.executable, "-m", "bench.multi_gpu_run", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    doc = orjson.loads((tmp_path / "multi_gpu_run.json").read_bytes())
    assert proc.returncode == 0, (doc.get("errors"), proc.stderr[-3000:])
    ph = doc["phases"]
    # every rank process got the multicast-off variables even though the driver's env lacked them
    for rank in ph["start"]["ranks"]:
        assert (rank["env"]["NCCL_NVLS_ENABLE"] == "0"
                and rank["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1")
    assert all(row["bytes_identical"] for v in ph["copy_limit"].values() for row in v["sizes"])
    move = ph["move"]
    assert move["ok"], move
    assert move["restored_on_dst"]["admitted_on_rank"] == 1 and move["restored_on_dst"]["restored_blocks"] > 0
    kill = ph["sigkill"]
    assert kill["epoch_after"] == kill["epoch_before"] + 1
    assert kill["first_new_request_ok_after_s"] is not None
    assert kill["agents"]["in_flight_at_kill"] == kill["agents"]["in_flight_failed"] + kill["agents"][
        "in_flight_completed"]
    assert ph["load"]["num_records"] > 0 and ph["cache"]["num_admissions"] > 0
    assert (tmp_path / "multi_gpu_run.md").read_text().count("## ") >= 6
