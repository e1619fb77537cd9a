"""Preflight ``l2_dir``: local disk, room for l2_gb, and the direct-I/O speed measured there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.config import load_config
from server.preflight_checks.l2_disk import check_l2_dir
from server.preflight_checks.probe import RealSystemProbe
from server.preflight_checks.report import Status
from tests.preflight.preflight_fakes import GIB, FakeProbe

MIB = 1 << 20


def test_unset_l2_dir_is_skipped() -> None:
    result = check_l2_dir(load_config({}), FakeProbe())
    assert result.status is Status.SKIPPED and "not set" in result.detail


def test_local_nvme_with_room_passes(tmp_path: Path) -> None:
    cfg = load_config({"l2_dir": str(tmp_path / "l2"), "l2_gb": 500})
    probe = FakeProbe(default_free_disk=800 * GIB, read_bytes_per_s=3.5e9)
    result = check_l2_dir(cfg, probe, sample_bytes=256 * MIB)
    assert result.status is Status.OK, result.line()
    assert "ext4 (local)" in result.detail and "read 3.50 GB/s" in result.detail
    assert (tmp_path / "l2").is_dir() and result.data["direct_io"] is True
    assert ("disk_speed", (str(tmp_path / "l2"), 256 * MIB, 3.0)) in probe.calls


@pytest.mark.parametrize(("fstype", "words"), [("nfs4", "network/FUSE"), ("fuse.s3fs", "network/FUSE"),
                                               ("tmpfs", "RAM L1 needs")])
def test_network_and_ram_filesystems_warn(tmp_path: Path, fstype: str, words: str) -> None:
    cfg = load_config({"l2_dir": str(tmp_path / "l2"), "l2_gb": 10})
    result = check_l2_dir(cfg, FakeProbe(default_fs=fstype))
    assert result.status is Status.WARN and words in result.fix


def test_too_little_room_and_a_slow_disk_warn(tmp_path: Path) -> None:
    cfg = load_config({"l2_dir": str(tmp_path / "l2"), "l2_gb": 500})
    probe = FakeProbe(default_free_disk=100 * GIB, read_bytes_per_s=0.3e9)
    result = check_l2_dir(cfg, probe, sample_bytes=256 * MIB)
    assert result.status is Status.WARN
    assert "lower l2_gb to 99" in result.fix and "below 1 GB/s" in result.fix


def test_protocol_state_only_warns_that_restarts_are_cold_and_skips_the_speed_test(tmp_path: Path) -> None:
    cfg = load_config({"l2_dir": str(tmp_path / "l2")})  # l2_gb 0: ledger and pieces only
    probe = FakeProbe()
    result = check_l2_dir(cfg, probe)
    assert result.status is Status.WARN and "Set l2_gb to keep KV on disk" in result.fix
    assert "starts every session cold" in result.fix
    assert not [c for c in probe.calls if c[0] == "disk_speed"]


def test_real_disk_speed_on_this_machine(tmp_path: Path) -> None:
    cfg = load_config({"l2_dir": str(tmp_path / "l2"), "l2_gb": 1})
    result = check_l2_dir(cfg, RealSystemProbe(), sample_bytes=32 * MIB, max_seconds=5.0)
    assert result.status in (Status.OK, Status.WARN), result.line()
    assert result.data["read_bytes_per_s"] > 0 and result.data["sample_bytes"] > 0
    assert os.listdir(tmp_path / "l2") == []  # the scratch file is gone
