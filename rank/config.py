"""``RankConfig``: what the rank layer reads of the workload config, typed and frozen.

The server validates the workload config (``server/config.py``, pydantic) and builds this with
``WorkloadConfig.rank_config()``; ``RankProcesses`` (``rank/rank_processes.py``) writes it as JSON
for every rank process, and ``rank.worker`` reads it back with ``from_json``. Only the standard
library: a rank runs the DeepInfer venv's interpreter, which has no pydantic and must not import
the server.
Derived values are resolved by the server once (``model_dir`` from ``DEEPINFER_HF_MODEL_DIR``,
``master_port`` from ``deepinfer_env``/``env``), so no rank needs the server's rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

EngineName = Literal["reference", "deepinfer", "scripted"]
ReferenceModelName = Literal["null", "tiny", "small", "medium", "large"]


def _frozen(mapping: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType({str(k): str(v) for k, v in mapping.items()})


@dataclass(frozen=True, slots=True)
class RankConfig:
    """Every field has the meaning of the workload config key of the same name (README table)."""

    engine: EngineName = "reference"
    ep: int = 4
    block_size: int = 128
    max_model_len: int = 1_064_960
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.90
    eplb: bool = False
    extra_experts: int = 0
    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    vote_filler: bool = True  # rank/vote_filler.py
    prefix_cache: bool = True
    l1_cache: bool = True
    l1_host_gb: float = 128.0
    load_timeout_seconds: float = 3600.0
    model_dir: str | None = None  # resolved: model_dir, else env DEEPINFER_HF_MODEL_DIR
    deepinfer_venv: str | None = None
    master_port: str | None = None  # as configured (deepinfer_env wins over env); None: pick a free one
    env: Mapping[str, str] = field(default_factory=dict)
    deepinfer_env: Mapping[str, str] = field(default_factory=dict)
    reference_model: ReferenceModelName = "tiny"
    reference_device: str = "cpu"
    reference_num_blocks: int = 2048
    reference_weights: str | None = None
    reference_eos_every: int = 0
    script_file: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", _frozen(self.env))
        object.__setattr__(self, "deepinfer_env", _frozen(self.deepinfer_env))

    @property
    def uses_gpu(self) -> bool:
        return self.engine == "deepinfer" or self.reference_device.startswith("cuda")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (what ``RankProcesses`` writes for the rank processes)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["env"], out["deepinfer_env"] = dict(self.env), dict(self.deepinfer_env)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RankConfig:
        """The inverse of ``to_json``; an unknown key is an error (a backend/rank version skew)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"rank config has unknown keys {unknown}")
        return cls(**raw)

    def replace(self, **changes: Any) -> RankConfig:
        return dataclasses.replace(self, **changes)
