"""Build a rank's engine from its ``RankConfig`` (engine modules are imported lazily, so a rank
process only imports what it runs: DeepInfer's stack is heavy and B200-only).

Engine ``scripted`` is a test stand-in: it lives in the ``standins`` package of a development
checkout, which the published archive leaves out (``publish.py``), so a worker reports it as
unavailable instead of failing on an import.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rank.config import RankConfig
from rank.engine import Engine

if TYPE_CHECKING:
    from rank.deepinfer_adapter import DeepInferEngine
    from rank.host_pool import HostPool

log = logging.getLogger(__name__)

# The stand-ins' package sits next to rank/ in a checkout (the ranks run with that directory on
# PYTHONPATH); ``publish.py`` never packages it.
STANDINS_DIR = Path(__file__).resolve().parents[1] / "standins"


class EngineUnavailable(RuntimeError):
    """The configured engine's code is not part of this installation."""


def scripted_engine_available() -> bool:
    """Whether engine ``scripted`` can run here: a development checkout, not a published archive."""
    return (STANDINS_DIR / "scripted_engine.py").is_file()


def require_scripted_engine() -> None:
    if not scripted_engine_available():
        raise EngineUnavailable(
            "engine 'scripted' is a test stand-in (standins/scripted_engine.py): it exists in a "
            "development checkout only and the published backend leaves it out; use engine "
            "'deepinfer' (or 'reference' for a development run)"
        )


def make_engine(config: RankConfig, rank: int, host_pool: HostPool | None, *,
                deepinfer_module: str | None = None) -> Engine:
    """``deepinfer_module`` (tests only): a stand-in for DeepInfer's Python API, see
    ``make_deepinfer_engine``."""
    if config.engine == "reference":
        from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig

        # Same seed on every rank: one model, so any rank gives the same answer for a prompt.
        return ReferenceEngine(ReferenceEngineConfig.from_rank_config(config), host_pool)
    if config.engine == "scripted":
        require_scripted_engine()
        from standins.scripted_engine import ScriptedEngine

        return ScriptedEngine.from_config(config, rank, host_pool)
    if config.engine == "deepinfer":
        return make_deepinfer_engine(config, rank, host_pool, api_module=deepinfer_module)
    raise ValueError(f"unknown engine {config.engine!r}; use reference, scripted or deepinfer")


def make_deepinfer_engine(config: RankConfig, rank: int, host_pool: HostPool | None = None,
                          api_module: str | None = None) -> DeepInferEngine:
    """Engine 'deepinfer': sets DeepInfer's environment, imports it, builds the
    adapter (``rank/deepinfer_adapter.py``).

    ``api_module`` (TESTS ONLY): import ``<api_module>.deepinfer_api()`` instead of ``deepinfer``,
    after the environment is set, as DeepInfer would be.
    """
    from rank import deepinfer_settings
    from rank.deepinfer_adapter import DeepInferEngine

    settings = deepinfer_settings.DeepInferSettings.from_rank_config(config, rank)
    deepinfer_settings.apply_environment(settings.environment())
    if api_module is None:
        api = deepinfer_settings.import_deepinfer()
    else:
        import importlib

        api = importlib.import_module(api_module).deepinfer_api()
        log.warning("deepinfer rank %d: TEST STAND-IN %s instead of DeepInfer", rank, api_module)
    return DeepInferEngine(settings, host_pool, api=api)
