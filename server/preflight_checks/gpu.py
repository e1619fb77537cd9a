"""GPU check: enough visible GPUs for ``ep`` ranks, SM100 for DeepInfer, no one else's memory on them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from server.preflight_checks.context import gib, is_deepinfer, uses_gpu
from server.preflight_checks.probe import GpuInfo, GpuQuery
from server.preflight_checks.report import CheckResult, ok, problem, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

NAME = "gpu"
DEEPINFER_SM_MAJOR = 10  # DeepInfer supports only SM100 (B200/B300); SM90 fails after the load
# Another process holding more than this share of a GPU's memory leaves DeepInfer short of
# its gpu_memory_utilization target (typically a previous backend that did not exit).
_FOREIGN_MEMORY_SLACK = 0.02


def visible_gpus(query: GpuQuery, cuda_visible: str | None) -> tuple[list[GpuInfo], str | None]:
    """The GPUs a rank can use, in CUDA order, and a note when ``CUDA_VISIBLE_DEVICES`` is odd.

    CUDA reads the list left to right and stops at the first entry that names no device.
    """
    if cuda_visible is None:
        return list(query.gpus), None
    by_index = {g.index: g for g in query.gpus}
    chosen: list[GpuInfo] = []
    for token in (t.strip() for t in cuda_visible.split(",")):
        if not token:
            break
        gpu: GpuInfo | None = None
        if token.lstrip("-").isdigit():
            gpu = by_index.get(int(token))
        elif token.startswith(("GPU-", "MIG-")):
            gpu = next((g for g in query.gpus if g.uuid.startswith(token)), None)
        if gpu is None:
            return chosen, f"CUDA_VISIBLE_DEVICES entry '{token}' names no GPU, so CUDA stops there"
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen, None


def _describe(gpus: list[GpuInfo]) -> str:
    parts = []
    for g in gpus:
        cc = f"SM{g.compute_capability[0]}{g.compute_capability[1]}" if g.compute_capability else "SM?"
        parts.append(f"{g.index}: {g.name} ({cc})")
    return "; ".join(parts)


def check_gpus(config: WorkloadConfig, query: GpuQuery, env: Mapping[str, str]) -> CheckResult:
    """``env`` is the ranks' environment (``CUDA_VISIBLE_DEVICES`` is read from it)."""
    needs_gpu = uses_gpu(config)
    deepinfer = is_deepinfer(config)
    data = {"source": query.source, "num_gpus": len(query.gpus), "error": query.error}
    if not needs_gpu and query.error == "not queried":
        return skipped(NAME, f"engine '{config.engine}' runs on cpu; GPUs not queried", **data)
    if not query.gpus:
        why = query.error or "the query returned no devices"
        if not needs_gpu:
            return skipped(
                NAME, f"no GPU on this machine ({why}); engine '{config.engine}' runs on cpu", **data
            )
        return problem(
            NAME, True, f"no NVIDIA GPU found ({why}); engine '{config.engine}' needs {config.ep} GPUs",
            "Run on the GPU worker (DeepInfer needs B200 GPUs, one per rank), or use engine "
            "'reference' with reference_device 'cpu' on this machine.", **data,
        )
    cuda_visible = env.get("CUDA_VISIBLE_DEVICES")
    visible, note = visible_gpus(query, cuda_visible)
    data.update(
        visible=[g.index for g in visible],
        cuda_visible_devices=cuda_visible,
        gpus=[
            {"index": g.index, "name": g.name, "sm": list(g.compute_capability or ()),
             "memory_total_bytes": g.memory_total_bytes, "memory_used_bytes": g.memory_used_bytes}
            for g in query.gpus
        ],
    )
    seen = f"{len(query.gpus)} GPU(s): {_describe(list(query.gpus))}"
    if not needs_gpu:
        return skipped(NAME, f"{seen}; engine '{config.engine}' runs on cpu and does not use them", **data)
    if note or len(visible) < config.ep:
        shown = f"CUDA_VISIBLE_DEVICES={cuda_visible!r} leaves {len(visible)}" if cuda_visible is not None \
            else f"{len(visible)} visible"
        return problem(
            NAME, True, f"{seen}; {shown}, ep {config.ep} needs {config.ep}" + (f" ({note})" if note else ""),
            f"Set env.CUDA_VISIBLE_DEVICES to {config.ep} existing GPU indices (e.g. "
            f"'{','.join(str(i) for i in range(config.ep))}') or lower ep to the GPUs you have.", **data,
        )
    used = visible[: config.ep]
    if deepinfer:
        unknown = [g for g in used if g.compute_capability is None]
        wrong = [g for g in used if g.compute_capability and g.compute_capability[0] != DEEPINFER_SM_MAJOR]
        if wrong:
            g = wrong[0]
            cc = g.compute_capability
            assert cc is not None
            return problem(
                NAME, True,
                f"{seen}; GPU {g.index} is SM{cc[0]}{cc[1]} but DeepInfer supports only SM100 "
                "(it fails after the model load with 'unknown GPU type')",
                "Run engine 'deepinfer' on B200 (SM100) GPUs, or use engine 'reference' on these GPUs.",
                **data,
            )
        if cuda_visible is None:
            return warn(
                NAME, f"{seen}; CUDA_VISIBLE_DEVICES is not set and DeepInfer requires it",
                f"Set env.CUDA_VISIBLE_DEVICES to the ranks' GPUs, e.g. "
                f"'{','.join(str(g.index) for g in used)}'.", **data,
            )
        if unknown:
            return warn(
                NAME, f"{seen}; compute capability unknown (nvidia-smi too old to report compute_cap)",
                "Check that the GPUs are B200 (SM100) with a driver of the 595 series or newer.", **data,
            )
    busy = [
        g for g in used
        if g.memory_total_bytes and g.memory_used_bytes is not None
        and g.memory_used_bytes > _FOREIGN_MEMORY_SLACK * g.memory_total_bytes
    ]
    if busy:
        g = busy[0]
        assert g.memory_used_bytes is not None
        return warn(
            NAME, f"{seen}; GPU {g.index} already has {gib(g.memory_used_bytes)} in use by another "
            f"process (gpu_memory_utilization {config.gpu_memory_utilization} assumes an empty GPU)",
            "Stop the process holding the GPU (nvidia-smi lists it), often a previous backend that "
            "did not exit.", **data,
        )
    return ok(NAME, f"{seen}; ranks use {[g.index for g in used]}", **data)
