"""bench.decode_bench runs end to end (small sizes; its figures are printed, never asserted): the
server, real rank processes with the DeepInfer adapter over the stand-in core and the null forward,
every stream complete, and each rank's step profile written and read back."""

from __future__ import annotations

from bench.decode_bench import parse_args, run
from tests.support.ports import free_port

RANKS, SEQS, TOKENS = 2, 3, 24



def test_decode_bench_streams_everything_and_profiles_each_rank(tmp_path, capsys) -> None:
    args = parse_args(["--core", "stand-in", "--ranks", str(RANKS), "--seqs", str(SEQS), "--max-tokens",
                       str(TOKENS), "--py-spy", "off", "--prefill-interval", "1", "--port", str(free_port()),
                       "--work-dir", str(tmp_path)])
    figures = run(args)
    assert figures["errors"] == 0 and figures["output_tokens"] == RANKS * SEQS * TOKENS
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0.json", "rank1.json"]
    assert figures["rank_step_cpu_us"] > figures["rank_ours_cpu_us"] > 0
    out = capsys.readouterr().out
    assert "rank step, mean over" in out and "adapter bookkeeping" in out and "projection" in out
