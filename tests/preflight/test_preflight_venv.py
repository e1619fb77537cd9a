"""DeepInfer venv checks: faked subprocess answers, and real Python 3.12 venvs with a stand-in deepinfer."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from server.preflight_checks.probe import RealSystemProbe
from server.preflight_checks.report import Status
from server.preflight_checks.venv import check_prefix_api, check_venv, probe_venv
from tests.preflight.preflight_fakes import (
    PYTHON312,
    FakeProbe,
    deepinfer_config,
    make_fake_venv,
    venv_runner,
)

GOOD = orjson.dumps({
    "python": [3, 12, 7], "modules": {"torch": "2.13.0", "numpy": "2.3.5", "zmq": "27.1.0"},
    "deepinfer_version": "0.1.0", "api": {"Scheduler.add_sequence_with_prefix": True,
                                          "LLMEngine.enqueue_with_prefix": True},
}).decode()


def fake_venv_dir(tmp_path: Path) -> Path:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    return tmp_path / "venv"


def test_fake_runner_good_venv(tmp_path: Path) -> None:
    venv = fake_venv_dir(tmp_path)
    config = deepinfer_config(tmp_path, venv)
    facts = probe_venv(venv, FakeProbe(runner=venv_runner(import_json=GOOD)), {})
    assert check_venv(config, facts).status is Status.OK
    assert check_prefix_api(config, facts).status is Status.OK


def test_wrong_python_version_is_fatal(tmp_path: Path) -> None:
    venv = fake_venv_dir(tmp_path)
    facts = probe_venv(venv, FakeProbe(runner=venv_runner(version="3.11.9")), {})
    res = check_venv(deepinfer_config(tmp_path, venv), facts)
    assert res.status is Status.FATAL and "Python 3.11.9" in res.detail and "3.12" in res.detail


def test_import_timeout_is_fatal_and_bounded(tmp_path: Path) -> None:
    venv = fake_venv_dir(tmp_path)
    probe = FakeProbe(runner=venv_runner(timed_out=True))
    facts = probe_venv(venv, probe, {}, import_timeout_s=7)
    res = check_venv(deepinfer_config(tmp_path, venv), facts)
    assert res.status is Status.FATAL and "within 7 s" in res.detail
    assert [c[1][1] for c in probe.calls if c[0] == "run"] == [20.0, 7]  # every subprocess has a timeout


def test_missing_venv_and_missing_python(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path / "nope")
    assert "does not exist" in check_venv(config, probe_venv(tmp_path / "nope", FakeProbe(), {})).detail
    (tmp_path / "empty").mkdir()
    res = check_venv(config, probe_venv(tmp_path / "empty", FakeProbe(), {}))
    assert res.status is Status.FATAL and "bin/python does not exist" in res.detail


def test_missing_rank_module_is_fatal(tmp_path: Path) -> None:
    venv = fake_venv_dir(tmp_path)
    data = orjson.loads(GOOD)
    data["modules"]["zmq"] = None
    facts = probe_venv(venv, FakeProbe(runner=venv_runner(import_json=orjson.dumps(data).decode())), {})
    res = check_venv(deepinfer_config(tmp_path, venv), facts)
    assert res.status is Status.FATAL and "zmq" in res.detail and "pip install zmq" in res.fix


def test_venv_problems_only_warn_for_reference_engine(tmp_path: Path) -> None:
    from server.config import load_config

    config = load_config({"deepinfer_venv": str(tmp_path / "nope")})
    res = check_venv(config, probe_venv(tmp_path / "nope", FakeProbe(), {}))
    assert res.status is Status.WARN
    assert check_venv(load_config({}), None).status is Status.SKIPPED


def test_prefix_api_missing_warns_unless_prefix_cache_off(tmp_path: Path) -> None:
    facts = {"python_version": "3.12.7", "api": {"Scheduler.add_sequence_with_prefix": False,
                                                 "LLMEngine.enqueue_with_prefix": None}}
    res = check_prefix_api(deepinfer_config(tmp_path, tmp_path), facts)
    assert res.status is Status.WARN and "cached_tokens stays 0" in res.detail
    off = check_prefix_api(deepinfer_config(tmp_path, tmp_path, prefix_cache=False), facts)
    assert off.status is Status.SKIPPED


needs312 = pytest.mark.skipif(PYTHON312 is None, reason="python3.12 not installed")


@needs312
@pytest.mark.parametrize("with_patch", [True, False])
def test_real_venv_subprocess_detects_patch(tmp_path: Path, with_patch: bool) -> None:
    venv = make_fake_venv(tmp_path, with_patch=with_patch)
    config = deepinfer_config(tmp_path, venv)
    facts = probe_venv(venv, RealSystemProbe(), {"PATH": "/usr/bin:/bin"}, import_timeout_s=60)
    assert facts["python_version"].startswith("3.12.")
    venv_res = check_venv(config, facts)
    assert venv_res.status is Status.OK, venv_res.line()
    assert "deepinfer 0.1.0+prefixcache" in venv_res.detail
    api = check_prefix_api(config, facts)
    assert api.status is (Status.OK if with_patch else Status.WARN)
    assert api.data["api"] == {"Scheduler.add_sequence_with_prefix": with_patch,
                               "LLMEngine.enqueue_with_prefix": with_patch}


@needs312
def test_real_venv_subprocess_reports_import_error(tmp_path: Path) -> None:
    venv = make_fake_venv(tmp_path, import_fails=True)
    facts = probe_venv(venv, RealSystemProbe(), {"PATH": "/usr/bin:/bin"}, import_timeout_s=60)
    res = check_venv(deepinfer_config(tmp_path, venv), facts)
    assert res.status is Status.FATAL
    assert "ImportError: libcuda.so.1" in res.detail
    assert check_prefix_api(deepinfer_config(tmp_path, venv), facts).status is Status.SKIPPED


def test_real_venv_of_wrong_python_is_fatal(tmp_path: Path) -> None:
    import sys

    if sys.version_info[:2] == (3, 12):
        pytest.skip("the test interpreter is 3.12 itself")
    venv = make_fake_venv(tmp_path, python=sys.executable)
    res = check_venv(deepinfer_config(tmp_path, venv), probe_venv(venv, RealSystemProbe(), {}))
    assert res.status is Status.FATAL and "need 3.12" in res.detail
