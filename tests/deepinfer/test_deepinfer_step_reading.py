"""The stand-in's null forward (bench/decode_bench.py) and the adapter's per-step reading of DeepInfer's outputs."""

from __future__ import annotations

from deepinfer_harness import drive, make_engine, prompt, request

from rank.engine import FinishReason

def test_null_forward_emits_ids_without_touching_the_kv_pool() -> None:
    engine = make_engine(null_forward=True, vocab_size=129280)
    for i in range(4):
        engine.add(request(f"r{i}", prompt(100 + 60 * i, i), 9, keep=False))
    t = drive(engine)
    for i in range(4):
        ids = t.tokens(f"r{i}")
        assert len(ids) == 9 and all(3 <= x < 129280 for x in ids)
        assert t.terminal(f"r{i}").finish_reason is FinishReason.LENGTH
    assert len({tuple(t.tokens(f"r{i}")) for i in range(4)}) > 1  # not one constant stream
    assert int(engine.llm._kv.count_nonzero()) == 0
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
