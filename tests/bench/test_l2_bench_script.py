"""bench.l2_bench runs end to end on this machine (small sizes; the figures themselves are
printed, not asserted): save/restore are byte-exact, and the --prefill path (CPU, the reference
engine's 'null' model) moves the engine's own KV rows GPU/host -> disk -> host -> engine intact."""

from __future__ import annotations

import os

from bench.l2_bench import main


def test_l2_bench_save_restore_and_prefill_paths(tmp_path, capsys) -> None:
    out = main(["--dir", str(tmp_path), "--tokens", "4096", "--raw-mb", "16", "--repeats", "1",
                "--threads", "1,2", "--chunk-mb", "1", "--prefill", "--device", "cpu", "--model", "null",
                "--prefill-tokens", "8448", "--batched-tokens", "512", "--json", str(tmp_path / "l2.json")])
    assert [r["identical"] for r in out["l2"]] == [True, True]
    assert all(r["save_gbps"] > 0 and r["restore_gbps"] > 0 for r in out["l2"])
    pf = out["prefill"]
    assert pf["saved_blocks"] == pf["loaded_blocks"] == 66 and pf["restored_identical"] is True
    assert "prefill / restore" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["l2.json"]  # scratch files and extents are gone
