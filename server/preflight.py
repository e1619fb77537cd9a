"""Preflight: check the worker before the ranks load, and say what is wrong and how to fix it.

``setup()`` calls ``run_preflight(config)`` before it starts the ranks: it logs the report
(``report.log(logger)``), stops on fatal problems (``report.raise_if_fatal()``) and shows the
rest in ``/healthz`` (``report.warnings()`` or ``report.to_dict()``). The same checks run on
their own before a deploy:

    python -m deepinfer_backend preflight --config workload.json [--json]
    python -m server.preflight --config workload.json [--json]

Every check runs in every run, whatever the others found (a missing venv or model directory is
one finding among the rest), so an operator preparing a worker sees the whole list at once.
Exit status: 0 when nothing is fatal, 1 when something is, 2 for a bad command line or config.
Each check is in ``server/preflight_checks/``; every read of the machine goes through a
``SystemProbe`` so tests can fake the machine. A check that crashes becomes a warning, never
a crash of ``setup()``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.config import ConfigError, WorkloadConfig, load_config
from server.preflight_checks.context import MIB, rank_env, uses_gpu
from server.preflight_checks.driver import check_driver
from server.preflight_checks.gpu import check_gpus
from server.preflight_checks.l2_disk import check_l2_dir
from server.preflight_checks.model_dir import (
    ModelFacts,
    check_model_files,
    check_model_filesystem,
    check_read_speed,
)
from server.preflight_checks.network import check_http_port, check_master_port, check_nccl_env
from server.preflight_checks.pinning import SHM_PATH, check_memlock, check_shm
from server.preflight_checks.probe import GpuQuery, RdmaInfo, RealSystemProbe, SystemProbe
from server.preflight_checks.report import (
    CheckResult,
    PreflightError,
    PreflightReport,
    Status,
    skipped,
    warn,
)
from server.preflight_checks.resources import (
    L1BudgetPlan,
    check_disk,
    check_host_ram,
    l1_budget_bytes,
    plan_l1_budget,
)
from server.preflight_checks.timeouts import check_ready_timeout, check_timeout_order
from server.preflight_checks.venv import IMPORT_TIMEOUT_S, check_prefix_api, check_venv, probe_venv

__all__ = [
    "CHECK_NAMES", "CheckResult", "L1BudgetPlan", "PreflightError", "PreflightOptions", "PreflightReport",
    "Status", "SystemProbe", "RealSystemProbe", "l1_budget_bytes", "main", "plan_l1_budget", "run_preflight",
]

CHECK_NAMES = (
    "gpu", "driver", "model_dir", "model_fs", "model_read_speed", "deepinfer_venv", "prefix_cache_api",
    "disk", "l2_dir", "host_ram", "shm", "memlock", "master_port", "http_port", "nccl_env", "ready_timeout",
    "timeout_order",
)


@dataclass(slots=True, frozen=True)
class PreflightOptions:
    """Bounds of the measuring checks, and checks the caller skips (e.g. ``http_port`` when the
    SDK's server, not ours, owns the port)."""

    read_sample_bytes: int = 256 * MIB
    read_max_seconds: float = 3.0
    import_timeout_s: float = IMPORT_TIMEOUT_S
    skip: frozenset[str] = field(default_factory=frozenset)


def _guarded(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; a bug or an unexpected machine must not crash setup()."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported as a warning with the exception text
        return warn(name, f"the check itself failed: {type(exc).__name__}: {exc}",
                    "Report this preflight bug with the message; the check did not run.")


def run_preflight(
    config: WorkloadConfig, probe: SystemProbe | None = None, *, options: PreflightOptions | None = None,
) -> PreflightReport:
    """Run every check against the machine ``probe`` reads (this one by default)."""
    probe = probe if probe is not None else RealSystemProbe()
    opts = options or PreflightOptions()
    unknown = opts.skip - set(CHECK_NAMES)
    if unknown:
        raise ValueError(f"unknown preflight checks to skip: {sorted(unknown)}; known: {list(CHECK_NAMES)}")
    env = rank_env(config, probe.environ())
    model_dir = config.resolved_model_dir()
    results: dict[str, CheckResult] = {}

    def run(name: str, fn: Callable[[], CheckResult]) -> None:
        results[name] = skipped(name, "skipped by the caller") if name in opts.skip else _guarded(name, fn)

    gpus = GpuQuery((), "none", "not queried")
    if not uses_gpu(config):
        # CPU ranks: no GPU query (its torch fallback costs seconds on every reference start).
        gpus = GpuQuery((), "none", "not queried")
    elif "gpu" not in opts.skip or "nccl_env" not in opts.skip:
        try:
            gpus = probe.query_gpus()
        except Exception as exc:  # noqa: BLE001
            gpus = GpuQuery((), "none", f"GPU query failed: {exc}")
    run("gpu", lambda: check_gpus(config, gpus, env))
    run("driver", lambda: check_driver(config, probe.nvidia_driver() if uses_gpu(config) else None))

    facts = ModelFacts()

    def model_files() -> CheckResult:
        nonlocal facts
        result, facts = check_model_files(config, model_dir)
        return result

    run("model_dir", model_files)
    run("model_fs", lambda: check_model_filesystem(config, model_dir, probe))
    speed: float | None = None

    def read_speed() -> CheckResult:
        nonlocal speed
        result, speed = check_read_speed(config, model_dir, probe, sample_bytes=opts.read_sample_bytes,
                                         max_seconds=opts.read_max_seconds)
        return result

    run("model_read_speed", read_speed)
    facts = ModelFacts(facts.weights_bytes, speed)

    venv_facts: dict[str, Any] | None = None
    if config.deepinfer_venv and not {"deepinfer_venv", "prefix_cache_api"} <= opts.skip:
        try:
            venv_facts = probe_venv(Path(config.deepinfer_venv), probe, env, opts.import_timeout_s)
        except Exception as exc:  # noqa: BLE001
            venv_facts = {"error": f"probing the venv failed: {type(exc).__name__}: {exc}"}
    run("deepinfer_venv", lambda: check_venv(config, venv_facts))
    run("prefix_cache_api", lambda: check_prefix_api(config, venv_facts))

    def disk() -> CheckResult:
        paths = {"tmp": Path(probe.environ().get("TMPDIR") or "/tmp")}
        if model_dir is not None and model_dir.is_dir():
            paths["model_dir"] = model_dir
        if config.deepinfer_venv and Path(config.deepinfer_venv).is_dir():
            paths["deepinfer_venv"] = Path(config.deepinfer_venv)
        return check_disk(paths, {label: probe.disk_free_bytes(p) for label, p in paths.items()})

    run("disk", disk)
    run("l2_dir", lambda: check_l2_dir(config, probe, sample_bytes=opts.read_sample_bytes,
                                       max_seconds=opts.read_max_seconds))
    run("host_ram", lambda: check_host_ram(config, probe.memory(), probe.disk_free_bytes(Path(SHM_PATH))))
    run("shm", lambda: check_shm(config, probe.shm(Path(SHM_PATH))))
    run("memlock", lambda: check_memlock(config, probe.memlock_limit()))
    run("master_port", lambda: check_master_port(config, env, probe))
    if config.http_mode == "sdk":
        results["http_port"] = skipped("http_port", "IK_BACKEND_HTTP=sdk: the SDK's server owns the port")
    else:
        run("http_port", lambda: check_http_port(config, probe))
    rdma = RdmaInfo(False)

    def nccl() -> CheckResult:
        nonlocal rdma
        rdma = probe.rdma()
        return check_nccl_env(config, env, gpus, rdma)

    run("nccl_env", nccl)
    run("ready_timeout", lambda: check_ready_timeout(config, facts))
    run("timeout_order", lambda: check_timeout_order(config, facts))
    context = {"engine": config.engine, "ep": config.ep, "model_dir": str(model_dir) if model_dir else None,
               "deepinfer_venv": config.deepinfer_venv}
    return PreflightReport((results[n] for n in CHECK_NAMES), context)


def _read_config(path: str) -> WorkloadConfig:
    raw_bytes = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    try:
        raw = json.loads(raw_bytes)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object (the workload config), got {type(raw).__name__}")
    return load_config(raw)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deepinfer_backend preflight",
        description="Check this machine against a workload config before deploying the backend.",
    )
    parser.add_argument("--config", metavar="FILE", help="workload config as JSON ('-' for stdin); "
                        "defaults to the built-in defaults (engine 'reference')")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--skip", action="append", default=[], choices=CHECK_NAMES, metavar="CHECK",
                        help=f"skip a check (repeatable): {', '.join(CHECK_NAMES)}")
    parser.add_argument("--read-sample-mb", type=int, default=256,
                        help="MiB read from a weight shard to measure the disk (0 skips it)")
    parser.add_argument("--import-timeout", type=float, default=IMPORT_TIMEOUT_S,
                        help="seconds allowed for importing deepinfer in the venv")
    return parser


def main(argv: Sequence[str] | None = None, probe: SystemProbe | None = None) -> int:
    """CLI body: print the report; 0 ok, 1 fatal problems, 2 bad arguments or config."""
    parser = _parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0) if exc.code in (0, None) else 2
    try:
        config = _read_config(args.config) if args.config else load_config({})
    except (ConfigError, OSError) as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 2
    options = PreflightOptions(
        read_sample_bytes=max(0, args.read_sample_mb) * MIB, import_timeout_s=args.import_timeout,
        skip=frozenset(args.skip),
    )
    report = run_preflight(config, probe, options=options)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        print(report.format_text())
    return 1 if report.has_fatal else 0


def statuses(report: PreflightReport) -> dict[str, str]:
    """name -> status value; a compact view for logs and tests."""
    return {c.name: c.status.value for c in report}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
