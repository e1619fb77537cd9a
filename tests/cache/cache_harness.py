"""Builders for cache tests over real engines (LocalRankGroup + reference engine, CPU)."""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from cache.config import CacheConfig
from cache.manager import CacheManager
from cache.metrics import CacheMetrics
from cache.sessions import SessionHint, StopKind
from cache.turns import AdmissionView
from rank.engine import SamplingParams
from rank.local_group import LocalRankGroup
from rank.reference_model import MODEL_SPECS, kv_bytes_per_block
from server.config import WorkloadConfig

BLOCK_SIZE = 16
_ids = itertools.count()


def workload(model: str = "null", num_blocks: int = 96, num_ranks: int = 2) -> WorkloadConfig:
    return WorkloadConfig(
        engine="reference",
        reference_model=model,
        block_size=BLOCK_SIZE,
        reference_num_blocks=num_blocks,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        ep=num_ranks,
        max_model_len=8192,
    )


async def make_group(
    model: str = "null", num_blocks: int = 96, num_ranks: int = 2, host_slots: int = 256,
    step_s: float = 0.001
) -> LocalRankGroup:
    """``step_s``: the (virtual) time a round of engine steps takes; > 0 lets turns overlap in
    time, so concurrent agents interleave the same way on every run."""
    cfg = workload(model, num_blocks, num_ranks)
    probe_bytes = kv_bytes_per_block(MODEL_SPECS[model], BLOCK_SIZE, torch.float32)
    group = LocalRankGroup.from_config(
        cfg.rank_config(), num_ranks=num_ranks, host_pool_bytes=host_slots * probe_bytes,
        name=f"cachetest-{os.getpid()}-{next(_ids)}", step_s=step_s,
    )
    await group.start()
    return group


def make_manager(group: LocalRankGroup, **overrides: object) -> tuple[CacheManager, CacheRegistry]:
    registry = CollectorRegistry()
    values: dict[str, object] = {"queue_recheck_s": 0.01}
    values.update(overrides)
    # The policy's clock is the loop's: virtual time under tests/cache/conftest.py.
    clock = asyncio.get_running_loop().time
    mgr = CacheManager(group, CacheConfig(**values), CacheMetrics(registry),
                       clock=clock)  # type: ignore[arg-type]
    return mgr, registry


CacheRegistry = CollectorRegistry


@dataclass
class SizesOnlyClient:
    """The RankClient fields the cache's bookkeeping reads, for tests of its parts without
    engines (the planner, the release ledger); ``release`` waits for ``gate`` (set by default)
    and records what was released."""

    num_ranks: int = 1
    block_size: int = 4
    num_blocks: int = 13  # 12 usable (block 0 is scratch)
    bytes_per_block: int = 64
    num_host_slots: int = 0
    epoch: int = 0
    released: list[list[int]] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.gate.set()

    async def release(self, rank: int, block_ids: list[int]) -> None:
        await self.gate.wait()
        self.released.append(list(block_ids))

    def add_restart_listener(self, fn: object) -> None:
        pass


@dataclass
class TurnResult:
    admission: AdmissionView
    output_ids: list[int]
    prompt: np.ndarray


async def run_turn(
    mgr: CacheManager,
    group: LocalRankGroup,
    prompt: np.ndarray,
    hint: SessionHint | str | None,
    max_tokens: int = 8,
    stop: StopKind = StopKind.TOOL_USE,
) -> TurnResult:
    async with mgr.turn(prompt, hint, max_tokens) as turn:
        request = turn.engine_request(f"r{next(_ids)}",
                                      SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        async for out in group.submit(turn.rank, request):
            turn.feed(out)
        assert turn.last_output is not None and turn.last_output.finished
        turn.stop_kind = stop
    return TurnResult(turn.admission, list(turn.output_ids), prompt)


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(2, 1000, size=n, dtype=np.int32)


def next_prompt(turn: TurnResult, new: np.ndarray) -> np.ndarray:
    """The agent's next prompt: everything so far, the model's output, then new input."""
    return np.concatenate([turn.prompt, np.asarray(turn.output_ids, dtype=np.int32), new])


async def settle(mgr: CacheManager, group: LocalRankGroup) -> None:
    """Drain background work, then assert no leaked blocks, refs or host slots."""
    await mgr.drain()
    mgr.check_balance()
    group.check_accounting()
