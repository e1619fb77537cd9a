"""Timeouts against the measured load speed.

``setup()`` returns only when the model is ready, and the worker kills a backend that is not
ready within ``ready_timeout_secs`` (default 300 s: the seed guide's classic failure, because
reading 476 GB takes about 4 minutes even from local NVMe). The ranks' own limit,
``load_timeout_seconds``, should fire first so the operator gets the backend's message rather
than a bare readiness timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.preflight_checks.context import human_bytes, is_deepinfer
from server.preflight_checks.model_dir import ModelFacts
from server.preflight_checks.report import CheckResult, ok, problem, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

READ_SAFETY_FACTOR = 1.25  # one stream measured; mmap page-ins under 4 ranks vary
DEEPINFER_INIT_S = 300.0  # CUDA graphs, block profiling, JIT kernels with a warm cache
REFERENCE_INIT_S = 30.0
DEEPINFER_UNMEASURED_MIN_READY_S = 1800.0  # without a measurement, less than this is suspicious
GUIDE_READY_S = 5400


def estimated_ready_s(config: WorkloadConfig, facts: ModelFacts) -> tuple[float, float] | None:
    """(seconds just to read the weights, seconds until ready with margins), None if unmeasured."""
    if not facts.weights_bytes or not facts.read_bytes_per_s:
        return None
    read_s = facts.weights_bytes / facts.read_bytes_per_s
    init_s = DEEPINFER_INIT_S if is_deepinfer(config) else REFERENCE_INIT_S
    return read_s, read_s * READ_SAFETY_FACTOR + init_s


def check_ready_timeout(config: WorkloadConfig, facts: ModelFacts) -> CheckResult:
    name = "ready_timeout"
    ready = config.ready_timeout_secs
    estimate = estimated_ready_s(config, facts)
    deepinfer = is_deepinfer(config)
    if estimate is None:
        if deepinfer and ready < DEEPINFER_UNMEASURED_MIN_READY_S:
            return warn(
                name, f"ready_timeout_secs {ready:g} s and the load speed could not be measured; a "
                "DeepInfer load takes about 4 min from local NVMe and 13 to 30 min from a network disk",
                f"Set ready_timeout_secs: {GUIDE_READY_S} in the workload config.", ready_timeout_secs=ready,
            )
        return skipped(name, f"ready_timeout_secs {ready:g} s; no weights measured to compare with")
    read_s, need_s = estimate
    assert facts.weights_bytes and facts.read_bytes_per_s  # measured: estimate is not None
    data = {"ready_timeout_secs": ready, "read_s": read_s, "estimated_ready_s": need_s,
            "weights_bytes": facts.weights_bytes, "read_bytes_per_s": facts.read_bytes_per_s}
    text = (f"reading {human_bytes(facts.weights_bytes)} at {facts.read_bytes_per_s / 1e6:,.0f} MB/s takes "
            f"about {read_s:,.0f} s, ready in about {need_s:,.0f} s with margins; "
            f"ready_timeout_secs is {ready:g}")
    least = max(GUIDE_READY_S, round(need_s * 1.5, -2))
    fix = f"Set ready_timeout_secs to at least {least:.0f} in the workload config."
    if read_s > ready:
        # Cannot finish even with no init at all: stop now with the reason, not after the timeout.
        return problem(name, deepinfer, text + ": the worker will kill setup() before the load ends", fix,
                       **data)
    if need_s > ready:
        return warn(name, text + ": likely to time out", fix, **data)
    return ok(name, text, **data)


def check_timeout_order(config: WorkloadConfig, facts: ModelFacts) -> CheckResult:
    name = "timeout_order"
    load, ready = config.load_timeout_seconds, config.ready_timeout_secs
    data = {"load_timeout_seconds": load, "ready_timeout_secs": ready}
    estimate = estimated_ready_s(config, facts)
    if not is_deepinfer(config) and (estimate is None or estimate[1] < min(load, ready)):
        return ok(name, f"load_timeout_seconds {load:g}, ready_timeout_secs {ready:g}: engine "
                  f"'{config.engine}' loads in seconds, the order does not matter", **data)
    if load >= ready:
        return warn(
            name, f"load_timeout_seconds {load:g} >= ready_timeout_secs {ready:g}: the worker's readiness "
            "timeout fires first and hides the backend's own load error",
            f"Set load_timeout_seconds below ready_timeout_secs (e.g. {max(ready - 300, ready * 0.8):.0f}), "
            "or raise ready_timeout_secs.", **data,
        )
    if estimate is not None and estimate[1] > load:
        return warn(
            name, f"load_timeout_seconds {load:g} is below the estimated load time of {estimate[1]:,.0f} s",
            f"Raise load_timeout_seconds to at least {estimate[1] * 1.5:.0f} (and ready_timeout_secs above "
            "it).",
            **data,
        )
    return ok(name, f"load_timeout_seconds {load:g} < ready_timeout_secs {ready:g}", **data)
