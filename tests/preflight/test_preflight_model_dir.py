"""Model directory checks: files, filesystem type (faked and real /proc/mounts parsing), read speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import load_config
from server.preflight_checks.model_dir import (
    check_model_files,
    check_model_filesystem,
    check_read_speed,
    classify_fs,
)
from server.preflight_checks.probe import RealSystemProbe, fs_type_for, parse_mounts
from server.preflight_checks.report import Status
from tests.preflight.preflight_fakes import MIB, FakeProbe, deepinfer_config, make_model_dir


def test_complete_model_dir_ok(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    res, facts = check_model_files(deepinfer_config(model, tmp_path), model)
    assert res.status is Status.OK
    assert res.data["num_shards"] == 2
    assert facts.weights_bytes == 2 * 4 * MIB


@pytest.mark.parametrize("drop", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_missing_file_is_fatal_for_deepinfer(tmp_path: Path, drop: str) -> None:
    model = make_model_dir(tmp_path, drop=[drop])
    res, _ = check_model_files(deepinfer_config(model, tmp_path), model)
    assert res.status is Status.FATAL
    assert drop in res.detail


def test_missing_indexed_shard_is_an_incomplete_download(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path, num_shards=3, drop=["model-00002-of-00003.safetensors"])
    res, _ = check_model_files(deepinfer_config(model, tmp_path), model)
    assert res.status is Status.FATAL
    assert "1 of 3 indexed shards" in res.detail
    assert "download" in res.fix


def test_no_shards_fatal_for_deepinfer_only(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path, num_shards=0, with_index=False)
    res, _ = check_model_files(deepinfer_config(model, tmp_path), model)
    assert res.status is Status.FATAL and "safetensors" in res.detail
    ref, _ = check_model_files(load_config({"model_dir": str(model)}), model)
    assert ref.status is Status.OK


def test_invalid_config_json(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path)
    (model / "config.json").write_text("{not json")
    res, _ = check_model_files(deepinfer_config(model, tmp_path), model)
    assert res.status is Status.FATAL and "not valid JSON" in res.detail


def test_missing_dir_and_unset_dir(tmp_path: Path) -> None:
    res, _ = check_model_files(deepinfer_config(tmp_path / "nope", tmp_path), tmp_path / "nope")
    assert res.status is Status.FATAL and "does not exist" in res.detail
    res, _ = check_model_files(load_config({}), None)
    assert res.status is Status.SKIPPED


@pytest.mark.parametrize("fstype,kind,status", [
    ("ext4", "local", Status.OK), ("xfs", "local", Status.OK), ("overlay", "local", Status.OK),
    ("nfs4", "network", Status.WARN), ("fuse.s3fs", "network", Status.WARN), ("cifs", "network", Status.WARN),
    ("fuse.juicefs", "network", Status.WARN), ("weirdfs", "unknown", Status.WARN),
])
def test_filesystem_type_classification(tmp_path: Path, fstype: str, kind: str, status: Status) -> None:
    model = make_model_dir(tmp_path)
    probe = FakeProbe(default_fs=fstype)
    res = check_model_filesystem(deepinfer_config(model, tmp_path), model, probe)
    assert classify_fs(fstype) == kind
    assert res.status is status
    assert res.data["fstype"] == fstype
    if status is Status.WARN:
        assert "local disk" in res.fix


def test_proc_mounts_longest_prefix_wins() -> None:
    mounts = parse_mounts(
        "overlay / overlay rw 0 0\n"
        "10.0.0.5:/vol /workspace nfs4 rw 0 0\n"
        "/dev/nvme0n1 /workspace/local ext4 rw 0 0\n"
        "fuse /mnt/my\\040bucket fuse.s3fs rw 0 0\n"
    )
    assert fs_type_for(Path("/workspace/v41flash"), mounts) == "nfs4"
    assert fs_type_for(Path("/workspace/local/v41flash"), mounts) == "ext4"
    assert fs_type_for(Path("/workspace2"), mounts) == "overlay"
    assert fs_type_for(Path("/mnt/my bucket/x"), mounts) == "fuse.s3fs"


def test_real_probe_reads_a_fake_proc_mounts(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"overlay / overlay rw 0 0\nserver:/x {tmp_path} nfs rw 0 0\n")
    assert RealSystemProbe(proc_mounts=mounts).filesystem_type(tmp_path / "a") == "nfs"


def test_read_speed_fast_local_disk(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path, shard_bytes=512 * MIB, num_shards=1)
    probe = FakeProbe(read_bytes_per_s=2.5e9)
    res, speed = check_read_speed(deepinfer_config(model, tmp_path), model, probe)
    assert res.status is Status.OK and speed == pytest.approx(2.5e9)
    (_, (_path, offset, max_bytes, _)) = next(c for c in probe.calls if c[0] == "read_sample")
    assert offset == 256 * MIB and max_bytes == 256 * MIB  # bounded, from the middle of the shard


def test_read_speed_slow_network_disk_warns_with_load_minutes(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path, shard_bytes=512 * MIB, num_shards=1)
    res, _ = check_read_speed(deepinfer_config(model, tmp_path), model, FakeProbe(read_bytes_per_s=3e8))
    assert res.status is Status.WARN
    assert "300 MB/s" in res.detail and "NVMe" in res.fix


def test_read_speed_small_sample_not_judged(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path, shard_bytes=4 * MIB, num_shards=1)
    res, _ = check_read_speed(deepinfer_config(model, tmp_path), model, FakeProbe(read_bytes_per_s=1e6))
    assert res.status is Status.OK and "too small to judge" in res.detail


def test_real_read_sample_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"\x01" * (3 * MIB))
    sample = RealSystemProbe().read_sample(path, MIB, 64 * MIB, 5.0)
    assert sample.num_bytes == 2 * MIB  # stops at EOF, never reads before the offset
    assert sample.elapsed_s > 0
