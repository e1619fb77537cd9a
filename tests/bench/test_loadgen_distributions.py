"""The load generator's turn-size distributions, trace replacement and request shape."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from bench.loadgen.distributions import (
    LogNormal,
    ParametricTurnSource,
    TraceError,
    TraceTurnSource,
    WorkloadParams,
    initial_context_tokens,
    make_turn_source,
    next_turn,
)


def test_lognormal_quantiles_match_parameters() -> None:
    dist = LogNormal(p50=700, p90=3600)
    rng = np.random.default_rng(1)
    samples = np.array([dist.sample(rng) for _ in range(40_000)])
    assert np.quantile(samples, 0.5) == pytest.approx(700, rel=0.05)
    assert np.quantile(samples, 0.9) == pytest.approx(3600, rel=0.06)
    assert samples.mean() == pytest.approx(dist.mean, rel=0.08)


def test_lognormal_rejects_p90_below_p50() -> None:
    with pytest.raises(ValueError):
        LogNormal(p50=100, p90=50)


def test_parametric_turns_follow_defaults() -> None:
    params = WorkloadParams()
    source = ParametricTurnSource(params)
    rng = np.random.default_rng(2)
    turns = [source.next_turn(rng) for _ in range(30_000)]
    tool = [t for t in turns if t.kind == "tool"]
    assert len(tool) / len(turns) == pytest.approx(0.94, abs=0.01)
    assert np.mean([t.thinking for t in turns]) == pytest.approx(0.39, abs=0.015)
    outputs = np.array([t.output_tokens for t in turns])
    assert np.quantile(outputs, 0.5) == pytest.approx(220, rel=0.05)
    assert np.quantile(outputs, 0.9) == pytest.approx(900, rel=0.07)
    calls = np.array([t.num_tool_calls for t in tool])
    assert np.mean(calls == 1) == pytest.approx(0.85, abs=0.015)
    assert calls.max() <= 4 and calls.min() >= 1
    # growth per tool step = output + tool result: [W3] p50 677, p90 3,649 (fitted within ~10%)
    growth = np.array([t.new_input_tokens for t in tool]) + outputs[: len(tool)]
    assert np.quantile(growth, 0.5) == pytest.approx(677, rel=0.12)
    assert np.quantile(growth, 0.9) == pytest.approx(3649, rel=0.12)
    assert all(t.gap_s == 3.0 for t in turns)


def test_size_scale_scales_medians() -> None:
    rng = np.random.default_rng(3)
    source = ParametricTurnSource(WorkloadParams(size_scale=0.1))
    outputs = [source.next_turn(rng).output_tokens for _ in range(20_000)]
    assert np.quantile(outputs, 0.5) == pytest.approx(22, rel=0.1)


def test_initial_context_stays_within_start_fractions() -> None:
    params = WorkloadParams(context_target_tokens=500_000)
    rng = np.random.default_rng(4)
    sizes = np.array([initial_context_tokens(params, rng) for _ in range(5_000)])
    assert sizes.min() >= 0.4 * 500_000 and sizes.max() <= 0.6 * 500_000
    assert sizes.mean() == pytest.approx(250_000, rel=0.02)


def test_fixed_prefix_shrinks_for_small_targets() -> None:
    system, tools = WorkloadParams(context_target_tokens=8_000).fixed_prefix_tokens()
    assert system + tools <= 0.25 * 8_000 + 1
    assert WorkloadParams().fixed_prefix_tokens() == (3_000, 15_000)


def test_trace_file_replaces_the_distributions(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"kind": "tool", "new_input_tokens": 100, "output_tokens": 10, "gap_s": 1.5, "num_tool_calls": 2},
        {"kind": "user", "new_input_tokens": 200, "output_tokens": 20},
        {"kind": "tool", "new_input_tokens": 300, "output_tokens": 30, "thinking": True},
    ]
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n\n")
    params = WorkloadParams(pacing_s=4.0)
    source = make_turn_source(params, str(path))
    assert isinstance(source, TraceTurnSource)
    rng = np.random.default_rng(5)
    walk = [next_turn(source, rng, agent_key=7) for _ in range(6)]
    # consecutive lines in order, wrapping around, from a random start
    sizes = [t.new_input_tokens for t in walk]
    start = sizes[0] // 100 - 1
    assert sizes == [100 * ((start + i) % 3 + 1) for i in range(6)]
    by_size = {t.new_input_tokens: t for t in walk}
    assert by_size[100].gap_s == 1.5 and by_size[100].num_tool_calls == 2
    assert by_size[200].gap_s == 4.0 and by_size[200].kind == "user" and by_size[200].num_tool_calls == 0
    assert by_size[300].thinking


@pytest.mark.parametrize(
    "line",
    [b"not json", b'{"kind": "tool"}', b'{"kind": "x", "new_input_tokens": 1, "output_tokens": 1}',
     b'{"new_input_tokens": 0, "output_tokens": 1}', b"[1, 2]"],
)
def test_bad_trace_lines_name_the_line(tmp_path, line: bytes) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"new_input_tokens": 5, "output_tokens": 5}\n' + line + b"\n")
    with pytest.raises(TraceError, match="line 2"):
        TraceTurnSource(path, WorkloadParams())
