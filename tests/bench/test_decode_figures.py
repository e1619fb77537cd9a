"""bench.decode_figures: what is counted as ours per rank step, and the backend's split by component
(the server's start and stop left out of the py-spy sample)."""

from __future__ import annotations

import pytest

from bench.decode_figures import classify, print_projection, print_rank_table

PHASES = ("drain", "vote", "engine", "adapter", "stats", "encode", "send", "other")


def test_our_share_of_a_rank_step_leaves_out_deepinfer_step_and_vote(capsys) -> None:
    cpu = dict(zip(PHASES, (10.0, 200.0, 300.0, 150.0, 20.0, 50.0, 40.0, 5.0)))
    wall = {p: 2 * v for p, v in cpu.items()}
    prof = {"wall_us": wall, "cpu_us": cpu, "steady_steps": 10, "ranks": 4, "tokens_per_step": 128.0}
    threads = {"loop thread": 800.0, "gloo_tcp_loop": 600.0, "ZMQbg": 30.0}
    figures = print_rank_table(prof, threads)
    assert figures["rank_ours_cpu_us"] == pytest.approx(275.0)  # drain, adapter, stats, encode, send, other
    assert figures["rank_vote_cpu_us"] == 200.0 and figures["rank_engine_cpu_us"] == 300.0
    assert figures["rank_added_cpu_us"] == pytest.approx(305.0)  # + zmq's I/O thread, not gloo's
    assert figures["rank_step_cpu_us"] == pytest.approx(775.0)
    assert "added per rank step by our code: 275 us loop thread + 30 us" in capsys.readouterr().out


def test_backend_split_by_innermost_component_without_start_and_stop(tmp_path) -> None:
    raw = tmp_path / "spy.txt"
    lines = [
        ("main (deepinfer_backend.py:1);ChatService._pump (server/service.py:2);IncrementalDetokenizer.feed "
         "(protocol/detokenize.py:3) 7"),
        "main (deepinfer_backend.py:1);RankLink.receive (rank/link.py:9) 5",
        "main (deepinfer_backend.py:1);ChatService._pump (server/service.py:2) 3",
        "main (deepinfer_backend.py:1) 2",
        "main (deepinfer_backend.py:1);_serve_forever (deepinfer_backend.py:363);run_preflight (x.py:1) 40",
        "_run_module_as_main (<frozen runpy>:1);_find_and_load (<frozen importlib._bootstrap>:1) 30",
        ("Thread.run (threading.py:1);Runtime._build_protocol (server/runtime.py:165);PromptTokenizer.load "
         "(protocol/tokenize.py:1) 20"),
        "garbage line without a count",
    ]
    raw.write_text("\n".join(lines))
    counts, startup = classify(raw)
    assert startup == 90
    assert counts == {"detokenize": 7, "rank receive": 5, "service": 3, "other (event loop, GC)": 2}


def test_projection_takes_the_slowest_of_a_rank_and_the_backend() -> None:
    figures = {"backend_cpu_us_per_token": 4.0, "ranks_cpu_us_per_token": 10.0, "rank_step_cpu_us": 800.0}
    print_projection(figures, ranks=4, seqs=128)
    # rank process 10 us x 128 = 1280 us per step; backend 4 us x 512 = 2048 us per node step
    assert figures["projected_node_tokens_per_s"] == pytest.approx(512 / 2048e-6)
    assert figures["rank_process_cpu_us_per_step"] == pytest.approx(1280.0)
