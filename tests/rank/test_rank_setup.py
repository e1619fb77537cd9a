"""The rank's test-only engine wrapper seam (``rank/rank_setup.py``, ``standins/step_gate.py``):
without ``DIB_TEST_ENGINE_WRAPPER`` the engine is left exactly as built; with it, the named
module's ``wrap_engine`` is applied, and the step gate then holds steps while the test's file exists."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rank import rank_setup
from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig
from rank.transfers import GATE_ENV


def _engine() -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(model="null", block_size=16, num_blocks=8))


def test_without_the_variable_the_engine_is_not_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rank_setup.TEST_ENGINE_WRAPPER_ENV, raising=False)
    engine = _engine()
    assert rank_setup._test_wrapper(engine, 0) is engine
    assert "step" not in vars(engine)  # the class's own method: nothing patched on the instance


def test_the_step_gate_holds_steps_while_the_file_exists(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.setenv(rank_setup.TEST_ENGINE_WRAPPER_ENV, "standins.step_gate")
    monkeypatch.setenv(GATE_ENV, str(tmp_path))
    engine = rank_setup._test_wrapper(_engine(), 0)
    assert "step" in vars(engine)  # wrapped on the instance
    assert engine.step() == []  # no hold file: runs at once
    (tmp_path / "hold-step").touch()
    stepped = threading.Event()

    def step() -> None:
        engine.step()
        stepped.set()

    t = threading.Thread(target=step, daemon=True)
    t.start()
    for _ in range(1000):  # bounds a hang; the order is shown by the marker, not by a clock
        if (tmp_path / "held-step").exists():
            break
        stepped.wait(0.01)
    assert (tmp_path / "held-step").exists() and not stepped.is_set()
    (tmp_path / "hold-step").unlink()
    t.join(10)
    assert stepped.is_set()
    assert not (tmp_path / "held-step").exists()
