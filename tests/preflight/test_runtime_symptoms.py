"""RuntimeSymptoms detectors: uncached repeat turns, serialised arrivals, unknown models, too long."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, strategies as st
from prometheus_client import CollectorRegistry

from server.config import load_config
from server.symptoms import OTHER_LABEL, RuntimeSymptoms, SymptomSettings, first_divergent_position


def make(**kw: object) -> tuple[RuntimeSymptoms, CollectorRegistry]:
    registry = CollectorRegistry()
    return RuntimeSymptoms(registry, SymptomSettings(**kw),
                           clock=lambda: 0.0), registry  # type: ignore[arg-type]


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels or None)
    return 0.0 if got is None else got


# ---- uncached repeat turns -------------------------------------------------------------------


def test_uncached_repeats_raise_a_warning_with_the_divergent_position(
        caplog: pytest.LogCaptureFixture) -> None:
    sym, reg = make()
    caplog.set_level(logging.WARNING)
    for i in range(5):
        sym.observe_turn(f"s{i}", 5000, 0, now=1.0)  # first turns: nothing expected
    assert sym.active_warnings(now=1.0) == []
    for i in range(4):
        sym.observe_turn(f"s{i}", 6000, 0, first_divergent_pos=4000, now=2.0)
    warnings = sym.active_warnings(now=2.0)
    assert len(warnings) == 1 and warnings[0].startswith("uncached_repeat: 4 of the last 4 repeat turns")
    assert "matches the previous turn for 4000 tokens" in warnings[0]
    assert value(reg, "deepinfer_symptom_uncached_repeat_turns_total") == 4
    assert value(reg, "deepinfer_symptom_active", symptom="uncached_repeat") == 1
    assert "0 of 6000 prompt tokens cached" in caplog.text
    assert caplog.text.count("symptom uncached_repeat: session") == 1  # rate limited within log_interval_s


def test_cached_turns_clear_the_warning_and_short_prompts_do_not_count() -> None:
    sym, _ = make(uncached_min_turns=2)
    sym.observe_turn("a", 1000, 0)
    sym.observe_turn("a", 1100, 0)
    sym.observe_turn("a", 1200, 0)
    assert sym.active_warnings()
    for _ in range(3):
        sym.observe_turn("a", 1300, 1152)
    assert sym.active_warnings() == []
    sym2, reg2 = make(uncached_min_turns=1)
    sym2.observe_turn("b", 100, 0)
    sym2.observe_turn("b", 120, 0)  # <= one block: nothing was cacheable
    assert value(reg2, "deepinfer_symptom_repeat_turns_total") == 0 and sym2.active_warnings() == []


def test_prefix_cache_off_or_no_session_never_warns() -> None:
    sym, _ = make(prefix_cache_enabled=False, uncached_min_turns=1)
    for _ in range(10):
        sym.observe_turn("a", 5000, 0)
        sym.observe_turn(None, 5000, 0)
    assert sym.active_warnings() == []


def test_divergence_computed_from_previous_ids(caplog: pytest.LogCaptureFixture) -> None:
    sym, _ = make(uncached_min_turns=1)
    caplog.set_level(logging.WARNING)
    prev_prompt = np.arange(300, dtype=np.int32)
    prev_out = np.arange(1000, 1040, dtype=np.int32)
    prompt = np.concatenate([prev_prompt, prev_out, np.arange(5, 200)]).astype(np.int32)
    prompt[17] = -1  # e.g. a timestamp in the system prompt changed
    sym.observe_turn("s", 200, 0)
    sym.observe_turn("s", len(prompt), 0, previous_prompt_ids=prev_prompt, previous_output_ids=prev_out,
                     prompt_ids=prompt)
    assert "differs from the previous turn at token 17, inside the first block" in caplog.text


def test_first_divergent_position_cases() -> None:
    assert first_divergent_position([1, 2, 3], [4, 5], [1, 2, 3, 4, 5, 6]) == 5
    assert first_divergent_position([1, 2, 3], [4, 5], [1, 2, 3, 4, 9]) == 4
    assert first_divergent_position([1, 2, 3], [], [1, 2]) == 2
    assert first_divergent_position([1, 2, 3], [4], [7]) == 0


@given(prev=st.lists(st.integers(0, 5), max_size=40), out=st.lists(st.integers(0, 5), max_size=20),
       new=st.lists(st.integers(0, 5), max_size=70))
def test_first_divergent_position_matches_a_plain_loop(prev: list[int], out: list[int],
                                                       new: list[int]) -> None:
    ref = prev + out
    expected = next((i for i, (a, b) in enumerate(zip(ref, new)) if a != b), min(len(ref), len(new)))
    assert first_divergent_position(prev, out, new) == expected


def test_session_table_is_bounded() -> None:
    sym, _ = make(max_sessions=8)
    for i in range(100):
        sym.observe_turn(f"s{i}", 5000, 0)
    assert len(sym._sessions) == 8


# ---- serialised arrivals ---------------------------------------------------------------------


def serial_traffic(sym: RuntimeSymptoms, num: int, *, sessions: int, gap_s: float, t0: float = 0.0) -> float:
    t = t0
    for i in range(num):
        key = f"agent{i % sessions}"
        sym.observe_request_start(key, now=t)
        t += 2.0
        sym.observe_request_end(key, now=t)
        t += gap_s
    return t


def test_back_to_back_one_at_a_time_from_many_sessions_is_the_concurrency_limit() -> None:
    sym, reg = make(serial_window_requests=24)
    t = serial_traffic(sym, 23, sessions=4, gap_s=0.01)
    assert sym.active_warnings(now=t) == []  # not enough evidence yet
    t = serial_traffic(sym, 1, sessions=4, gap_s=0.01, t0=t)
    warnings = sym.active_warnings(now=t)
    assert len(warnings) == 1 and warnings[0].startswith("serial_requests:")
    assert "Concurrent requests" in warnings[0] and "512" in warnings[0]
    assert value(reg, "deepinfer_symptom_active", symptom="serial_requests") == 1
    # Real concurrency shows up: the warning clears at once.
    sym.observe_request_start("agent0", now=t)
    sym.observe_request_start("agent1", now=t)
    assert sym.active_warnings(now=t) == []
    assert value(reg, "deepinfer_symptom_serial_run_requests") == 0


def test_one_agent_alone_is_not_a_concurrency_limit() -> None:
    sym, _ = make()
    t = serial_traffic(sym, 200, sessions=1, gap_s=0.01)
    assert sym.active_warnings(now=t) == []


def test_spaced_out_requests_are_not_a_queue() -> None:
    sym, _ = make()
    t = serial_traffic(sym, 200, sessions=8, gap_s=20.0)  # humans pausing, nothing waits
    assert sym.active_warnings(now=t) == []


def test_unknown_session_keys_do_not_count_as_sessions() -> None:
    sym, _ = make()
    t = 0.0
    for _ in range(100):
        sym.observe_request_start(None, now=t)
        sym.observe_request_end(None, now=t + 1)
        t += 1.01
    assert sym.active_warnings(now=t) == []


def test_single_slot_backend_never_warns() -> None:
    sym, _ = make(capacity_slots=1)
    t = serial_traffic(sym, 100, sessions=4, gap_s=0.01)
    assert sym.active_warnings(now=t) == []


def test_warnings_expire_after_ttl() -> None:
    sym, _ = make(warning_ttl_s=100.0)
    t = serial_traffic(sym, 30, sessions=3, gap_s=0.0)
    assert sym.active_warnings(now=t)
    assert sym.active_warnings(now=t + 101) == []


def test_in_flight_never_negative() -> None:
    sym, _ = make()
    sym.observe_request_end("x", now=1.0)
    assert sym.in_flight == 0


# ---- unknown models, prompt too long ---------------------------------------------------------


def test_claude_model_id_gets_the_claude_code_hint() -> None:
    sym, reg = make()
    sym.observe_unknown_model("claude-sonnet-4-5-20250929")
    sym.observe_unknown_model("claude-sonnet-4-5-20250929")
    sym.observe_unknown_model("claude-3-5-haiku-20241022")
    assert value(reg, "deepinfer_symptom_unknown_model_requests_total",
                 model="claude-sonnet-4-5-20250929") == 2
    [warning] = sym.active_warnings()
    assert "set ANTHROPIC_DEFAULT_HAIKU_MODEL and ANTHROPIC_MODEL to deepseek-v4.1-flash" in warning
    assert sym.unknown_model_counts() == {"claude-sonnet-4-5-20250929": 2, "claude-3-5-haiku-20241022": 1}


def test_other_unknown_names_and_bounded_labels() -> None:
    sym, _ = make(max_model_labels=3)
    sym.observe_unknown_model("gpt-4o")
    assert "send model deepseek-v4.1-flash" in sym.active_warnings()[0]
    for i in range(50):
        sym.observe_unknown_model(f"junk-{i}\n\x00")
    counts = sym.unknown_model_counts()
    assert len(counts) == 4 and counts[OTHER_LABEL] == 48
    assert "junk-0??" in counts  # control characters never reach a label
    sym.observe_unknown_model("x" * 500)
    assert all(len(k) <= 64 for k in sym.unknown_model_counts())


def test_repeated_prompt_too_long_suggests_claude_code_context_limit() -> None:
    sym, reg = make()
    sym.observe_prompt_too_long(1_100_000, 1_064_960, now=1.0)
    sym.observe_prompt_too_long(1_100_000, 1_064_960, now=2.0)
    assert sym.active_warnings(now=2.0) == []  # Claude Code compacts on this; once or twice is normal
    sym.observe_prompt_too_long(1_200_000, 1_064_960, now=3.0)
    [warning] = sym.active_warnings(now=3.0)
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS below 1064960" in warning
    assert value(reg, "deepinfer_symptom_prompt_too_long_total") == 3


def test_from_config_uses_capacity_and_model_name() -> None:
    config = load_config({"ep": 2, "max_num_seqs": 8, "model_name": "my-model", "prefix_cache": False})
    sym = RuntimeSymptoms.from_config(config, CollectorRegistry())
    assert sym.settings.capacity_slots == 16 and sym.settings.served_model_name == "my-model"
    assert sym.settings.prefix_cache_enabled is False
