"""/dev/shm size, the memlock limit and the NVIDIA driver: the readings (statvfs, getrlimit,
nvidia-smi, /proc/driver/nvidia/version, all faked) and the checks; and every finding in one run."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.config import load_config
from server.preflight import PreflightError, run_preflight, statuses
from server.preflight_checks import probe as probe_mod
from server.preflight_checks.driver import check_driver
from server.preflight_checks.pinning import check_memlock, check_shm
from server.preflight_checks.probe import DriverInfo, GpuQuery, RealSystemProbe, RunResult, ShmInfo
from server.preflight_checks.report import Status
from tests.preflight.preflight_fakes import GIB, MIB, FakeProbe, deepinfer_config

REPO = Path(__file__).resolve().parents[2]
SMI_BANNER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 595.91                 Driver Version: 595.91         CUDA Version: 13.2     |
|-----------------------------------------+------------------------+----------------------+
"""
PROC_VERSION = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  "
                "(dvs-builder@U16-I3-B03-4-1)  Tue Jul  1 2026\nGCC version:  gcc version 12.3.0\n")


def seed(**overrides: object):  # type: ignore[no-untyped-def]
    return deepinfer_config("/workspace/v41flash", "/workspace/di-venv", **overrides)


# -- readings -------------------------------------------------------------------------------------
def test_shm_reading_from_statvfs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SimpleNamespace(f_blocks=16384, f_bavail=4096, f_frsize=4096)
    monkeypatch.setattr(os, "statvfs", lambda path: fake)
    assert RealSystemProbe().shm(Path("/dev/shm")) == ShmInfo(64 * MIB, 16 * MIB)

    def missing(path: str) -> None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "statvfs", missing)
    assert RealSystemProbe().shm(Path("/dev/shm")) is None


def test_memlock_reading_from_getrlimit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * MIB, resource.RLIM_INFINITY))
    assert RealSystemProbe().memlock_limit() == (8 * MIB, None)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert RealSystemProbe().memlock_limit() == (None, None)


