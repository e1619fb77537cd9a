"""Shared helpers for the DeepInfer adapter tests (fake core and real ``deepinfer._C`` core)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rank.deepinfer_adapter import DeepInferEngine
from rank.deepinfer_settings import DeepInferSettings
from rank.engine import EngineRequest, RequestOutput, SamplingParams
from standins import fake_deepinfer

BS = 128


class HostPoolStub:
    """The slice of ``rank.host_pool.HostPool`` the engines use: ``[num_slots, bytes_per_block]``."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: torch.Tensor | None = None
        self.closed = False

    def open(self, bytes_per_block: int) -> None:
        self.slots = torch.zeros(self.num_slots, bytes_per_block, dtype=torch.uint8)

    def copy_from_device(self, pool: torch.Tensor, block_ids: list[int], host_slot: int) -> None:
        assert self.slots is not None
        self.slots[host_slot: host_slot + len(block_ids)] = pool[torch.tensor(block_ids)]

    def copy_to_device(self, pool: torch.Tensor, block_ids: list[int], host_slot: int) -> None:
        assert self.slots is not None
        pool[torch.tensor(block_ids)] = self.slots[host_slot: host_slot + len(block_ids)]

    def close(self) -> None:
        self.closed = True


def settings(**overrides: Any) -> DeepInferSettings:
    base = dict(model_dir="/nonexistent/model", engine_rank=0, ep=1, max_model_len=4096, max_num_seqs=8,
                max_num_batched_tokens=512)
    base.update(overrides)
    return DeepInferSettings(**base)


def make_engine(patched: bool = True, host_slots: int = 0, core: Any = None, prefix_cache: bool = True,
                settings_overrides: dict[str, Any] | None = None, **fake_options: Any) -> DeepInferEngine:
    opts = dict(num_gpu_blocks=48, vocab_size=1000)
    opts.update(fake_options)
    api = fake_deepinfer.make_api(patched=patched, core=core, **opts)
    pool = HostPoolStub(host_slots) if host_slots else None
    return DeepInferEngine(settings(prefix_cache=prefix_cache, **(settings_overrides or {})), host_pool=pool, api=api)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 900, size=n, dtype=np.int32)


def request(rid: str, ids: np.ndarray, max_tokens: int = 8, prefix: list[int] | None = None,
            keep: bool = True, **sampling: Any) -> EngineRequest:
    prefix = prefix or []
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, **sampling), prefix, BS * len(prefix), keep)


@dataclass
class Transcript:
    """Everything a drive produced, checked against the Engine output invariants on the way."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    steps: int = 0

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.token_ids]

    def terminal(self, rid: str) -> RequestOutput:
        last = self.outputs[rid][-1]
        assert last.finished, f"{rid} has no terminal output"
        return last

    def record(self, outs: list[RequestOutput]) -> None:
        seen: set[str] = set()
        for out in outs:
            assert out.request_id not in seen, f"two outputs for {out.request_id} in one step"
            seen.add(out.request_id)
            prior = self.outputs.setdefault(out.request_id, [])
            assert not (prior and prior[-1].finished), f"output for {out.request_id} after its terminal"
            prior.append(out)


def drive(engine: DeepInferEngine, transcript: Transcript | None = None, max_steps: int = 500,
          before_step: Callable[[int], None] | None = None, until: Callable[[Transcript], bool] | None = None) -> Transcript:
    """DeepInfer's loop as the rank worker runs it (``lockstep_has_work`` then ``step``) until idle."""
    t = transcript or Transcript()
    for i in range(max_steps):
        if before_step is not None:
            before_step(i)
        group_has_work = engine.lockstep_has_work()
        outs = engine.step()
        t.steps += 1
        t.record(outs)
        engine.check_accounting()
        if until is not None and until(t):
            return t
        if not group_has_work and not outs and not engine.has_work():
            return t
    raise AssertionError(f"engine still busy after {max_steps} steps")


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
