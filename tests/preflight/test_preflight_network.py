"""Ports (faked and with a real listening socket) and the NCCL / NVLS / RDMA settings check."""

from __future__ import annotations

import socket
from pathlib import Path

from server.config import load_config
from server.preflight_checks.network import (
    check_http_port,
    check_master_port,
    check_nccl_env,
    rendezvous_ports,
)
from server.preflight_checks.probe import GpuQuery, RdmaInfo, RealSystemProbe
from server.preflight_checks.report import Status
from tests.preflight.preflight_fakes import FakeProbe, b200, deepinfer_config

FOUR = GpuQuery(tuple(b200(i) for i in range(4)), "nvidia-smi")
EIGHT = GpuQuery(tuple(b200(i) for i in range(8)), "nvidia-smi")
NO_RDMA = RdmaInfo(False, ())


def env_of(config) -> dict[str, str]:
    return {**config.env, **config.deepinfer_env}


def test_master_and_rendezvous_ports_checked(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path)
    probe = FakeProbe()
    res = check_master_port(config, env_of(config), probe)
    assert res.status is Status.OK
    assert [c[1] for c in probe.calls if c[0] == "port_in_use"] == [("127.0.0.1", 29511),
                                                                    ("127.0.0.1", 29461)]


def test_busy_rendezvous_port_is_fatal(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path)
    res = check_master_port(config, env_of(config), FakeProbe(busy_ports={29461: "Address already in use"}))
    assert res.status is Status.FATAL
    assert "MASTER_PORT-50) 29461" in res.detail and "MASTER_PORT" in res.fix


def test_bad_master_port_values(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path)
    assert rendezvous_ports(config, {"MASTER_PORT": "abc"})[1] == "MASTER_PORT='abc' is not a port number"
    assert "rendezvous port -10" in (rendezvous_ports(config, {"MASTER_PORT": "40"})[1] or "")
    assert rendezvous_ports(config, {}) == ({"DeepInfer rendezvous (default)": 23333}, None)
    assert rendezvous_ports(load_config({}), {}) == ({}, None)
    clash = deepinfer_config(tmp_path, tmp_path, port=29511)
    res = check_master_port(clash, env_of(clash), FakeProbe())
    assert res.status is Status.FATAL and "also the HTTP port" in res.detail


def test_http_port_real_socket_in_use() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        config = load_config({"port": port})
        res = check_http_port(config, RealSystemProbe())
        assert res.status is Status.FATAL and f"127.0.0.1:{port} cannot be bound" in res.detail
    assert check_http_port(config, RealSystemProbe()).status is Status.OK  # freed again
    assert check_http_port(load_config({"port": 0}), RealSystemProbe()).status is Status.SKIPPED


def test_seed_settings_match_a_four_gpu_container_without_rdma(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path)
    res = check_nccl_env(config, env_of(config), FOUR, NO_RDMA)
    assert res.status is Status.OK, res.line()
    assert "settings match" in res.detail


def test_nvls_left_on_in_part_of_a_node_warns(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path, deepinfer_env={
        "DEEPINFER_ENGRAM_LOCAL": "1", "EP_DISABLE_GIN": "1", "NCCL_IB_DISABLE": "1"})
    res = check_nccl_env(config, env_of(config), FOUR, NO_RDMA)
    assert res.status is Status.WARN
    assert "CUDA error 401" in res.detail
    assert '"NCCL_NVLS_ENABLE": "0"' in res.fix and '"DEEPINFER_NCCL_NVLS_ENABLE": "0"' in res.fix


def test_no_rdma_needs_engram_local_and_ib_disable(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path, deepinfer_env={"NCCL_NVLS_ENABLE": "0",
                                                                "DEEPINFER_NCCL_NVLS_ENABLE": "0"})
    res = check_nccl_env(config, env_of(config), FOUR, RdmaInfo(True, ()))
    assert res.status is Status.WARN
    assert "no verbs devices" in res.detail
    for key in ("NCCL_IB_DISABLE", "DEEPINFER_ENGRAM_LOCAL", "EP_DISABLE_GIN"):
        assert key in res.fix


def test_whole_node_with_rdma_needs_nothing(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path, ep=8, deepinfer_env={})
    res = check_nccl_env(config, {}, EIGHT, RdmaInfo(True, ("mlx5_0", "mlx5_1")))
    assert res.status is Status.OK and "mlx5_0" in res.detail


def test_force_gpu_storage_is_flagged(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path)
    env = {**env_of(config), "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE": "1"}
    res = check_nccl_env(config, env, FOUR, NO_RDMA)
    assert res.status is Status.WARN and res.fix.startswith("Remove DEEPINFER_ENGRAM_FORCE_GPU_STORAGE")


def test_cpu_reference_skips_nccl() -> None:
    assert check_nccl_env(load_config({}), {}, FOUR, NO_RDMA).status is Status.SKIPPED
