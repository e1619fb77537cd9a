"""The NVIDIA driver against what the prebuilt DeepInfer package needs.

The prebuilt package (``inferencekey/deepinfer-sm100-cu132``) is DeepInfer built for SM100 and
CUDA 13.2; the deployment guide's machines ran driver 595.91 (CUDA 13.2). A driver whose newest
CUDA is below 13.0 cannot run a CUDA 13 build at all; 13.0 and 13.1 run it only under CUDA's
minor-version compatibility, which does not cover every feature a 13.2 build may use (PTX JIT of
kernels built for newer toolkits among them: NVIDIA's CUDA Compatibility guide,
https://docs.nvidia.com/deploy/cuda-compatibility/). CUDA 13 needs the R580 driver branch or
newer (the CUDA Toolkit release notes' minimum driver versions).

Read from plain ``nvidia-smi`` (its header has both versions), else from
``/proc/driver/nvidia/version`` (the driver only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.preflight_checks.context import is_deepinfer, uses_gpu
from server.preflight_checks.probe import DriverInfo
from server.preflight_checks.report import CheckResult, ok, problem, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

NEEDED_CUDA = (13, 2)
CUDA_MAJOR_MIN = (13, 0)
MIN_DRIVER_FOR_CUDA13 = (580,)
TESTED_DRIVER = "595.91"
TESTED_DRIVER_VERSION = (595, 91)


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = [p for p in text.strip().split(".") if p.isdigit()]
    return tuple(int(p) for p in parts) or None


def check_driver(config: WorkloadConfig, info: DriverInfo | None) -> CheckResult:
    name = "driver"
    if not uses_gpu(config):
        return skipped(name, f"not checked: engine '{config.engine}' runs on cpu")
    if info is None or info.driver_version is None:
        why = info.error if info is not None and info.error else "no driver found"
        return skipped(name, f"not checked: no NVIDIA driver ({why})")
    data = {"driver_version": info.driver_version, "cuda_version": info.cuda_version, "source": info.source,
            "needed_cuda": ".".join(map(str, NEEDED_CUDA)), "tested_driver": TESTED_DRIVER}
    seen = f"driver {info.driver_version}, CUDA {info.cuda_version or 'not reported'} ({info.source})"
    if not is_deepinfer(config):
        return ok(name, f"{seen}; engine '{config.engine}' uses its own torch build", **data)
    driver, cuda = version_tuple(info.driver_version), version_tuple(info.cuda_version)
    fix = (f"Install an NVIDIA driver that supports CUDA {'.'.join(map(str, NEEDED_CUDA))} (tested: "
           f"{TESTED_DRIVER}); the prebuilt DeepInfer package is built for CUDA 13.2.")
    if cuda is not None:
        if cuda < CUDA_MAJOR_MIN:
            return problem(name, True, f"{seen}: the prebuilt DeepInfer package needs CUDA 13.2; this driver "
                           "cannot run CUDA 13 code", fix, **data)
        if cuda < NEEDED_CUDA:
            return warn(name, f"{seen}: below CUDA 13.2, the prebuilt package runs only under CUDA's "
                        "minor-version compatibility (kernels compiled on first use may fail)", fix, **data)
        return ok(name, f"{seen}: supports the prebuilt package's CUDA 13.2 (tested with {TESTED_DRIVER})",
                  **data)
    if driver is not None and driver < MIN_DRIVER_FOR_CUDA13:
        return problem(name, True, f"{seen}: CUDA 13 needs driver 580 or newer", fix, **data)
    if driver is not None and driver < TESTED_DRIVER_VERSION:
        return warn(name, f"{seen}: older than the tested {TESTED_DRIVER} and its CUDA version is unknown",
                    f"Check `nvidia-smi` reports CUDA 13.2 or newer. {fix}", **data)
    return ok(name, f"{seen}: at least the tested {TESTED_DRIVER}", **data)
