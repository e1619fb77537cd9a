"""bench/multi_gpu_run.py --policy both: the argument plumbing, the levers each run gets, the
comparison table and the simulator's prediction for a tiny setup (the whole run: the CPU smoke in
the report, ``python -m bench.multi_gpu_run --quick --policy both --out DIR``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson

from bench.multi_gpu.onoff import POLICIES, measured, predict, render, report, shared_prefix_tokens
from bench.multi_gpu_run import _without, parse_args, workload_config


def test_both_runs_off_then_on_with_the_levers_and_no_sigkill() -> None:
    args = parse_args(["--quick", "--policy", "both", "--out", "/tmp/x", "--gpus", "1"])
    assert args.kill_at == 0.0 and args.gpus == 1
    assert _without(["--quick", "--policy", "both", "--out=/tmp/x", "--kill-at", "5", "--gpus", "1"],
                    "--policy", "--out", "--kill-at") == ["--quick", "--gpus", "1"]
    on = workload_config(parse_args(["--quick", "--policy", "on", "--out", "/tmp/x"]))
    off = workload_config(parse_args(["--quick", "--policy", "off", "--out", "/tmp/x"]))
    assert (on["place_homeless"], on["submit_gate"]) == (True, False)
    assert (off["place_homeless"], off["submit_gate"]) == (False, False)
    assert "place_homeless" not in workload_config(parse_args(["--quick", "--out", "/tmp/x"]))


def _doc(ttft: float, ratio50: float, ratio95: float) -> dict:
    return {
        "settings": {"ranks": 2, "num_blocks": 56, "l1_gb": 0.05, "context": 4000, "size_scale": 0.1,
                     "agents": 4, "duration": 40.0, "warmup": 10.0, "ramp": 4.0, "batched_tokens": 2048,
                     "pacing": 3.0, "pacing_dist": "constant"},
        "bytes_per_block": 65536,
        "phases": {
            "load": {"steady": {"num_requests": 20, "error_rate": 0.0, "ttft_p50_s": ttft,
                                "ttft_p95_s": 2 * ttft, "tok_s_p50": 10.0, "tok_s_p10": 5.0,
                                "cache_hit": 0.8}},
            "cache": {"admission_queue_s_p50_p95": [0.0, 0.5],
                      "restores_before_kill": {"num": 3, "wall_p50_s": 0.01, "wall_p95_s": 0.02,
                                               "ratio_p50": ratio50, "ratio_p95": ratio95}},
            "copy_limit": {"0": {"sizes": [{"bytes": 1000, "contiguous_gb_s": 1.0},
                                           {"bytes": 4000, "contiguous_gb_s": 2.0}]}},
        },
    }


def test_table_marks_the_restore_targets(tmp_path: Path) -> None:
    runs = {"off": measured(_doc(0.5, 1.4, 2.9)), "on": measured(_doc(0.4, 1.6, 2.0))}
    assert runs["off"]["ttft_p95_s"] == 1.0 and runs["on"]["restore_ratio_p50"] == 1.6
    text = render(runs, None, "note")
    assert "| TTFT p95 s | 1.00 | 0.80 | - | - |" in text
    assert "off: restore wall / copy 1.40 / 2.90 -> meets" in text
    assert "on: restore wall / copy 1.60 / 2.00 -> misses" in text
    for policy in POLICIES:
        (tmp_path / policy).mkdir()
        (tmp_path / policy / "multi_gpu_run.json").write_bytes(orjson.dumps(_doc(0.5, 1.0, 1.0)))
    out = report(tmp_path, 20_000.0, simulate=False)
    assert (tmp_path / "onoff.md").read_text() == out and "simulator: not run" in out


def test_prediction_runs_the_simulator_with_the_levers_off_and_on() -> None:
    doc = _doc(0.5, 1.0, 1.0)
    sim = predict(doc["settings"], doc["bytes_per_block"], 10.0, 2.0, 20_000.0)
    assert set(sim) == {"off", "on"}
    for row in sim.values():
        assert row["requests"] > 0 and row["errors"] == 0.0 and not math.isnan(row["ttft_p50_s"])


def test_shared_prefix_is_the_cold_turns_common_hit_plus_the_replayed_block() -> None:
    def rec(cold: bool, cached: int, status: int = 200) -> dict:
        return {"cold": cold, "cached_tokens": cached, "status": status}

    # the one-H200 run: cold turns hit 9,856 tokens (77 blocks) unless they came first
    records = [rec(True, 0), rec(True, 9856), rec(True, 9856), rec(False, 18944), rec(True, 9856),
               rec(True, 12800), rec(True, 9856, status=503)]
    assert shared_prefix_tokens(records, 128) == 9856 + 128
    assert shared_prefix_tokens([rec(True, 0), rec(False, 5000)], 128) is None


def test_measured_queue_is_the_steady_windows_admissions() -> None:
    doc = _doc(0.5, 1.0, 1.0)
    doc["phases"]["load"].update({"t_measure_from": 10.0, "t_measure_to": 20.0})
    waits = [(5.0, 0.0), (11.0, 0.0), (12.0, 4.0), (13.0, 0.0), (19.0, 8.0), (21.0, 50.0)]
    doc["raw_admissions"] = [{"t": t, "queue_s": q} for t, q in waits]
    row = measured(doc)
    assert row["queued_share"] == 0.5 and row["queue_p50_s"] == 2.0
    assert row["queue_p95_s"] == np.percentile([0.0, 4.0, 0.0, 8.0], 95)
    assert math.isnan(measured(_doc(0.5, 1.0, 1.0))["queued_share"])  # no raw admissions: as reported


def test_prediction_over_seeds_is_the_median_with_the_range() -> None:
    doc = _doc(0.5, 1.0, 1.0)
    one = predict(doc["settings"], doc["bytes_per_block"], 10.0, 2.0, 20_000.0, 1000, seeds=1)
    three = predict(doc["settings"], doc["bytes_per_block"], 10.0, 2.0, 20_000.0, 1000, seeds=3)
    assert "ttft_p50_s_min" not in one["off"]
    row = three["off"]
    assert row["ttft_p50_s_min"] <= row["ttft_p50_s"] <= row["ttft_p50_s_max"]
    assert row["requests_min"] <= one["off"]["requests"] <= row["requests_max"]  # seed 0 is one of them
    text = render({}, three, "")
    assert f"| TTFT p50 s | - | - | {row['ttft_p50_s']:.2f} ({row['ttft_p50_s_min']:.2f}-" in text
