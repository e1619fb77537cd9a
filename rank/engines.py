"""Build a rank's engine from its ``RankConfig`` (engine modules are imported lazily, so a rank
process only imports what it runs: DeepInfer's stack is heavy and B200-only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rank.config import RankConfig
from rank.engine import Engine

if TYPE_CHECKING:
    from rank.host_pool import HostPool


def make_engine(config: RankConfig, rank: int, host_pool: HostPool | None, *,
                deepinfer_module: str | None = None) -> Engine:
    """``deepinfer_module`` (tests only): a stand-in for DeepInfer's Python API, see
    ``rank.deepinfer_adapter.make_deepinfer_engine``."""
    if config.engine == "reference":
        from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig

        # Same seed on every rank: one model, so any rank gives the same answer for a prompt.
        return ReferenceEngine(ReferenceEngineConfig.from_rank_config(config), host_pool)
    if config.engine == "scripted":
        from rank.scripted_engine import ScriptedEngine  # issue 8

        return ScriptedEngine.from_config(config, rank, host_pool)
    if config.engine == "deepinfer":
        from rank.deepinfer_adapter import make_deepinfer_engine  # issue 3 item 5

        return make_deepinfer_engine(config, rank, host_pool, api_module=deepinfer_module)
    raise ValueError(f"unknown engine {config.engine!r}; use reference, scripted or deepinfer")
