"""Small shared pieces of the checks: units, the rank processes' environment, engine traits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.config import WorkloadConfig

GIB = 1024**3
MIB = 1024**2


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def human_bytes(num_bytes: float) -> str:
    """GiB for big sizes, MiB below 1 GiB (so a small test shard does not print as 0.0 GiB)."""
    return gib(num_bytes) if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def rank_env(config: WorkloadConfig, base_env: Mapping[str, str]) -> dict[str, str]:
    """The environment a rank process sees: the backend's, then ``env``, then ``deepinfer_env``;
    MASTER_PORT only as configured (the rank group sets it: the configured port or a free one)."""
    merged = dict(base_env)
    merged.update(config.env)
    merged.update(config.deepinfer_env)
    merged.pop("MASTER_PORT", None)
    if config.master_port:
        merged["MASTER_PORT"] = config.master_port
    return merged


def is_deepinfer(config: WorkloadConfig) -> bool:
    return config.engine == "deepinfer"


def uses_gpu(config: WorkloadConfig) -> bool:
    """True when the ranks need CUDA devices (DeepInfer always; the reference engine on cuda)."""
    return is_deepinfer(config) or (
        config.engine == "reference" and config.reference_device.startswith("cuda")
    )


def env_flag_off(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("0", "false", "no", "off")
