"""Host RAM, the L1 budget rule, /dev/shm, cgroup limits and free disk, with faked readings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from server.config import load_config
from server.preflight import l1_budget_bytes, plan_l1_budget
from server.preflight_checks.probe import MemoryInfo, RealSystemProbe
from server.preflight_checks.report import Status
from server.preflight_checks.resources import (
    MIN_FREE_DISK_BYTES,
    check_disk,
    check_host_ram,
    engine_host_bytes_per_rank,
)
from tests.preflight.preflight_fakes import GIB, MIB, deepinfer_config


def seed(tmp_path: Path, **kw: object):
    return deepinfer_config(tmp_path, tmp_path, **kw)


def test_seed_machine_gets_the_full_budget(tmp_path: Path) -> None:
    # The tested machines had 2 to 3 TB: 512 GiB of L1 fits with room to spare.
    res = check_host_ram(seed(tmp_path), MemoryInfo(2048 * GIB, 1900 * GIB), shm_free_bytes=1900 * GIB)
    assert res.status is Status.OK
    assert res.data["l1_granted_bytes"] == 512 * GIB
    assert "L1 gets 512.0 GiB (128.0 GiB x 4 ranks)" in res.detail


def test_short_ram_lowers_l1_and_says_by_how_much(tmp_path: Path) -> None:
    config = seed(tmp_path)
    res = check_host_ram(config, MemoryInfo(512 * GIB, 480 * GIB), shm_free_bytes=None)
    assert res.status is Status.WARN
    plan = plan_l1_budget(config, 480 * GIB, total_bytes=512 * GIB)
    assert plan.limited_by == "ram"
    # The cache's rule on what is left once the ranks run: margin = max(8 GiB, 10 % of total RAM).
    engine = 4 * (8 * 10**9 + 12 * GIB)
    margin = int(0.10 * 512 * GIB)
    assert plan.reserve_bytes == engine + margin
    assert plan.granted_total_bytes == (480 * GIB - engine - margin) // MIB * MIB
    assert plan.granted_total_bytes == res.data["l1_granted_bytes"] < 512 * GIB
    assert "lowered" in res.detail and "for the ranks themselves" in res.detail and "l1_host_gb" in res.fix


def test_prediction_equals_the_cache_rule_once_the_engine_runs(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from rank.host_budget import plan_l1_budget as cache_rule

    for avail_gib, total_gib in [(100, 128), (480, 512), (1900, 2048), (10, 16)]:
        mine = l1_budget_bytes(seed(tmp_path), avail_gib * GIB, total_bytes=total_gib * GIB,
                               engine_running=True)
        theirs = cache_rule(l1_cache=True, l1_host_gb=128, num_ranks=4, bytes_per_block=MIB,
                            virtual_memory=lambda a=avail_gib, t=total_gib: SimpleNamespace(
                                available=a * GIB, total=t * GIB))
        assert mine == theirs.pool_bytes


def test_multimodal_pool_opt_out_frees_reserve(tmp_path: Path) -> None:
    base = seed(tmp_path)
    env = dict(base.deepinfer_env, DEEPINFER_USE_MULTIMODAL_POOL="0")
    opted = seed(tmp_path, deepinfer_env=env)
    assert engine_host_bytes_per_rank(base) - engine_host_bytes_per_rank(opted) == 8 * 10**9
    assert l1_budget_bytes(opted, 300 * GIB) > l1_budget_bytes(base, 300 * GIB)


def test_tiny_ram_turns_l1_off(tmp_path: Path) -> None:
    res = check_host_ram(seed(tmp_path), MemoryInfo(128 * GIB, 90 * GIB), shm_free_bytes=None)
    assert res.status is Status.WARN
    assert res.data["l1_granted_bytes"] == 0  # 90 - 78 GiB for the ranks - 12.8 GiB margin < 0
    assert "L1 off" in res.detail and "l1_cache false" in res.fix


def test_ranks_alone_do_not_fit(tmp_path: Path) -> None:
    res = check_host_ram(seed(tmp_path), MemoryInfo(64 * GIB, 40 * GIB), None)
    assert res.status is Status.WARN and "the 4 ranks alone need" in res.detail


def test_small_dev_shm_caps_l1(tmp_path: Path) -> None:
    plan = plan_l1_budget(seed(tmp_path), 1900 * GIB, shm_free_bytes=65 * GIB)
    assert plan.limited_by == "shm"
    assert plan.granted_total_bytes == 64 * GIB
    res = check_host_ram(seed(tmp_path), MemoryInfo(2048 * GIB, 1900 * GIB), 65 * GIB)
    assert res.status is Status.WARN and "/dev/shm" in res.fix
    assert l1_budget_bytes(seed(tmp_path), 1900 * GIB, shm_free_bytes=64 * 1024**2) == 0  # docker's 64 MB


def test_container_limit_caps_available(tmp_path: Path) -> None:
    mem = MemoryInfo(2048 * GIB, 1900 * GIB, cgroup_limit_bytes=400 * GIB, cgroup_usage_bytes=100 * GIB)
    assert mem.usable_bytes == 300 * GIB
    res = check_host_ram(seed(tmp_path), mem, None)
    assert res.data["available_bytes"] == 300 * GIB and "container limit 400.0 GiB" in res.detail


def test_l1_disabled_and_running_engine(tmp_path: Path) -> None:
    assert l1_budget_bytes(seed(tmp_path, l1_cache=False), 1900 * GIB) == 0
    ok = check_host_ram(seed(tmp_path, l1_cache=False), MemoryInfo(2048 * GIB, 1900 * GIB), None)
    assert ok.status is Status.OK and "L1 off by config" in ok.detail
    before = plan_l1_budget(seed(tmp_path), 400 * GIB)
    after = plan_l1_budget(seed(tmp_path), 400 * GIB, engine_running=True)
    assert after.reserve_bytes < before.reserve_bytes


@given(available_gib=st.integers(0, 4096), extra_gib=st.integers(0, 512),
       shm_gib=st.one_of(st.none(), st.integers(0, 4096)), l1_gb=st.floats(0, 512), ep=st.integers(1, 8),
       engine=st.sampled_from(["deepinfer", "reference"]))
def test_budget_never_exceeds_request_ram_or_shm(
    available_gib: int, extra_gib: int, shm_gib: int | None, l1_gb: float, ep: int, engine: str
) -> None:
    raw: dict[str, object] = {"engine": engine, "ep": ep, "l1_host_gb": l1_gb}
    if engine == "deepinfer":
        raw["deepinfer_venv"] = "/x"
    config = load_config(raw)
    shm = None if shm_gib is None else shm_gib * GIB
    plan = plan_l1_budget(config, available_gib * GIB, total_bytes=(available_gib + extra_gib) * GIB,
                          shm_free_bytes=shm)
    assert plan.granted_total_bytes <= plan.requested_total_bytes
    assert plan.granted_total_bytes <= max(0, available_gib * GIB - plan.reserve_bytes)
    if shm is not None:
        assert plan.granted_total_bytes <= shm
    assert (plan.granted_total_bytes
            == 0) == plan.reason.startswith("L1 off") or plan.limited_by == "disabled"


def test_disk_low_and_unknown() -> None:
    paths = {"tmp": Path("/tmp"), "model_dir": Path("/workspace/v41flash")}
    ok = check_disk(paths, {"tmp": 100 * GIB, "model_dir": 400 * GIB})
    assert ok.status is Status.OK and "model_dir /workspace/v41flash: 400.0 GiB free" in ok.detail
    low = check_disk(paths, {"tmp": MIN_FREE_DISK_BYTES - 1, "model_dir": None})
    assert low.status is Status.WARN and "tmp" in low.fix and "unknown" in low.detail


@pytest.mark.parametrize("files,expected", [
    ({"memory.max": "max\n", "memory.current": "5\n"}, (None, None)),
    ({"memory.max": "1073741824\n", "memory.current": "536870912\n"}, (GIB, GIB // 2)),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, (None, None)),
    ({"memory/memory.limit_in_bytes": "2147483648\n", "memory/memory.usage_in_bytes": "1\n"}, (2 * GIB, 1)),
    ({}, (None, None)),
])
def test_real_probe_reads_cgroup_v1_and_v2(tmp_path: Path, files: dict[str, str], expected: tuple) -> None:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mem = RealSystemProbe(cgroup_root=tmp_path).memory()
    assert (mem.cgroup_limit_bytes, mem.cgroup_usage_bytes) == expected
    assert mem.total_bytes > 0 and 0 < mem.available_bytes <= mem.total_bytes
