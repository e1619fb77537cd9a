"""What only the reference engine does: its stop rules, sampling, EOS knob and KV byte layout.

The Engine contract (block accounting, misuse, aborts, prefix start, host tier) runs over every
engine in tests/engines/test_engine_contract.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rank.engine import (
    CapacityExhausted,
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from rank.host_pool import HostPool
from rank.reference_engine import EOS_ID, ReferenceEngine, ReferenceEngineConfig

BLOCK = 16


@pytest.fixture(params=["tiny", "null"])
def engine(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[ReferenceEngine]:
    pool = HostPool(os.path.join(str(tmp_path), "l1"), 1 << 20, pin=False)
    eng = ReferenceEngine(
        ReferenceEngineConfig(model=request.param, block_size=BLOCK, num_blocks=32, max_num_seqs=4,
                              max_num_batched_tokens=48, max_model_len=400),
        pool,
    )
    yield eng
    eng.check_accounting()  # after every scenario
    eng.close()
    pool.close()


def req(rid: str, n: int, max_tokens: int = 3, **kw: object) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=bool(kw.pop("ignore_eos", True)))
    ids = np.arange(100, 100 + n, dtype=np.int32)
    return EngineRequest(rid, ids, sampling, **kw)  # type: ignore[arg-type]


def run(engine: ReferenceEngine, max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for out in engine.step():
            assert not (outs.get(out.request_id) and outs[out.request_id][-1].finished), "output after finish"
            outs.setdefault(out.request_id, []).append(out)
        engine.check_accounting()
    raise AssertionError("engine did not go idle")


def test_stop_conditions(engine: ReferenceEngine) -> None:
    engine.add(req("toolong", 400))
    engine.add(req("cap", 395, max_tokens=50, keep_blocks=False))
    outs = run(engine)
    assert (outs["toolong"][-1].finish_reason == FinishReason.ERROR
            and "max_model_len" in outs["toolong"][-1].error)
    cap = outs["cap"]
    assert cap[-1].finish_reason == FinishReason.LENGTH and sum(len(o.token_ids) for o in cap) == 5


def test_eos_stops_unless_ignored() -> None:
    eng = ReferenceEngine(ReferenceEngineConfig(model="null", block_size=BLOCK, num_blocks=16))
    # The model's choice is replaced so that it always says EOS; the stop logic is what's tested.
    eng._forward = lambda token_ids, positions, items, rows, sampled: ([EOS_ID] * len(sampled),
                                                                       {})  # type: ignore[method-assign]
    eng.add(req("eos", 20, max_tokens=5, ignore_eos=False))
    outs = run(eng)["eos"]
    assert [t for o in outs for t in o.token_ids] == [EOS_ID]  # EOS is part of the output
    assert outs[-1].finish_reason == FinishReason.STOP
    eng.add(req("ign", 20, max_tokens=5, ignore_eos=True))
    ign = run(eng)["ign"]
    assert sum(len(o.token_ids) for o in ign) == 5 and ign[-1].finish_reason == FinishReason.LENGTH
    for o in (outs[-1], ign[-1]):
        eng.release(o.kept_blocks)
    eng.check_accounting()


def test_seeded_sampling_is_reproducible() -> None:
    eng = ReferenceEngine(ReferenceEngineConfig(model="tiny", block_size=BLOCK, num_blocks=32))
    sp = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    ids = np.arange(300, 330, dtype=np.int32)
    eng.add(EngineRequest("x", ids, sp, keep_blocks=False))
    eng.add(EngineRequest("other", ids[::-1].copy(), SamplingParams(4, temperature=1.0, ignore_eos=True),
                          keep_blocks=False))
    first = [t for o in run(eng)["x"] for t in o.token_ids]
    eng.add(EngineRequest("y", ids, sp, keep_blocks=False))
    second = [t for o in run(eng)["y"] for t in o.token_ids]
    assert first == second and len(first) == 6
    eng.check_accounting()


def test_export_import_roundtrip_is_byte_exact(engine: ReferenceEngine) -> None:
    engine.add(req("a", 70, max_tokens=2))
    kept = run(engine)["a"][-1].kept_blocks
    original = engine.pool[kept].clone()
    engine.export_blocks(kept, 5)
    assert engine.host_pool is not None and engine.host_pool.tensor is not None
    assert torch.equal(engine.host_pool.tensor[5 : 5 + len(kept)], original)
    engine.release(kept)
    engine.pool.zero_()
    imported = engine.import_blocks(5, len(kept))
    assert torch.equal(engine.pool[imported], original)
    assert engine.stats().num_cached_blocks == len(kept)
    with pytest.raises(CapacityExhausted):
        engine.import_blocks(0, 32)
    assert engine.stats().num_cached_blocks == len(kept)
    engine.release(imported)


def test_eos_every_ends_sampled_replies_and_leaves_greedy_ones() -> None:
    """reference_eos_every: random weights end a sampled reply about once every N tokens."""
    eng = ReferenceEngine(ReferenceEngineConfig(model="tiny", block_size=BLOCK, num_blocks=256,
                                                max_num_seqs=8,
                                                max_num_batched_tokens=64, max_model_len=1000, eos_every=4),
                          None)
    try:
        for i in range(6):
            ids = np.arange(100 + i, 140 + i, dtype=np.int32)
            eng.add(EngineRequest(f"s{i}", ids, SamplingParams(max_tokens=300, temperature=1.0, seed=i)))
        eng.add(EngineRequest("greedy", np.arange(100, 140, dtype=np.int32), SamplingParams(max_tokens=30)))
        outs = run(eng, max_steps=2000)
        for i in range(6):  # P(no EOS in 300 tokens at 1/4 each) ~ 1e-37
            last = outs[f"s{i}"][-1]
            assert last.finish_reason is FinishReason.STOP and last.token_ids[-1] == EOS_ID
        assert outs["greedy"][-1].finish_reason is FinishReason.LENGTH
        lengths = [sum(len(o.token_ids) for o in outs[f"s{i}"]) for i in range(6)]
        print(f"\nreply lengths with eos_every=4: {lengths}")
    finally:
        eng.close()
