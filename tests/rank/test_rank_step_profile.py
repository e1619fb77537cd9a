"""rank/step_profile.py: the per-phase step timings behind DIB_RANK_PROFILE (benchmarks only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

from rank import step_profile
from rank.engine import RequestOutput


def test_off_without_the_variable(monkeypatch) -> None:
    monkeypatch.delenv(step_profile.PROFILE_ENV, raising=False)
    prof = step_profile.from_environment(0)
    assert prof is step_profile.NO_PROFILE
    llm = SimpleNamespace(step=lambda: "out", flush_inflight_reqs=lambda: "flushed")
    prof.wrap_engine_step(SimpleNamespace(llm=llm))
    assert llm.step() == "out"  # not wrapped


def test_busy_iterations_are_recorded_by_phase(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(step_profile.PROFILE_ENV, str(tmp_path))
    prof = step_profile.from_environment(3)
    assert isinstance(prof, step_profile.StepProfile)
    llm = SimpleNamespace(step=lambda: time.sleep(0.01) or "out", flush_inflight_reqs=lambda: "flushed")
    prof.wrap_engine_step(SimpleNamespace(llm=llm))
    outputs = [RequestOutput("a", [1, 2]), RequestOutput("b", [3])]
    for busy in (True, False, True):
        prof.begin()
        prof.lap(step_profile.DRAIN)
        assert llm.step() == "out"
        prof.lap(step_profile.ADAPTER)
        prof.end(busy, outputs if busy else [])
    prof.write()
    data = json.loads((tmp_path / "rank3.json").read_text())
    assert data["phases"] == list(step_profile.PHASES)
    rows = [data["rows"][i: i + data["row"]] for i in range(0, len(data["rows"]), data["row"])]
    assert len(rows) == 2  # the idle iteration is not kept
    for row in rows:
        assert row[-2:] == [2, 3]  # outputs, tokens
        assert row[2 * step_profile.ENGINE] >= 10_000_000  # the sleep is inside the wrapped step
        assert all(v >= 0 for v in row)
