"""Reference engine unit tests: block accounting, misuse, abort, keep/release, host tier."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rank.host_pool import HostPool
from rank.engine import (
    CapacityExhausted,
    EngineMisuse,
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from rank.reference_engine import EOS_ID, ReferenceEngine, ReferenceEngineConfig

BLOCK = 16


@pytest.fixture(params=["tiny", "null"])
def engine(request: pytest.FixtureRequest, tmp_path: "os.PathLike[str]") -> Iterator[ReferenceEngine]:
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


def test_finish_keeps_full_blocks_and_release_frees_them(engine: ReferenceEngine) -> None:
    engine.add(req("a", 40, max_tokens=9))
    outs = run(engine)["a"]
    last = outs[-1]
    assert last.finished and last.finish_reason == FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in outs) == 9
    assert len(last.kept_blocks) == (40 + 9 - 1) // BLOCK == 3
    stats = engine.stats()
    assert stats.num_cached_blocks == 3 and stats.num_free_blocks == 31 - 3
    engine.release(last.kept_blocks)
    assert engine.stats().num_free_blocks == 31
    with pytest.raises(EngineMisuse):  # double release
        engine.release(last.kept_blocks)


def test_keep_blocks_false_frees_everything(engine: ReferenceEngine) -> None:
    engine.add(req("a", 40, keep_blocks=False))
    assert run(engine)["a"][-1].kept_blocks == []
    assert engine.stats().num_free_blocks == 31


def test_misuse_raises_without_state_change(engine: ReferenceEngine) -> None:
    engine.add(req("a", 40, max_tokens=2))
    kept = run(engine)["a"][-1].kept_blocks
    before = (engine.stats(), list(engine.blocks.ref_counts), list(engine.blocks.cache_refs))
    bad = [
        req("b", 40, prefix_blocks=kept[:1], num_cached_tokens=BLOCK + 1),  # not block-aligned
        req("b", 16, prefix_blocks=kept[:1], num_cached_tokens=BLOCK),  # nothing left to compute
        req("b", 40, prefix_blocks=[0], num_cached_tokens=BLOCK),  # scratch block
        req("b", 40, prefix_blocks=[kept[0], kept[0]], num_cached_tokens=2 * BLOCK),  # duplicate
        req("b", 40, prefix_blocks=[kept[0], 31], num_cached_tokens=2 * BLOCK),  # 31 is free
        req("b", 40, prefix_blocks=[99], num_cached_tokens=BLOCK),  # out of range
        EngineRequest("b", np.array([], np.int32), SamplingParams(3)),
        EngineRequest("b", np.array([5, 200_000], np.int32), SamplingParams(3)),
        EngineRequest("b", np.array([5, 6], np.int32), SamplingParams(0)),
        EngineRequest("b", np.array([5, 6], np.int32), SamplingParams(3, temperature=1.0, top_p=0.0)),
    ]
    for request in bad:
        with pytest.raises(EngineMisuse):
            engine.add(request)
    for call in (lambda: engine.release([0]), lambda: engine.release([31]),
                 lambda: engine.export_blocks([31], 0), lambda: engine.export_blocks(kept, -1),
                 lambda: engine.import_blocks(0, 0)):
        with pytest.raises(EngineMisuse):
            call()
    engine.add(req("dup", 20))
    with pytest.raises(EngineMisuse):
        engine.add(req("dup", 20))
    engine.abort(["dup"])
    run(engine)
    assert (engine.stats(), engine.blocks.ref_counts, engine.blocks.cache_refs) == before
    engine.release(kept)


def test_abort_waiting_and_running(engine: ReferenceEngine) -> None:
    for i in range(6):  # max_num_seqs=4: two stay waiting
        engine.add(req(f"r{i}", 30, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats().num_running == 4 and engine.stats().num_waiting == 2
    engine.abort(["r0", "r5", "unknown"])
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.finished}
    assert set(aborted) == {"r0", "r5"}
    assert all(o.finish_reason == FinishReason.ABORT and o.kept_blocks == [] for o in aborted.values())
    engine.abort([f"r{i}" for i in range(1, 5)])
    rest = run(engine)
    assert {rid for rid, o in rest.items() if o[-1].finish_reason == FinishReason.ABORT} == {"r1", "r2", "r3", "r4"}
    assert engine.stats().num_free_blocks == 31 and not engine.has_work()


def test_prefix_start_counts_cached_tokens_and_shares_blocks(engine: ReferenceEngine) -> None:
    engine.add(req("a", 50, max_tokens=2))
    kept = run(engine)["a"][-1].kept_blocks
    engine.add(req("b", 60, max_tokens=2, prefix_blocks=kept[:2], num_cached_tokens=2 * BLOCK))
    engine.step()
    assert engine.blocks.ref_counts[kept[0]] == 2  # cache + sequence
    last = run(engine)["b"][-1]
    assert last.num_cached_tokens == 2 * BLOCK and last.kept_blocks[:2] == kept[:2]
    assert engine.stats().num_cached_tokens_total == 2 * BLOCK
    engine.release(kept)
    engine.release(last.kept_blocks)
    assert engine.stats().num_free_blocks == 31


def test_chunked_prefill_respects_the_token_budget(engine: ReferenceEngine) -> None:
    engine.add(req("long", 130, max_tokens=1, keep_blocks=False))  # 48-token budget: 3 chunks
    steps = 0
    while engine.has_work():
        outs = engine.step()
        steps += 1
        assert engine.stats().waiting_tokens in (130 - 48 * steps, 0)
    assert steps == 3 and outs[0].finished


def test_stop_conditions(engine: ReferenceEngine) -> None:
    engine.add(req("toolong", 400))
    engine.add(req("cap", 395, max_tokens=50, keep_blocks=False))
    outs = run(engine)
    assert outs["toolong"][-1].finish_reason == FinishReason.ERROR and "max_model_len" in outs["toolong"][-1].error
    cap = outs["cap"]
    assert cap[-1].finish_reason == FinishReason.LENGTH and sum(len(o.token_ids) for o in cap) == 5


def test_eos_stops_unless_ignored() -> None:
    eng = ReferenceEngine(ReferenceEngineConfig(model="null", block_size=BLOCK, num_blocks=16))
    # The model's choice is replaced so that it always says EOS; the stop logic is what's tested.
    eng._forward = lambda token_ids, positions, items, rows, sampled: ([EOS_ID] * len(sampled), {})  # type: ignore[method-assign]
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
    eng.add(EngineRequest("other", ids[::-1].copy(), SamplingParams(4, temperature=1.0, ignore_eos=True), keep_blocks=False))
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


def test_decode_out_of_blocks_finishes_with_error_and_frees() -> None:
    eng = ReferenceEngine(ReferenceEngineConfig(model="null", block_size=BLOCK, num_blocks=5, max_num_seqs=4))
    eng.add(req("a", BLOCK * 2, max_tokens=100))
    eng.add(req("b", BLOCK * 2, max_tokens=100))
    outs = run(eng)
    reasons = sorted(o[-1].finish_reason.value for o in outs.values())
    assert "error" in reasons
    eng.check_accounting()
    for o in outs.values():
        eng.release(o[-1].kept_blocks)
    assert eng.stats().num_free_blocks == 4


def test_eos_every_ends_sampled_replies_and_leaves_greedy_ones() -> None:
    """reference_eos_every: random weights end a sampled reply about once every N tokens."""
    eng = ReferenceEngine(ReferenceEngineConfig(model="tiny", block_size=BLOCK, num_blocks=256, max_num_seqs=8,
                                                max_num_batched_tokens=64, max_model_len=1000, eos_every=4), None)
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
