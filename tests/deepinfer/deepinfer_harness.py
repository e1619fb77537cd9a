"""Shared helpers for the DeepInfer adapter tests (fake core and real ``deepinfer._C`` core)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rank.config import RankConfig
from rank.deepinfer_adapter import DeepInferEngine
from rank.deepinfer_settings import DeepInferSettings
from rank.engine import EngineRequest, SamplingParams
from standins import fake_deepinfer
from tests.engines.engine_kits import Transcript, drive

BS = 128


class HostPoolStub:
    """The slice of ``rank.host_pool.HostPool`` the engines use: ``[num_slots, bytes_per_block]``."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.bytes_per_block = 0
        self.slots: torch.Tensor | None = None
        self.closed = False

    def open(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self.slots = torch.zeros(self.num_slots, bytes_per_block, dtype=torch.uint8)

    def copy_from_device(self, pool: torch.Tensor, block_ids: list[int], host_slot: int, **_: Any) -> None:
        assert self.slots is not None
        self.slots[host_slot: host_slot + len(block_ids)] = pool[torch.tensor(block_ids)]

    def copy_to_device(self, pool: torch.Tensor, block_ids: list[int], host_slot: int, **_: Any) -> None:
        assert self.slots is not None
        pool[torch.tensor(block_ids)] = self.slots[host_slot: host_slot + len(block_ids)]

    def close(self) -> None:
        self.closed = True


def settings(engine_rank: int = 0, **overrides: Any) -> DeepInferSettings:
    """DeepInferSettings as a rank builds them: from a RankConfig (``overrides`` are its keys)."""
    base: dict[str, Any] = dict(engine="deepinfer", model_dir="/nonexistent/model", ep=1, max_model_len=4096,
                                max_num_seqs=8, max_num_batched_tokens=512)
    base.update(overrides)
    return DeepInferSettings.from_rank_config(RankConfig(**base), engine_rank)


def make_engine(patched: bool = True, host_slots: int = 0, core: Any = None, prefix_cache: bool = True,
                settings_overrides: dict[str, Any] | None = None, **fake_options: Any) -> DeepInferEngine:
    opts = dict(num_gpu_blocks=48, vocab_size=1000)
    opts.update(fake_options)
    api = fake_deepinfer.make_api(patched=patched, core=core, **opts)
    pool = HostPoolStub(host_slots) if host_slots else None
    return DeepInferEngine(settings(prefix_cache=prefix_cache, **(settings_overrides or {})), host_pool=pool,
                           api=api)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 900, size=n, dtype=np.int32)


def request(rid: str, ids: np.ndarray, max_tokens: int = 8, prefix: list[int] | None = None,
            keep: bool = True, **sampling: Any) -> EngineRequest:
    prefix = prefix or []
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, **sampling), prefix,
                         BS * len(prefix), keep)


def cold_tokens(rid: str, ids: np.ndarray, max_tokens: int, **engine_kwargs: Any) -> list[int]:
    engine = make_engine(**engine_kwargs)
    engine.add(request(rid, ids, max_tokens))
    return drive(engine).tokens(rid)


def random_scenario(engine: DeepInferEngine, num_requests: int = 40, seed: int = 5) -> Transcript:
    """Many requests of random lengths, random aborts and releases; everything balances after."""
    from rank.engine import FinishReason

    rng = np.random.default_rng(seed)
    kept_all: list[list[int]] = []
    ids = [f"r{i}" for i in range(num_requests)]
    for rid in ids:
        engine.add(request(rid, prompt(int(rng.integers(1, 700)), int(rng.integers(1 << 30))),
                           int(rng.integers(1, 12)), keep=bool(rng.integers(2))))

    def churn(step: int) -> None:
        if step % 4 == 0:
            engine.abort([ids[int(rng.integers(len(ids)))]])

    t = drive(engine, max_steps=3000, before_step=churn)
    for rid in ids:
        term = t.terminal(rid)
        assert term.finish_reason in (FinishReason.LENGTH, FinishReason.ABORT, FinishReason.STOP), term
        if term.kept_blocks:
            kept_all.append(list(term.kept_blocks))
    assert engine.stats().num_cached_blocks == len({b for k in kept_all for b in k})
    for kept in kept_all:
        engine.release(kept)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
    return t
