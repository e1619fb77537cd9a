"""Preflight's DeepInfer venv probe against the real DeepInfer venv (scripts/build_deepinfer.sh).

It looked for ``Scheduler`` in ``deepinfer._C``, where the extension does not put it (it is in
``deepinfer._C.engine``), so it reported the prefix-cache patch missing on a patched build (seen
in the worker stand-in's /healthz).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.config import load_config
from server.preflight_checks.probe import RealSystemProbe
from server.preflight_checks.report import Status
from server.preflight_checks.venv import check_prefix_api, check_venv, probe_venv

pytestmark = pytest.mark.deepinfer_build


def test_probe_finds_the_patch_in_the_real_venv() -> None:
    build = Path(os.environ["DEEPINFER_BUILD_DIR"])
    venv = build / "venv"
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(build / "stubs")}
    facts = probe_venv(venv, RealSystemProbe(), env, import_timeout_s=120)
    config = load_config({"engine": "deepinfer", "deepinfer_venv": str(venv), "model_dir": "/nonexistent"})
    assert check_venv(config, facts).status is Status.OK, facts
    assert facts["api"]["Scheduler.add_sequence_with_prefix"] is True, facts
    result = check_prefix_api(config, facts)
    # LLMEngine needs DeepEP (SM100 wheels), absent on a CPU machine: reported as not checked.
    assert facts["api"]["LLMEngine.enqueue_with_prefix"] is None and "deep_ep" in result.detail, result.line()
    assert result.status is Status.WARN and "lacks the prefix-cache patch" not in result.detail
