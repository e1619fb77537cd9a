"""GPU check against faked nvidia-smi answers, and the nvidia-smi parser on real output shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import load_config
from server.preflight_checks.gpu import check_gpus, visible_gpus
from server.preflight_checks.probe import GpuInfo, GpuQuery, parse_nvidia_smi
from server.preflight_checks.report import Status
from tests.preflight.preflight_fakes import GIB, b200, deepinfer_config, h200

ENV4 = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def cfg(tmp_path: Path, **kw: object):
    return deepinfer_config(tmp_path / "m", tmp_path / "venv", **kw)


def test_four_b200_pass(tmp_path: Path) -> None:
    res = check_gpus(cfg(tmp_path), GpuQuery(tuple(b200(i) for i in range(4)), "nvidia-smi"), ENV4)
    assert res.status is Status.OK
    assert res.data["visible"] == [0, 1, 2, 3]
    assert "NVIDIA B200 (SM100)" in res.detail


def test_no_gpu_is_fatal_for_deepinfer_and_says_so(tmp_path: Path) -> None:
    res = check_gpus(cfg(tmp_path), GpuQuery((), "none", "nvidia-smi not found"), ENV4)
    assert res.status is Status.FATAL
    assert "no NVIDIA GPU found (nvidia-smi not found)" in res.detail
    assert res.fix


def test_no_gpu_is_skipped_for_reference_on_cpu() -> None:
    res = check_gpus(load_config({}), GpuQuery((), "none", "nvidia-smi not found"), {})
    assert res.status is Status.SKIPPED
    assert "no GPU on this machine" in res.detail


def test_no_gpu_is_fatal_for_reference_on_cuda() -> None:
    res = check_gpus(load_config({"reference_device": "cuda"}), GpuQuery((), "none", "x"), {})
    assert res.status is Status.FATAL


def test_h200_is_fatal_for_deepinfer_naming_sm100(tmp_path: Path) -> None:
    res = check_gpus(cfg(tmp_path), GpuQuery(tuple(h200(i) for i in range(4)), "nvidia-smi"), ENV4)
    assert res.status is Status.FATAL
    assert "SM90" in res.detail and "SM100" in res.detail
    assert "B200" in res.fix


def test_h200_is_fine_for_reference_on_cuda() -> None:
    res = check_gpus(load_config({"reference_device": "cuda", "ep": 2}),
                     GpuQuery(tuple(h200(i) for i in range(2)), "nvidia-smi"), {})
    assert res.status is Status.OK


def test_fewer_gpus_than_ep_is_fatal(tmp_path: Path) -> None:
    res = check_gpus(cfg(tmp_path), GpuQuery(tuple(b200(i) for i in range(2)), "nvidia-smi"),
                     {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert res.status is Status.FATAL
    assert "ep 4 needs 4" in res.detail


def test_cuda_visible_devices_naming_missing_gpu_stops_there(tmp_path: Path) -> None:
    query = GpuQuery(tuple(b200(i) for i in range(4)), "nvidia-smi")
    res = check_gpus(cfg(tmp_path), query, {"CUDA_VISIBLE_DEVICES": "0,1,7,2"})
    assert res.status is Status.FATAL
    assert "'7' names no GPU" in res.detail
    chosen, note = visible_gpus(query, "GPU-b200-0003,0")
    assert [g.index for g in chosen] == [3, 0] and note is None


def test_cuda_visible_devices_unset_warns_for_deepinfer(tmp_path: Path) -> None:
    config = cfg(tmp_path, env={"DEEPINFER_HF_MODEL_DIR": str(tmp_path)})
    res = check_gpus(config, GpuQuery(tuple(b200(i) for i in range(4)), "nvidia-smi"), {})
    assert res.status is Status.WARN
    assert "CUDA_VISIBLE_DEVICES" in res.fix


def test_foreign_memory_on_gpu_warns(tmp_path: Path) -> None:
    gpus = (b200(0), b200(1, used_gib=40), b200(2), b200(3))
    res = check_gpus(cfg(tmp_path), GpuQuery(gpus, "nvidia-smi"), ENV4)
    assert res.status is Status.WARN
    assert "GPU 1 already has 40.0 GiB" in res.detail


def test_unknown_compute_capability_warns(tmp_path: Path) -> None:
    gpus = tuple(GpuInfo(i, f"GPU-{i}", "NVIDIA B200", None, 180 * GIB, 0) for i in range(4))
    res = check_gpus(cfg(tmp_path), GpuQuery(gpus, "nvidia-smi"), ENV4)
    assert res.status is Status.WARN


def test_parse_nvidia_smi_output_shapes() -> None:
    text = ("0, GPU-aaaa, NVIDIA B200, 10.0, 183359, 1\n"
            "1, GPU-bbbb, NVIDIA B200, 10.0, 183359, [N/A]\n")
    gpus = parse_nvidia_smi(text, has_compute_cap=True)
    assert [g.compute_capability for g in gpus] == [(10, 0), (10, 0)]
    assert gpus[0].memory_total_bytes == 183359 * 1024 * 1024
    assert gpus[1].memory_used_bytes is None
    old = parse_nvidia_smi("0, GPU-cccc, Tesla V100-SXM2-16GB, 16160, 0\n", has_compute_cap=False)
    assert old[0].compute_capability is None and old[0].name == "Tesla V100-SXM2-16GB"
    with pytest.raises(ValueError):
        parse_nvidia_smi("garbage line", has_compute_cap=True)