def test_driver_reading_from_nvidia_smi_then_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    proc = tmp_path / "version"
    real = RealSystemProbe(proc_driver=proc)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(real, "run", lambda argv, timeout_s, env: RunResult(0, SMI_BANNER, ""))
    assert real.nvidia_driver() == DriverInfo("595.91", "13.2", "nvidia-smi")
    # nvidia-smi broken: the kernel module's version file still tells the driver (not the CUDA version).
    monkeypatch.setattr(real, "run", lambda argv, timeout_s, env: RunResult(
        9, "", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"))
    proc.write_text(PROC_VERSION)
    info = real.nvidia_driver()
    assert (info.driver_version, info.cuda_version, info.source) == ("575.57.08", None, str(proc))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    proc.unlink()
    info = real.nvidia_driver()
    assert info.driver_version is None and "nvidia-smi not found" in (info.error or "")


def test_banner_and_proc_parsers() -> None:
    assert probe_mod.parse_nvidia_smi_banner(SMI_BANNER) == ("595.91", "13.2")
    assert probe_mod.parse_nvidia_smi_banner("garbage") == (None, None)
    assert probe_mod.parse_proc_driver_version(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024") == "550.54.15"


# -- checks ---------------------------------------------------------------------------------------
def test_shm_check() -> None:
    cfg = seed()  # 128 GiB x 4 ranks = 512 GiB
    assert check_shm(cfg, ShmInfo(1024 * GIB, 1000 * GIB)).status is Status.OK
    small = check_shm(cfg, ShmInfo(64 * MIB, 64 * MIB))  # a container's default /dev/shm
    assert small.status is Status.WARN and "does not fit" in small.detail and "--shm-size" in small.fix
    assert small.data["usable_bytes"] == int(64 * MIB * 0.9)
    assert check_shm(cfg, None).status is Status.WARN
    assert check_shm(seed(l1_cache=False), ShmInfo(64 * MIB, 64 * MIB)).status is Status.SKIPPED


def test_memlock_check() -> None:
    cfg = seed()
    assert check_memlock(cfg, (None, None)).status is Status.OK
    low = check_memlock(cfg, (8 * MIB, 8 * MIB))
    assert low.status is Status.WARN and "cudaHostRegister" in low.detail and "memlock=-1" in low.fix
    assert low.data["pinned_per_rank_bytes"] == 512 * GIB and low.data["pin_estimate_s"] == 256.0
    assert check_memlock(cfg, (600 * GIB, None)).status is Status.OK
    assert check_memlock(seed(l1_host_gb=0), (8 * MIB, 8 * MIB)).status is Status.SKIPPED
    cpu = load_config({"engine": "reference", "reference_device": "cpu"})
    assert check_memlock(cpu, (8 * MIB, 8 * MIB)).status is Status.SKIPPED


@pytest.mark.parametrize(("driver", "cuda", "status"), [
    ("595.91", "13.2", Status.OK),
    ("600.10", "13.4", Status.OK),
    ("580.65.06", "13.0", Status.WARN),
    ("570.86.15", "12.8", Status.FATAL),
    ("595.91", None, Status.OK),  # /proc only: the tested driver
    ("590.10", None, Status.WARN),  # /proc only: older than tested, CUDA unknown
    ("575.57.08", None, Status.FATAL),  # /proc only: below the R580 branch
])
def test_driver_check(driver: str, cuda: str | None, status: Status) -> None:
    result = check_driver(seed(), DriverInfo(driver, cuda, "nvidia-smi" if cuda else "/proc"))
    assert result.status is status, result.line()
    if status is not Status.OK:
        assert "13.2" in result.fix


def test_driver_check_without_a_driver_or_a_gpu_engine() -> None:
    none = check_driver(seed(), DriverInfo(None, None, "none", "nvidia-smi not found"))
    assert none.status is Status.SKIPPED and none.detail.startswith("not checked: no NVIDIA driver")
    cpu = load_config({"engine": "reference", "reference_device": "cpu"})
    assert check_driver(cpu, None).status is Status.SKIPPED
    ref_gpu = load_config({"engine": "reference", "reference_device": "cuda"})
    assert check_driver(ref_gpu, DriverInfo("570.1", "12.8", "nvidia-smi")).status is Status.OK


# -- every finding in one run ---------------------------------------------------------------------
def test_all_findings_in_one_run(tmp_path: Path) -> None:
    """Missing venv, missing model, no GPU, old driver, small /dev/shm, low memlock: all reported."""
    cfg = deepinfer_config(tmp_path / "no-model", tmp_path / "no-venv")
    probe = FakeProbe(gpus=GpuQuery((), "none", "nvidia-smi not found"),
                      driver=DriverInfo("570.86.15", "12.8", "nvidia-smi"),
                      shm_info=ShmInfo(64 * MIB, 64 * MIB), memlock=(8 * MIB, 8 * MIB))
    report = run_preflight(cfg, probe)
    st = statuses(report)
    assert {k: st[k] for k in ("gpu", "driver", "model_dir", "deepinfer_venv", "shm", "memlock")} == {
        "gpu": "fatal", "driver": "fatal", "model_dir": "fatal", "deepinfer_venv": "fatal", "shm": "warn",
        "memlock": "warn"}
    with pytest.raises(PreflightError) as info:
        report.raise_if_fatal()
    for name in ("gpu:", "driver:", "model_dir:", "deepinfer_venv:"):
        assert name in str(info.value)


def test_cli_reports_a_missing_venv_among_all_findings(tmp_path: Path) -> None:
    """``python -m deepinfer_backend preflight`` with a venv and a model directory that do not exist:
    one run lists both and every other check (exit 1: fatal), not a one-line exit 2."""
    cfg = tmp_path / "workload.json"
    cfg.write_text(seed(deepinfer_venv=str(tmp_path / "no-venv"), port=0,
                        env={"DEEPINFER_HF_MODEL_DIR": str(tmp_path / "no-model")}).model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "deepinfer_backend", "preflight", "--config", str(cfg),
                           "--read-sample-mb", "0"], cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[FATAL]   deepinfer_venv" in out and "no-venv does not exist" in out
    assert "[FATAL]   model_dir" in out
    for name in ("driver", "shm", "memlock", "host_ram", "master_port", "timeout_order"):
        assert re.search(rf"\]\s+{name}\s", out), name
    assert "Result: " in out


def test_setup_with_a_missing_venv_names_every_fatal_finding(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's setup(): a missing deepinfer_venv stops it with the whole preflight's fatal list."""
    from inferencekey.backend import BackendContext

    import deepinfer_backend

    monkeypatch.setenv(deepinfer_backend.PREFLIGHT_SKIP_ENV, "gpu,nccl_env")  # no GPU query here

    config = {"engine": "deepinfer", "ep": 2, "deepinfer_venv": str(tmp_path / "no-venv"),
              "model_dir": str(tmp_path / "no-model"), "port": 0}
    with pytest.raises(PreflightError) as info:
        deepinfer_backend.DeepInferBackend().setup(BackendContext(config=config, port=0))
    assert "deepinfer_venv:" in str(info.value) and "model_dir:" in str(info.value)
