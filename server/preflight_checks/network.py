"""Ports (rendezvous, HTTP) and the NCCL / NVLink multicast / RDMA settings the node needs.

Facts used (the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``, the prebuilt package notes):
DeepInfer's rendezvous is ``tcp://$MASTER_ADDR:($MASTER_PORT-50+engine_group_rank)`` (default
localhost:23333); a container holding part of a node cannot create NVLink multicast objects
(CUDA error 401) unless NVLS is off; without RDMA devices Engram needs the local path
(``DEEPINFER_ENGRAM_LOCAL=1``, ``EP_DISABLE_GIN=1``) and NCCL should not look for InfiniBand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from server.preflight_checks.context import is_deepinfer, uses_gpu
from server.preflight_checks.probe import GpuQuery, RdmaInfo, SystemProbe
from server.preflight_checks.report import CheckResult, fatal, ok, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

DEEPINFER_DEFAULT_RENDEZVOUS_PORT = 23333
RENDEZVOUS_OFFSET = 50
ENGINE_GROUP_RANK = 0  # one engine group per backend
FULL_NODE_GPUS = 8  # an HGX B200 board; fewer visible GPUs means part of a node (or no NVSwitch)


def rendezvous_ports(config: WorkloadConfig, env: Mapping[str, str]) -> tuple[dict[str, int], str | None]:
    """label -> port the ranks will bind, or an error naming a bad ``MASTER_PORT``."""
    raw = env.get("MASTER_PORT")
    if raw is None:
        if is_deepinfer(config):
            return {"DeepInfer rendezvous (default)": DEEPINFER_DEFAULT_RENDEZVOUS_PORT}, None
        return {}, None
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 65535:
        return {}, f"MASTER_PORT={raw!r} is not a port number"
    port = int(raw)
    ports = {"MASTER_PORT": port}
    if is_deepinfer(config):
        rdv = port - RENDEZVOUS_OFFSET + ENGINE_GROUP_RANK
        if rdv < 1:
            return {}, f"MASTER_PORT={port} gives DeepInfer rendezvous port {rdv}"
        ports["DeepInfer rendezvous (MASTER_PORT-50)"] = rdv
    return ports, None


def check_master_port(config: WorkloadConfig, env: Mapping[str, str], probe: SystemProbe) -> CheckResult:
    name = "master_port"
    fix_pick = "Set deepinfer_env.MASTER_PORT to a free port above 1100 (e.g. 29511) that no other job uses."
    ports, error = rendezvous_ports(config, env)
    if error:
        return fatal(name, error, fix_pick)
    if not ports:
        return skipped(name, f"MASTER_PORT not set; engine '{config.engine}' rank group picks its own port")
    host = env.get("MASTER_ADDR", "127.0.0.1")
    if host == "localhost":
        host = "127.0.0.1"
    busy = []
    for label, port in ports.items():
        if port == config.port and config.port != 0:
            busy.append(f"{label} {port} is also the HTTP port")
            continue
        reason = probe.port_in_use(host, port)
        if reason:
            busy.append(f"{label} {port} on {host}: {reason}")
    shown = ", ".join(f"{label} {port}" for label, port in ports.items())
    data = {"host": host, "ports": ports}
    if busy:
        return fatal(name, "; ".join(busy) + " (another backend or job still running?)", fix_pick, **data)
    return ok(name, f"free on {host}: {shown}", **data)


def check_http_port(config: WorkloadConfig, probe: SystemProbe) -> CheckResult:
    name = "http_port"
    if config.port == 0:
        return skipped(name, "port 0: the server picks a free port")
    reason = probe.port_in_use(config.host, config.port)
    if reason:
        return fatal(
            name, f"{config.host}:{config.port} cannot be bound: {reason} (is a backend already running?)",
            "Stop the process holding the port, or set port to a free one (0 picks one).",
        )
    return ok(name, f"{config.host}:{config.port} is free")


def check_nccl_env(
    config: WorkloadConfig, env: Mapping[str, str], gpus: GpuQuery, rdma: RdmaInfo
) -> CheckResult:
    """NVLS and RDMA settings in the ranks' environment must match what the node has."""
    name = "nccl_env"
    if not uses_gpu(config):
        return skipped(name, f"engine '{config.engine}' on cpu does not use NCCL")
    deepinfer = is_deepinfer(config)
    expected: dict[str, str] = {}
    facts = []
    num_gpus = len(gpus.gpus)
    if 0 < num_gpus < FULL_NODE_GPUS:
        facts.append(f"the container sees {num_gpus} GPUs (part of a node, or no NVSwitch), so NVLink "
                     "multicast cannot be created (CUDA error 401)")
        expected["NCCL_NVLS_ENABLE"] = "0"
        if deepinfer:
            # upstream pops NCCL_NVLS_ENABLE; the patch honours this one
            expected["DEEPINFER_NCCL_NVLS_ENABLE"] = "0"
    elif num_gpus >= FULL_NODE_GPUS:
        facts.append(f"the container sees {num_gpus} GPUs (a whole node; NVLS may stay on)")
    else:
        facts.append("GPU count unknown, NVLS not judged")
    if rdma.usable:
        facts.append(f"RDMA devices {', '.join(rdma.verbs_devices)}")
    else:
        where = ("no /dev/infiniband" if not rdma.dev_infiniband
                 else "no verbs devices in /sys/class/infiniband")
        facts.append(f"no RDMA ({where})")
        expected["NCCL_IB_DISABLE"] = "1"
        if deepinfer:
            expected["DEEPINFER_ENGRAM_LOCAL"] = "1"  # upstream Engram needs NCCL GIN over a ConnectX NIC
            expected["EP_DISABLE_GIN"] = "1"
    wrong = {k: v for k, v in expected.items() if env.get(k, "").strip() != v}
    forbidden = [k for k in ("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE",) if deepinfer and k in env]
    detail = "; ".join(facts)
    data = {"expected": expected, "actual": {k: env.get(k) for k in expected}, "num_gpus": num_gpus,
            "rdma": list(rdma.verbs_devices)}
    if wrong or forbidden:
        have = ", ".join(f"{k}={env.get(k)!r}" for k in wrong)
        parts = [f"{detail}; ranks get {have}"] if wrong else [detail]
        if forbidden:
            parts.append(f"{', '.join(forbidden)} is set (the prebuilt package says not to)")
        add = ", ".join(f'"{k}": "{v}"' for k, v in wrong.items())
        fix = f"Add {{{add}}} to deepinfer_env" if wrong else ""
        if forbidden:
            fix = (fix + " and remove "
                   if fix else "Remove ") + ", ".join(forbidden) + " from the environment"
        return warn(name, "; ".join(parts), fix + ".", **data)
    return ok(name, f"{detail}; settings match" if expected else detail, **data)
