"""What one rank's DeepInfer engine is built from, and how DeepInfer is imported.

``DeepInferSettings`` takes the rank's ``RankConfig`` keys; ``environment()`` is what must be set
before DeepInfer (and torch) are imported, because DeepInfer reads some knobs at import time.
``import_deepinfer`` gathers the classes the adapter (``rank/deepinfer_adapter.py``) uses, and
``patch_missing_reason`` says whether our prefix-cache patch is on them. See
the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md`` for DeepInfer's side.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from rank.config import RankConfig

DEEPINFER_BLOCK_SIZE = 128
EPLB_REARRANGEMENT_INTERVAL_STEPS = 1000

# (owner, attribute) pairs the prefix-cache patch adds; LLMEngine's is checked when present.
PATCH_API = (
    ("Scheduler", "add_sequence_with_prefix"),
    ("Sequence", "block_table"),
    ("BlockManager", "num_blocks"),
    ("LLMEngine", "enqueue_with_prefix"),
)


def patch_missing_reason(api: Any) -> str | None:
    """None if the prefix-cache patch's API is on the real classes, else what is missing."""
    missing = [
        f"{owner}.{attr}"
        for owner, attr in PATCH_API
        if hasattr(api, owner) and not hasattr(getattr(api, owner), attr)
    ]
    return f"missing {', '.join(missing)}" if missing else None


def import_deepinfer() -> SimpleNamespace:
    """The DeepInfer classes this adapter uses (import only after ``apply_environment``)."""
    from deepinfer._C.engine import (  # type: ignore[import-not-found]
        BlockManager,
        RequestOutput as NativeOutput,
        Scheduler,
        Sequence as NativeSequence,
        SequenceStatus,
    )
    from deepinfer.engine.arg_utils import EngineArgs  # type: ignore[import-not-found]
    from deepinfer.engine.llm_engine import LLMEngine  # type: ignore[import-not-found]

    return SimpleNamespace(
        LLMEngine=LLMEngine, EngineArgs=EngineArgs, RequestOutput=NativeOutput, Scheduler=Scheduler,
        BlockManager=BlockManager, Sequence=NativeSequence, SequenceStatus=SequenceStatus, is_fake=False,
        votes_across_ranks=True,
    )


@dataclass(frozen=True, slots=True)
class DeepInferSettings:
    """What one rank's DeepInfer engine is built from (the workload config's keys + the rank)."""

    # No defaults: the values come from RankConfig (``from_rank_config``), whose defaults are the
    # README's; a second set here could drift from them.
    model_dir: str
    engine_rank: int
    ep: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    eplb: bool
    extra_experts: int
    prefill_attempt_interval: int
    prefill_any_attempt_interval: int
    prefix_cache: bool
    vote_filler: bool
    extra_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.engine_rank < self.ep:
            raise ValueError(f"engine_rank {self.engine_rank} outside 0..{self.ep - 1}")
        if self.prefill_attempt_interval < 1 or self.prefill_any_attempt_interval < 1:
            raise ValueError("prefill vote intervals must be >= 1")

    @classmethod
    def from_rank_config(cls, config: RankConfig, engine_rank: int) -> DeepInferSettings:
        model_dir = config.model_dir
        if model_dir is None:
            raise ValueError("engine 'deepinfer' needs model_dir or env DEEPINFER_HF_MODEL_DIR")
        return cls(
            model_dir=model_dir, engine_rank=engine_rank, ep=config.ep,
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            gpu_memory_utilization=config.gpu_memory_utilization, eplb=config.eplb,
            extra_experts=config.extra_experts, prefill_attempt_interval=config.prefill_attempt_interval,
            prefill_any_attempt_interval=config.prefill_any_attempt_interval,
            prefix_cache=config.prefix_cache, vote_filler=config.vote_filler,
            extra_env=tuple(sorted(config.deepinfer_env.items())),
        )

    def environment(self, current: Mapping[str, str] | None = None) -> dict[str, str]:
        """Variables to set before importing torch/deepinfer (the workload's ``deepinfer_env`` wins).

        ``CUDA_VISIBLE_DEVICES`` (mandatory for DeepInfer; its first entry is the rank's GPU) is
        only filled in when the supervisor has not set it: rank's GPU first, then the others.
        """
        current = os.environ if current is None else current
        env = {
            # Read at import time (SchedulerConfig defaults), hence set before the import.
            "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": str(self.prefill_attempt_interval),
            "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": str(self.prefill_any_attempt_interval),
            "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": str(self.extra_experts),
            "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": str(EPLB_REARRANGEMENT_INTERVAL_STEPS
                                                                if self.eplb else 0),
            # Text only: skip the multimodal worker's 8 GB pinned host pool.
            "DEEPINFER_USE_MULTIMODAL_POOL": "0",
        }
        if "CUDA_VISIBLE_DEVICES" not in current:
            gpus = [self.engine_rank] + [g for g in range(self.ep) if g != self.engine_rank]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        env.update(dict(self.extra_env))
        return env

    def engine_args(self, api: Any) -> Any:
        # Chunked prefill: without it DeepInfer requires max_num_batched_tokens >= max_model_len.
        return api.EngineArgs(
            model=self.model_dir, max_model_len=self.max_model_len, data_parallel_size=self.ep,
            context_parallel_size=1, expert_parallel_size=self.ep, engine_rank=self.engine_rank,
            engine_group_rank=0, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            chunked_prefill=True, stop_preempted_request=True,
        )


def apply_environment(env: Mapping[str, str]) -> None:
    """Set ``env`` in this process; refuse if CUDA was already initialised (too late for it)."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and "CUDA_VISIBLE_DEVICES" in env and torch_mod.cuda.is_initialized():
        raise RuntimeError("CUDA_VISIBLE_DEVICES must be set before CUDA is initialised")
    os.environ.update(env)
