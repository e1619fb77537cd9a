"""run_preflight end to end on a faked machine, and the CLI on this real machine (no GPU here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from server.preflight import CHECK_NAMES, PreflightError, PreflightOptions, main, run_preflight, statuses
from server.preflight_checks.probe import GpuQuery, RunResult
from server.preflight_checks.report import Status
from tests.preflight.preflight_fakes import (
    MIB,
    PYTHON312,
    FakeProbe,
    deepinfer_config,
    h200,
    make_fake_venv,
    make_model_dir,
)

REPO = Path(__file__).resolve().parents[2]


def good_runner(argv, timeout_s, env) -> RunResult:  # type: ignore[no-untyped-def]
    if "deepinfer" not in argv[-1]:
        return RunResult(0, "3.12.7\n", "")
    payload = {"python": [3, 12, 7], "modules": {"torch": "2.13.0", "numpy": "2.3.5", "zmq": "27.1.0"},
               "deepinfer_version": "0.1.0", "api": {"Scheduler.add_sequence_with_prefix": True,
                                                     "LLMEngine.enqueue_with_prefix": True}}
    return RunResult(0, "PREFLIGHT_JSON " + orjson.dumps(payload).decode() + "\n", "")


def seed_setup(tmp_path: Path, **probe_kw: object) -> tuple:
    model = make_model_dir(tmp_path, shard_bytes=64 * MIB)
    venv = tmp_path / "di-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    probe = FakeProbe(runner=good_runner, **probe_kw)  # type: ignore[arg-type]
    return deepinfer_config(model, venv), probe


def test_seed_deployment_on_a_good_b200_machine_passes(tmp_path: Path) -> None:
    config, probe = seed_setup(tmp_path)
    report = run_preflight(config, probe)
    assert [c.name for c in report] == list(CHECK_NAMES)
    assert not report.has_fatal and report.warnings() == [], report.format_text()
    report.raise_if_fatal()  # does not raise
    body = report.to_dict()
    assert body["ok"] is True and body["counts"]["fatal"] == 0
    assert orjson.loads(orjson.dumps(body)) == body  # JSON-safe for /healthz


def test_each_classic_failure_is_reported(tmp_path: Path) -> None:
    config, probe = seed_setup(tmp_path, gpus=GpuQuery(tuple(h200(i) for i in range(4)), "nvidia-smi"),
                               default_fs="nfs4", read_bytes_per_s=2e8)
    config = config.model_copy(update={"ready_timeout_secs": 300})
    report = run_preflight(config, probe)
    st = statuses(report)
    assert st["gpu"] == "fatal" and st["model_fs"] == "warn" and st["model_read_speed"] == "warn"
    assert st["timeout_order"] == "warn"
    with pytest.raises(PreflightError) as info:
        report.raise_if_fatal()
    assert "gpu:" in str(info.value) and "SM100" in str(info.value)
    assert any(w.startswith("model_fs:") for w in report.warnings())


def test_skip_and_crashing_check_become_results_not_exceptions(tmp_path: Path) -> None:
    config, probe = seed_setup(tmp_path)

    def broken_memory():  # type: ignore[no-untyped-def]
        raise PermissionError("psutil: access denied")

    probe.memory = broken_memory  # type: ignore[method-assign]
    report = run_preflight(config, probe, options=PreflightOptions(skip=frozenset({"http_port"})))
    assert report.get("http_port").status is Status.SKIPPED  # type: ignore[union-attr]
    ram = report.get("host_ram")
    assert ram is not None and ram.status is Status.WARN and "PermissionError" in ram.detail
    with pytest.raises(ValueError, match="unknown preflight checks"):
        run_preflight(config, probe, options=PreflightOptions(skip=frozenset({"nope"})))


def test_main_json_and_exit_codes_with_fake_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, probe = seed_setup(tmp_path)
    path = tmp_path / "workload.json"
    path.write_bytes(orjson.dumps(config.model_dump(mode="json")))
    assert main(["--config", str(path), "--json"], probe=probe) == 0
    body = orjson.loads(capsys.readouterr().out)
    assert body["ok"] is True and len(body["checks"]) == len(CHECK_NAMES)
    probe.gpus = GpuQuery((), "none", "nvidia-smi not found")
    assert main(["--config", str(path)], probe=probe) == 1
    assert "[FATAL]   gpu" in capsys.readouterr().out


def test_main_bad_config_and_bad_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"epp": 4}')
    assert main(["--config", str(bad)]) == 2
    assert "unknown config key 'epp'" in capsys.readouterr().err
    bad.write_text("[1, 2]")
    assert main(["--config", str(bad)]) == 2
    assert main(["--config", str(tmp_path / "missing.json")]) == 2
    assert main(["--skip", "nonsense"]) == 2


def test_cli_on_this_machine_prints_a_real_report(tmp_path: Path) -> None:
    """The real probe on this machine: no GPU, a temp model dir with the real tokenizer, a small shard."""
    model = make_model_dir(tmp_path, shard_bytes=8 * MIB, num_shards=1)
    with open(model / "model-00001-of-00001.safetensors", "wb") as f:
        f.write(b"\x00" * (8 * MIB))  # real bytes, so the read test reads them
    venv = make_fake_venv(tmp_path) if PYTHON312 else tmp_path / "no-venv"
    config = deepinfer_config(model, venv, port=0)
    path = tmp_path / "workload.json"
    path.write_bytes(orjson.dumps(config.model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-m", "server.preflight", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    print(proc.stdout)
    assert proc.returncode == 1, proc.stderr  # no GPU for DeepInfer here: fatal
    out = proc.stdout
    assert "[FATAL]   gpu" in out and "no NVIDIA GPU found" in out
    assert "[OK]      model_dir" in out and "config, tokenizer and 1 shard(s)" in out
    assert "model_fs" in out and "MB/s sequential" in out
    if PYTHON312:
        assert "[OK]      deepinfer_venv    Python 3.12" in out
        assert "[OK]      prefix_cache_api" in out
    assert "Result: " in out and "setup() would stop" in out
    json_proc = subprocess.run([sys.executable, "-m", "server.preflight", "--config", str(path), "--json"],
                               cwd=REPO, capture_output=True, text=True, timeout=240)
    body = orjson.loads(json_proc.stdout)
    assert json_proc.returncode == 1 and body["ok"] is False
    assert {c["name"]: c["status"] for c in body["checks"]}["gpu"] == "fatal"


def test_cli_default_reference_config_on_this_machine_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "server.preflight", "--skip", "http_port"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runs on cpu" in proc.stdout


def test_cpu_reference_does_not_query_gpus_and_sdk_http_mode_skips_port() -> None:
    from server.config import load_config

    probe = FakeProbe(busy_ports={8000: "Address already in use"})
    report = run_preflight(load_config({"env": {"IK_BACKEND_HTTP": "sdk"}}), probe)
    assert ("query_gpus", None) not in probe.calls
    assert report.get("gpu").status is Status.SKIPPED  # type: ignore[union-attr]
    assert "SDK's server owns the port" in report.get("http_port").detail  # type: ignore[union-attr]
    native = run_preflight(load_config({}), probe)
    assert native.get("http_port").status is Status.FATAL  # type: ignore[union-attr]
